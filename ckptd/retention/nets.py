"""The retention safety nets: which facts (`Guards`, read from the store just before) forbid
which destructive act, and the refusal that names the net. Pure: no I/O, no clock; it only
answers, and the executor and the trash carry the answer out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ckptd.lifecycle import answers
from ckptd.retention.planner import Tag

# Reasons a delete is refused for, beyond the planner's vocabulary.
UNSAFE_PATH = "unsafe_path"  # outside the root, absolute, climbing, or ckptd's own files
SYMLINK = "symlink"  # a symlinked checkpoint directory, or a parent link leaving the root
NOT_ON_DISK = "not_on_disk"  # the store says the local copy is already gone
NO_TARGET = "no_target"  # the caller passed no (or a mismatched) Target for a planned step
SHARED = "shared_files"  # its files are also another checkpoint's
COMPRESSED = "compressed"  # the copy is the checkpoint's only local form

Act = Literal["prune_local", "prune_remote", "replace_originals", "release_copy", "release_last",
              "replace_remote", "replace_save"]


@dataclass(frozen=True)
class Guards:
    """Facts the safety nets check, read from the store right before executing (not the plan).

    `invalid`: steps the store holds invalid; they are never uploaded, so the not-uploaded net
    does not keep them (every other net still does). `shared`: steps whose local files (or
    whose directory) hold a file another checkpoint on disk counts as its own: deleting them
    would delete that one too, so they are never deleted locally."""

    latest_step: int | None
    best_step: int | None
    pinned: frozenset[int]
    in_use: frozenset[int]
    committed: frozenset[int]
    upload_configured: bool
    invalid: frozenset[int] = frozenset()
    shared: frozenset[int] = frozenset()
    adopted: frozenset[int] = frozenset()  # adopted, no remote copy, and no --apply


class DeleteRefused(Exception):
    """A destructive act refused: by a net, or by a name it may not touch. Never escapes the
    executor: it becomes an Outcome `refused` with this reason."""

    def __init__(self, tag: str, detail: str = "") -> None:
        super().__init__(f"{tag}: {detail}" if detail else tag)
        self.reason = str(self)


# The nets that guard each act, checked in this order; the first that holds refuses the act.
# A net an act does not list cannot be hurt by it (docs/RETENTION.md, "Where deletion happens"):
# compress keeps the checkpoint whole and verified on disk (pinned and best ones are compressed
# like the others, a policy decision); a spare copy beside its originals loses nothing; a
# re-save's earlier upload is replaced by the same step's newer save (and a re-save's earlier
# local save by the newer one, which the async-save writer commits in its place).
NETS: dict[str, tuple[str, ...]] = {
    "prune_local": ("latest", "best", "pinned", "in_use", "not_uploaded", "shared", "adopted"),
    "prune_remote": ("latest", "best", "pinned", "in_use", "newest_committed", "not_committed"),
    "replace_originals": ("latest", "in_use", "invalid", "shared"),
    "release_copy": ("in_use",),  # the originals are on disk: the copy is a spare
    "release_last": ("latest", "best", "pinned", "in_use", "not_uploaded", "adopted"),
    "replace_remote": ("in_use",),
    "replace_save": ("in_use",),  # the trainer saves the step again: its earlier save goes
}


def _net_holds(net: str, step: int, g: Guards) -> bool:
    if net == "latest":
        return step == g.latest_step
    if net == "best":
        return step == g.best_step
    if net == "pinned":
        return step in g.pinned
    if net == "in_use":
        return step in g.in_use
    if net == "not_uploaded":
        return g.upload_configured and step not in g.committed and step not in g.invalid
    if net == "shared":
        return step in g.shared
    if net == "adopted":
        return step in g.adopted
    if net == "newest_committed":
        return step == answers.newest(g.committed)
    if net == "not_committed":  # no MANIFEST.json yet: an upload may be writing it now
        return step not in g.committed
    if net == "invalid":
        return step in g.invalid
    raise ValueError(f"unknown net {net!r}")


_NET_TAGS = {"newest_committed": str(Tag.LATEST), "not_committed": str(Tag.NOT_UPLOADED),
             "shared": SHARED}


def check_nets(step: int, act: Act, g: Guards) -> None:
    """Raise DeleteRefused naming the first net that forbids `act` on `step`."""
    for net in NETS[act]:
        if _net_holds(net, step, g):
            raise DeleteRefused(_NET_TAGS.get(net, net))
