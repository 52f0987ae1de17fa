"""The walk of one root, directory by directory: each directory's listing (its files' sizes,
mtimes and kinds, its subdirectories) is kept, and reused by the next walk while the watcher
vouches that nothing in it changed, so a rescan costs what changed, not what the root holds.

Never follows a symlink out of the root nor descends a linked directory; never reads a file's
bytes, decides completeness, watches for events or touches the store.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Collection
from dataclasses import dataclass

from ckptd.model import is_own

Entry = tuple[str, int, int, bool]  # root-relative path, size, mtime_ns, reached through a link


@dataclass(eq=False)
class Listing:
    """What one directory held when it was last listed."""

    ident: tuple[int, int, int, int]  # the directory's st_dev, st_ino, st_mtime_ns, st_ctime_ns
    files: list[Entry]
    subdirs: list[str]
    # Reusable only when it holds no link (a link's stat is its target's, whose changes raise
    # no event in this directory) and it was the same at the listing before: a directory's
    # mtime moves in coarse ticks, and a directory made moments before its watch was added
    # may have changed unseen between the first listing and the watch.
    links: bool
    stable: bool


def same_entries(a: Listing, b: Listing) -> bool:
    return a.ident == b.ident and a.files == b.files and a.subdirs == b.subdirs


class Walk:
    """One root's walk, keeping each directory's listing for the next one."""

    def __init__(self, path: str | os.PathLike[str], real_root: str,
                 top: Callable[[str, bool], bool] | None,
                 stat_member: Callable[[str, str], tuple[os.stat_result, bool]]) -> None:
        self.path = os.fspath(path)
        self._real_root = real_root
        self._top = top  # which top-level entries (name, is_dir) to walk; None = all
        self._stat_member = stat_member
        self._listings: dict[str, Listing] = {}
        self.unreadable: set[str] = set()  # directories the last walk could not read
        self.listed = 0  # directories the last walk listed (each entry lstat'ed)
        self.reused = 0  # directories it took as they were, unlisted (one lstat of the directory)

    def run(self, dirty: Collection[str] | None) -> dict[str, tuple[Listing, bool]]:
        """Every directory under the root (root-relative, "" = the root) with its listing and
        whether it is the one kept from the last walk (reused, or listed again and found the
        same). `dirty`: the directories the watcher
        saw change since the last walk, or None when it cannot vouch for the rest (no watcher,
        a lost event, a watch it could not add): then every directory is listed again."""
        out: dict[str, tuple[Listing, bool]] = {}
        self.unreadable = set()
        self.listed = self.reused = 0
        stack = [""]
        while stack:
            rel_dir = stack.pop()
            got = self._one(rel_dir, dirty)
            if got is None:
                continue
            out[rel_dir] = got
            stack.extend(got[0].subdirs)
        self._listings = {rel: listing for rel, (listing, _) in out.items()}
        return out

    def _one(self, rel_dir: str, dirty: Collection[str] | None) -> tuple[Listing, bool] | None:
        abs_dir = os.path.join(self.path, rel_dir) if rel_dir else self.path
        try:  # the root itself may be a link to its directory; nothing below it is followed
            st = os.stat(abs_dir) if not rel_dir else os.lstat(abs_dir)
        except FileNotFoundError:
            return None  # vanished mid-scan; the next scan sees the truth
        except OSError:
            self.unreadable.add(rel_dir)
            return None
        if not stat.S_ISDIR(st.st_mode):
            return None  # replaced by a file or a link since its parent was listed
        ident = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
        old = self._listings.get(rel_dir)
        if (dirty is not None and old is not None and old.stable and not old.links
                and old.ident == ident and rel_dir not in dirty):
            self.reused += 1
            return old, True
        listing = self._list(rel_dir, abs_dir, ident)
        if listing is None:
            return None
        self.listed += 1
        if old is not None and same_entries(old, listing):
            old.stable = True
            return old, True  # listed again, the same: what was built from it still holds
        return listing, False

    def _list(self, rel_dir: str, abs_dir: str, ident: tuple[int, int, int, int]
              ) -> Listing | None:
        try:
            entries = list(os.scandir(abs_dir))
        except FileNotFoundError:
            return None
        except OSError:
            self.unreadable.add(rel_dir)  # EACCES, EIO, a stale NFS handle
            return None
        files: list[Entry] = []
        subdirs: list[str] = []
        links = False
        for entry in entries:
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            if is_own(entry.name):
                continue  # `.ckptd/`, ckptd's temp files and a restore's staging dir
            if not rel_dir and self._top is not None and not self._top(
                    entry.name, entry.is_dir(follow_symlinks=False)):
                continue
            try:
                st, escapes = self._stat_member(self._real_root, entry.path)
            except OSError:
                continue  # vanished mid-scan
            is_link = entry.is_symlink()
            links = links or is_link
            if escapes:
                # Reported as a file so its checkpoint completes and validation refuses it
                # (unsafe_path); never followed, never descended.
                files.append((rel, st.st_size, st.st_mtime_ns, True))
            elif stat.S_ISDIR(st.st_mode):
                if not is_link:  # a symlinked dir is never descended
                    subdirs.append(rel)
            elif stat.S_ISREG(st.st_mode):
                files.append((rel, st.st_size, st.st_mtime_ns, is_link))
        files.sort()
        subdirs.sort()
        return Listing(ident, files, subdirs, links, False)


def relative_dirs(root: str, paths: Collection[str]) -> set[str]:
    """Absolute directory paths under `root` as root-relative ones ("" = the root itself);
    paths outside it are left out."""
    prefix = root.rstrip(os.sep) + os.sep
    out: set[str] = set()
    for p in paths:
        if p == root or p + os.sep == prefix:
            out.add("")
        elif p.startswith(prefix):
            out.add(p[len(prefix):].rstrip(os.sep))
    return out
