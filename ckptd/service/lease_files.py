"""The root lease's files in `<root>/.ckptd`: looked at and written beneath the root's directory
fd, never through a link, every read bounded. Decides nothing (`ckptd.cluster.lease.judge` does)
and keeps no state (`ckptd.service.lease` does)."""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from ckptd import fileio, inputs
from ckptd.cluster.lease import (
    CLAIM_PREFIX,
    LEASE_FILE,
    Holder,
    Seen,
    claim_generation,
    claim_name,
    valid_token,
)
from ckptd.errors import BadInput
from ckptd.model import CKPTD_DIR, RootError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class LeaseProblem(Exception):
    """A root whose lease cannot be looked at or written; the message says why, `kind` which
    of the root's errors it is."""

    def __init__(self, message: str, kind: RootError = RootError.LEASE) -> None:
        super().__init__(message)
        self.kind = kind


def open_dir(root: Path, create: bool) -> int:
    """`<root>/.ckptd`, opened without following a symlink at either step. `root` is the path
    the config resolved (`ckptd.config.load`): a link there now was made after the config was
    read, and is refused until a reload follows it."""
    try:
        rfd = os.open(root, _DIR_FLAGS)
    except FileNotFoundError:
        raise LeaseProblem(f"root path {root} does not exist", RootError.ROOT_MISSING) from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(root):
            raise LeaseProblem(f"lease: root path {root} became a symlink after the config was"
                               " read; a root's link is followed only when the config is read"
                               " (`systemctl reload ckptd`)") from exc
        raise LeaseProblem(f"lease: cannot open root {root}: {exc.strerror}") from exc
    try:
        if create:
            try:
                os.mkdir(CKPTD_DIR, 0o755, dir_fd=rfd)
            except FileExistsError:
                pass
        return os.open(CKPTD_DIR, _DIR_FLAGS, dir_fd=rfd)
    except OSError as exc:
        link = exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(rfd, CKPTD_DIR)
        why = "it is a symlink (never followed out of a root)" if link else exc.strerror
        raise LeaseProblem(f"lease: cannot open {root / CKPTD_DIR}: {why}") from exc
    finally:
        os.close(rfd)


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _read_small(dfd: int, name: str) -> tuple[bytes, os.stat_result] | None:
    """A lease file through the bounded reader (a regular file, never through a link, at most
    the lease cap), with its stat; None when absent, refused or unreadable (then it is judged
    by its claim and by time alone)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                     dir_fd=dfd)
    except OSError:
        return None
    try:
        return inputs.read_fd(fd, inputs.LEASE, name), os.fstat(fd)
    except (OSError, BadInput):
        return None
    finally:
        os.close(fd)


def top_claim(dfd: int) -> tuple[int, str | None]:
    gens = [g for g in (claim_generation(n) for n in os.listdir(dfd)) if g is not None]
    if not gens:
        return 0, None
    top = max(gens)
    got = _read_small(dfd, claim_name(top))
    token = got[0][:128].decode("ascii", "replace").strip() if got else None
    return top, token if token and valid_token(token) else None


def look(dfd: int) -> Seen:
    top, token = top_claim(dfd)
    holder: Holder | None = None
    stat_key: tuple[Any, ...] = ()
    got = _read_small(dfd, LEASE_FILE)
    if got is not None:
        data, st = got
        stat_key = (st.st_ino, st.st_mtime_ns, st.st_size)
        try:
            holder = Holder.from_json(inputs.loads(data, LEASE_FILE))
        except (ValueError, BadInput):
            holder = None  # damaged: judged by its claim and by time alone
    else:
        try:  # refused (a FIFO, a link, over the cap): still seen to change, never read
            st = os.stat(LEASE_FILE, dir_fd=dfd, follow_symlinks=False)
            stat_key = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            pass
    return Seen(top=top, top_token=token, holder=holder, key=(top, token, stat_key))


def write_lease(dfd: int, doc: Holder) -> None:
    """lease.json replaced atomically beneath the root's `.ckptd` directory fd."""
    data = json.dumps(doc.as_json(), sort_keys=True).encode() + b"\n"
    fileio.atomic_write_bytes(LEASE_FILE, data, dir_fd=dfd)


def retire_claims(dfd: int, top: int) -> bool:
    """Retire every claim, the stale one at `top` first: renamed away (only one taker's rename
    succeeds; False for the others), then every lower claim removed, so the next claim is
    generation 1. Only a stale lease is retired: its claims are all outdated."""
    retired = f".lease.retired.{secrets.token_hex(8)}"
    try:
        os.rename(claim_name(top), retired, src_dir_fd=dfd, dst_dir_fd=dfd)
    except FileNotFoundError:
        return False
    drop_claims_below(dfd, top + 1)
    try:
        os.unlink(retired, dir_fd=dfd)
    except OSError:
        pass
    return True


def drop_claims_below(dfd: int, gen: int) -> None:
    for name in os.listdir(dfd):
        g = claim_generation(name)
        if name.startswith(CLAIM_PREFIX) and g is not None and g < gen:
            try:
                os.unlink(name, dir_fd=dfd)
            except OSError:
                pass
