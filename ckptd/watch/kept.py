"""Which checkpoint directories a scan takes as the last one judged them, instead of passing
their files to the layouts again: a root keeps its finished steps, and a layout pass over every
file of every one of them at every scan would cost more with each step the root holds.

A directory is kept while it is a complete checkpoint's own (its candidates' files all under
it, no other candidate's file under it, none open, no link in it) and, since it was judged:
every directory under it kept its records (the walk reused their listings: the watcher saw no
change there), and along its path up to the root no file came, went or changed and no
temp-named directory came or went (a NeMo `-unfinished` marker, a framework's pointer file:
the layouts read those beside a checkpoint). Must not read the filesystem or decide
completeness (the layouts did, when the directory was judged).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ckptd.layouts import common
from ckptd.model import Candidate, FileInfo
from ckptd.watch.walk import Entry, Listing


class Record(Protocol):
    """A directory's share of a scan (`ckptd.watch.scanner`)."""

    listing: Listing
    files: dict[str, FileInfo]
    open: bool


@dataclass(eq=False)
class Unit:
    """A checkpoint directory whose candidates the next scan may keep."""

    path: str
    ranked: list[tuple[int, Candidate]]  # its candidates, each with its recognizer's place
    bad: list[str]  # the unrecognised paths under it
    records: dict[str, Record]  # each directory under it, itself included: its record then
    along: list[tuple[str, list[Entry], frozenset[str]]]  # each ancestor: files, subdirs then


def still(unit: Unit, records: Mapping[str, Record]) -> bool:
    """Whether `unit` may be kept in a scan that built `records`."""
    for rel_dir, rec in unit.records.items():
        if records.get(rel_dir) is not rec:
            return False
    for rel_dir, files, subdirs in unit.along:
        now = records.get(rel_dir)
        if now is None or now.listing.files != files:
            return False
        moved = subdirs.symmetric_difference(now.listing.subdirs)
        if any(common.is_temp_name(common.name_of(d)) for d in moved):
            return False
    return True


def frozen_dirs(units: Iterable[Unit]) -> set[str]:
    return {rel_dir for unit in units for rel_dir in unit.records}


def choose(ranked: Sequence[tuple[int, Candidate]], bad: Sequence[str],
           records: Mapping[str, Record], kept: Mapping[str, Unit]) -> dict[str, Unit]:
    """The directories the next scan may keep, from this scan's candidates (`ranked`, with
    those of the `kept` units among them) and unrecognised paths."""
    groups: dict[str, list[tuple[int, Candidate]]] = {}
    for rank, cand in ranked:
        groups.setdefault(cand.path, []).append((rank, cand))
    paths = sorted(groups)
    dirs = sorted(records)
    # A kept unit's candidates hold only files under it (checked when it was chosen).
    carried = {id(c) for unit in kept.values() for _, c in unit.ranked}
    touched = _touched_from_outside(rc for rc in ranked if id(rc[1]) not in carried)
    out: dict[str, Unit] = {}
    for path, group in groups.items():
        old = kept.get(path)
        if old is not None and {id(c) for _, c in old.ranked} == {id(c) for _, c in group}:
            out[path] = old  # still as judged: carried as it is
            continue
        if not path or path not in records or path in touched:
            continue  # a file checkpoint, or one whose directory another candidate reaches
        if not all(c.complete for _, c in group) or not _owns(path, group):
            continue
        if _nested(path, groups, paths):
            continue
        recs = {d: records[d] for d in _subtree(path, dirs)}
        if any(rec.open or rec.listing.links for rec in recs.values()):
            continue
        prefix = path + "/"
        out[path] = Unit(path, group, [b for b in bad if b == path or b.startswith(prefix)],
                         recs, _along(path, records))
    return out


def _owns(path: str, group: Sequence[tuple[int, Candidate]]) -> bool:
    prefix = path + "/"
    return all(f.startswith(prefix) for _, c in group for f in c.files)


def _touched_from_outside(ranked: Iterable[tuple[int, Candidate]]) -> set[str]:
    """Every ancestor directory of a file some candidate holds outside its own directory."""
    out: set[str] = set()
    for _, cand in ranked:
        prefix = cand.path + "/"
        for f in cand.files:
            if not f.startswith(prefix):
                d = common.parent_of(f)
                while d and d not in out:
                    out.add(d)
                    d = common.parent_of(d)
    return out


def _nested(path: str, groups: Mapping[str, object], paths: Sequence[str]) -> bool:
    """Whether another candidate's path (`paths`, sorted) lies below `path` or above it."""
    prefix = path + "/"
    i = bisect.bisect_left(paths, prefix)
    if i < len(paths) and paths[i].startswith(prefix):
        return True
    d = common.parent_of(path)
    while d:
        if d in groups:
            return True
        d = common.parent_of(d)
    return False


def _subtree(path: str, dirs: Sequence[str]) -> list[str]:
    """`path` and every directory below it, from the sorted list of a scan's directories."""
    lo = bisect.bisect_left(dirs, path + "/")
    hi = bisect.bisect_left(dirs, path + "0")  # "0" sorts right after "/"
    return [path, *dirs[lo:hi]]


def _along(path: str, records: Mapping[str, Record]) -> list[tuple[str, list[Entry],
                                                                   frozenset[str]]]:
    out = []
    d = path
    while d:
        d = common.parent_of(d)
        rec = records.get(d)
        if rec is not None:
            out.append((d, rec.listing.files, frozenset(rec.listing.subdirs)))
    return out
