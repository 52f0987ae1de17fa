"""Bounded property tests of what ckptd reads from the bucket: the manifest and part parsers
given any bytes or any JSON (a valid document mutated anywhere) end in a document or in the
parser's own error, never another exception; and a remote listing with any mix of bad
manifests beside good ones lists every good step. A few hundred cases a run."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptd.backends import LocalBackend
from ckptd.cluster import commit as cc
from ckptd.errors import CorruptData, ObjectNotFound
from ckptd.remote import keys as remote
from ckptd.remote.manifest import Manifest, StoredFile, parse_manifest

MANIFEST = Manifest("r1", 7, "single", (
    StoredFile("model.pt", 10, "ab", "xxh3-128", "zstd", 8, "model.pt.zst"),
    StoredFile("sub/opt.pt", 20, "cd", "xxh3-128", "none", 20, "sub/opt.pt")),
    created="2026-01-01T00:00:00Z", metrics={"loss": 0.5})
PART = cc.Part("n1", "100-abc", "single", (
    cc.PartFile("model.pt", 10, 100.5, "ab", "xxh3-128", "zstd", 8, "n1.100-abc/model.pt.zst"),),
    cc.CommitRecord("model.pt", 100.5, {"model.pt": 10}))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=4),
    max_leaves=12)


def _replace(doc: Any, path: list[int], value: Any) -> Any:
    """`doc` with the node reached by following `path` (indexes into children) set to `value`."""
    if not path or not isinstance(doc, dict | list) or not doc:
        return value
    keys = list(doc) if isinstance(doc, dict) else list(range(len(doc)))
    key = keys[path[0] % len(keys)]
    out = dict(doc) if isinstance(doc, dict) else list(doc)
    out[key] = _replace(doc[key], path[1:], value)  # type: ignore[index]
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_any_bytes_are_a_manifest_or_corrupt_data(data: bytes) -> None:
    try:
        parse_manifest(data)
    except CorruptData:
        pass
    try:
        cc.parse_part(data, "p")
    except cc.BadPart:
        pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["manifest", "part"]), st.lists(st.integers(0, 50), max_size=5),
       json_values)
def test_a_mutated_document_is_parsed_or_refused(which: str, path: list[int],
                                                 value: Any) -> None:
    source = MANIFEST.as_json() if which == "manifest" else PART.as_json()
    data = json.dumps(_replace(source, path, value)).encode()
    if which == "manifest":
        try:
            m = parse_manifest(data)
        except CorruptData:
            return
        assert len({f.path for f in m.files}) == len(m.files)
        assert all(0 <= f.size < 2**63 and 0 <= f.stored_size < 2**63 for f in m.files)
    else:
        try:
            p = cc.parse_part(data, "p")
        except cc.BadPart:
            return
        assert all(0 <= f.size < 2**63 for f in p.files)


bad_bodies = st.sampled_from([b"", b"{", b"[]", b'{"format": "ckptd-manifest/1"}', b"\xff\xfe",
                              b'{"format": "ckptd-manifest/1", "step": 1e999}',
                              b"9" * 5000, b'{"a": ' * 100 + b"1" + b"}" * 100])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sets(st.integers(0, 30), max_size=6), st.dictionaries(st.integers(31, 60),
                                                                bad_bodies, max_size=6))
def test_a_listing_finds_every_good_step_whatever_lies_beside(good: set[int],
                                                               bad: dict[int, bytes]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        backend = LocalBackend(Path(tmp))
        for step in good:
            m = Manifest("r1", step, "single", MANIFEST.files, created=MANIFEST.created)
            backend.put(remote.manifest_key("r1", step), m.to_bytes())
        for step, body in bad.items():
            backend.put(remote.manifest_key("r1", step), body)
        readable = set()
        for step in remote.list_steps(backend, "r1"):
            try:
                remote.read_manifest(backend, "r1", step)
            except (CorruptData, ObjectNotFound):
                continue
            readable.add(step)
        assert readable == good
