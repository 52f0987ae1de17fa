"""Plain data types shared by every layer: states, snapshots, candidates, records.

Owns the product's vocabulary (docs/CLI.md, docs/LAYOUTS.md) as Python types. Imports
nothing else of ckptd; holds no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal


class State(StrEnum):
    PENDING = "pending"
    COMPLETE = "complete"
    VALID = "valid"
    INVALID = "invalid"


class Local(StrEnum):
    PRESENT = "present"
    COMPRESSED = "compressed"
    PRUNED = "pruned"


class Remote(StrEnum):
    NONE = "none"
    UPLOADING = "uploading"
    UPLOADED = "uploaded"
    PRUNED = "pruned"


# Whether a root's metric is better low or high (`metric_mode` in the config).
MetricMode = Literal["min", "max"]

# The codec names a root's `compress.codec` may take, in docs/FORMAT.md's order: the built-in
# ones, then any `ckptd.codec.register` adds (the config checks names here when it validates).
CODECS: list[str] = ["auto", "zstd", "zstd-bytegroup", "none"]


class Tier(StrEnum):
    ANY = "any"
    LOCAL = "local"
    REMOTE = "remote"


class Reason(StrEnum):
    """Machine-readable reasons a checkpoint is invalid."""

    MISSING_FILE = "missing_file"
    SIZE_MISMATCH = "size_mismatch"
    CRC_MISMATCH = "crc_mismatch"
    TRUNCATED = "truncated"
    BAD_HEADER = "bad_header"
    BAD_METADATA = "bad_metadata"
    NAN = "nan"
    UNSAFE_PICKLE = "unsafe_pickle"
    UNSAFE_PATH = "unsafe_path"
    EMPTY_FILE = "empty_file"
    IO_ERROR = "io_error"
    CHANGED = "changed"  # files changed while being validated


class RootError(StrEnum):
    """The kinds of error a root's status shows as `last_error`. The service that meets one sets
    it by kind with its message; once the cause is gone it clears its own kinds, never another's
    (the newest error set is the one shown)."""

    SCAN = "scan"  # a scan of the root failed
    ROOT_MISSING = "root_missing"  # the root's path is not there (the scan and the lease see it)
    UNREADABLE = "unreadable"  # directories under the root the scan could not read
    LEASE = "lease"  # the root lease could not be taken or renewed
    RETENTION = "retention"  # a retention run failed
    VALIDATE = "validate"  # a stage failed (the upload: also a store that refuses commits)
    COMPRESS = "compress"
    UPLOAD = "upload"
    VALIDATE_STUCK = "validate_stuck"  # a stage's call went past its bound and was set aside
    COMPRESS_STUCK = "compress_stuck"
    UPLOAD_STUCK = "upload_stuck"

    @classmethod
    def of_stage(cls, stage: str, stuck: bool = False) -> RootError:
        """A stage's failure, or (`stuck`) its call set aside past its bound."""
        return cls(f"{stage}_stuck" if stuck else stage)

    @classmethod
    def cleared_by_stage(cls, stage: str) -> tuple[RootError, ...]:
        """What a stage that went through clears: its failures and its stalls."""
        return cls.of_stage(stage), cls.of_stage(stage, stuck=True)


# Names that never belong to a complete checkpoint (docs/LAYOUTS.md: temporary names).
TEMP_SUFFIXES = (".tmp", ".partial")
TEMP_MARKERS = (".orbax-checkpoint-tmp",)
# A step is ASCII digits below 2^63 (what SQLite's INTEGER holds).
MAX_STEP = 2**63
# ckptd's own directory inside each root; never scanned as checkpoint data.
CKPTD_DIR = ".ckptd"
# ckptd's own transient names anywhere in a root (temp files, a restore's staging directory).
OWN_PREFIX = f"{CKPTD_DIR}-"


def is_own(rel: str) -> bool:
    """Is `rel` (a '/'-separated path relative to a root, or one name) ckptd's own: inside a
    `.ckptd/` directory or named `.ckptd-*`, at any depth? Never checkpoint data: the scanner
    skips it, no watch is put on it, and its changes never wake the scanner."""
    return any(part == CKPTD_DIR or part.startswith(OWN_PREFIX) for part in rel.split("/"))


@dataclass(frozen=True)
class FileInfo:
    """One regular file seen under a root by a scan.

    `path` is relative to the root, '/'-separated. `changed_at` is the wall-clock time (seconds)
    at which the scanner last saw this file's size or mtime differ from the scan before (or first
    saw it), so "settled" never trusts an mtime copied from elsewhere. `open_for_write` is true
    when the watcher saw the file opened for writing and not yet closed. `seen_at` is when the
    scanner first saw a file at this path (None: not tracked; read as `changed_at`).
    `symlink`: the path is a link to a file inside the root (Lightning's `last.ckpt`).
    """

    path: str
    size: int
    mtime: float
    changed_at: float
    open_for_write: bool = False
    seen_at: float | None = None
    symlink: bool = False  # a link (inside the root) to a regular file
    first_mtime: float | None = None  # its mtime when the scanner first saw it (None: unknown)

    @property
    def first_seen(self) -> float:
        return self.changed_at if self.seen_at is None else self.seen_at


# A value a completion rule may read out of a checkpoint's pickle: numbers, short strings.
PlainValue = int | float | str | bool | None


@dataclass(frozen=True)
class Snapshot:
    """Everything a completion rule may look at: names, sizes, times, and small file contents.

    `files` maps relative path -> FileInfo (regular files only; symlinks that leave the root and
    ckptd's own files are already dropped). `dirs` is the set of relative directory paths.
    `contents` holds the bytes of small files that some layout asked for (`Layout.wants_content`),
    read by the scanner at snapshot time. `torch_fields` holds, for torch files some layout asked
    for (`ReadsTorchFields`), the plain top-level values of their pickle as read from the file's
    first bytes (DeepSpeed's `dp_world_size`); a file whose pickle could not be read there is
    absent. `registrations` maps step -> registered relative paths (the `registered` layout; an
    empty tuple means "registered without paths").
    """

    files: dict[str, FileInfo]
    dirs: frozenset[str] = frozenset()
    contents: dict[str, bytes] = field(default_factory=dict)
    registrations: dict[int, tuple[str, ...]] = field(default_factory=dict)
    torch_fields: dict[str, dict[str, PlainValue]] = field(default_factory=dict)
    # Files a layout asked for that the scanner refused to read (`ckptd.inputs`: not a regular
    # file, a link, over its kind's cap), with why: a layout makes their checkpoint invalid.
    bad_contents: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RootOptions:
    """The per-root settings a completion rule needs (a slice of the root's config)."""

    settle: float = 5.0
    world_size: int = 0
    # Several nodes write each checkpoint (docs/MULTINODE.md): a node's own settled files are
    # complete for this node even where the commit record, or the files it names, are elsewhere.
    multi_node: bool = False


@dataclass(frozen=True)
class Candidate:
    """A checkpoint a layout recognized in a snapshot, complete or not.

    `path` is the checkpoint's anchor relative to the root: its directory, or its main file for
    layouts made of sibling files. `files` lists every member file (relative to the root).
    `expected_sizes` maps member path -> the exact size the layout's own metadata promises;
    `min_sizes` maps member path -> a lower bound (DCP references). `waiting_for` says in words
    why a pending candidate is not complete yet ("" when complete). `metrics` come from the
    layout's metadata (meta.json, trainer_state.json), when it has any.
    """

    layout: str
    step: int
    path: str
    files: tuple[str, ...]
    complete: bool
    waiting_for: str = ""
    expected_sizes: dict[str, int] = field(default_factory=dict)
    min_sizes: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    invalid_reason: str = ""  # set when the layout's own metadata already proves it broken
    invalid_message: str = ""
    # Members a framework pickles its own config objects into and that resume never loads
    # (HF `training_args.bin`): integrity-checked and hashed, but their pickle is not judged.
    opaque: tuple[str, ...] = ()
    # Per-rank files whose count is recorded inside a member; validation reads it and
    # requires every one (a layout may not see the count: it reads no large file).
    rank_files: tuple[RankFiles, ...] = ()
    # One node's share of a multi-node save (docs/MULTINODE.md): files its record names that
    # are not here belong to other nodes, and validation does not require them.
    node_share: bool = False
    # Pending because a member is short of the size its layout's metadata promises (not
    # because one is missing): the cause a save that never completes is judged invalid by.
    truncated: bool = False


@dataclass(frozen=True)
class RankFiles:
    """One file per rank `0..n-1`, `n` recorded inside another member: validation reads the
    integer `key` at the top level of `source`'s torch pickle and requires the member
    `f"{prefix}{rank}{suffix}"` for every rank below it (DeepSpeed: `dp_world_size` in
    `mp_rank_00_model_states.pt`, one `zero_pp_rank_<r>_mp_rank_00_optim_states.pt` per rank).
    A source that records no such key is not checked."""

    source: str
    key: str
    prefix: str
    suffix: str

    def member(self, rank: int) -> str:
        return f"{self.prefix}{rank}{self.suffix}"


@dataclass(frozen=True)
class FileRecord:
    """A checked member file: its size and content hash, as recorded in the store/manifest."""

    path: str
    size: int
    hash: str
    hash_alg: str


@dataclass(frozen=True)
class ValidationResult:
    valid: bool
    reason: str = ""
    message: str = ""
    files: tuple[FileRecord, ...] = ()
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointRecord:
    """One checkpoint as the store knows it (the shape `ckptd ls --json` prints, plus internals)."""

    id: int
    root: str
    step: int
    layout: str
    path: str
    state: State
    local: Local
    remote: Remote
    bytes: int
    stored_bytes: int
    metrics: dict[str, float]
    reason: str
    message: str
    pinned: bool
    created: float  # wall time when first seen
    completed: float | None  # wall time when found complete
    fingerprint: str  # digest of (member paths, sizes, mtimes) at completion
    adopted: bool = False  # on disk before ckptd first watched the root

    def as_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "state": str(self.state),
            "local": str(self.local),
            "remote": str(self.remote),
            "layout": self.layout,
            "path": self.path,
            "bytes": self.bytes,
            "stored_bytes": self.stored_bytes,
            "metrics": dict(self.metrics),
            "reason": self.reason or None,
            "pinned": self.pinned,
            "adopted": self.adopted,
        }
