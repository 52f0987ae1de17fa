"""Simulation of the multi-node commit (ckptd.cluster.commit) over a create-only store: 64 nodes
x 1,000 steps with skewed clocks, daemons that die and come back, slow daemons, crashed first
attempts re-saved at once or later, and a coordinator killed after writing its part. A node
confirms its part for the coordinator's save once it has seen the record and finds its files
unchanged (`stages.multinode.parts`). After every event the step it touched is checked:
committed at most once, never mixing attempts, covering the whole save, and no node treats a
step as latest or prunable before its commit. At the end every step whose save completed is
committed exactly once. Seeded; a few seconds."""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptd.cluster import commit as cc

NODES = 64
STEPS = 1000
COMMIT_TIMEOUT = 300.0
SIZE = 1000


@dataclass
class Save:
    """The ground truth of one step: each attempt's files per node, the final attempt."""

    attempts: list[dict[int, tuple[float, str]]] = field(default_factory=list)  # node -> file
    record_at: float | None = None  # true time of the final attempt's record
    final: int = -1


@dataclass
class Store:
    objects: dict[tuple[int, str], object] = field(default_factory=dict)
    creates: dict[tuple[int, str], int] = field(default_factory=dict)

    def put_create_only(self, step: int, key: str, value: object) -> bool:
        k = (step, key)
        if k in self.objects:
            return False
        self.objects[k] = value
        self.creates[k] = self.creates.get(k, 0) + 1
        return True

    def parts(self, step: int) -> list[cc.Part]:
        return [v for (s, k), v in self.objects.items()
                if s == step and k.startswith("_parts/") and isinstance(v, cc.Part)]


class Sim:
    def __init__(self, seed: int, deepspeed: bool = False, steps: int = STEPS) -> None:
        """`deepspeed`: the record (rank 0's model states) is written right after node 0's
        own file, and the other ranks may finish after it (`CommitRecord.after`)."""
        self.deepspeed = deepspeed
        self.steps = steps
        self.rng = random.Random(seed)
        self.offset = [self.rng.uniform(-cc.SKEW_S / 2, cc.SKEW_S / 2) for _ in range(NODES)]
        self.down_until = [0.0] * NODES
        self.store = Store()
        self.saves: dict[int, Save] = {}
        self.disk: dict[tuple[int, int], tuple[float, str]] = {}  # (node, step) -> (mtime, hash)
        self.published: dict[tuple[int, int], str] = {}  # (node, step) -> attempt published
        self.mine: dict[tuple[int, int], cc.Part] = {}  # (node, step) -> its part published
        self.confirms: dict[int, dict[str, set[str]]] = {}  # step -> coordinator -> parts
        self.uploaded: dict[int, set[int]] = {n: set() for n in range(NODES)}  # node -> steps
        self.parts_by_step: dict[int, list[cc.Part]] = {}
        self.pending: dict[tuple[int, int], list[tuple[float, str]]] = {}  # writes to come
        self.queue: list[tuple[float, int, str, int, int]] = []
        self.seq = 0
        self.commits = 0
        self.events = 0
        self.polls: dict[tuple[int, int], int] = {}
        self.plans: dict[int, tuple[tuple[int, int], cc.Plan]] = {}
        self.newest: dict[int, float] = {}
        self.horizon = 0.0
        self.checked: dict[int, object] = {}  # step -> the commit checked already

    def later(self, now: float, node: int, step: int) -> None:
        """The next look at a step waiting for its commit: 4 s, then doubling up to a minute."""
        n = min(self.polls.get((node, step), 0), 4)
        self.polls[(node, step)] = n + 1
        if now > self.horizon:
            return  # the job ended long ago: what is not committed now never will be
        self.at(now + min(60.0, 4.0 * 2.0 ** n), "poll", node, step)

    def at(self, when: float, kind: str, node: int, step: int) -> None:
        self.seq += 1
        heapq.heappush(self.queue, (when, self.seq, kind, node, step))

    # -- the job -------------------------------------------------------------------------

    def write_attempt(self, step: int, start: float, nodes: list[int], record: bool) -> float:
        """The ranks of `nodes` write their files finishing within SPREAD; node 0 writes the
        record last when `record`. Returns when the attempt ended (true time)."""
        save = self.saves.setdefault(step, Save())
        n = len(save.attempts)
        files: dict[int, tuple[float, str]] = {}
        end = start
        for node in nodes:
            t = start + self.rng.uniform(0, cc.SPREAD_S * 0.9)
            files[node] = (t + self.offset[node], f"{step}.{n}.{node}")
            self.pending.setdefault((node, step), []).append(files[node])
            self.at(t, "write", node, step)
            end = max(end, t)
        save.attempts.append(files)
        if record:
            save.record_at = (files[0][0] - self.offset[0] if self.deepspeed else end) + 0.5
            save.final = n
            self.pending[(0, -step - 1)] = [(save.record_at + self.offset[0], f"{step}.{n}.rec")]
            self.at(save.record_at, "write", 0, -step - 1)
        return end

    def schedule_job(self) -> None:
        t = 0.0
        for step in range(self.steps):
            if self.rng.random() < 0.1:  # a crashed first attempt and its re-save
                some = self.rng.sample(range(NODES), self.rng.randrange(1, NODES))
                end = self.write_attempt(step, t, some, record=False)
                # The record comes last (DCP): re-saved at once, inside any window of mtimes,
                # half the time. Where it comes first, after the gap (docs/MULTINODE.md).
                soon = not self.deepspeed and self.rng.random() < 0.5
                t = end + (self.rng.uniform(1, 30) if soon else
                           cc.GAP_S + self.rng.uniform(1, 600))
            end = self.write_attempt(step, t, list(range(NODES)), record=True)
            t = end + self.rng.uniform(1, 400)
        self.horizon = t + 20 * COMMIT_TIMEOUT + 4000
        for _ in range(self.steps // 3):  # daemon deaths and slow restarts
            node = self.rng.randrange(NODES)
            start = self.rng.uniform(0, t)
            self.at(start, "die", node, self.rng.uniform(10, 3000).__int__())

    # -- a node's daemon -----------------------------------------------------------------

    def observe(self, node: int, step: int, now: float) -> None:
        mtime, digest = self.disk[(node, step)]
        files = [cc.PartFile(f"step-{step}/__{node}_0.distcp", SIZE, mtime, digest, "xxh3",
                             "none", SIZE, "")]
        record = None
        rec = self.disk.get((0, -step - 1))
        if node == 0 and rec is not None and rec[0] >= mtime:
            files.append(cc.PartFile(f"step-{step}/.metadata", 10, rec[0], rec[1], "xxh3",
                                     "none", 10, ""))
            record = cc.CommitRecord(f"step-{step}/.metadata", rec[0],
                               {f"step-{step}/__{n}_0.distcp": SIZE for n in range(NODES)},
                               after=cc.SPREAD_S if self.deepspeed else 0.0)
        attempt = cc.attempt_id((f.path, f.size, int(f.mtime * 1e9)) for f in files)
        if self.published.get((node, step)) == attempt:
            return
        part = cc.Part(str(node), attempt, "dcp", tuple(files), record, written=now)
        if self.store.put_create_only(step, f"_parts/{part.name}.json", part):
            self.parts_by_step.setdefault(step, []).append(part)
            self.newest[step] = now
        self.published[(node, step)] = attempt
        self.mine[(node, step)] = part
        self.confirm(node, step)
        if node == 0 and record is not None and self.rng.random() < 0.02:
            self.at(now + 0.01, "die", 0, int(self.rng.uniform(60, 2000)))
        self.polls[(node, step)] = 0
        self.later(now, node, step)

    def confirm(self, node: int, step: int) -> None:
        """Having seen the coordinator's part, a node confirms its own part for that save
        when its file on disk is still the part's (else it has yet to observe a re-save)."""
        coord = cc.coordinator(self.parts_by_step.get(step, []))
        mine = self.mine.get((node, step))
        if coord is None or mine is None or coord.node == str(node):
            return
        if self.disk[(node, step)] == (mine.files[0].mtime, mine.files[0].hash):
            self.confirms.setdefault(step, {}).setdefault(coord.name, set()).add(mine.name)

    def poll(self, node: int, step: int, now: float) -> None:
        manifest = self.store.objects.get((step, "MANIFEST.json"))
        if manifest is not None:
            if not isinstance(manifest, dict):
                raise TypeError(manifest)
            if manifest["nodes"].get(str(node)) == self.published.get((node, step)):
                self.uploaded[node].add(step)
            return
        parts = self.parts_by_step.get(step, [])
        self.confirm(node, step)
        newest = self.newest.get(step, now)  # the newest part's write
        if node != 0 and now - newest < COMMIT_TIMEOUT:
            self.later(now, node, step)
            return
        plan = self.plan(step, parts)
        if cc.may_commit(plan, str(node), now, COMMIT_TIMEOUT):
            doc = {"nodes": {p.node: p.attempt for p in plan.chosen},
                   "files": {f.path: f.hash for f in plan.files}}
            if self.store.put_create_only(step, "MANIFEST.json", doc):
                self.commits += 1
            self.at(now + 0.01, "poll", node, step)
            return
        self.later(now, node, step)

    def plan(self, step: int, parts: list[cc.Part]) -> cc.Plan:
        """`choose` is pure and parts are only added: decided again only when one was."""
        confirms = self.confirms.get(step, {})
        seen = (len(parts), sum(len(v) for v in confirms.values()))
        hit = self.plans.get(step)
        if hit is None or hit[0] != seen:
            hit = (seen, cc.choose(parts, (str(n) for n in range(NODES)), confirms))
            self.plans[step] = hit
        return hit[1]

    # -- the run -------------------------------------------------------------------------

    def run(self) -> None:
        self.schedule_job()
        while self.queue:
            now, _seq, kind, node, step = heapq.heappop(self.queue)
            self.events += 1
            if kind == "write":  # the job writes whether or not the daemon lives
                self.disk[(node, step)] = self.pending[(node, step)].pop(0)
                self.at(now + self.rng.uniform(0.1, 20), "observe", node, max(step, -step - 1))
                continue
            if kind == "die":
                self.down_until[node] = max(self.down_until[node], now + step)
                continue
            if now < self.down_until[node]:  # a dead daemon acts when it is back
                self.at(self.down_until[node] + self.rng.uniform(0, 5), kind, node, step)
                continue
            if kind == "observe":
                self.observe(node, step, now)
            else:
                self.poll(node, step, now)
            self.check(node, step)

    def check(self, node: int, step: int) -> None:
        """The invariants of the step an event of `node` touched (raised plainly: this runs a
        million times, pytest's assertion rewriting would triple the test's time)."""
        if self.store.creates.get((step, "MANIFEST.json"), 0) > 1:
            raise AssertionError(f"step {step} committed twice")
        manifest = self.store.objects.get((step, "MANIFEST.json"))
        if step in self.uploaded[node] and manifest is None:  # latest / prunable: committed
            raise AssertionError(f"node {node} took step {step} as committed before its commit")
        if manifest is None or manifest is self.checked.get(step):
            return
        assert isinstance(manifest, dict)
        save = self.saves[step]
        self.checked[step] = manifest
        final = save.attempts[save.final]
        want = {f"step-{step}/__{n}_0.distcp": final[n][1] for n in range(NODES)}
        got = {p: h for p, h in manifest["files"].items() if not p.endswith(".metadata")}
        assert got == want, f"step {step}: commit mixes attempts or misses files"


def test_sixty_four_nodes_a_thousand_steps() -> None:
    sim = Sim(seed=16)
    sim.run()
    assert sim.events > 100_000
    assert sim.commits == STEPS
    for step in range(STEPS):
        assert sim.store.creates[(step, "MANIFEST.json")] == 1
        for node in range(NODES):
            assert step in sim.uploaded[node], (step, node)


def test_records_other_ranks_finish_after_deepspeed_style() -> None:
    """Rank 0 writes the record first and the other ranks finish up to SPREAD later: every
    step still commits once (without `CommitRecord.after` most would wait forever)."""
    sim = Sim(seed=17, deepspeed=True, steps=300)
    sim.run()
    assert sim.commits == 300
    assert all(sim.store.creates[(step, "MANIFEST.json")] == 1 for step in range(300))


def test_a_part_of_an_earlier_attempt_is_never_chosen() -> None:
    """The rule alone: node 1's first-attempt part fits no later save's window, so without
    its re-save's part the step is not covered, and with it only the re-save is chosen."""
    exp = {"s/a": 10, "s/b": 10}
    old = cc.Part("1", "old", "dcp", (cc.PartFile("s/b", 10, 1000.0, "h-old", "x", "none", 10,
                                                  "1.old/s/b"),))
    coord = cc.Part("0", "c", "dcp", (
        cc.PartFile("s/a", 10, 1000.0 + cc.GAP_S + 5, "h-a", "x", "none", 10, "0.c/s/a"),
        cc.PartFile("s/.metadata", 1, 1000.0 + cc.GAP_S + 6, "m", "x", "none", 1,
                    "0.c/s/.metadata")), cc.CommitRecord("s/.metadata", 1000.0 + cc.GAP_S + 6, exp))
    plan = cc.choose([old, coord], confirmed={"0.c": {"1.old"}})
    assert not plan.covered and plan.missing_nodes == ("1",)
    new = cc.Part("1", "new", "dcp", (cc.PartFile("s/b", 10, 1000.0 + cc.GAP_S + 4, "h-new", "x",
                                                  "none", 10, "1.new/s/b"),))
    plan = cc.choose([old, coord, new], confirmed={"0.c": {"1.old", "1.new"}})
    assert plan.covered and {p.name for p in plan.chosen} == {"0.c", "1.new"}
    assert not cc.may_commit(plan, "1", now=0.0, commit_timeout=60)
    assert cc.may_commit(plan, "0", now=0.0, commit_timeout=60)
    short = cc.Part("1", "short", "dcp", (cc.PartFile("s/b", 9, 1000.0 + cc.GAP_S + 4, "h",
                                                      "x", "none", 9, "1.short/s/b"),))
    assert not cc.choose([coord, short], confirmed={"0.c": {"1.short"}}).covered


def test_only_a_part_its_node_confirmed_for_the_save_is_chosen() -> None:
    """A crash and a re-save seconds apart: node 1's first-attempt part lies inside the
    re-save's window and covers the record by path and size. It is chosen only once node 1
    has confirmed it for the coordinator's save, which node 1 does only when its files are
    that part's after it saw the record; it confirms its re-save's part instead."""
    exp = {"s/a": 10, "s/b": 10}
    first = cc.Part("1", "first", "dcp", (cc.PartFile("s/b", 10, 1000.0, "h-old", "x", "none",
                                                      10, "1.first/s/b"),))
    coord = cc.Part("0", "c", "dcp", (
        cc.PartFile("s/a", 10, 1005.0, "h-a", "x", "none", 10, "0.c/s/a"),
        cc.PartFile("s/.metadata", 1, 1006.0, "m", "x", "none", 1, "0.c/s/.metadata")),
        cc.CommitRecord("s/.metadata", 1006.0, exp))
    lo, hi = cc.window(coord)
    assert lo <= 1000.0 <= hi  # the window alone cannot tell the attempts apart
    for confirmed in ({}, {"0.c": {"1.other"}}, {"0.other": {"1.first"}}):
        plan = cc.choose([first, coord], confirmed=confirmed)
        assert not plan.covered and plan.missing_nodes == ("1",), confirmed
    again = cc.Part("1", "again", "dcp", (cc.PartFile("s/b", 10, 1004.0, "h-new", "x", "none",
                                                      10, "1.again/s/b"),))
    plan = cc.choose([first, coord, again], confirmed={"0.c": {"1.again"}})
    assert plan.covered and {p.name for p in plan.chosen} == {"0.c", "1.again"}
    assert {f.hash for f in plan.files} == {"h-a", "m", "h-new"}
    assert cc.parse_confirms(["0.c/1.again", "0.c/1.first", "0.c", "x/y/z", "0.c/..",
                              "0.c/bad name.x"]) == {"0.c": frozenset({"1.again", "1.first"})}


def test_a_part_round_trips_and_bad_parts_are_refused() -> None:
    part = cc.Part("n1", "17-ab", "dcp", (cc.PartFile("s/b", 10, 5.5, "h", "x", "none", 10,
                                                      "n1.17-ab/s/b"),),
                   cc.CommitRecord("s/.metadata", 6.0, {"s/b": 10}))
    assert cc.parse_part(part.to_bytes(), "p", written=3.0) == cc.Part(
        "n1", "17-ab", "dcp", part.files, part.record, written=3.0)
    for bad in (b"{", b"[]", part.to_bytes().replace(b"n1.17-ab/s/b", b"n2.x/s/b"),
                part.to_bytes().replace(b'"s/b"', b'"../b"'),
                part.to_bytes().replace(b'"n1"', b'"a/b"')):
        try:
            cc.parse_part(bad, "p")
        except cc.BadPart:
            continue
        raise AssertionError(bad)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.text(alphabet="n0.1-_/ ab\x00é", max_size=24), max_size=20),
       st.sets(st.sampled_from(["0.c/1.first", "0.c/1.again", "0.old/1.first"]), max_size=3))
def test_any_confirmation_keys_are_parsed_or_ignored(junk: list[str], real: set[str]) -> None:
    """Any key names under `_confirms/` (a bucket anyone may write): parsed without error,
    only well-formed `<node>.<attempt>/<node>.<attempt>` pairs kept, and a part is chosen only
    when a key names it under the coordinator's part."""
    got = cc.parse_confirms([*junk, *real])
    for coord, names in got.items():
        for name in names:
            assert f"{coord}/{name}" in [*junk, *real]
            assert all(cc.valid_ids(*n.rsplit(".", 1)) for n in (coord, name))
    first = cc.Part("1", "first", "dcp", (cc.PartFile("s/b", 10, 1000.0, "h-old", "x", "none",
                                                      10, "1.first/s/b"),))
    again = cc.Part("1", "again", "dcp", (cc.PartFile("s/b", 10, 1004.0, "h-new", "x", "none",
                                                      10, "1.again/s/b"),))
    coord_part = cc.Part("0", "c", "dcp", (
        cc.PartFile("s/.metadata", 1, 1006.0, "m", "x", "none", 1, "0.c/s/.metadata"),),
        cc.CommitRecord("s/.metadata", 1006.0, {"s/b": 10}))
    plan = cc.choose([first, again, coord_part], confirmed=got)
    vouched = {n for k in [*junk, *real] if k.startswith("0.c/") for n in [k[4:]]}
    assert {p.name for p in plan.chosen[1:]} <= vouched
    assert plan.covered == bool(vouched & {"1.first", "1.again"})
