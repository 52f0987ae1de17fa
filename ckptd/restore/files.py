"""Restore: rebuild a step's original files, byte for byte and hash-checked, from its local
compressed copy or its remote objects, without the daemon.

Owns choosing the source of a step and writing restored files atomically; never touches the
store or the daemon, and never holds a whole file in memory.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TextIO

from ckptd import fileio, layouts
from ckptd.backends import Backend
from ckptd.config import Config, RootConfig
from ckptd.copies.decode import Decoding, decode_object, every_core
from ckptd.copies.store import objects_dir, read_local_manifest
from ckptd.errors import NotFound, UnsafePath
from ckptd.fetch import pipe
from ckptd.fetch.holds import ReaderHold, daemon_socket
from ckptd.fetch.source import (
    StepArg,
    list_remote_steps,
    newest_copy,
    read_remote_manifest,
    remote_backend,
    resolve_step,
)
from ckptd.fileio import DurableWriter, write_error
from ckptd.log import get_logger
from ckptd.remote.keys import manifest_exists
from ckptd.remote.manifest import Manifest, StoredFile, for_node, step_prefix
from ckptd.units import progress_line

Progress = Callable[[int], None]  # bytes just restored
TotalProgress = Callable[[int, int], None]  # (bytes restored so far, bytes in the step)


# --- writing one restored file ---------------------------------------------------------------


def _restore_file(src: Path, f: StoredFile, to: Path, progress: Progress | None,
                  decoding: Decoding) -> Path:
    """Decode `src` into `<to>/<f.path>` through a temp name: fsynced, checked, then renamed.
    On any failure the temp file is removed and nothing is left at the final name."""
    dest = fileio.safe_join(to, f.path)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise write_error(exc, f"the directory of {dest}") from exc
    tmp = fileio.temp_name(dest)
    out = DurableWriter(tmp, str(dest))
    try:
        decode_object(src, f, out, progress, decoding)
        out.close_durably()
        os.replace(tmp, dest)
        fileio.fsync_dir(dest.parent)
    except BaseException:
        out.close()
        tmp.unlink(missing_ok=True)
        raise
    return dest


def restore_local(root_name: str, root_dir: Path, step: int, to: Path,
                  progress: TotalProgress | None = None, socket: str | None = None
                  ) -> list[Path] | None:
    """Restore a step from its local compressed copy, held through the daemon at `socket`
    while it is read (a daemon releases a copy once it is uploaded, unless a reader holds
    it); without a daemon nothing else deletes it. None when the copy is gone, before the
    read or under it (a hold refused, a copy damaged by hand): the caller tries the next
    tier. Nothing of a read that failed is left in `to`."""
    with ReaderHold(None, root_name, step, socket=socket):
        manifest = read_local_manifest(root_dir, step)
        if manifest is None:
            get_logger().warning("restore_source_gone", root=root_name, step=step,
                                 tier="local", error="its manifest is gone")
            return None
        check_target(to, [f.path for f in manifest.files])
        cb = _cumulative(progress, manifest.size)
        try:
            return all_or_nothing(to, with_pointers(manifest, lambda staging:
                                  restore_from_dir(objects_dir(root_dir, step), manifest,
                                                   staging, cb)))
        except NotFound as exc:
            get_logger().warning("restore_source_gone", root=root_name, step=step,
                                 tier="local", error=str(exc))
            return None


def restore_from_dir(
    objects_dir: Path, manifest: Manifest, to: Path, progress: Progress | None = None
) -> list[Path]:
    """Rebuild every file of `manifest` under `to` from the objects in `objects_dir`.

    Each file is decoded streaming, checked against the manifest's size and hash, fsynced and
    renamed into place (replacing a file of that name). A missing object is NotFound naming
    it; CorruptData names the file (and the block, where the codec knows it); the
    half-written file is removed. `progress(n)` is called with each count of bytes restored.
    """
    to = Path(to)
    to.mkdir(parents=True, exist_ok=True)
    restored = []
    with every_core() as decoding:
        for f in manifest.files:
            src = fileio.safe_join(objects_dir, f.key)
            if not src.is_file():
                raise NotFound(f"{f.path}: stored object {src} is missing")
            try:
                restored.append(_restore_file(src, f, to, progress, decoding))
            except FileNotFoundError as exc:
                if str(exc.filename) != str(src):  # the target's, not the copy's: a write error
                    raise write_error(exc, str(to)) from exc
                raise NotFound(f"{f.path}: stored object {src} is missing") from None
    return _one_mtime(restored)


def with_pointers(manifest: Manifest, fill: Callable[[Path], list[Path]]
                  ) -> Callable[[Path], list[Path]]:
    """`fill`, then the pointer files the checkpoint's framework loads it through and that
    are not its members (DeepSpeed's `latest`, naming the restored tag even where the run
    had moved on): without them the loader would not find the restored step."""

    def run(staging: Path) -> list[Path]:
        done = fill(staging)
        members = {f.path for f in manifest.files}
        paths = tuple(f.path for f in manifest.files)
        for rel, data in layouts.pointer_files(manifest.layout, paths).items():
            if rel not in members:
                dest = fileio.safe_join(staging, rel)
                try:
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    fileio.atomic_write_bytes(dest, data)
                except OSError as exc:
                    raise write_error(exc, str(dest)) from exc
                done.append(dest)  # last: moved into place after the files it points to
        return done

    return run


def _one_mtime(paths: list[Path]) -> list[Path]:
    """Give every restored file the same mtime. Files come back in manifest order, so without
    this a commit file restored first (DCP's `.metadata`) would look older than its data: to
    the layouts, a re-save in progress, and the restored checkpoint would never be whole."""
    now = time.time()
    for p in paths:
        os.utime(p, (now, now))
    return paths


# --- remote ----------------------------------------------------------------------------------


def restore_remote(
    backend: Backend, manifest: Manifest, to: Path, concurrency: int = 4,
    progress: Progress | None = None,
) -> list[Path]:
    """Rebuild a remote step's files under `to`: fetch the objects on `concurrency` threads,
    each decoded and checked as it arrives (`fetch.pipe`), written like `restore_from_dir`
    does. The first failure stops the rest and is raised; files already restored stay,
    nothing half-written does."""
    to.mkdir(parents=True, exist_ok=True)
    prefix = step_prefix(manifest.root, manifest.step)
    safe = _Locked(progress) if progress is not None else None
    failed: Future[Path] | None = None
    with every_core() as decoding, ThreadPoolExecutor(max(1, concurrency),
                                                      "ckptd-restore") as pool:
        futures = [pool.submit(pipe.fetch_and_restore, backend, f"{prefix}/{f.key}",
                               f, to, safe, decoding) for f in manifest.files]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((fut for fut in futures if fut in done and fut.exception()), None)
        if failed is not None:
            for fut in futures:
                fut.cancel()
    error = failed.exception() if failed is not None else None
    if error is not None:
        raise error
    return _one_mtime([fut.result() for fut in futures])


class _Locked:
    """A progress callback made safe to call from several fetch threads."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._lock = threading.Lock()

    def __call__(self, n: int) -> None:
        with self._lock:
            self._progress(n)


# --- the whole job ---------------------------------------------------------------------------


def restore(
    config: Config,
    root_name: str,
    step: StepArg,
    to: Path,
    progress: TotalProgress | None = None,
    node: str | None = None,
) -> tuple[int, list[Path]]:
    """Restore a step of a configured root into `to` (see `resolve_step` for which and from
    where); no daemon needed. `progress(done, total)` gets cumulative bytes. Returns the step
    and the restored paths. A multi-node root restores from its commit: `node` "*" the whole
    checkpoint, else that node's files and the record (default: this node's)."""
    root = config.root(root_name)
    backend = remote_backend(root)
    if root.multi_node:
        return _restore_nodes(root, backend, step, to, progress,
                              node or config.daemon.node_id, str(config.daemon.socket))
    n, where = resolve_step(root.path, root.name, step, backend)
    if where == "local":
        done = restore_local(root.name, root.path, n, Path(to), progress,
                             str(config.daemon.socket))
        if done is not None:
            return n, done
        if backend is None or not manifest_exists(backend, root.name, n):
            raise NotFound(f"the local copy of step {n} of {root_name!r} disappeared")
    assert backend is not None
    with ReaderHold(backend, root.name, n, socket=str(config.daemon.socket)):
        remote = read_remote_manifest(backend, root.name, n)
        check_target(Path(to), [f.path for f in remote.files])
        cb = _cumulative(progress, remote.size)
        return n, all_or_nothing(Path(to), with_pointers(remote, lambda staging:
                                 restore_remote(backend, remote, staging,
                                                root.upload.concurrency, cb)))


def _restore_nodes(root: RootConfig, backend: Backend | None, step: StepArg, to: Path,
                   progress: TotalProgress | None, node: str, socket: str
                   ) -> tuple[int, list[Path]]:
    """A multi-node step from its commit (docs/MULTINODE.md): no node's disk holds it whole."""
    if backend is None:
        raise NotFound(f"root {root.name!r} has no upload.url: a multi-node step is restored"
                       " from its commit")
    n = step if step != "latest" else newest_copy(
        set(), set(list_remote_steps(backend, root.name)), backend, root.name)
    if n is None:
        raise NotFound(f"no committed step of {root.name!r} at {backend.url}")
    with ReaderHold(backend, root.name, n, socket=socket):
        try:
            remote = for_node(read_remote_manifest(backend, root.name, n), node)
        except ValueError as exc:
            raise NotFound(str(exc)) from None
        check_target(Path(to), [f.path for f in remote.files])
        cb = _cumulative(progress, remote.size)
        return n, all_or_nothing(Path(to), with_pointers(remote, lambda staging:
                                 restore_remote(backend, remote, staging,
                                                root.upload.concurrency, cb)))


def all_or_nothing(to: Path, fill: Callable[[Path], list[Path]]) -> list[Path]:
    """Restore into a staging directory inside `to`, and move the files into place only once
    every one is written and verified: a failed restore leaves no partial files (and no `to`
    it had to create). Files already in `to` under the same names are replaced."""
    created = not to.exists()
    try:
        to.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=to))
    except OSError as exc:
        raise write_error(exc, str(to)) from exc
    try:
        done = fill(staging)
        check_target(to, [p.relative_to(staging).as_posix() for p in done])
        final = []
        for p in done:
            dest = to / p.relative_to(staging)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(p, dest)
            final.append(dest)
        for d in {f.parent for f in final}:
            fileio.fsync_dir(d)
        return _one_mtime(final)
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                fileio.remove_tree(to)
        raise
    finally:
        with contextlib.suppress(OSError):
            fileio.remove_tree(staging)


def check_target(to: Path, paths: list[str]) -> None:
    """Refuse (UnsafePath, naming it) a restore into `to` whose file would be placed through
    a symlink or a non-directory already there ("a" a link or a file, restoring "a/b"), or
    over a directory: checked for every file before any is placed."""
    for rel in paths:
        parts = rel.split("/")
        at = to
        for i, name in enumerate(parts):
            at = at / name
            try:
                mode = os.lstat(at).st_mode
            except FileNotFoundError:
                break
            except OSError as exc:
                raise write_error(exc, str(at)) from exc
            last = i == len(parts) - 1
            if not last and stat.S_ISLNK(mode):
                raise UnsafePath(f"{at} is a symlink: restoring {rel} would write through it;"
                                 " nothing was restored")
            if not last and not stat.S_ISDIR(mode):
                raise UnsafePath(f"{at} is not a directory: cannot restore {rel} under it;"
                                 " nothing was restored")
            if last and stat.S_ISDIR(mode):
                raise UnsafePath(f"{at} is a directory: cannot restore the file {rel} over"
                                 " it; nothing was restored")


def _cumulative(progress: TotalProgress | None, total: int) -> Progress | None:
    if progress is None:
        return None
    done = 0

    def step(n: int) -> None:
        nonlocal done
        done += n
        progress(done, total)

    progress(0, total)
    return step


def tty_progress(stream: TextIO | None = None, interval: float = 0.1) -> TotalProgress | None:
    """A progress bar for `restore` drawn on `stream` (stderr) when it is a terminal, else None."""
    out = sys.stderr if stream is None else stream
    if not out.isatty():
        return None
    last = 0.0
    start = time.monotonic()

    def draw(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if done < total and now - last < interval:
            return
        last = now
        out.write(f"\r{progress_line(done, total, now - start)}\x1b[K")
        if done >= total:
            out.write("\n")
        out.flush()

    return draw


def restore_checkpoint(root_name: str, step: int, to: Path, root_dir: Path | None = None,
                       config_path: Path | None = None) -> list[Path]:
    """Rebuild one step's original files under `to` for a loader (`ckptd.torch.load`, through
    `ckptd.cli.restore_child`): from the local compressed copy in `root_dir` when there is
    one, else from the remote named by the config (`config_path`, else as the daemon finds
    its own: `config.find_config`)."""
    if root_dir is not None:
        done = restore_local(root_name, Path(root_dir), step, Path(to),
                             socket=daemon_socket(config_path, None))
        if done is not None:
            return done
    from ckptd.config import find_config, load_config
    from ckptd.errors import ConfigError

    path = find_config(config_path)
    if path is None:
        raise ConfigError("no config to find the remote: pass one, or set CKPTD_CONFIG (neither"
                          " /etc/ckptd/ckptd.toml nor ./ckptd.toml exists)")
    get_logger().info("config_used", path=str(path))
    _, paths = restore(load_config(path), root_name, step, Path(to))
    return paths


STAGING_PREFIX = ".ckptd-restore-"
