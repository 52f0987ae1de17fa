"""System probes for the compression benchmark: page-cache residency, eviction, child rusage,
and a one-pass fadvise reader used when `ckptd.fileio.read_pass` is not available.

Measures and reads only; never changes files it is handed except to drop their cached pages.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Input:
    name: str
    path: str
    kind: str  # what it is, for the table
    zipnn_dtype: str  # the element type zipnn is told ("bfloat16", "float16" or "float32")
    is_zip: bool = False


class Sink(Protocol):
    def update(self, offset: int, view: memoryview) -> None: ...

    def finish(self, total: int) -> None: ...


def evict(path: str) -> None:
    """Write back and drop the file's cached pages, so every run starts from a cold cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_bytes(path: str) -> int:
    """Bytes of `path` in the page cache (util-linux `fincore`, else mincore(2))."""
    if shutil.which("fincore"):
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES", path],
            capture_output=True,
            text=True,
            check=True,
        )
        return int(out.stdout.split()[0])
    return _mincore(path)


def _mincore(path: str) -> int:
    size = os.path.getsize(path)
    if size == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec) * mmap.PAGESIZE


def local_read_pass(path: str, sinks: Sequence[Sink], chunk_size: int = 8 << 20) -> int:
    """open, fadvise SEQUENTIAL, readinto one reused buffer, DONTNEED behind the cursor."""
    fd = os.open(path, os.O_RDONLY)
    buf = memoryview(bytearray(chunk_size))
    offset = 0
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while n := os.readv(fd, [buf]):
            for sink in sinks:
                sink.update(offset, buf[:n])
            os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)
            offset += n
    finally:
        os.close(fd)
    for sink in sinks:
        sink.finish(offset)
    return offset


def read_pass(path: str, sinks: Sequence[Sink]) -> tuple[int, str]:
    """Run the project's read pass when it exists, else the local one; says which ran."""
    try:
        from ckptd.fileio import read_pass as project_read_pass
    except ImportError:
        return local_read_pass(path, sinks), "bench local reader"
    return project_read_pass(path, sinks), "ckptd.fileio.read_pass"


@dataclass(frozen=True)
class ChildRun:
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    cpu_s: float
    max_rss_bytes: int


def run_child(argv: list[str], stdout_path: str | None = None) -> ChildRun:
    """Run a command and return its own rusage (os.wait4), not that of every child so far."""
    out_file = open(stdout_path, "wb") if stdout_path else None  # noqa: SIM115
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=out_file or subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = b"", b""
    try:
        if out_file is None:
            assert proc.stdout is not None
            out = proc.stdout.read()
        assert proc.stderr is not None
        err = proc.stderr.read()
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        if out_file:
            out_file.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return ChildRun(
        returncode=proc.returncode,
        stdout=out.decode(errors="replace"),
        stderr=err.decode(errors="replace"),
        wall_s=time.perf_counter() - start,
        cpu_s=usage.ru_utime + usage.ru_stime,
        max_rss_bytes=usage.ru_maxrss * 1024,
    )
