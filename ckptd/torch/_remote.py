"""A native checkpoint read straight from the root's remote: each component file streamed
through a ranged, block-checked reader into `torch.load(weights_only=True)`, no staging disk.
The backends and the config are imported only here, and only when a load reads the bucket.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ckptd.codec.buffers import same_memory
from ckptd.errors import BadInput, NotFound, ValidationFailed
from ckptd.torch import _meta
from ckptd.units import progress_line


class _Into:
    """A sink writing each piece at its offset of `view`, unless it was decoded there."""

    def __init__(self, view: memoryview) -> None:
        self.view = view

    def __call__(self, at: int, data: memoryview) -> None:
        target = self.view[at : at + len(data)]
        if not same_memory(target, data):
            target[:] = data


class _Counted(_Into):
    """An _Into that also draws the bytes landed so far on a terminal (`draw`); its blocks
    arrive from several threads."""

    def __init__(self, view: memoryview, total: int, draw: Callable[[int, int], None]) -> None:
        super().__init__(view)
        self.total, self.draw, self.done = total, draw, 0
        self.lock = threading.Lock()

    def __call__(self, at: int, data: memoryview) -> None:
        super().__call__(at, data)
        with self.lock:
            self.done += len(data)
            self.draw(self.done, self.total)


def _tty_progress(name: str, interval: float = 0.1) -> Callable[[int, int], None] | None:
    """A progress line for one file's bytes drawn on stderr when it is a terminal, else None
    (a job's log gets nothing)."""
    if not sys.stderr.isatty():
        return None
    start, last = time.monotonic(), 0.0

    def draw(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if done < total and now - last < interval:
            return
        last = now
        line = progress_line(done, total, now - start)
        sys.stderr.write(f"\r{name} {line}\x1b[K" + ("\n" if done >= total else ""))
        sys.stderr.flush()

    return draw


class RemoteNative:
    """One committed native step of a remote; `states()` as `_NativeReader.states()`."""

    def __init__(self, root: str, step: int | str, rank: int, map_location: Any, *,
                 config: str | os.PathLike[str] | None, remote: str | None) -> None:
        from ckptd.fetch.step import RemoteStep

        self.opened = RemoteStep.open(root, step, config=config, remote=remote)
        self.rank, self.map_location = rank, map_location
        files = self.opened.files()
        metas = [f.path for f in files if f.path.rpartition("/")[2] == "meta.json"]
        # A single-file (legacy) checkpoint: its one file, else None (a native step).
        self.single: str | None = files[0].path if not metas and len(files) == 1 else None
        if len(metas) != 1 and self.single is None:
            self.opened.close()
            raise NotFound(f"{self.opened.url}: neither a native checkpoint ({len(metas)} "
                           f"meta.json) nor a single file ({len(files)} files)")
        self.base = metas[0].rpartition("/")[0] if metas else ""
        self.where = f"{self.opened.url}/{self.base}" if self.base else self.opened.url
        try:
            self.checked = self._meta() if metas else None
        except BaseException:
            self.opened.close()
            raise
        self.meta: dict[str, Any] = self.checked.doc if self.checked else {}

    @property
    def step(self) -> int:
        return self.opened.step

    def close(self) -> None:
        self.opened.close()

    def _path(self, name: str) -> str:
        return f"{self.base}/{name}" if self.base else name

    def has(self, name: str) -> bool:
        """Whether the step holds `name`: listed in its meta.json (a legacy file: its one)."""
        if self.checked is None:
            return name == self.single
        return name in self.checked.files

    def _meta(self) -> _meta.Meta:
        """meta.json through the bounded strict reader, every value a load acts on checked,
        and every file it lists held by the manifest at the listed size: all before the
        first tensor is read. BadInput (a CorruptData) naming the object otherwise."""
        where = f"{self.where}/{_meta.NAME}"
        f = self.opened.stored(self._path(_meta.NAME))
        if f.size > _meta.KIND.cap:
            raise BadInput(f"{where}: {f.size} bytes, over the {_meta.KIND.name} cap of "
                           f"{_meta.KIND.cap}")
        buf = bytearray()

        def sink(_at: int, view: memoryview) -> None:
            if len(buf) + len(view) > _meta.KIND.cap:
                raise BadInput(f"{where}: over the {_meta.KIND.name} cap of {_meta.KIND.cap}")
            buf.extend(view)

        self.opened.reader(f.path).read(None, sink)
        meta = _meta.parse(bytes(buf), where, self.opened.step)
        held = {g.path: g.size for g in self.opened.files()}
        for name, size in meta.files.items():
            stored = held.get(self._path(name))
            if stored is None:
                raise BadInput(f"{where}: lists {name}, which the step's manifest does not hold")
            if stored != size:
                raise BadInput(f"{self.where}/{name}: {stored} bytes in the manifest, {size} "
                               f"in {_meta.NAME}")
        return meta

    def load(self, name: str, map_location: Any = None) -> Any:
        """torch.load of one file of the step. Where the system has anonymous memory files
        (Linux), the file is decoded straight into one, blocks in place and in parallel, and
        torch maps its tensors from it: no staging disk and no second copy; else it is read
        through the ranged file object (`ckptd.open`)."""
        location = map_location or self.map_location
        if hasattr(os, "memfd_create"):
            fd = self._in_memory(name)
            try:
                return self._torch_load(f"/proc/self/fd/{fd}", name, location, mmap=True)
            finally:
                os.close(fd)  # the tensors' mapping keeps the memory while they live
        from ckptd.fetch.openfile import RemoteFile

        raw = RemoteFile(self.opened, self._path(name))
        with io.BufferedReader(raw, buffer_size=1 << 20) as f:
            try:
                return self._torch_load(f, name, location)
            except Exception:
                if raw.error is not None:  # what the bucket's bytes did, not torch's echo of it
                    raise raw.error from None
                raise

    def _in_memory(self, name: str) -> int:
        """A memory file holding the original bytes of `name`, checked block by block and
        whole against the manifest; its descriptor."""
        f = self.opened.stored(self._path(name))
        self.opened.reader(f.path).check()  # the sizes against the object, before any memory
        fd = os.memfd_create(f"ckptd-{name}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, f.size)
            if f.size:
                mem = mmap.mmap(fd, f.size)
                view = memoryview(mem)
                draw = _tty_progress(name)  # on a terminal: the bytes, their rate, the ETA
                sink = _Into(view) if draw is None else _Counted(view, f.size, draw)
                try:
                    self.opened.reader(f.path).read(None, sink, lambda at, n: view[at : at + n])
                finally:
                    # After a failure, blocks still decoding may hold pieces of the mapping:
                    # then it is unmapped when the last of them goes, not here.
                    with contextlib.suppress(BufferError):
                        view.release()
                        mem.close()
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _torch_load(self, src: Any, name: str, location: Any, mmap: bool = False) -> Any:
        try:
            return torch.load(src, map_location=location, weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as exc:
            raise ValidationFailed(
                "unsafe_pickle", f"{self.where}/{name}: refused, it needs more than plain "
                f"tensors and containers to load ({exc})", name) from exc

    def states(self) -> dict[str, Callable[[bool], Any]]:
        files = self.checked.component_files(self.rank) if self.checked else {}
        return {c: self._loader(n) for c, n in files.items()}

    def _loader(self, name: str) -> Callable[[bool], Any]:
        return lambda _mmap: self.load(name)

    def rng(self) -> Any:
        name = f"rng.rank{self.rank}.pt"
        return self.load(name, "cpu") if self.has(name) else None
