"""Bounded property tests of the remote manifest and node part parsers given hostile JSON
anywhere in a good document, and documents over their caps: a document, or the parser's own
error, in bounded time. A few hundred cases a run (`CKPTD_FUZZ_EXAMPLES` for more)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.fuzzing import (
    _splice,
    bounded,
    fuzz,
    hostile_literals,
    json_values,
)

from ckptd import inputs
from ckptd.cluster import commit as cc
from ckptd.errors import BadPart, CorruptData
from ckptd.remote.manifest import Manifest, StoredFile, parse_manifest

MANIFEST = Manifest("r1", 7, "single", (
    StoredFile("model.pt", 10, "ab", "xxh3-128", "zstd", 8, "model.pt.zst"),
    StoredFile("sub/opt.pt", 20, "cd", "xxh3-128", "none", 20, "sub/opt.pt")),
    created="2026-01-01T00:00:00Z", metrics={"loss": 0.5},
    nodes=(("n1", "100-abc", "model.pt"),))


PART = cc.Part("n1", "100-abc", "single", (
    cc.PartFile("model.pt", 10, 100.5, "ab", "xxh3-128", "zstd", 8, "n1.100-abc/model.pt.zst"),),
    cc.CommitRecord("model.pt", 100.5, {"model.pt": 10}))


@fuzz(300)
@given(st.sampled_from(["manifest", "part"]), st.lists(st.integers(0, 50), max_size=5),
       hostile_literals | json_values.map(json.dumps))
def test_manifest_and_part_with_hostile_json_are_parsed_or_refused(which: str, path: list[int],
                                                                   literal: str) -> None:
    """The manifest parser raises CorruptData (BadInput is one), the part parser BadPart (a
    ValueError), for JSON a lenient parser would take: NaN, 400-digit numbers, duplicate keys,
    deep nesting, anywhere in an otherwise good document."""
    source = MANIFEST.as_json() if which == "manifest" else PART.as_json()
    data = _splice(source, path, literal)
    with bounded(which):
        if which == "manifest":
            try:
                m = parse_manifest(data)
            except CorruptData:
                return
            assert all(0 <= f.size < 2**63 for f in m.files)
            assert all(math.isfinite(v) for v in m.metrics.values())
        else:
            try:
                p = cc.parse_part(data, "p")
            except cc.BadPart:
                return
            assert all(0 <= f.size < 2**63 and math.isfinite(f.mtime) for f in p.files)


@fuzz(50)
@given(st.sampled_from(["manifest", "part"]), st.integers(0, 3))
def test_manifest_and_part_over_their_caps_are_refused_unparsed(which: str, extra: int) -> None:
    cap = inputs.MANIFEST.cap if which == "manifest" else inputs.PART.cap
    data = b" " * (cap + 1 + extra) + b"{}"
    with bounded(which):
        if which == "manifest":
            with pytest.raises(CorruptData):
                parse_manifest(inputs.check_size(data, inputs.MANIFEST, "m"))
        else:
            with pytest.raises(BadPart):
                cc.parse_part(data, "p")
