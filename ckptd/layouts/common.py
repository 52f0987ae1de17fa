"""Helpers shared by the layout recognizers: path names, step patterns, temp names, settling.

Pure functions of a `Snapshot` and plain values; no filesystem access, no clock.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable, Iterable
from functools import lru_cache
from typing import Any

from ckptd import inputs
from ckptd.errors import BadInput, Malformed
from ckptd.model import TEMP_MARKERS, TEMP_SUFFIXES, Candidate, RootOptions, Snapshot

UNFINISHED_SUFFIX = "-unfinished"  # NeMo's marker: `<checkpoint name>-unfinished` beside it
# transformers' atomic save (#35580, since reverted) wrote `tmp-checkpoint-<N>/` then renamed it.
TEMP_PREFIXES = ("tmp-checkpoint-",)

# Directory names that carry a step: step-N, step_N, stepN, step=N, iter_N, checkpoint-N,
# checkpoint_N, global_stepN, or a bare number.
_DIR_STEP = re.compile(r"^(?:step[-_=]?|iter_|checkpoint[-_]|global_step)?(\d+)$", re.ASCII)
# Lightning/NeMo names put `step=N` among other fields: `epoch=1-step=500-last`.
_KEYED_STEP = re.compile(r"(?:^|[^A-Za-z0-9])step=(\d+)", re.ASCII)
# File names: step_N, step=N, step-N, iter_N anywhere in the name, else `_N.` (model_100.pt).
_FILE_STEP = re.compile(r"(?:^|[^A-Za-z0-9])(?:step[-_=]|iter_)(\d+)", re.ASCII)
_FILE_UNDERSCORE_STEP = re.compile(r"_(\d+)\.", re.ASCII)
# The most ranks a job may have (a world size, a rank in a file name, a count in a record):
# beyond this it is no real job's, and no per-rank list is built for it.
MAX_RANKS = 1 << 20


def name_of(rel: str) -> str:
    return rel.rsplit("/", 1)[-1]


def parent_of(rel: str) -> str:
    """The parent directory of a relative path; "" for the root."""
    return rel.rsplit("/", 1)[0] if "/" in rel else ""


def join(directory: str, name: str) -> str:
    return f"{directory}/{name}" if directory else name


@lru_cache(maxsize=1 << 16)
def is_temp_name(name: str) -> bool:
    """True for one path component that names something still being written. Cached: a scan
    asks about every file of every step the root holds, and steps share their file names."""
    return (
        name.endswith(TEMP_SUFFIXES)
        or name.endswith(UNFINISHED_SUFFIX)
        or any(m in name for m in TEMP_MARKERS)
        or name.startswith(TEMP_PREFIXES)
    )


def is_temp_path(rel: str) -> bool:
    """True when any component of `rel` is a temp name (a file in a temp dir is temporary)."""
    return is_temp_name(name_of(rel)) or _is_temp_dir(parent_of(rel))


@lru_cache(maxsize=1 << 16)
def _is_temp_dir(directory: str) -> bool:
    # Cached per directory: a scan asks about every file, and files share few directories.
    return bool(directory) and (is_temp_name(name_of(directory))
                                or _is_temp_dir(parent_of(directory)))


def dir_step(name: str) -> int | None:
    """The step a directory name carries, or None."""
    m = _DIR_STEP.match(name) or _KEYED_STEP.search(name)
    return int(m.group(1)) if m else None


def file_step(name: str) -> int | None:
    """The step a single-file checkpoint's name carries, or None."""
    m = _FILE_STEP.search(name) or _FILE_UNDERSCORE_STEP.search(name)
    return int(m.group(1)) if m else None


def nearest_dir(rel: str, match: Callable[[str], int | None]) -> tuple[str, int] | None:
    """The closest ancestor directory of file `rel` whose name `match`es, with the match."""
    return _nearest(parent_of(rel), match)


@lru_cache(maxsize=1 << 16)
def _nearest(directory: str, match: Callable[[str], int | None]) -> tuple[str, int] | None:
    # Cached per (directory, matcher): `match` is always a module-level pure function.
    if not directory:
        return None
    value = match(name_of(directory))
    return (directory, value) if value is not None else _nearest(parent_of(directory), match)


def group_dirs(snap: Snapshot, match: Callable[[str], int | None]
               ) -> dict[str, tuple[int, list[str]]]:
    """Checkpoint dirs found by name: dir -> (step, every file under it, temp ones included).

    A dir is the nearest matching ancestor of its files; dirs inside a temp dir are dropped.
    """
    groups: dict[str, tuple[int, list[str]]] = {}
    for parent, files in by_parent(snap).items():
        hit = _nearest(parent, match)
        if hit is not None and not is_temp_path(hit[0]):
            groups.setdefault(hit[0], (hit[1], []))[1].extend(files)
    return groups


def by_parent(snap: Snapshot) -> dict[str, list[str]]:
    """Files grouped by their directory, so per-directory work is done once per directory."""
    out: dict[str, list[str]] = {}
    for rel in snap.files:
        out.setdefault(parent_of(rel), []).append(rel)
    return out


class Tree:
    """Sorted paths of a snapshot, so "every file under a dir" is a slice, not a full scan."""

    def __init__(self, snap: Snapshot) -> None:
        self.paths = sorted(snap.files)

    def under(self, directory: str) -> list[str]:
        """Every file below `directory` ("" = the whole root)."""
        if not directory:
            return list(self.paths)
        prefix = directory + "/"
        lo = bisect.bisect_left(self.paths, prefix)
        hi = bisect.bisect_left(self.paths, directory + "0")  # "0" sorts right after "/"
        return self.paths[lo:hi]

    def children(self, directory: str) -> list[str]:
        """The files directly inside `directory`."""
        return [f for f in self.under(directory) if parent_of(f) == directory]


def group_dirs_any(snap: Snapshot, match: Callable[[str], int | None]
                   ) -> dict[str, tuple[int, list[str]]]:
    """Like `group_dirs`, for matches that are themselves temp names (Orbax's tmp dirs): only
    the dir's own ancestors must not be temporary."""
    groups: dict[str, tuple[int, list[str]]] = {}
    for parent, files in by_parent(snap).items():
        hit = _nearest(parent, match)
        if hit is not None and not _is_temp_dir(parent_of(hit[0])):
            groups.setdefault(hit[0], (hit[1], []))[1].extend(files)
    return groups


def members(files: Iterable[str]) -> list[str]:
    """The files that may belong to a checkpoint: temp names never do."""
    return sorted(f for f in files if not is_temp_path(f))


def touches(files: Iterable[str], claimed: frozenset[str]) -> bool:
    """True when any file already belongs to a more specific layout's candidate."""
    return any(f in claimed for f in files)


def settle_problem(snap: Snapshot, paths: Iterable[str], opts: RootOptions, now: float) -> str:
    """Why `paths` are not settled yet, or "".

    Settled: no file open for writing, and every file's last change (the later of the scanner's
    `changed_at` and the file's mtime) at least `opts.settle` seconds before `now`.
    """
    infos = [snap.files[p] for p in paths if p in snap.files]
    for info in infos:
        if info.open_for_write:
            return f"{info.path} to be closed"
    for info in infos:
        if now - max(info.changed_at, info.mtime) < opts.settle:
            return f"files unchanged for {opts.settle:g}s"
    return ""


def open_problem(snap: Snapshot, paths: Iterable[str]) -> str:
    """A file still open for writing (even a committed checkpoint must not be read then)."""
    for p in paths:
        info = snap.files.get(p)
        if info is not None and info.open_for_write:
            return f"{p} to be closed"
    return ""


def unfinished_problem(snap: Snapshot, anchor: str, under: Iterable[str] = ()) -> str:
    """A NeMo `-unfinished` marker beside `anchor`, or among the files `under` it, means a save
    in progress. NeMo names the marker after the checkpoint minus `.nemo`/`.ckpt` and `-EMA`."""
    stem = anchor.removesuffix(".nemo").removesuffix(".ckpt").removesuffix("-EMA")
    for base in dict.fromkeys((anchor, stem)):
        marker = base + UNFINISHED_SUFFIX
        if marker in snap.files or marker in snap.dirs:
            return f"{marker} to be removed"
    for rel in under:
        if rel.endswith(UNFINISHED_SUFFIX):
            return f"{rel} to be removed"
    return ""


def load_json(data: bytes | None, what: str = "") -> Any:
    """Parsed strict JSON (`ckptd.inputs.loads`: integers within 2^63, bounded nesting; the
    constants NaN and Infinity a framework writes for a NaN loss pass, as no number to
    `numeric_metrics`), or raise ValueError (bad bytes, bad UTF-8, bad JSON), naming `what`."""
    if data is None:
        raise Malformed("no content")
    try:
        return inputs.loads(data, what or "-", nan=True)
    except BadInput as exc:
        raise Malformed(str(exc) if what else str(exc).removeprefix("-: ")) from None


def numeric_metrics(obj: object, keep: Callable[[str], bool] = lambda _k: True) -> dict[str, float]:
    """The finite numbers of a JSON object (bools, NaN/Inf and integers past a float's range
    dropped: they cannot rank)."""
    if not isinstance(obj, dict):
        return {}
    out: dict[str, float] = {}
    for key, value in obj.items():
        if isinstance(key, str) and keep(key):
            try:
                out[key] = inputs.check_float(value, key)
            except BadInput:
                continue
    return out


def bad_content(snap: Snapshot, rel: str) -> str:
    """Why the scanner refused to read `rel`, a file some layout asked for ("" when it did
    not): not a regular file, a link, over its kind's cap (`ckptd.inputs`)."""
    return snap.bad_contents.get(rel, "") if rel else ""


def rank_problem(ranks: Iterable[int], what: str) -> str:
    """A rank or world size past MAX_RANKS ("" when none): no real job's, never expanded into
    a per-rank list (a 40-byte file claiming 2*10^7 ranks would take gigabytes)."""
    big = max(ranks, default=0)
    return f"{what} {big} is past the {MAX_RANKS} ranks ckptd accepts" if big > MAX_RANKS else ""


def missing_ranks(have: Iterable[int], size: int, limit: int = 8) -> list[int]:
    """Up to `limit` ranks of 0..size-1 not in `have`, found without listing every rank."""
    present = set(have)
    out: list[int] = []
    for r in range(size):
        if r not in present:
            out.append(r)
            if len(out) >= limit:
                break
    return out


def make(layout: str, step: int, path: str, files: Iterable[str], problems: list[str],
         **extra: Any) -> Candidate:
    """A candidate: complete exactly when no problem remains; `waiting_for` lists them."""
    todo = [p for p in problems if p]
    return Candidate(
        layout=layout,
        step=step,
        path=path,
        files=tuple(sorted(set(files))),
        complete=not todo,
        waiting_for="; ".join(todo),
        **extra,
    )


def written_at(snap: Snapshot, cand: Candidate) -> float:
    """When the candidate was last written (latest member mtime); orders same-step candidates."""
    times = [snap.files[f].mtime for f in cand.files if f in snap.files]
    return max(times, default=0.0)


def pointer_problem(snap: Snapshot, directory: str, pointer: str, wanted: str,
                    accepts: Callable[[str], bool]) -> str:
    """What a framework's pointer file still lacks ("" when none): the file `pointer` in the save
    dir beside `directory` (DeepSpeed's `latest`, Megatron's tracker) must exist, be readable
    and name this checkpoint or a later one (`accepts` judges its stripped text)."""
    rel = join(parent_of(directory), pointer)
    if rel not in snap.files:
        return f"{rel} naming {wanted}"
    if bad := bad_content(snap, rel):
        return f"{rel} to be a readable regular file ({bad})"
    data = snap.contents.get(rel)
    if data is None:
        return f"{rel} to be readable"
    text = data.decode("utf-8", "replace").strip()
    return "" if accepts(text) else f"{rel} naming {wanted} or later (names {text!r})"
