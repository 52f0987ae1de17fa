"""The validate stage: is one checkpoint complete, intact, safe to load and durable on disk?

Cheapest checks first, then one read pass per file feeding the hash and the format's check;
never unpickles with the full machinery. Knows nothing of the store, the pipeline or other stages.
"""

from __future__ import annotations

import errno
import json
import os
import posixpath
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ckptd import fileio, layouts
from ckptd.errors import TooManyFiles, UnsafePath, ValidationFailed
from ckptd.fileio import HASH_ALG, HashSink, Sink
from ckptd.formats import dcpmeta, picklescan, safetensors, torchpickle, zipcheck
from ckptd.model import (
    Candidate,
    FileRecord,
    PlainValue,
    RankFiles,
    Reason,
    ValidationResult,
)
from ckptd.stages.deep import deepscan, nonfinite

SinkFactory = Callable[[str], list[Sink]]

_TORCH_EXTS = {".pt", ".pth", ".ckpt", ".pkl", ".pickle"}  # must be a torch zip or a pickle
_MAYBE_TORCH_EXTS = _TORCH_EXTS | {".bin"}  # `.bin` is also used for raw binaries
# First bytes of a pickle of any protocol: PROTO, or an opcode protocols 0 and 1 open with.
_PICKLE_OPENERS = frozenset({b"\x80", b"(", b"c", b"]", b"}", b")", b"I", b"L", b"F", b"S",
                             b"V", b"N", b"X", b"U", b"T", b"J", b"K", b"M", b"G", b"q", b"r",
                             b"\x88", b"\x89", b"i", b"o", b"d", b"l", b"t", b"p", b"g"})
# Files that cannot be empty whatever the layout says.
_PAYLOAD_EXTS = _MAYBE_TORCH_EXTS | {".safetensors", ".json", ".distcp"}
_JSON_LIMIT = 64 << 20  # JSON files larger than this are hashed but not parsed
_MAX_RANKS = 1 << 20  # a recorded rank count beyond this is not a real job's


@dataclass
class _Member:
    rel: str
    path: Path  # /proc/self/fd/<fd>: the member as opened beneath the root
    size: int
    fd: int = -1
    kind: str = "opaque"  # zip | pickle | maybe_pickle | safetensors | dcp_metadata | json | opaque
    record: FileRecord | None = None
    archives: list[zipcheck.ZipArchive] = field(default_factory=list)
    st_header: safetensors.SafetensorsHeader | None = None
    trusted_seen: bool = False  # its pickle used a root's trusted global (no weights-only load)


def validate(
    root_dir: Path,
    cand: Candidate,
    deep: bool = False,
    extra_sinks: SinkFactory | None = None,
    trusted: frozenset[str] = frozenset(),
    every_file: Sequence[Sink] = (),
) -> ValidationResult:
    """Validate `cand`'s files under `root_dir`. Never raises for a bad checkpoint: the result
    carries a machine-readable reason. Each file's single read pass also feeds `every_file`
    (progress) and `extra_sinks(rel)` (a compressor). `deep` also loads torch files and
    safetensors and rejects NaN/Inf in floating tensors. Valid means every file was also
    fsynced. `trusted` adds the root's trusted globals to the weights-only allow-list of pickle
    checks (to which the candidate's layout adds its framework's own, `layouts.trusted_globals`).
    Raises TooManyFiles (retry later) when the step has more files than the process may open."""
    if cand.invalid_reason:
        return ValidationResult(False, cand.invalid_reason, cand.invalid_message)
    extra = extra_sinks or (lambda rel: [])
    run = _Run(Path(root_dir), cand, deep, lambda rel: [*every_file, *extra(rel)], trusted)
    try:
        run.check()
    except ValidationFailed as exc:
        return ValidationResult(
            False, str(exc.reason), exc.message, run.records(), dict(cand.metrics)
        )
    return ValidationResult(True, "", "", run.records(), dict(cand.metrics))


class _Run:
    """One validation of one candidate; raises ValidationFailed at the first problem."""

    def __init__(
        self, root: Path, cand: Candidate, deep: bool, extra_sinks: SinkFactory | None,
        trusted: frozenset[str] = frozenset(),
    ) -> None:
        self.root, self.cand, self.deep = root, cand, deep
        self.trusted = trusted | layouts.trusted_globals(cand.layout)
        self.allowed = picklescan.SAFE_GLOBALS | self.trusted
        # Plain top-level values of each torch member's pickle (for `cand.rank_files`).
        self.fields: dict[str, dict[str, PlainValue]] = {}
        self.extra_sinks = extra_sinks or (lambda rel: [])
        self.members: list[_Member] = []
        self.dcp_ranges: dict[str, tuple[tuple[int, int], ...]] = {}
        self._fds: list[int] = []
        self._by_rel: dict[str, _Member] = {}

    def records(self) -> tuple[FileRecord, ...]:
        return tuple(m.record for m in self.members if m.record is not None)

    def check(self) -> None:
        try:
            self._check()
        except UnsafePath as exc:
            raise ValidationFailed(Reason.UNSAFE_PATH, str(exc)) from None
        except FileNotFoundError as exc:
            raise ValidationFailed(Reason.MISSING_FILE, f"{exc.filename}: vanished") from None
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):  # the process's limit, not the step
                raise TooManyFiles(f"{self.cand.path}: {exc.strerror} while its"
                                   f" {len(self.cand.files)} files were open") from None
            raise ValidationFailed(Reason.IO_ERROR, f"{exc.filename}: {exc}") from None
        finally:
            for fd in self._fds:
                os.close(fd)
            self._fds.clear()

    def _note(self, m: _Member, found: frozenset[str]) -> None:
        if found & self.trusted:
            m.trusted_seen = True

    def _check(self) -> None:
        rels = dict.fromkeys([*self.cand.files, *self.cand.expected_sizes, *self.cand.min_sizes])
        if not rels:
            raise ValidationFailed(Reason.MISSING_FILE, f"{self.cand.path}: no files")
        _check_open_files(self.cand.path, len(rels))
        self.members = [self._stat(rel) for rel in rels]
        for m in self.members:
            self._check_size(m)
        for m in self.members:
            m.kind = _kind(m.rel, os.pread(m.fd, 8, 0) if m.size else b"")
        for m in sorted(self.members, key=_pass_order):
            self._read(m)
        self._check_dcp_items()
        for need in self.cand.rank_files:
            self._check_rank_files(need)
        if self.deep:
            for m in self.members:
                # A file using trusted framework globals cannot be loaded weights-only.
                if m.rel not in self.cand.opaque and not m.trusted_seen:
                    _deep_scan(m)
        self._fsync()

    # --- cheap checks --------------------------------------------------------------------

    def _stat(self, rel: str) -> _Member:
        """Open the member beneath the root, following no link. Every later read (hash, CRC,
        formats, the compressor, a deep load) goes through this one open file, by its
        /proc/self/fd path: a file swapped after this moment is never what gets read."""
        try:
            fd = fileio.open_beneath(self.root, rel)
        except FileNotFoundError:
            raise ValidationFailed(Reason.MISSING_FILE, f"{rel} is missing", rel) from None
        except UnsafePath as exc:
            if "not a regular file" in str(exc):
                raise ValidationFailed(Reason.MISSING_FILE, f"{rel} is not a regular file",
                                       rel) from None
            raise
        self._fds.append(fd)
        return _Member(rel, Path(f"/proc/self/fd/{fd}"), os.fstat(fd).st_size, fd)

    def _check_size(self, m: _Member) -> None:
        expected = self.cand.expected_sizes.get(m.rel)
        least = self.cand.min_sizes.get(m.rel, 0)
        if m.size == 0 and (_expects_payload(m.rel) or expected or least):
            raise ValidationFailed(Reason.EMPTY_FILE, f"{m.rel} is empty", m.rel)
        if expected is not None and m.size != expected:
            raise ValidationFailed(
                Reason.SIZE_MISMATCH, f"{m.rel} has {m.size} bytes, expected {expected}", m.rel
            )
        if m.size < least:
            raise ValidationFailed(
                Reason.TRUNCATED, f"{m.rel} has {m.size} bytes, needs at least {least}", m.rel
            )

    # --- the read pass -------------------------------------------------------------------

    def _read(self, m: _Member) -> None:
        hasher = HashSink()
        fmt, after = self._format_sinks(m)
        size = fileio.read_pass(m.rel, [hasher, *fmt, *self.extra_sinks(m.rel)], fd=m.fd)
        if size != m.size:
            raise ValidationFailed(Reason.CHANGED, f"{m.rel} changed while validated", m.rel)
        m.record = FileRecord(m.rel, size, hasher.digest, HASH_ALG)
        after()

    def _format_sinks(self, m: _Member) -> tuple[list[Sink], Callable[[], None]]:
        if m.kind == "zip":
            return self._zip_sinks(m)
        if m.kind == "safetensors":
            sink = safetensors.SafetensorsSink(m.rel)

            def keep_header() -> None:
                m.st_header = sink.header

            return [sink], keep_header
        if m.kind in ("pickle", "maybe_pickle"):
            if m.rel in self.cand.opaque:
                return [], lambda: None
            return [], lambda: self._note(m, _scan_pickle_file(m, self.allowed,
                                                              m.kind == "maybe_pickle"))
        if m.kind == "dcp_metadata":
            meta = _CaptureSink(dcpmeta.MAX_METADATA_BYTES)
            return [meta], lambda: self._dcp_metadata(m, meta)
        if m.kind == "json":
            doc = _CaptureSink(_JSON_LIMIT)
            return [doc], lambda: _parse_json(m, doc)
        return [], lambda: None

    def _zip_sinks(self, m: _Member) -> tuple[list[Sink], Callable[[], None]]:
        opaque = m.rel in self.cand.opaque
        refs: dict[str, list[tuple[str, str, int]]] = {}

        def scan(entry: zipcheck.ZipEntry, data: bytes) -> None:
            if not opaque:
                self._note(m, picklescan.scan_pickle(data, f"{m.rel}:{entry.name}",
                                                     self.allowed))
                if entry.name.endswith("/data.pkl"):
                    read = torchpickle.read_torch_pickle(data, f"{m.rel}:{entry.name}")
                    refs[entry.name[: -len("data.pkl")]] = list(read.refs)
                    self.fields.setdefault(m.rel, read.fields)  # the outermost archive's

        sink = zipcheck.ZipCrcSink.for_fd(m.fd, m.rel, on_capture=scan)
        m.archives = sink.archives
        if _is_torch_name(m.rel) and not all(map(_is_torch_archive, m.archives)):
            raise ValidationFailed(Reason.BAD_HEADER, f"{m.rel}: a zip without data.pkl", m.rel)

        def after() -> None:
            for entry in [] if opaque else sink.uncaptured:  # too big to keep: read it again
                with zipcheck.open_stored_member(m.path, entry, m.rel) as f:
                    self._note(m, picklescan.scan_pickle(f, f"{m.rel}:{entry.name}",
                                                         self.allowed))
                fileio.drop_cache(m.path)
            _check_storages(m, refs)

        return [sink], after

    def _dcp_metadata(self, m: _Member, capture: _CaptureSink) -> None:
        if capture.overflow:
            raise ValidationFailed(Reason.BAD_METADATA, f"{m.rel} is too large to parse", m.rel)
        meta = dcpmeta.parse_once(bytes(capture.data), m.rel)
        base = posixpath.dirname(m.rel)
        for name, least in sorted(meta.references.items()):
            rel = posixpath.join(base, name)
            if self.cand.node_share and rel not in self.cand.files:
                continue  # another node's file (a multi-node save)
            size = self._size_of(rel)
            if size < least:
                raise ValidationFailed(
                    Reason.TRUNCATED,
                    f"{rel} has {size} bytes; {m.rel} references {least}",
                    rel,
                )
            if name not in meta.transformed:
                self.dcp_ranges[rel] = meta.ranges[name]

    def _check_rank_files(self, need: RankFiles) -> None:
        """Every rank's file, as many as `need.source` records: a layout that cannot read the
        count (it reads no large file) may have called the checkpoint complete without one."""
        count = self.fields.get(need.source, {}).get(need.key)
        if count is None or self.cand.node_share:
            return  # not recorded there (an older writer), or other ranks are on other nodes
        if type(count) is not int or not 0 < count <= _MAX_RANKS:
            raise ValidationFailed(Reason.BAD_METADATA, f"{need.source} records {need.key} ="
                                   f" {count!r}, not a rank count", need.source)
        have = {m.rel for m in self.members}
        gone = [need.member(r) for r in range(count) if need.member(r) not in have]
        if gone:
            shown = ", ".join(gone[:8]) + (f" and {len(gone) - 8} more" if len(gone) > 8 else "")
            raise ValidationFailed(Reason.MISSING_FILE, f"{need.source} records {need.key} ="
                                   f" {count}, but {len(gone)} of those ranks' files are"
                                   f" missing: {shown}", gone[0])

    def _size_of(self, rel: str) -> int:
        if len(self._by_rel) != len(self.members):  # one dict, not a scan per reference
            self._by_rel = {m.rel: m for m in self.members}
        m = self._by_rel.get(rel)
        return m.size if m is not None else self._stat(rel).size  # opened beneath the root

    def _check_dcp_items(self) -> None:
        """Each item DCP wrote into a zip-framed data file must be exactly one torch archive;
        a mismatch means the metadata describes other data than the files hold."""
        for m in self.members:
            ranges = self.dcp_ranges.get(m.rel)
            if m.kind != "zip" or not ranges:
                continue
            bounds = {(a.start, a.end - a.start) for a in m.archives}
            for offset, length in ranges:
                if (offset, length) not in bounds:
                    raise ValidationFailed(
                        Reason.BAD_METADATA,
                        f"{m.rel}: bytes {offset}+{length} named by .metadata are not one archive",
                        m.rel,
                    )

    def _fsync(self) -> None:
        # The files, and every directory from theirs up to the root: a checkpoint directory
        # created moments ago is not durable until its parent's entry for it is.
        dirs: dict[Path, None] = {}
        # durable and hashed: out of the page cache; through the descriptors read, together
        fileio.fsync_many([m.fd for m in self.members], drop=True)
        for m in self.members:
            parts = m.rel.split("/")[:-1]
            for i in range(len(parts), -1, -1):
                dirs[self.root.joinpath(*parts[:i])] = None
        for d in dirs:
            fileio.fsync_dir(d)


# Descriptors the rest of the process may hold while a step's files are all open: the
# socket's clients, the store, the backends' connections, the compressed copy being written.
_FD_HEADROOM = 256


def _check_open_files(path: str, files: int) -> None:
    """Every file of a step is held open during its pass: a step with more files than the
    process may open fails here, as a retryable error saying which limit to raise, rather than
    as an I/O error that would make a good checkpoint invalid."""
    limit = fileio.open_file_limit()
    if files + _FD_HEADROOM > limit:
        raise TooManyFiles(
            f"{path} has {files} files, more than this process may hold open at once (its"
            f" open-file limit is {limit}); raise it: LimitNOFILE= in the unit, ulimit -n"
            f" before `ckptd run`, or the container's nofile limit")


def _check_storages(m: _Member, refs: dict[str, list[tuple[str, str, int]]]) -> None:
    """Every storage a torch pickle references is a member, holding at least its bytes: a
    zip that is CRC-clean but would fail to load is not a valid checkpoint."""
    sizes = {e.name: e.size for a in m.archives for e in a.entries}
    for prefix, found in refs.items():
        for key, kind, numel in found:
            name = f"{prefix}data/{key}"
            size = sizes.get(name)
            if size is None:
                raise ValidationFailed(Reason.MISSING_FILE, f"{m.rel}: storage {key} has no"
                                       f" member {name}", m.rel)
            need = numel * torchpickle.STORAGE_ITEM_BYTES.get(kind, 1)
            if size < need:
                raise ValidationFailed(Reason.TRUNCATED, f"{m.rel}: member {name} holds"
                                       f" {size} bytes, its storage needs {need}", m.rel)


def _pass_order(m: _Member) -> tuple[int, int]:
    # Small metadata first: a broken `.metadata` or meta.json fails before gigabytes are read.
    return (0 if m.kind in ("dcp_metadata", "json") else 1, m.size)


def _is_torch_name(rel: str) -> bool:
    return posixpath.splitext(rel)[1].lower() in _MAYBE_TORCH_EXTS | {".distcp"}


def _expects_payload(rel: str) -> bool:
    name = posixpath.basename(rel)
    return name == ".metadata" or posixpath.splitext(name)[1].lower() in _PAYLOAD_EXTS


def _kind(rel: str, head: bytes) -> str:
    name = posixpath.basename(rel)
    ext = posixpath.splitext(name)[1].lower()
    if ext == ".safetensors":
        return "safetensors"
    if name == ".metadata":
        return "dcp_metadata"
    if ext == ".json":
        return "json"
    if zipcheck.is_zip_magic(head):
        return "zip"
    if ext in _TORCH_EXTS and head:
        return "pickle"  # any protocol: 0 and 1 start with no PROTO opcode
    if ext in _MAYBE_TORCH_EXTS and head[:1] in _PICKLE_OPENERS:
        return "maybe_pickle"  # `.bin`: a pickle torch.load would run, or raw bytes
    return "opaque"


def _scan_pickle_file(m: _Member, allowed: frozenset[str], maybe: bool = False
                      ) -> frozenset[str]:
    """A second read, of the pickles only (a legacy file's storages follow them, unread).
    `maybe` (a `.bin`): bytes that do not parse as a pickle are raw data, which no pickle
    loader can run either; anything unsafe before that point is still `unsafe_pickle`."""
    try:
        with open(m.path, "rb") as f:
            return picklescan.scan_torch_pickle_file(f, m.rel, allowed)
    except ValidationFailed as exc:
        if maybe and exc.reason == Reason.BAD_HEADER:
            return frozenset()
        raise
    finally:
        fileio.drop_cache(m.path)


class _CaptureSink:
    """Keeps a small file's bytes from the pass (JSON, DCP metadata), up to a limit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.overflow = False

    def update(self, offset: int, view: memoryview) -> None:
        if not self.overflow:
            if len(self.data) + len(view) > self.limit:
                self.overflow, self.data = True, bytearray()
            else:
                self.data += view

    def finish(self, total: int) -> None:
        pass


def _parse_json(m: _Member, capture: _CaptureSink) -> None:
    if capture.overflow:
        return
    try:
        json.loads(bytes(capture.data))
    except (ValueError, RecursionError) as exc:
        raise ValidationFailed(
            Reason.BAD_METADATA, f"{m.rel} is not valid JSON: {exc}", m.rel
        ) from None


# --- deep: NaN/Inf ---------------------------------------------------------------------------


def _deep_scan(m: _Member) -> None:
    if m.kind == "zip" and len(m.archives) == 1 and _is_torch_archive(m.archives[0]):
        try:
            deepscan.scan_torch_file(m.fd, m.rel)
        finally:
            fileio.drop_cache(m.path)
    elif m.kind == "safetensors" and m.st_header is not None:
        try:
            nonfinite.scan_safetensors(m.path, m.st_header, m.rel)
        finally:
            fileio.drop_cache(m.path)


def _is_torch_archive(archive: zipcheck.ZipArchive) -> bool:
    return any(zipcheck.is_pickle_member(e.name) for e in archive.entries)
