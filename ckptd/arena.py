"""The async-save arena both sides share (docs/ASYNC.md): a memfd with a small header (magic,
state, generation), the persist request that names what is in it, and who may hand one over.

Standard library and ckptd.inputs only (training processes import it). Pure checks and
header bytes; never writes a checkpoint file and never talks to the socket.
"""

from __future__ import annotations

import enum
import fcntl
import json
import os
import re
import stat
import struct
from dataclasses import dataclass
from typing import Any

from ckptd import inputs
from ckptd.errors import BadInput, BadValue, Malformed

MAGIC = b"CKPTDAR1"
VERSION = 1
_HEADER = struct.Struct("<8sIIQQ")  # magic, version, state, generation, used bytes
DATA_OFFSET = 4096  # components start on the second page
ALIGN = 4096  # and each one on a page boundary
MAX_ARENA = 1 << 40
MAX_FILES = 16
MAX_WORLD = 1 << 16
MAX_STEP = 2**63
MAX_TIMEOUT_S = 7 * 86400.0
MAX_METRICS = 256
_RANK0_FILES = {"model.pt": "model", "ema.pt": "ema", "scheduler.pt": "scheduler",
                "scaler.pt": "scaler", "extra.pt": "extra"}
_RANK_FILE = re.compile(r"^(optim|rng)\.rank(\d{1,5})\.pt$", re.ASCII)


class State(enum.IntEnum):
    EMPTY = 0
    WRITING = 1
    SEALED = 2
    PERSISTED = 3
    FAILED = 4


@dataclass(frozen=True)
class Header:
    state: State
    generation: int
    used: int


def pack_header(state: State, generation: int, used: int) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, int(state), generation, used)


def read_header(buf: Any) -> Header:
    """The header at the start of `buf` (an mmap or bytes); ValueError if it is not one."""
    if len(buf) < _HEADER.size:
        raise Malformed(f"not a ckptd arena header: {len(buf)} bytes, under {_HEADER.size}")
    magic, version, state, generation, used = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC or version != VERSION or state not in State._value2member_map_:
        raise Malformed("not a ckptd arena header")
    if generation >= 2**63 or used > MAX_ARENA:  # what a request may name, what an arena holds
        raise Malformed(f"arena header out of range (generation {generation}, used {used})")
    return Header(State(state), generation, used)


def init_header(buf: Any) -> None:
    buf[0:_HEADER.size] = pack_header(State.EMPTY, 0, 0)


def set_state(buf: Any, state: State, generation: int, used: int | None = None) -> None:
    """Write the header; the state word goes last, so a reader that sees the new state sees
    the generation and size that go with it."""
    if used is not None:
        struct.pack_into("<Q", buf, 24, used)
    struct.pack_into("<Q", buf, 16, generation)
    struct.pack_into("<I", buf, 12, int(state))


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def create_memfd(size: int) -> int:
    """A new arena descriptor of `size` bytes, sealed against shrinking (it only ever grows, so
    no mapping of it can be cut short under a reader)."""
    fd = os.memfd_create("ckptd-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_memfd(fd: int) -> int:
    """The size of a handed-over arena; ValueError unless it is a memfd sealed against
    shrinking, of at most MAX_ARENA bytes."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise BadValue("the descriptor is not a memfd arena")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise BadValue("the descriptor is not a memfd arena (it has no seals)") from None
    if not seals & fcntl.F_SEAL_SHRINK:
        raise BadValue("the arena is not sealed against shrinking")
    if not DATA_OFFSET <= st.st_size <= MAX_ARENA:
        raise BadValue(f"the arena's size {st.st_size} is out of range")
    return st.st_size


# -- who may hand one over ---------------------------------------------------------------------


def peer_allowed(uid: int, gids: set[int], daemon_uid: int, socket_gid: int | None) -> bool:
    """Same uid as the daemon, or a member (primary or supplementary) of the socket's group."""
    return uid == daemon_uid or (socket_gid is not None and socket_gid in gids)


def peer_groups(pid: int, primary: int) -> set[int]:
    """The peer's groups: its primary gid plus the supplementary ones /proc shows."""
    gids = {primary}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    gids.update(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return gids


# -- the persist request ------------------------------------------------------------------------


@dataclass(frozen=True)
class FileRange:
    path: str
    component: str
    offset: int
    size: int


@dataclass(frozen=True)
class Request:
    root: str
    dir: str
    step: int
    rank: int
    world_size: int
    generation: int
    timeout: float
    files: tuple[FileRange, ...]
    head: dict[str, Any]
    register: bool = True  # rank 0's save registers the step once committed


def parse_request(body: Any, arena_size: int) -> Request:
    """A persist request checked against the arena it names; ValueError says what is wrong."""
    if not isinstance(body, dict):
        raise BadValue("the body is not a JSON object")
    root, where = _str(body, "root"), _str(body, "dir")
    step = _int(body, "step", 0, MAX_STEP - 1)
    world = _int(body, "world_size", 1, MAX_WORLD)
    rank = _int(body, "rank", 0, world - 1)
    generation = _int(body, "generation", 1, 2**63 - 1)
    timeout = body.get("timeout", 1800.0)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not (
            0 < timeout <= MAX_TIMEOUT_S):
        raise BadValue(f"timeout must be a number of seconds up to {MAX_TIMEOUT_S:.0f}")
    files = _files(body.get("files"), rank, arena_size)
    head = body.get("head")
    if not isinstance(head, dict) or not str(head.get("format", "")).startswith("ckptd-native/"):
        raise BadValue("head must be a meta.json head with format ckptd-native/*")
    if head.get("step") != step or head.get("world_size") != world:
        raise BadValue("head's step and world_size must match the request's")
    metrics = head.get("metrics", {})
    if not isinstance(metrics, dict) or len(metrics) > MAX_METRICS:
        raise BadValue(f"head's metrics must be at most {MAX_METRICS} numbers")
    try:
        for name, value in metrics.items():
            inputs.check_float(value, f"head's metric {str(name)[:40]!r}")
        # The head becomes meta.json, read back as strict JSON: integers within 2^63, finite
        # floats, bounded nesting. Refused here rather than written and found bad later.
        inputs.loads(json.dumps(head, allow_nan=False), "head")
    except (BadInput, ValueError, RecursionError) as exc:
        raise BadValue(f"head: {exc}") from None
    register = body.get("register", True)
    if not isinstance(register, bool):
        raise BadValue("register must be true or false")
    return Request(root, where, step, rank, world, generation, float(timeout), files, head,
                   register)


def _files(listing: Any, rank: int, arena_size: int) -> tuple[FileRange, ...]:
    if not isinstance(listing, list) or not 0 < len(listing) <= MAX_FILES:
        raise BadValue(f"files must be a list of 1 to {MAX_FILES} entries")
    out: list[FileRange] = []
    for entry in listing:
        if not isinstance(entry, dict):
            raise BadValue("each file must be an object")
        path = _str(entry, "path")
        component = file_component(path, rank)
        if component is None or entry.get("component") != component:
            raise BadValue(f"{path!r} is not a file rank {rank} of a native checkpoint writes")
        offset = _int(entry, "offset", DATA_OFFSET, arena_size)
        size = _int(entry, "size", 0, arena_size - offset)
        out.append(FileRange(path, component, offset, size))
    if len({f.path for f in out}) != len(out):
        raise BadValue("a file is named twice")
    return tuple(out)


def file_component(name: str, rank: int) -> str | None:
    """The component a native file name holds, if rank `rank` writes it; else None."""
    if rank == 0 and name in _RANK0_FILES:
        return _RANK0_FILES[name]
    m = _RANK_FILE.match(name)
    if m is None or int(m.group(2)) != rank or m.group(2) != str(rank):
        return None
    return "optimizer" if m.group(1) == "optim" else "rng"


def _str(obj: dict[str, Any], key: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not 0 < len(value) <= 4096 or "\x00" in value:
        raise BadValue(f"{key} must be a non-empty string")
    return value


def _int(obj: dict[str, Any], key: str, low: int, high: int) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadValue(f"{key} must be an integer from {low} to {high}")
    return value
