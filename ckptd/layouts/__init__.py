"""Layout recognizers: which checkpoints a root's snapshot holds and which are complete.
`detect` runs them most specific first, each file claimed by one candidate at most.
Pure: functions of a `Snapshot`, `RootOptions` and `now`; no I/O, no clock. The contract is
`base`, shared helpers `common`; one module per layout: `native`, `registered`, `dcp`, `split`,
`ranked`, `hf`, `deepspeed`, `megatron`, `orbax`, `single`."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from ckptd import inputs
from ckptd.errors import BadValue
from ckptd.layouts import (
    common,
    dcp,
    deepspeed,
    hf,
    megatron,
    native,
    orbax,
    ranked,
    registered,
    single,
    split,
)
from ckptd.layouts.base import Layout, ReadsTorchFields, TrustsGlobals, WritesPointers
from ckptd.model import MAX_STEP, Candidate, RootOptions, Snapshot

__all__ = [
    "Layout", "auto_order", "content_kind", "detect", "detect_ranked", "get", "names",
    "pointer_files", "register", "trusted_globals", "wants_content", "wants_torch_fields",
]

# The registry, filled by `register` only: every layout by name, in docs/LAYOUTS.md's table
# order, and every recognizer "auto" runs, by its place.
_BY_NAME: dict[str, Layout] = {}
_AUTO: dict[int, Layout] = {}


def register(layout: Layout, auto: int | Mapping[int, Layout]) -> None:
    """Make `layout` known by its name, the one registration a layout needs: a value a root's
    `layout` may take (the config checks names here), what `get` gives, and a recognizer
    "auto" runs at place `auto` (lower runs first). A layout recognised in two passes maps
    each place to its recognizer. ValueError for a name or a place already taken."""
    places = {auto: layout} if isinstance(auto, int) else dict(auto)
    if layout.name in _BY_NAME or layout.name == "auto":
        raise BadValue(f"layout {layout.name!r} is already registered")
    if taken := sorted(places.keys() & _AUTO.keys()):
        raise BadValue(f"auto detection place {taken[0]} is already taken")
    _BY_NAME[layout.name] = layout
    _AUTO.update(places)
    _field_readers.cache_clear()


def names() -> tuple[str, ...]:
    """Every registered layout's name, in docs/LAYOUTS.md's table order: the accepted values
    of a root's `layout` besides "auto"."""
    return tuple(_BY_NAME)


def auto_order() -> tuple[Layout, ...]:
    """The recognizers "auto" runs, most specific first."""
    return tuple(_AUTO[place] for place in sorted(_AUTO))


def get(name: str) -> Layout:
    """The layout called `name`; ValueError for an unknown name."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise BadValue(
            f"unknown layout {name!r}; expected 'auto' or one of {names()}") from None


def _plan(layout: str) -> tuple[Layout, ...]:
    """Layouts run for a root: all for "auto"; else registered first, then the one named.

    Registrations with paths are honoured whatever the root's layout: the client said which
    files make the step.
    """
    if layout == "auto":
        return auto_order()
    chosen = get(layout)
    return (chosen,) if layout == registered.NAME else (registered.LAYOUT, chosen)


def wants_content(rel: str, layout: str = "auto") -> bool:
    """True when some layout run for this root needs the bytes of `rel` in the snapshot."""
    return any(lay.wants_content(rel) for lay in _plan(layout))


def content_kind(rel: str) -> inputs.Kind:
    """The bounded reader's kind (its size cap) for a file some layout wants the bytes of:
    DeepSpeed's `latest` and Megatron's tracker are a line; DCP's `.metadata` is a pickle of
    the whole plan; HF's `trainer_state.json` holds the whole log history; the rest (meta.json,
    meta_<N>.json, Orbax's metadata) are small JSON documents."""
    name = common.name_of(rel)
    if name in (deepspeed.LATEST, megatron.TRACKER):
        return inputs.TRACKER
    if name == dcp.METADATA:
        return inputs.DCP_METADATA
    if name == hf.STATE:
        return inputs.TRAINER_STATE
    return inputs.ROOT_META


def wants_torch_fields(rel: str, layout: str = "auto") -> bool:
    """True when some layout run for this root needs the plain values of `rel`'s pickle."""
    return any(lay.wants_torch_fields(rel) for lay in _field_readers(layout))


@functools.cache
def _field_readers(layout: str) -> tuple[ReadsTorchFields, ...]:
    """The layouts of a plan that read pickles' plain values. Asked once per plan: the check
    against a runtime protocol costs tens of microseconds, and a scan asks for every file."""
    return tuple(lay for lay in _plan(layout) if isinstance(lay, ReadsTorchFields))


def trusted_globals(name: str) -> frozenset[str]:
    """The globals the layout called `name` trusts in its checkpoints' pickles (a framework's
    plain-data classes); empty for an unknown name."""
    lay = _BY_NAME.get(name)
    return lay.trusted_globals if isinstance(lay, TrustsGlobals) else frozenset()


def pointer_files(name: str, files: tuple[str, ...]) -> dict[str, bytes]:
    """Files (relative path -> bytes) beside a checkpoint of layout `name` with these member
    files that its framework's loader needs and that are not members (DeepSpeed's `latest`)."""
    lay = _BY_NAME.get(name)
    return lay.pointer_files(files) if isinstance(lay, WritesPointers) else {}


def detect(snap: Snapshot, opts: RootOptions, now: float, layout: str = "auto") -> list[Candidate]:
    """Every checkpoint in `snap` (see `detect_all`), without the unrecognised names."""
    return detect_all(snap, opts, now, layout)[0]


def detect_all(snap: Snapshot, opts: RootOptions, now: float, layout: str = "auto"
               ) -> tuple[list[Candidate], list[str]]:
    """Every checkpoint in `snap`, complete or pending, sorted by step; and the paths that look
    like checkpoints but carry a step no checkpoint can have (2^63 or more), or metadata the
    scanner refused to read that made no checkpoint invalid: unrecognised, reported, and never
    allowed to stop the rest of the root.

    Two candidates with the same step are both returned, the earlier-written one first (by the
    newest mtime among their files, then by layout order): the store keeps the last one and
    records the one before as superseded.
    """
    ranked, bad = detect_ranked(snap, opts, now, layout)
    return [cand for _, cand in ranked], bad


def detect_ranked(snap: Snapshot, opts: RootOptions, now: float, layout: str = "auto",
                  view: Snapshot | None = None, kept: Sequence[tuple[int, Candidate]] = (),
                  kept_bad: Iterable[str] = ()) -> tuple[list[tuple[int, Candidate]], list[str]]:
    """`detect_all`, each candidate with the place of its recognizer in the root's plan. A
    caller that knows some directories' checkpoints as a run of this function judged them
    (their files and those of their ancestors unchanged since, all complete) passes them as
    `kept`, with the unrecognised paths under them (`kept_bad`), and a `view`: `snap` without
    those directories, the only snapshot the recognizers see; `snap` decides the order."""
    claimed: set[str] = set()
    found: list[tuple[int, Candidate]] = []
    for rank, lay in enumerate(_plan(layout)):
        batch = lay.candidates(view or snap, opts, now, frozenset(claimed))
        for cand in batch:
            claimed.update(cand.files)
            found.append((rank, cand))
    bad = {c.path for _, c in found if not 0 <= c.step < MAX_STEP}
    found = [(r, c) for r, c in found if 0 <= c.step < MAX_STEP]
    bad.update(_look_alikes(view or snap, claimed, [c.path for _, c in found]))
    bad.update(kept_bad)
    found.extend(kept)
    # Metadata the scanner refused to read (a link, not a regular file, over its cap) that
    # made no checkpoint invalid (a framework's `latest`, a tracker): reported here.
    if snap.bad_contents:
        judged = {f for _, c in found if c.invalid_reason for f in c.files}
        bad.update(rel for rel in snap.bad_contents if rel not in judged)
    # The newest mtime orders two candidates of one step; other steps need no look at files.
    steps = Counter(c.step for _, c in found)
    found.sort(key=lambda rc: (rc[1].step, common.written_at(snap, rc[1])
                               if steps[rc[1].step] > 1 else 0.0, rc[0], rc[1].path))
    return found, sorted(bad)


# A weights file by its suffix: what a user would call a checkpoint.
WEIGHTS_SUFFIXES = (".pt", ".pth", ".ckpt", ".safetensors", ".bin", ".distcp")


def _look_alikes(snap: Snapshot, claimed: set[str], dirs: list[str]) -> list[str]:
    """Weights files no layout took and no checkpoint directory holds: `final.pt`,
    `ckpt-200.pt` (no step in a known pattern), a stray shard. Listed, never acted on. A
    symlink (Lightning's `last.ckpt`) names another file: not a checkpoint of its own."""
    inside = tuple(d + "/" for d in dirs)
    return [rel for rel, info in snap.files.items()
            if rel not in claimed and rel.endswith(WEIGHTS_SUFFIXES) and not info.symlink
            and not rel.startswith(inside) and not common.is_temp_path(rel)]


# The built-in layouts, in docs/LAYOUTS.md's table order; their places in "auto", most specific
# first. Why this order:
# - registered: the client's own word about which files make the step;
# - native with meta.json: ckptd's own format, unambiguous;
# - hf, megatron, deepspeed before dcp: Trainer's FSDP saves and Megatron's torch_dist put DCP
#   files inside `checkpoint-N/` and `iter_N/`, whose own commit rule (trainer_state.json, the
#   tracker) must decide; HF before deepspeed since Trainer+DeepSpeed nests `global_stepN/`;
# - dcp, then orbax (bare-number dirs, recognised only by Orbax's own files);
# - split before ranked before single: `step_5_model.pt` and `model_5.pt` also look single;
# - native dirs WITHOUT meta.json last, so a torchtitan `step-N/` being written stays dcp.
register(native.LAYOUT, {20: native.NativeLayout(with_meta=True, without_meta=False),
                         110: native.NativeLayout(with_meta=False, without_meta=True)})
register(registered.LAYOUT, 10)
register(dcp.LAYOUT, 60)
register(split.LAYOUT, 80)
register(ranked.LAYOUT, 90)
register(hf.LAYOUT, 30)
register(deepspeed.LAYOUT, 50)
register(megatron.LAYOUT, 40)
register(orbax.LAYOUT, 70)
register(single.LAYOUT, 100)
