"""The replicas held for peers: one per (root, node, rank), newer steps replacing older ones,
within a byte cap that counts uploads still arriving; the oldest steps dropped first."""

from __future__ import annotations

import threading

import pytest

from ckptd.errors import HttpError
from ckptd.memory.replicas import Replicas


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def time(self) -> float:
        self.now += 1
        return self.now

    def monotonic(self) -> float:
        return self.now


def test_put_get_index_and_what_is_held() -> None:
    r = Replicas(1000, Clock())
    r.put("a", "n1", 0, 5, [b"xx", b"yyy"], 5)
    r.put("a", "n1", 1, 5, [b"z" * 10], 10)
    r.put("a", "n2", 0, 4, [b"q"], 1)
    r.put("b", "n1", 0, 9, [b"w" * 7], 7)
    assert r.get("a", "n1", 0, 5) == [b"xx", b"yyy"]
    assert r.get("a", "n1", 7, 5) is None
    assert r.index("a", "n1") == [{"rank": 0, "step": 5, "bytes": 5},
                                  {"rank": 1, "step": 5, "bytes": 10}]
    assert r.held_bytes() == 23 and r.held_bytes("a") == 16
    assert r.holding_for("a") == [{"node": "n1", "step": 5, "bytes": 15},
                                  {"node": "n2", "step": 4, "bytes": 1}]
    assert r.drop("a") == 16
    assert r.index("a", "n1") == [] and r.held_bytes() == 7


def test_another_step_held_is_said() -> None:
    r = Replicas(1000, Clock())
    r.put("a", "n1", 0, 5, [b"xx"], 2)
    with pytest.raises(HttpError) as info:
        r.get("a", "n1", 0, 6)
    assert info.value.status == 409 and "step 5" in info.value.message
    found = r.find("a", "n1", 0)
    assert found is not None and found.step == 5


def test_a_newer_or_equal_step_replaces_the_held_one_an_older_is_refused() -> None:
    r = Replicas(1000, Clock())
    r.put("a", "n1", 0, 5, [b"xx"], 2)
    r.put("a", "n1", 0, 5, [b"yyy"], 3)
    assert r.get("a", "n1", 0, 5) == [b"yyy"] and r.held_bytes() == 3
    r.put("a", "n1", 0, 6, [b"z"], 1)
    assert r.held_bytes() == 1
    with pytest.raises(HttpError) as info:
        r.put("a", "n1", 0, 4, [b"old"], 3)
    assert info.value.status == 409 and info.value.code == "stale"
    with pytest.raises(HttpError):
        r.begin("a", "n1", 0, 4)
    assert r.get("a", "n1", 0, 6) == [b"z"] and r.reserved_bytes() == 0


def test_past_the_cap_the_oldest_steps_go_first_ties_by_arrival() -> None:
    r = Replicas(100, Clock())
    r.put("a", "n1", 0, 7, [b"a" * 30], 30)
    r.put("b", "n2", 0, 3, [b"b" * 30], 30)
    r.put("a", "n3", 0, 7, [b"c" * 30], 30)
    r.put("a", "n4", 0, 8, [b"d" * 30], 30)  # drops step 3 of b
    assert r.find("b", "n2", 0) is None and r.held_bytes() == 90
    r.put("a", "n5", 0, 9, [b"e" * 30], 30)  # drops the first step 7 (the older arrival)
    assert r.find("a", "n1", 0) is None and r.find("a", "n3", 0) is not None
    assert r.held_bytes() == 90


def test_an_older_step_cannot_push_out_newer_ones() -> None:
    r = Replicas(60, Clock())
    r.put("a", "n1", 0, 7, [b"a" * 30], 30)
    r.put("a", "n2", 0, 8, [b"b" * 30], 30)
    with pytest.raises(HttpError) as info:
        r.put("a", "n3", 0, 2, [b"c" * 30], 30)
    assert info.value.status == 507 and r.held_bytes() == 60 and r.reserved_bytes() == 0


def test_one_larger_than_the_cap_is_refused_and_nothing_is_dropped() -> None:
    r = Replicas(100, Clock())
    r.put("a", "n1", 0, 1, [b"a" * 50], 50)
    with pytest.raises(HttpError) as info:
        r.put("a", "n2", 0, 9, [b"x" * 101], 101)
    assert info.value.status == 507 and info.value.code == "too_large"
    assert r.held_bytes() == 50
    with r.begin("a", "n2", 0, 9) as up:
        up.grow(100)
        with pytest.raises(HttpError) as info:
            up.grow(1)
        assert info.value.code == "too_large"
    assert r.reserved_bytes() == 0


def test_uploads_arriving_together_never_exceed_the_cap() -> None:
    r = Replicas(1000, Clock())
    ups = [r.begin("a", f"n{i}", 0, 5) for i in range(3)]
    ups[0].grow(400)
    ups[1].grow(400)
    with pytest.raises(HttpError) as info:
        ups[2].grow(300)  # only 200 left: the others' room is not taken from them
    assert info.value.status == 507
    ups[2].grow(200)
    assert r.reserved_bytes() == 1000
    ups[0].commit([b"x" * 400])
    ups[1].close()  # an upload that failed gives its room back
    assert r.reserved_bytes() == 200 and r.held_bytes() == 400
    ups[2].grow(300)
    ups[2].commit([b"y" * 500])
    assert r.held_bytes() == 900 and r.reserved_bytes() == 0


def test_many_threads_keep_the_books_straight() -> None:
    r = Replicas(10_000, Clock())

    def work(i: int) -> None:
        for step in range(50):
            try:
                with r.begin("a", f"n{i % 4}", i, step) as up:
                    up.grow(100)
                    up.commit([b"x" * 100])
            except HttpError:
                pass

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert r.reserved_bytes() == 0
    assert r.held_bytes() == sum(e["bytes"] for n in range(4)
                                 for e in r.index("a", f"n{n}")) == 800
