"""DCP's StorageReader over a committed remote step: which step and checkpoint directory, the
metadata (`meta`), the global plan's one-step check, and each rank's read items grouped by file,
a few files at once. Decides nothing about the plan (DCP's planner does); what a file's bytes
become is `route`'s.
"""

from __future__ import annotations

import dataclasses
import io
import os
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from ckptd import needs_torch

try:
    import torch
except ModuleNotFoundError as exc:  # the slim install (`pip install ckptd`) brings no torch
    if exc.name != "torch":
        raise
    raise ModuleNotFoundError(needs_torch("ckptd.dcp"), name="torch") from None

from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader as _StorageReader

from ckptd.dcp.meta import MAX_METADATA_BYTES, read_metadata
from ckptd.dcp.route import Chunk, Router, sink_for
from ckptd.errors import BadInput, Cancelled, CorruptData, NotFound

if TYPE_CHECKING:  # the backends and the config load only when a read begins
    from ckptd.fetch.step import RemoteStep, StepArg

_METADATA = ".metadata"
FILES_AT_ONCE = 4


class StorageReader(_StorageReader):
    """Read a DCP checkpoint of root `root` at `step` ("latest": the newest committed step)
    from the remote the config gives the root (`config=`, else the usual search), or from
    `remote=` (the upload URL, credentials from the environment)::

        dcp.load(state_dict, storage_reader=StorageReader("llm-7b", step="latest"))

    Every rank opens its own reader; with step="latest" all ranks must resolve the same step
    (checked in the global plan: a mismatch is an error asking for an explicit step).
    `stats` counts the stored bytes fetched, requests and blocks decoded.
    """

    def __init__(self, root: str, step: StepArg = "latest", *,
                 config: str | os.PathLike[str] | None = None, remote: str | None = None,
                 threads: int | None = None) -> None:
        super().__init__()
        self.root, self.requested, self.config, self.remote = root, step, config, remote
        self.threads = threads
        self._step: RemoteStep | None = None
        self._failed: Exception | None = None
        self._base: str | None = None
        self.storage_data: dict[MetadataIndex, Any] = {}
        # Each saved chunk's size, by its storage index: what a slice's tensor must be.
        self._chunks: dict[MetadataIndex, Chunk] = {}

    # -- where and which step ----------------------------------------------------------------

    @property
    def step(self) -> int:
        return self._open().step

    @property
    def stats(self) -> Any:
        return self._open().stats

    def _open(self) -> RemoteStep:
        if self._failed is not None:  # DCP asks again per rank: one failure is enough
            raise self._failed
        if self._step is None:
            from ckptd.fetch.step import DEFAULT_THREADS, RemoteStep

            try:
                self._step = RemoteStep.open(self.root, self.requested, config=self.config,
                                             remote=self.remote,
                                             threads=self.threads or DEFAULT_THREADS)
            except Exception as exc:
                self._failed = exc
                raise
        return self._step

    def _path(self, name: str) -> str:
        """The manifest path of a file DCP names relative to its checkpoint directory: the
        directory that holds the step's `.metadata` (the manifest's paths are the root's)."""
        if self._base is None:
            found = {f.path.rpartition("/")[0] for f in self._open().files()
                     if f.path.rpartition("/")[2] == _METADATA}
            if len(found) != 1:
                raise NotFound(f"{self._open().url}: {len(found)} DCP .metadata files in the "
                               "step, not one: not a DCP checkpoint")
            self._base = found.pop()
        return f"{self._base}/{name}" if self._base else name

    def close(self) -> None:
        if self._step is not None:
            self._step.close()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never picked for a bare checkpoint_id: pass the reader explicitly

    # -- the protocol ------------------------------------------------------------------------

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        step = self._open()
        name = self._path(_METADATA if rank is None else f"__{rank}{_METADATA}")
        f = step.stored(name)
        if f.size > MAX_METADATA_BYTES:
            raise BadInput(f"{step.url}/{f.key}: DCP metadata of {f.size} bytes is over "
                           f"{MAX_METADATA_BYTES}")
        buf = bytearray()
        step.reader(name).read(None, lambda _at, view: buf.extend(view))
        metadata = read_metadata(bytes(buf), f"{step.url}/{f.key}")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool,
                              *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise CorruptData(f"{self._open().url}: DCP metadata without storage_data")
        self.storage_data = metadata.storage_data
        self._chunks = {MetadataIndex(fqn, c.offsets): (tuple(c.sizes), md.properties.dtype)
                        for fqn, md in metadata.state_dict_metadata.items()
                        if isinstance(md, TensorStorageMetadata) for c in md.chunks}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return dataclasses.replace(plan, storage_data=self.step)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        steps = {p.storage_data for p in plans}
        if len(steps) > 1:
            raise CorruptData(f"ranks resolved different steps of {self.root!r} "
                              f"({sorted(steps)}): a step was committed while they opened; "
                              "pass step= explicitly")
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        step = self._open()
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            info = self._info(item)
            per_file.setdefault(self._path(str(info.relative_path)), []).append(item)
        # Files at once: a job of many small files is not one request at a time; the blocks
        # in flight stay bounded across them (RemoteStep.slots).
        with ThreadPoolExecutor(min(FILES_AT_ONCE, max(1, len(per_file))),
                                "ckptd-dcp-file") as files:
            stop = threading.Event()
            locked = _Locked(planner)
            futures = [files.submit(self._read_file, step, path, items, locked, stop)
                       for path, items in per_file.items()]
            wait(futures, return_when=FIRST_EXCEPTION)
            stop.set()  # the others stop at their next piece
            for fut in futures:
                fut.cancel()
            errors = [e for f in futures if not f.cancelled() and (e := f.exception())]
        step.release_hold()  # DCP's last call to the reader: the step is read
        if errors:  # the failure itself, not the others' stopping because of it
            raise next((e for e in errors if not isinstance(e, Cancelled)), errors[0])
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    def _info(self, item: ReadItem) -> Any:
        """The storage entry of a read item, its numbers checked (the metadata a rank gets
        from the coordinator is checked there; this is where the plan meets it)."""
        info = self.storage_data.get(item.storage_index)
        fqn = item.storage_index.fqn
        if info is None:
            raise CorruptData(f"{self._open().url}: DCP metadata has no storage entry for "
                              f"{fqn!r} at {item.storage_index.offset}")
        rel, offset, length = (getattr(info, k, None)
                               for k in ("relative_path", "offset", "length"))
        if not (isinstance(rel, str) and rel and _count(offset) and _count(length)):
            raise CorruptData(f"{self._open().url}: {fqn!r}: bad storage entry "
                              f"{rel!r} [{offset!r}, +{length!r})")
        return info

    def _read_file(self, step: RemoteStep, path: str, items: list[ReadItem],
                   planner: Any, stop: threading.Event) -> None:
        f = step.stored(path)
        where = f"{step.url}/{f.key}"
        slices: dict[tuple[int, int], list[ReadItem]] = {}
        transforms: dict[tuple[int, int], tuple[str, ...]] = {}
        for item in items:
            info = self._info(item)
            at = (info.offset, info.length)
            if info.offset + info.length > f.size:  # before any range or buffer of it
                raise CorruptData(f"{where}: {item.storage_index.fqn!r}: DCP metadata puts "
                                  f"its slice at [{info.offset}, +{info.length}), past the "
                                  f"file's {f.size} bytes")
            slices.setdefault(at, []).append(item)
            transforms[at] = tuple(getattr(info, "transform_descriptors", None) or ())
        router = Router(where, stop)
        for (offset, length), reqs in sorted(slices.items()):
            what = f"{where} [{offset}, +{length})"
            router.add(offset, length, sink_for(reqs, length, planner, what, self._chunks,
                                                transforms[offset, length]))
        step.reader(path).read(router.ranges(), router.feed, router.place)
        router.finish()


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class _Locked:
    """The planner as the file threads see it: one call at a time (DCP's planners are not
    written for concurrent callers)."""

    def __init__(self, planner: LoadPlanner) -> None:
        self._planner, self._lock = planner, threading.Lock()

    def resolve_tensor(self, req: ReadItem) -> torch.Tensor:
        with self._lock:
            return self._planner.resolve_tensor(req)

    def commit_tensor(self, req: ReadItem, tensor: torch.Tensor) -> None:
        with self._lock:
            self._planner.commit_tensor(req, tensor)

    def load_bytes(self, req: ReadItem, value: io.BytesIO) -> None:
        with self._lock:
            self._planner.load_bytes(req, value)
