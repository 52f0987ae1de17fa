"""A native checkpoint read straight from the root's remote: each component file streamed
through a ranged, block-checked reader into `torch.load(weights_only=True)`, no staging disk.
The backends and the config are imported only here, and only when a load reads the bucket.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from collections.abc import Callable
from typing import Any

import torch

from ckptd.errors import CorruptData, NotFound, ValidationFailed

_NAMES = {"model": "model.pt", "ema": "ema.pt", "scheduler": "scheduler.pt",
          "scaler": "scaler.pt"}
_META_MAX = 64 << 20


class RemoteNative:
    """One committed native step of a remote; `states()` as `_NativeReader.states()`."""

    def __init__(self, root: str, step: int | str, rank: int, map_location: Any, *,
                 config: str | os.PathLike[str] | None, remote: str | None) -> None:
        from ckptd.remote.step import RemoteStep

        self.opened = RemoteStep.open(root, step, config=config, remote=remote)
        self.rank, self.map_location = rank, map_location
        metas = [f.path for f in self.opened.files() if f.path.rpartition("/")[2] == "meta.json"]
        if len(metas) != 1:
            self.opened.close()
            raise NotFound(f"{self.opened.url}: not a native checkpoint ({len(metas)} meta.json)")
        self.base = metas[0].rpartition("/")[0]
        self.where = f"{self.opened.url}/{self.base}" if self.base else self.opened.url
        self.meta = self._json("meta.json")

    @property
    def step(self) -> int:
        return self.opened.step

    def close(self) -> None:
        self.opened.close()

    def _path(self, name: str) -> str:
        return f"{self.base}/{name}" if self.base else name

    def has(self, name: str) -> bool:
        return any(f.path == self._path(name) for f in self.opened.files())

    def _json(self, name: str) -> dict[str, Any]:
        f = self.opened.stored(self._path(name))
        if f.size > _META_MAX:
            raise CorruptData(f"{self.where}/{name}: {f.size} bytes, over {_META_MAX}")
        buf = bytearray()
        self.opened.reader(f.path).read(None, lambda _at, view: buf.extend(view))
        try:
            doc = json.loads(bytes(buf))
        except ValueError as exc:
            raise CorruptData(f"{self.where}/{name}: not JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise CorruptData(f"{self.where}/{name}: not a JSON object")
        return doc

    def load(self, name: str, map_location: Any = None) -> Any:
        """torch.load of one file of the step, read through the block-checked reader."""
        from ckptd.remote.openfile import RemoteFile

        raw = RemoteFile(self.opened, self._path(name))
        with io.BufferedReader(raw, buffer_size=1 << 20) as f:
            try:
                return torch.load(f, map_location=map_location or self.map_location,
                                  weights_only=True)
            except Exception as exc:
                if raw.error is not None:  # what the bucket's bytes did, not torch's echo of it
                    raise raw.error from None
                if not isinstance(exc, pickle.UnpicklingError):
                    raise
                raise ValidationFailed(
                    "unsafe_pickle", f"{self.where}/{name}: refused, it needs more than plain "
                    f"tensors and containers to load ({exc})", name) from exc

    def states(self) -> dict[str, Callable[[bool], Any]]:
        names = {**_NAMES, "optimizer": f"optim.rank{self.rank}.pt"}
        return {c: self._loader(n) for c, n in names.items() if self.has(n)}

    def _loader(self, name: str) -> Callable[[bool], Any]:
        return lambda _mmap: self.load(name)

    def rng(self) -> Any:
        name = f"rng.rank{self.rank}.pt"
        return self.load(name, "cpu") if self.has(name) else None
