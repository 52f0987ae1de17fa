"""The recognizer contract every layout module implements.

A layout turns a `Snapshot` of a root into `Candidate`s with a completion verdict. Layouts are
pure: no filesystem access, no clock (`now` is passed in), no store. Imports only model/formats.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ckptd.model import Candidate, RootOptions, Snapshot


class Layout(Protocol):
    """One on-disk convention (docs/LAYOUTS.md)."""

    name: str

    def wants_content(self, rel: str) -> bool:
        """True when the completion rule needs the bytes of this (small) file in the snapshot."""
        ...

    def candidates(
        self, snap: Snapshot, opts: RootOptions, now: float, claimed: frozenset[str]
    ) -> list[Candidate]:
        """Every checkpoint of this layout in `snap`, complete or pending.

        Files in `claimed` already belong to a candidate of a more specific layout and must not
        be used. `now` is wall-clock seconds, compared with `FileInfo.changed_at`/`mtime`.
        """
        ...


@runtime_checkable
class ReadsTorchFields(Protocol):
    """A layout whose rule needs a count recorded inside a (large) torch file: the scanner
    reads the plain top-level values of the file's pickle from its first bytes into
    `snap.torch_fields` (never the whole file)."""

    def wants_torch_fields(self, rel: str) -> bool:
        ...


@runtime_checkable
class TrustsGlobals(Protocol):
    """A layout whose framework pickles known plain-data objects into its checkpoints: their
    globals are allowed in the pickle check of this layout's checkpoints (never executed)."""

    trusted_globals: frozenset[str]


@runtime_checkable
class WritesPointers(Protocol):
    """A layout whose framework finds a checkpoint through a pointer file beside it that is not
    one of its members (DeepSpeed's `latest`): what a restore writes so the loader finds it."""

    def pointer_files(self, files: tuple[str, ...]) -> dict[str, bytes]:
        ...
