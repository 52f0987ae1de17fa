"""The `registered` layout: the files a client named when it registered a save for a step.
Complete when every registered path exists (a directory: all files under it) and is settled."""

from __future__ import annotations

from ckptd.layouts import common
from ckptd.model import Candidate, RootOptions, Snapshot

NAME = "registered"


class RegisteredLayout:
    name = NAME

    def wants_content(self, rel: str) -> bool:
        return False

    def candidates(
        self, snap: Snapshot, opts: RootOptions, now: float, claimed: frozenset[str]
    ) -> list[Candidate]:
        out: list[Candidate] = []
        tree = common.Tree(snap) if snap.registrations else None
        for step, raw_paths in sorted(snap.registrations.items()):
            paths = [_normalize(p) for p in raw_paths]
            if not paths or tree is None:
                continue  # registered without paths: a layout's own candidate stands for it
            cand = _candidate(snap, tree, opts, now, step, paths)
            if not common.touches(cand.files, claimed):
                out.append(cand)
        return out


def _normalize(path: str) -> str:
    """Registered paths are root-relative; tolerate `./x` and `x/` spellings."""
    path = path.strip().removeprefix("./").rstrip("/")
    return "" if path == "." else path


def files_of(snap: Snapshot, tree: common.Tree, path: str) -> list[str]:
    """The files a registered path stands for: itself, or everything under the directory."""
    return [path] if path in snap.files else tree.under(path)


def _candidate(snap: Snapshot, tree: common.Tree, opts: RootOptions, now: float, step: int,
               paths: list[str]) -> Candidate:
    problems: list[str] = []
    files: list[str] = []
    under: list[str] = []  # temp files included: a dir is settled only when all of it is
    for path in paths:
        if not path or path.startswith("/") or ".." in path.split("/"):
            problems.append(f"{path!r} to name a path inside the root")
        elif common.is_temp_path(path):
            problems.append(f"{path} to be renamed from its temporary name")
        elif not (found := common.members(files_of(snap, tree, path))):
            problems.append(path)
        else:
            files.extend(found)
            under.extend(files_of(snap, tree, path))
            problems.append(common.unfinished_problem(snap, path, files_of(snap, tree, path)))
    problems.append(common.settle_problem(snap, under, opts, now))
    # The first path the client listed is the one `ckptd latest` hands back.
    return common.make(NAME, step, paths[0], files, problems)


LAYOUT = RegisteredLayout()
