"""Roots that follow the jobs: a [[roots]] entry whose path ends in `/*` stands for one root per
directory under it, named `<entry>-<directory>`. This module lists those directories (bounded,
never through a link) and derives the roots; the daemon applies the result as it applies a
reload. It never creates, deletes or opens anything below a job directory.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ckptd.config import Config, RootConfig
from ckptd.config.fields import _root_name
from ckptd.log import get_logger

GLOB = "*"
# How many roots one glob entry may make: each is a lease, a scan and a row of metrics. A
# directory past the cap is skipped (with a warning) until one of the entry's roots retires.
MAX_ROOTS_PER_GLOB = 256
# How many entries of a glob's directory one pass reads, so a directory of millions of files
# costs a bounded pass; past it the rest are not seen (and a warning says so).
MAX_ENTRIES_READ = 16_384


MISSING = "no such directory"


def is_glob(root: RootConfig) -> bool:
    return root.path.name == GLOB


@dataclass(frozen=True)
class Skipped:
    """A directory under a glob that makes no root, and why (logged, never raised)."""

    entry: str
    directory: str
    reason: str


@dataclass(frozen=True)
class Listing:
    """The job directories found under one glob's directory."""

    dirs: tuple[str, ...]
    truncated: bool = False
    error: str = ""


def list_dirs(parent: Path, max_entries: int = MAX_ENTRIES_READ) -> Listing:
    """The directories directly under `parent`, not a link among them (a link could lead out
    of the glob's directory), not a hidden one; a missing or unreadable parent lists none."""
    dirs: list[str] = []
    try:
        with os.scandir(parent) as it:
            for n, entry in enumerate(it):
                if n >= max_entries:
                    return Listing(tuple(sorted(dirs)), truncated=True)
                if not entry.name.startswith(".") and _real_dir(entry):
                    dirs.append(entry.name)
    except FileNotFoundError:
        return Listing((), error=MISSING)
    except OSError as exc:
        return Listing((), error=exc.strerror or str(exc))
    return Listing(tuple(sorted(dirs)))


def _real_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return stat.S_ISDIR(entry.stat(follow_symlinks=False).st_mode)
    except OSError:  # gone since the listing read it (a job cleaned up): no root
        return False


def derive(entry: RootConfig, dirs: Sequence[str], taken: set[str], keep: Iterable[str] = (),
           cap: int = MAX_ROOTS_PER_GLOB) -> tuple[list[RootConfig], list[Skipped]]:
    """The roots `entry` makes of `dirs` (pure). A name that is not a usable root name, or one
    already in `taken` (which grows with each root made), is skipped; so is every directory
    past `cap`. Roots already made (`keep`) come first, so a new directory never displaces one."""
    kept = set(keep)
    order = sorted(dirs, key=lambda d: (f"{entry.name}-{d}" not in kept, d))
    made: list[RootConfig] = []
    skipped: list[Skipped] = []
    for directory in order:
        name = f"{entry.name}-{directory}"
        reason = _refusal(name, taken) or ("over the cap of" f" {cap} roots per glob entry"
                                           if len(made) >= cap else "")
        if reason:
            skipped.append(Skipped(entry.name, directory, reason))
            continue
        taken.add(name)
        made.append(entry.model_copy(update={"name": name,
                                             "path": entry.path.parent / directory}))
    return made, skipped


def _refusal(name: str, taken: set[str]) -> str:
    try:
        _root_name(name)
    except ValueError as exc:
        return str(exc)
    return f'"{name}" is already the name of another root' if name in taken else ""


@dataclass(frozen=True)
class Expansion:
    config: Config
    skipped: tuple[Skipped, ...]
    problems: tuple[str, ...]  # a glob's directory that could not be read, or read in full


def expand(cfg: Config, active: Iterable[str] = ()) -> Expansion:
    """`cfg` with each glob entry's roots added after the configured ones (whose names win)."""
    taken = {r.name for r in cfg.roots}
    active = set(active)
    roots = list(cfg.roots)
    skipped: list[Skipped] = []
    problems: list[str] = []
    for entry in cfg.globs:
        listing = list_dirs(entry.path.parent)
        if listing.error:
            problems.append(f"{entry.name}: {entry.path.parent}: {listing.error}")
        if listing.error and listing.error != MISSING:
            # Unreadable for now (permissions, I/O): the roots it made stay as they were.
            prefix = f"{entry.name}-"
            listing = Listing(tuple(sorted(n.removeprefix(prefix) for n in active
                                           if n.startswith(prefix))))
        if listing.truncated:
            problems.append(f"{entry.name}: {entry.path.parent}: more than"
                            f" {MAX_ENTRIES_READ} entries; only the first were read")
        made, passed = derive(entry, listing.dirs, taken, active)
        roots += made
        skipped += passed
    return Expansion(cfg.model_copy(update={"roots": tuple(roots)}), tuple(skipped),
                     tuple(problems))


def same_roots(a: Config, b: Config) -> bool:
    return {r.name: r for r in a.roots} == {r.name: r for r in b.roots}


class GlobRoots:
    """The service that keeps the glob entries' roots current: a pass at each scan interval
    (and when woken: start, reload) expands the config the daemon was given and hands a
    changed set of roots to `apply`. Warnings are logged when what is skipped changes."""

    def __init__(self, given: Callable[[], Config], current: Callable[[], Config],
                 apply: Callable[[Config], None], interval: Callable[[], float]) -> None:
        self._given, self._current, self._apply = given, current, apply
        self._interval = interval
        self._wake = threading.Event()
        self._lock = threading.Lock()  # one expansion and its apply at a time
        self._said: frozenset[Skipped | str] = frozenset()
        self.log = get_logger()

    def expand(self, cfg: Config) -> Config:
        """`cfg` expanded now (the daemon's start and each reload), warnings logged."""
        found = expand(cfg, (r.name for r in self._current().roots))
        said: frozenset[Skipped | str] = frozenset((*found.skipped, *found.problems))
        for skip in sorted(said - self._said, key=str):
            if isinstance(skip, Skipped):
                self.log.warning("glob_directory_skipped", entry=skip.entry,
                                 directory=skip.directory, reason=skip.reason)
            else:
                self.log.warning("glob_unreadable", problem=skip)
        self._said = said
        return found.config

    def refresh(self) -> None:
        """One pass: apply the given config's expansion if its roots changed."""
        with self._lock:
            new = self.expand(self._given())
            if not same_roots(new, self._current()):
                self._apply(new)

    def locked(self) -> threading.Lock:
        """Held by a reload, so a pass never applies an expansion of the config it replaced."""
        return self._lock

    def wake(self) -> None:
        self._wake.set()

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self._wake.wait(self._interval())
            self._wake.clear()
            if not stop.is_set() and self._given().globs:
                self.refresh()
