"""The compress stage: a step's local compressed copy written under `<root>/.ckptd/objects/`,
encoded inside validation's single read pass, staged and committed. Never imports the store,
the pipeline or another stage, and never holds a whole file in memory. Deletes nothing but its
own staging; the copy store's layout and checks are `ckptd.copies.store`.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, cast

from ckptd import fileio
from ckptd.backends.base import ObjectMeta
from ckptd.codec import make_encoder
from ckptd.codec.encoder import Encoder
from ckptd.copies.store import objects_dir
from ckptd.errors import CkptdError
from ckptd.fileio import DurableWriter, Sink, write_error
from ckptd.model import FileRecord
from ckptd.remote.manifest import MANIFEST_NAME, Manifest, StoredFile
from ckptd.stages.sending.early import EarlySender
from ckptd.stages.sending.growing import Growth


@dataclass(frozen=True)
class _Stored:
    """One finished object in the staging dir."""

    tmp: Path
    codec: str
    suffix: str
    raw_size: int
    stored_size: int


class _ObjectSink:
    """One file's encoder, fed by the validation read pass; records what it wrote on finish.

    With `early`, the object is offered when finished, or, once it has passed `early`'s part
    size while still being written, streamed: the encoder only appends through `out` (its
    index or seek table comes last), so every byte written is final and the sender is told
    how far it may read (`Growth`), then that the object is finished, or that it failed."""

    def __init__(self, rel: str, tmp: Path, make: Callable[[BinaryIO], Encoder],
                 early: EarlySender | None = None) -> None:
        self.rel, self.tmp = rel, tmp
        self.early = early
        self._stream_past = early.max_object if early is not None else 0
        self.growth: Growth | None = None
        self.out = DurableWriter(tmp, f"the compressed copy of {rel}")
        self.encoder = make(cast(BinaryIO, self.out))
        self.result: _Stored | None = None

    def update(self, offset: int, view: memoryview) -> None:
        self.encoder.update(offset, view)
        if self.growth is not None:
            self.growth.advance(self.out.size)
        elif self._stream_past and self.out.size > self._stream_past:
            self._stream_past = 0  # asked once; if refused, offered when finished
            assert self.early is not None
            # The suffix is settled once bytes are written (`auto` writes only its container).
            self.growth = self.early.stream(self.rel + self.encoder.suffix, self.tmp)
            if self.growth is not None:
                self.growth.advance(self.out.size)

    def finish(self, total: int) -> None:
        try:
            self.encoder.finish(total)
            self.out.close_written()  # made durable with the others at commit (`fsync_many`)
        except BaseException:
            self._fail("the object's encoding failed")
            raise
        enc = self.encoder
        self.result = _Stored(self.tmp, enc.codec, enc.suffix, enc.raw_size, enc.stored_size)
        key = self.rel + enc.suffix  # its object, as the manifest will name it
        if self.growth is not None:
            self.growth.done(key, self.out.size)
            if self.growth.streamed():
                return
        if self.early is not None:
            self.early.offer(key, self.tmp, enc.stored_size)

    def _fail(self, why: str) -> None:
        if self.growth is not None:
            self.growth.fail(why)

    def close(self) -> None:
        self._fail("the object was not finished")
        self.encoder.close()
        self.out.close()

    def discard(self) -> None:
        self.close()
        self.tmp.unlink(missing_ok=True)


class Stager:
    """Builds a step's compressed copy in a staging dir during validation; `commit` installs it.

    Usage: `validate(root, cand, extra_sinks=stager.sinks_for)`, then `commit(result.files,
    result.metrics)` if valid, else (or on any error) `abort()`. The staging dir starts with
    `fileio.TEMP_PREFIX`, so what a crash leaves is removed by `remove_stale_staging`.
    `install(staging, final)` moves the finished copy into place; the daemon passes the
    executor's `install_copy`, the one that may replace a superseded copy. Without it a copy
    already at `step-<N>/` is an error (CkptdError) and nothing is replaced.
    """

    def __init__(
        self,
        root_dir: Path,
        root_name: str,
        step: int,
        layout: str,
        codec: str,
        level: int,
        threads: int,
        min_saving: float,
        install: Callable[[Path, Path], None] | None = None,
    ) -> None:
        self.root_dir, self.root_name = Path(root_dir), root_name
        self._install = install or _install_new
        self.step, self.layout = step, layout
        self.final = objects_dir(self.root_dir, step)
        self.staging = fileio.temp_name(self.final)
        self._make: Callable[[BinaryIO], Encoder] = lambda out: make_encoder(
            codec, out, level=level, threads=threads, min_saving=min_saving
        )
        make_encoder(codec, io.BytesIO(), level, threads, min_saving).close()  # bad args fail here
        self._sinks: dict[str, _ObjectSink] = {}
        self._early: EarlySender | None = None
        self._discard: Callable[[Mapping[str, ObjectMeta]], object] = lambda sent: None

    def send_early(self, early: EarlySender,
                   discard: Callable[[Mapping[str, ObjectMeta]], object]) -> None:
        """Offer each object to `early` as it is finished; on `abort`, hand what it sent to
        `discard` (the executor's `discard_early`). Call before the read pass."""
        self._early, self._discard = early, discard

    def sinks_for(self, rel: str) -> list[Sink]:
        """The sinks to add to `rel`'s read pass: its encoder, writing into the staging dir."""
        if rel in self._sinks:
            self._sinks.pop(rel).discard()  # a second pass over one file replaces the first
        dest = fileio.safe_join(self.staging, rel)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise write_error(exc, f"the staging dir {self.staging}") from exc
        sink = _ObjectSink(rel, fileio.temp_name(dest), self._make, self._early)
        self._sinks[rel] = sink
        return [sink]

    def commit(self, records: Sequence[FileRecord], metrics: Mapping[str, float]) -> Manifest:
        """Name each object by its codec, write MANIFEST.json, make it all durable, and move the
        staging dir to `step-<N>/` through `install`. Aborts on failure."""
        early: EarlySender | None = None
        try:
            files = [self._stored_file(rec) for rec in records]
            _check_keys(files)
            manifest = Manifest(self.root_name, self.step, self.layout, tuple(files),
                                metrics=dict(metrics))
            if self._early is not None:  # its puts end before any object is renamed
                early, self._early = self._early, None
                early.finish()  # multipart sends go on: their files stay open across renames
            # Every object durable before any name or the manifest says it is done; fsyncs
            # in flight together share journal commits (one per file in a row cost 0.15-5 ms
            # each, 10,000 times for a 10,000-file step).
            fileio.fsync_many([self._sinks[f.path].tmp for f in files], drop=True)
            self._name_objects(files)
            fileio.atomic_write_bytes(self.staging / MANIFEST_NAME, manifest.to_bytes())
            self._install(self.staging, self.final)
        except OSError as exc:
            self._abort_after(early)
            raise write_error(exc, f"the compressed copy of step {self.step}") from exc
        except BaseException:
            self._abort_after(early)
            raise
        if early is not None:
            early.installed(self.final)
        return manifest

    def _abort_after(self, early: EarlySender | None) -> None:
        """`abort`, and when `early` was finished already, cancel its multipart sends and
        discard what they completed."""
        if early is not None:
            sent = early.abandon_big()
            if sent:
                self._discard(sent)
        self.abort()

    def abort(self) -> None:
        """Drop everything staged (idempotent), and what was sent early; the originals are
        never touched."""
        early, self._early = self._early, None
        if early is not None:
            sent = early.abandon()
            if sent:
                self._discard(sent)
        for sink in self._sinks.values():
            sink.close()
        self._sinks.clear()
        with contextlib.suppress(OSError):
            fileio.remove_tree(self.staging)

    def _stored_file(self, rec: FileRecord) -> StoredFile:
        sink = self._sinks.get(rec.path)
        done = sink.result if sink else None
        if done is None:
            raise CkptdError(f"{rec.path}: no compressed object staged (was the read pass given "
                             "this Stager's sinks_for?)")
        if done.raw_size != rec.size:
            raise CkptdError(f"{rec.path}: staged {done.raw_size} bytes, validated {rec.size}")
        return StoredFile(rec.path, rec.size, rec.hash, rec.hash_alg, done.codec,
                          done.stored_size, rec.path + done.suffix)

    def _name_objects(self, files: Sequence[StoredFile]) -> None:
        dirs = {self.staging}
        for f in files:
            final = self.staging / f.key
            os.rename(self._sinks[f.path].tmp, final)
            parent = final.parent
            while parent != self.staging and parent not in dirs:
                dirs.add(parent)
                parent = parent.parent
        for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
            fileio.fsync_dir(d)


def _check_keys(files: Sequence[StoredFile]) -> None:
    """Object names must not collide (`a` stored as `a.zst` beside a file named `a.zst`), and
    no key may also be a directory of another."""
    keys: set[str] = set()
    for f in files:
        if f.key in keys or f.key == MANIFEST_NAME:
            raise CkptdError(f"cannot store {f.path} as {f.key!r}: another object (or the "
                             "manifest) has that name; object names collide")
        keys.add(f.key)
    for key in keys:
        parts = key.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in keys:
                raise CkptdError(f"object {key!r} would sit inside object {'/'.join(parts[:i])!r}")


def _install_new(staging: Path, final: Path) -> None:
    """Rename `staging` to `final`, which must not exist (an empty directory is replaced)."""
    try:
        os.rename(staging, final)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        raise CkptdError(f"{final} holds an older compressed copy; only the retention "
                         "executor replaces one (executor.install_copy)") from None
    fileio.fsync_dir(final.parent)
