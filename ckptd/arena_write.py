"""Writing an async save: one rank's `native` files from a mapped arena into
`<root>/step-<N>.tmp/`, hashing as it writes, and (rank 0) the step's commit by rename; and the
native commit protocol itself (`save_rank0`, `save_rank`, `commit`), the one implementation,
which ckptd.torch's blocking writers call with their own way of writing a rank's files.

Both the daemon's persist service and ckptd.torch's in-process fallback run this: given the
arena's bytes, a checked request and the root's path; it never touches the store. Every path is
opened beneath the root's descriptor without following a symlink.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import xxhash

from ckptd import fileio, inputs
from ckptd.arena import FileRange, Request
from ckptd.errors import BadInput, Cancelled, CkptdError
from ckptd.fileio import CHUNK_SIZE, HASH_ALG
from ckptd.formats.zipcrc import fill_crcs

META = "meta.json"
MAX_MARKER = inputs.MARKER.cap
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_DROP_EVERY = 64 << 20  # start writeback and forget written pages in steps of this many bytes

Entry = dict[str, Any]


class Cancel(threading.Event):
    """One save's stop flag (set when the daemon stops: the save is abandoned before its
    commit), which also counts the bytes written so far (`status`'s in-flight progress)."""

    def __init__(self) -> None:
        super().__init__()
        self.written = 0


# How rank 0 commits over an earlier save of the step: given `swap` (the renames; it returns
# the root-relative name the earlier save was moved aside to, or None), do it and drop that
# save, or answer False to be asked again shortly. The daemon's goes through the retention
# executor (`replace_save`, behind its nets); the trainer's own process drops it itself.
Replace = Callable[[Callable[[], "str | None"]], bool]


@dataclass(frozen=True)
class Written:
    path: str  # the committed step dir (rank 0), or the tmp dir this rank wrote into
    files: list[Entry]


def persist(view: memoryview, fd: int, req: Request, root_path: str,
            cancel: Cancel, replace: Replace | None = None) -> Written:
    """Write this rank's files from the arena `fd` (mapped as `view`); rank 0 also waits for
    every rank and commits `step-<N>/` (over an earlier save of the step through `replace`;
    None: in the trainer's own process, which drops its earlier save itself). Each file is a
    torch.save archive whose CRC fields the trainer left empty: they are filled in here
    first."""
    for f in req.files:
        fill_crcs(view, fd, f.offset, f.offset + f.size, f.path)
    deadline = time.monotonic() + req.timeout
    root_fd = os.open(root_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if req.rank == 0:
            return _persist_rank0(view, req, root_fd, deadline, cancel,
                                  replace if replace is not None else replace_here(root_fd))
        return _persist_rank(view, req, root_fd, deadline, cancel)
    finally:
        os.close(root_fd)


def _persist_rank0(view: memoryview, req: Request, root_fd: int, deadline: float,
                   cancel: Cancel, replace: Replace) -> Written:
    tmp, final = f"step-{req.step}.tmp", f"step-{req.step}"
    everyone = save_rank0(root_fd, tmp, final, req.world_size, req.head,
                          lambda tmp_fd: _write_files(view, req, tmp_fd, cancel),
                          deadline, cancel, replace)
    return Written(final, everyone)


def _persist_rank(view: memoryview, req: Request, root_fd: int, deadline: float,
                  cancel: Cancel) -> Written:
    tmp, final = f"step-{req.step}.tmp", f"step-{req.step}"
    entries = save_rank(root_fd, tmp, final, req.rank,
                        lambda tmp_fd: _write_files(view, req, tmp_fd, cancel), deadline, cancel)
    return Written(final, entries)


# -- the native commit protocol: the one implementation (ckptd.torch's writers use it too) -----
#
# Rank 0 makes a fresh `tmp` holding `.ready` with a new token; every rank writes its files into
# it and then `.done.rank<R>` (its token and file entries); rank 0 waits for every marker,
# checks each file still has its reported size, removes the markers, writes meta.json last
# (fsyncing `tmp`), renames `tmp` to `final` (an earlier save of the step moved aside first)
# and fsyncs the root. A rank that wrote into a leftover dir sees the token change and writes
# again, so a stale file is never committed; it returns once meta.json names its token.

Write = Callable[[int], list[Entry]]  # writes this rank's files into `tmp` (its fd): entries


def save_rank0(root_fd: int, tmp: str, final: str, world: int, head: dict[str, Any],
               write: Write, deadline: float, cancel: Cancel, replace: Replace) -> list[Entry]:
    """Rank 0's part: start the save, write, gather every rank's entries, commit."""
    token = secrets.token_hex(16)
    fresh_dir(root_fd, tmp)
    with opendir(root_fd, tmp) as tmp_fd:
        fileio.atomic_write_json(".ready", {"token": token}, dir_fd=tmp_fd)
        report(tmp_fd, 0, token, write(tmp_fd))
        everyone = collect(tmp_fd, world, token, deadline, cancel)
        commit(root_fd, tmp_fd, tmp, final, {**head, "save_id": token, "files": everyone},
               replace, deadline, cancel)
    return everyone


def save_rank(root_fd: int, tmp: str, final: str, rank: int, write: Write, deadline: float,
              cancel: Cancel) -> list[Entry]:
    """Another rank's part: write under rank 0's token and wait for the commit naming it."""
    while True:
        token = wait(lambda: read_token(root_fd, tmp), deadline, cancel,
                     f"rank 0 to start {tmp}")
        try:
            with opendir(root_fd, tmp) as tmp_fd:
                entries = write(tmp_fd)
                report(tmp_fd, rank, token, entries)
        except (OSError, RuntimeError):  # torch.save's failure to write is a RuntimeError
            if read_token(root_fd, tmp) == token:
                raise
            continue  # rank 0 cleared a leftover dir under us: write again under its token
        if wait(partial(_committed, root_fd, final, tmp, token), deadline, cancel,
                f"rank 0 to commit {final}") == "yes":
            return entries


def _committed(root_fd: int, final: str, tmp: str, token: str) -> str | None:
    meta = _read_json(root_fd, f"{final}/{META}")
    if meta is not None and meta.get("save_id") == token:
        return "yes"
    current = read_token(root_fd, tmp)
    return "again" if current is not None and current != token else None


def report(tmp_fd: int, rank: int, token: str, entries: list[Entry]) -> None:
    """This rank's marker: its files are written (and durable) under `token`."""
    fileio.atomic_write_json(f".done.rank{rank}", {"token": token, "files": entries},
                             dir_fd=tmp_fd)


# -- writing ------------------------------------------------------------------------------------


def _write_files(view: memoryview, req: Request, tmp_fd: int,
                 cancel: Cancel) -> list[Entry]:
    entries = []
    for f in req.files:
        size, digest = _write_one(view, f, tmp_fd, cancel)
        entry: Entry = {"path": f.path, "component": f.component, "size": size,
                        "hash": digest, "hash_alg": HASH_ALG}
        if f.component in ("optimizer", "rng"):
            entry["rank"] = req.rank
        entries.append(entry)
    return entries


def _write_one(view: memoryview, f: FileRange, tmp_fd: int,
               cancel: Cancel) -> tuple[int, str]:
    """Write, hash, fdatasync and drop the cached pages of one file; (size, xxh3-128 hex)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f.path, dir_fd=tmp_fd)  # a retry under a new token writes the file again
    fd = os.open(f.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644, dir_fd=tmp_fd)
    try:
        h = xxhash.xxh3_128()
        done = dropped = 0
        while done < f.size:
            if cancel.is_set():
                raise Cancelled(f"stopped while writing {f.path}")
            chunk = view[f.offset + done:f.offset + min(f.size, done + CHUNK_SIZE)]
            h.update(chunk)
            cancel.written += len(chunk)
            while chunk:
                chunk = chunk[os.write(fd, chunk):]
            done = min(f.size, done + CHUNK_SIZE)
            if done - dropped >= _DROP_EVERY:
                fileio.advise(fd, dropped, done - dropped)
                dropped = done
        os.fdatasync(fd)
        fileio.advise(fd, 0, 0)
        return f.size, h.hexdigest()
    finally:
        os.close(fd)


def collect(tmp_fd: int, world: int, token: str, deadline: float,
            cancel: Cancel) -> list[Entry]:
    """Every rank's entries from their markers; each file must still have its listed size."""
    entries: list[Entry] = []
    for r in range(world):
        def marker(r: int = r) -> list[Entry] | None:
            done = _read_json(tmp_fd, f".done.rank{r}")
            ok = done is not None and done.get("token") == token
            return list(done["files"]) if ok and done is not None else None

        entries.extend(wait(marker, deadline, cancel, f"rank {r} to finish writing"))
    for e in entries:
        st = os.stat(str(e["path"]), dir_fd=tmp_fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode) or st.st_size != e["size"]:
            raise CkptdError(f"{e['path']}: size {st.st_size}, its rank reported {e['size']}")
    return entries


def commit(root_fd: int, tmp_fd: int, tmp: str, final: str, meta: dict[str, Any] | None,
           replace: Replace, deadline: float, cancel: Cancel) -> None:
    """The markers go, meta.json last (None: a node's share without it), `tmp` fsynced, then
    renamed to `final` by `swap`, through `replace` (waited for up to `deadline`)."""
    for name in os.listdir(tmp_fd):
        if name.startswith("."):
            os.unlink(name, dir_fd=tmp_fd)  # rendezvous markers are not part of the checkpoint
    if meta is not None:
        fileio.atomic_write_json(META, meta, dir_fd=tmp_fd)  # fsyncs tmp_fd: the unlinks too
    else:
        os.fsync(tmp_fd)
    wait(lambda: True if replace(partial(swap, root_fd, tmp, final)) else None, deadline,
         cancel, f"the readers of {final} to let the earlier save go")


def swap(root_fd: int, tmp: str, final: str) -> str | None:
    """`tmp` becomes `final` by one rename; an older `final` is moved aside first, to the name
    returned (None when there was none) for the `Replace` to drop."""
    old = None
    if _lexists(root_fd, final):
        old = f".{final}.old-{secrets.token_hex(4)}"
        os.rename(final, old, src_dir_fd=root_fd, dst_dir_fd=root_fd)
    os.rename(tmp, final, src_dir_fd=root_fd, dst_dir_fd=root_fd)
    os.fsync(root_fd)
    return old


def replace_here(root_fd: int) -> Replace:
    """The trainer's own process (ckptd.torch's fallback writer): as ckptd.torch does, the
    trainer's earlier save of the step goes once the new one is in."""
    def replace(swap: Callable[[], str | None]) -> bool:
        old = swap()
        if old is not None:
            with contextlib.suppress(OSError):  # committed already: a leftover stays
                fileio.remove_tree(old, dir_fd=root_fd)
        return True
    return replace


# -- directories and small files beneath the root ----------------------------------------------


def fresh_dir(root_fd: int, name: str) -> bool:
    """An empty directory `name`; True when a leftover one was set aside and removed first."""
    stale = _lexists(root_fd, name)
    if stale:
        aside = f".{name}.stale-{secrets.token_hex(4)}"
        os.rename(name, aside, src_dir_fd=root_fd, dst_dir_fd=root_fd)
        with contextlib.suppress(OSError):  # set aside already: the new dir does not need it
            fileio.remove_tree(aside, dir_fd=root_fd)
    os.mkdir(name, 0o755, dir_fd=root_fd)
    return stale


@contextlib.contextmanager
def opendir(root_fd: int, name: str) -> Iterator[int]:
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=root_fd)
    try:
        yield fd
    finally:
        os.close(fd)


def _lexists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _read_json(dir_fd: int, rel: str) -> dict[str, Any] | None:
    """A small JSON object beneath `dir_fd`, or None (absent, a link, too big, not JSON)."""
    parent, _, name = rel.rpartition("/")
    try:
        with contextlib.ExitStack() as stack:
            base = dir_fd
            if parent:
                base = stack.enter_context(opendir(dir_fd, parent))
            data = inputs.read_json(name, inputs.MARKER, dir_fd=base)
    except (OSError, BadInput):  # the bounded reader: a regular file, no link, strict JSON
        return None
    return data if isinstance(data, dict) else None


def read_token(root_fd: int, tmp: str) -> str | None:
    """The token of the save `tmp` holds (its `.ready`), or None."""
    ready = _read_json(root_fd, f"{tmp}/.ready")
    return None if ready is None else str(ready.get("token"))


def wait(probe: Callable[[], Any], deadline: float, cancel: Cancel, what: str) -> Any:
    """`probe()` once it is not None, polled with backoff; CkptdError past `deadline`."""
    delay = 0.01
    while True:
        found = probe()
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise CkptdError(f"timed out waiting for {what}")
        if cancel.wait(delay):
            raise Cancelled(f"stopped while waiting for {what}")
        delay = min(delay * 2, 0.25)
