"""The peers' directory in a real file:// bucket: entries written and read back, every bad
entry skipped with a warning beside good ones, addresses checked, and the ring of peers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs
from support.fuzzing import _replace, fuzz, json_values

from ckptd.backends import LocalBackend
from ckptd.errors import BadValue, CorruptData
from ckptd.memory import directory as d
from ckptd.memory.directory import PeerEntry
from ckptd.remote.keys import peer_key, peers_prefix


@pytest.fixture
def bucket(tmp_path: Path) -> LocalBackend:
    return LocalBackend(tmp_path / "bucket")


def _entry(node: str, port: int = 9465, **kw: Any) -> PeerEntry:
    return PeerEntry(node, kw.pop("address", f"10.0.0.{port % 250}:{port}"),
                     kw.pop("updated", 1_700_000_000.5), kw.pop("held_by", ()))


def test_keys() -> None:
    assert peers_prefix("llm") == "llm/_peers/"
    assert peer_key("llm", "n-1.a") == "llm/_peers/n-1.a.json"


def test_publish_and_read_back(bucket: LocalBackend) -> None:
    entries = [_entry("n2", 2, held_by=(("n3", 40), ("n1", 38))), _entry("n1", 1),
               _entry("n3", 3, address="[::1]:7000")]
    for e in entries:
        d.publish(bucket, "llm", e)
    d.publish(bucket, "other", _entry("n9", 9))
    assert d.peers(bucket, "llm") == sorted(entries, key=lambda e: e.node)
    moved = _entry("n1", 1, address="host-1.cluster.local:9466", updated=1_700_000_100.0)
    d.publish(bucket, "llm", moved)  # overwritten in place
    assert d.peers(bucket, "llm")[0] == moved
    assert d.peers(bucket, "empty") == []


def test_bad_entries_are_skipped_with_a_warning(bucket: LocalBackend) -> None:
    good = _entry("n1", 1)
    d.publish(bucket, "llm", good)
    doc = json.loads(d.entry_json(_entry("n2", 2)))
    bad: dict[str, bytes] = {
        "llm/_peers/n2.json": b"{not json",
        "llm/_peers/n3.json": d.entry_json(_entry("n4", 4)),  # another node's entry
        "llm/_peers/n5.json": json.dumps({**doc, "node": "n5", "pad": "x" * 70_000}).encode(),
        "llm/_peers/n6.json": json.dumps({**doc, "node": "n6", "address": "n6"}).encode(),
        "llm/_peers/n7.json": json.dumps({**doc, "node": "n7", "address": "0.0.0.0:1"}).encode(),
        "llm/_peers/n8.json": json.dumps({**doc, "node": "n8", "updated": -1}).encode(),
        "llm/_peers/n9.json": json.dumps({**doc, "node": "n9", "held_by": [["n1", 3]]}).encode(),
        "llm/_peers/readme.txt": b"hello",
        "llm/_peers/sub/n10.json": d.entry_json(_entry("n10", 10)),
        "llm/_peers/.json": b"{}",
    }
    for key, data in bad.items():
        bucket.put(key, data)
    with capture_logs() as logs:
        assert d.peers(bucket, "llm") == [good]
    skipped = {e["key"] for e in logs if e["event"] == "peer_entry_skipped"}
    assert skipped == set(bad)
    assert all(e["root"] == "llm" and e["error"] for e in logs)


def test_at_most_limit_entries_are_read(bucket: LocalBackend) -> None:
    for n in range(5):
        d.publish(bucket, "llm", _entry(f"n{n}", n + 1))
    with capture_logs() as logs:
        got = d.peers(bucket, "llm", limit=3)
    assert len(got) == 3
    assert [e["event"] for e in logs] == ["peer_entry_skipped"]  # the one listed past the limit
    assert logs[0]["key"] not in {peer_key("llm", e.node) for e in got}


@pytest.mark.parametrize("address", ["10.0.0.1:9465", "node-1.cluster.local:80",
                                     "[::1]:9465", "localhost:65535", "[fe80::1%eth0]:1"])
def test_dialable_addresses(address: str) -> None:
    host, port = d.check_address(address)
    assert f"{host}:{port}" in address.replace("[", "").replace("]", "")


@pytest.mark.parametrize("address", [
    "host", "host:", ":9465", "host:0", "host:65536", "host:09", "host:+9", "host:9465 ",
    "0.0.0.0:9465", "[::]:9465", "::1:9465", "[zz]:1", "a b:1", "-host:1", "host-:1",
    "1.2.3:4", "1.2.3.256:4", "[1.2.3.4]:5", "h" * 300 + ":1", 9465, None])
def test_undialable_addresses(address: Any) -> None:
    with pytest.raises(BadValue):
        d.check_address(address)


@pytest.mark.parametrize("entry", [
    _entry("bad/node"), _entry(".n"), _entry("n" * 129), _entry("n1", address="n1"),
    _entry("n1", updated=float("nan")), _entry("n1", held_by=(("n 2", 1),)),
    _entry("n1", held_by=(("n2", -1),)), _entry("n1", held_by=(("n2", 1),) * 257)])
def test_a_bad_entry_is_not_published(bucket: LocalBackend, entry: PeerEntry) -> None:
    with pytest.raises(BadValue):
        d.publish(bucket, "llm", entry)
    assert list(bucket.list("")) == []


@pytest.mark.parametrize(("nodes", "me", "replicas", "chosen"), [
    (["a", "b", "c", "d"], "b", 2, ["c", "d"]),
    (["a", "b", "c", "d"], "d", 2, ["a", "b"]),
    (["a", "b", "c", "d"], "c", 3, ["d", "a", "b"]),
    (["d", "c", "b", "a"], "c", 9, ["d", "a", "b"]),
    (["a", "b", "c"], "bb", 2, ["c", "a"]),  # this node not (yet) listed: its ring place
    (["a", "a", "b"], "b", 2, ["a"]),
    (["a"], "a", 1, []),
    ([], "a", 1, []),
    (["a", "b"], "a", 0, []),
    (["n10", "n2", "n1"], "n1", 1, ["n10"]),
])
def test_choose_follows_the_ring(nodes: list[str], me: str, replicas: int,
                                 chosen: list[str]) -> None:
    assert d.choose(nodes, me, replicas) == chosen


def test_every_node_is_chosen_by_as_many_as_it_holds_for() -> None:
    nodes = [f"n{i:02}" for i in range(7)]
    held: dict[str, int] = dict.fromkeys(nodes, 0)
    for me in nodes:
        for peer in d.choose(nodes, me, 2):
            held[peer] += 1
    assert set(held.values()) == {2}


VALID = json.loads(d.entry_json(_entry("n1", held_by=(("n2", 5),))))


@fuzz()
@given(st.lists(st.integers(0, 50), max_size=4), json_values)
def test_a_mutated_entry_is_parsed_or_refused(path: list[int], value: Any) -> None:
    data = json.dumps(_replace(VALID, path, value)).encode()
    try:
        entry = d.parse_entry(data, "llm/_peers/n1.json")
    except CorruptData:
        return
    assert d.parse_entry(d.entry_json(entry), "n1.json") == entry


@fuzz()
@given(st.binary(max_size=200))
def test_any_bytes_are_an_entry_or_refused(data: bytes) -> None:
    try:
        d.parse_entry(data, "n1.json")
    except CorruptData:
        pass
