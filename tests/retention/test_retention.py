"""Retention planner: tables of cases, golden plans, randomized invariants, the documented example.

Pure function tests: no filesystem except reading golden files and docs/RETENTION.md.
Regenerate golden files with CKPTD_UPDATE_GOLDEN=1.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ckptd.cluster.coordinator import coordinates
from ckptd.config import LocalRetention, RemoteRetention
from ckptd.model import Local, Remote, State
from ckptd.retention.planner import (
    Action,
    CheckpointView,
    Disk,
    MetricMode,
    Plan,
    PlanItem,
    Tag,
    plan,
    preflight,
)
from ckptd.retention.rules import RULES
from ckptd.units import parse_duration

NOW = 1_700_000_000.0
HOUR = 3600.0
DAY = 86400.0
GiB = 1 << 30
REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "retention"
PLENTY = Disk(free_bytes=900 * GiB, total_bytes=1000 * GiB, min_free_bytes=100 * GiB)
OFF_LOCAL = LocalRetention(keep_last=0, keep_best=0)
OFF_REMOTE = RemoteRetention(keep_last=0, keep_best=0, keep_every=0, keep_within="")


def cp(step: int, **kw: Any) -> CheckpointView:
    """A valid, local-only checkpoint completed `step` seconds after an epoch a day ago."""
    base: dict[str, Any] = {
        "state": State.VALID,
        "local": Local.PRESENT,
        "remote": Remote.NONE,
        "completed": NOW - DAY + step,
        "bytes": GiB,
    }
    base.update(kw)
    return CheckpointView(step=step, **base)


def run(
    views: list[CheckpointView],
    local: LocalRetention = OFF_LOCAL,
    remote: RemoteRetention = OFF_REMOTE,
    disk: Disk = PLENTY,
    mode: MetricMode = "min",
    upload: bool = False,
) -> Plan:
    return plan(views, local, remote, disk, NOW, metric_mode=mode, upload_configured=upload)


def local_actions(p: Plan) -> dict[int, str]:
    return {i.step: str(i.local) for i in p.items}


def remote_actions(p: Plan) -> dict[int, str]:
    return {i.step: str(i.remote) for i in p.items}


def reasons(p: Plan) -> dict[int, tuple[str, ...]]:
    return {i.step: i.reasons for i in p.items}


def losses(*pairs: tuple[int, float | None]) -> list[CheckpointView]:
    return [cp(step, metric=m) for step, m in pairs]


LETTERS = {"K": "keep", "D": "delete", "C": "compress", "N": "none"}


def expand(letters: str) -> list[str]:
    """'K D C N' -> actions, so a case's expectation reads as one row."""
    return [LETTERS[a] for a in letters.split()]


# (id, checkpoints, local rules, mode, upload, expected local actions, expected reasons subset)
LocalCase = tuple[
    str, list[CheckpointView], LocalRetention, MetricMode, bool, str, dict[int, list[str]]
]
LOCAL_CASES: list[LocalCase]
LOCAL_CASES = [
    (
        "best_among_newest",
        losses((100, 3.0), (200, 2.5), (300, 2.0), (400, 1.5), (500, 1.0)),
        LocalRetention(keep_last=2, keep_best=1),
        "min",
        False,
        "D D D K K",
        {
            500: ["local:latest", "local:best", "local:keep_last=2", "local:keep_best=1"],
            400: ["local:keep_last=2"],
            100: ["local:not_kept"],
        },
    ),
    (
        "best_among_oldest",
        losses((100, 0.5), (200, 2.5), (300, 2.0), (400, 1.5), (500, 1.0)),
        LocalRetention(keep_last=2, keep_best=1),
        "min",
        False,
        "K D D K K",
        {100: ["local:best", "local:keep_best=1"], 500: ["local:latest", "local:keep_last=2"]},
    ),
    (
        "keep_best_k_beyond_the_best",
        losses((100, 0.5), (200, 0.6), (300, 0.7), (400, 1.5), (500, 1.0)),
        LocalRetention(keep_last=1, keep_best=3),
        "min",
        False,
        "K K K D K",
        {200: ["local:keep_best=3"], 300: ["local:keep_best=3"]},
    ),
    (
        "max_mode_prefers_high_metric",
        losses((100, 0.9), (200, 0.5), (300, 0.4)),
        LocalRetention(keep_last=1, keep_best=1),
        "max",
        False,
        "K D K",
        {100: ["local:best", "local:keep_best=1"]},
    ),
    (
        "min_mode_same_data",
        losses((100, 0.9), (200, 0.5), (300, 0.4)),
        LocalRetention(keep_last=1, keep_best=1),
        "min",
        False,
        "D D K",
        {300: ["local:latest", "local:best"]},
    ),
    (
        "tie_in_metric_goes_to_newer_step",
        losses((100, 1.0), (200, 1.0), (300, 2.0)),
        LocalRetention(keep_last=1, keep_best=1),
        "min",
        False,
        "D K K",
        {200: ["local:best", "local:keep_best=1"]},
    ),
    (
        "metric_missing_on_some",
        losses((100, None), (200, 1.0), (300, None), (400, 2.0)),
        LocalRetention(keep_last=1, keep_best=1),
        "min",
        False,
        "D K D K",
        {200: ["local:best"]},
    ),
    (
        "metric_missing_on_all_means_no_best",
        losses((100, None), (200, None), (300, None)),
        LocalRetention(keep_last=1, keep_best=2),
        "min",
        False,
        "D D K",
        {300: ["local:latest", "local:keep_last=1"]},
    ),
    (
        "nan_and_inf_metrics_count_as_missing",
        losses((100, float("nan")), (200, float("-inf")), (300, 2.0), (400, 3.0)),
        LocalRetention(keep_last=1, keep_best=1),
        "min",
        False,
        "D D K K",
        {300: ["local:best"]},
    ),
    (
        "all_invalid_kept_when_delete_invalid_off",
        [cp(s, state=State.INVALID) for s in (100, 200, 300)],
        LocalRetention(keep_last=1, keep_best=1),
        "min",
        False,
        "K K K",
        {100: ["local:invalid"], 300: ["local:invalid"]},
    ),
    (
        "all_invalid_deleted_when_delete_invalid_on",
        [cp(s, state=State.INVALID) for s in (100, 200, 300)],
        LocalRetention(keep_last=1, keep_best=1, delete_invalid=True),
        "min",
        False,
        "D D D",
        {100: ["local:delete_invalid"]},
    ),
    (
        "invalid_do_not_count_toward_keep_last",
        [cp(100), cp(200), cp(300, state=State.INVALID), cp(400, state=State.INVALID)],
        LocalRetention(keep_last=2, keep_best=0, delete_invalid=True),
        "min",
        False,
        "K K D D",
        {100: ["local:keep_last=2"], 200: ["local:latest"]},
    ),
    (
        "invalid_pinned_survives_delete_invalid",
        [cp(100, state=State.INVALID, pinned=True), cp(200)],
        LocalRetention(keep_last=1, delete_invalid=True),
        "min",
        False,
        "K K",
        {100: ["local:pinned"]},
    ),
    (
        "pending_and_complete_always_kept_and_not_counted",
        [cp(100), cp(200), cp(300, state=State.COMPLETE), cp(400, state=State.PENDING)],
        LocalRetention(keep_last=1, keep_best=0),
        "min",
        False,
        "D K K K",
        {200: ["local:latest"], 300: ["local:pending"], 400: ["local:pending"]},
    ),
    (
        "pins",
        [cp(100, pinned=True), cp(200), cp(300, pinned=True), cp(400)],
        LocalRetention(keep_last=1, keep_best=0),
        "min",
        False,
        "K D K K",
        {100: ["local:pinned"], 300: ["local:pinned"]},
    ),
    (
        "in_use_kept",
        [cp(100, in_use=True), cp(200), cp(300)],
        LocalRetention(keep_last=1, keep_best=0),
        "min",
        False,
        "K D K",
        {100: ["local:in_use"]},
    ),
    (
        "keep_every_with_gaps_in_steps",
        [cp(s) for s in (900, 1000, 1100, 1900, 2100, 3000, 3100)],
        LocalRetention(keep_last=1, keep_best=0, keep_every=1000),
        "min",
        False,
        "D K D D D K K",
        {1000: ["local:keep_every=1000"], 3000: ["local:keep_every=1000"]},
    ),
    (
        "keep_every_zero_is_off",
        [cp(0), cp(1000), cp(2000)],
        LocalRetention(keep_last=1, keep_best=0, keep_every=0),
        "min",
        False,
        "D D K",
        {},
    ),
    (
        "keep_within_exact_edge_kept_just_outside_deleted",
        [
            cp(100, completed=NOW - DAY - 1),
            cp(200, completed=NOW - DAY),
            cp(300, completed=NOW - DAY + 1),
            cp(400, completed=NOW + 5),  # a clock ahead of ours: still recent
        ],
        LocalRetention(keep_last=0, keep_best=0, keep_within="1d"),
        "min",
        False,
        "D K K K",
        {100: ["local:not_kept"], 200: ["local:keep_within=1d"], 400: ["local:latest"]},
    ),
    (
        "upload_configured_keeps_not_uploaded",
        [
            cp(100, remote=Remote.UPLOADED),
            cp(200, remote=Remote.UPLOADING),
            cp(300, remote=Remote.NONE),
            cp(400, remote=Remote.PRUNED),
            cp(500, remote=Remote.UPLOADED),
        ],
        LocalRetention(keep_last=1, keep_best=0),
        "min",
        True,
        "D K K K K",
        {200: ["local:not_uploaded"], 300: ["local:not_uploaded"], 400: ["local:not_uploaded"]},
    ),
    (
        "upload_not_configured_ignores_remote_state",
        [cp(100), cp(200, remote=Remote.NONE), cp(300)],
        LocalRetention(keep_last=1, keep_best=0),
        "min",
        False,
        "D D K",
        {100: ["local:not_kept"]},
    ),
    (
        "invalid_never_held_by_not_uploaded",
        [cp(100, state=State.INVALID), cp(200)],
        LocalRetention(keep_last=1, delete_invalid=True),
        "min",
        True,
        "D K",
        {100: ["local:delete_invalid"], 200: ["local:not_uploaded"]},
    ),
    (
        "compress_older",
        [
            cp(1000, metric=0.5),
            cp(2000, metric=1.0),
            cp(2500, metric=1.2),
            cp(3000, metric=1.1, local=Local.COMPRESSED),
            cp(3500, metric=1.3, in_use=True),
            cp(3600, metric=1.4, pinned=True),
            cp(3700, metric=1.5),
            cp(3800, metric=1.6),
        ],
        LocalRetention(keep_last=2, keep_best=1, keep_every=1000, compress_older=True),
        "min",
        False,
        "C C D K K C K K",
        {
            1000: ["local:best", "local:keep_best=1", "local:keep_every=1000"],
            2000: ["local:keep_every=1000", "local:compress_older"],
            3000: ["local:keep_every=1000"],
            3500: ["local:in_use"],
            3600: ["local:pinned", "local:compress_older"],
            3800: ["local:latest"],
        },
    ),
    (
        "compress_older_never_touches_latest_or_invalid_or_pending",
        [
            cp(100, state=State.INVALID),
            cp(200, state=State.PENDING),
            cp(300),
        ],
        LocalRetention(keep_last=0, keep_best=0, compress_older=True),
        "min",
        False,
        "K K K",
        {300: ["local:latest"]},
    ),
    (
        "root_latest_remote_only_keeps_newest_local_as_tier_latest",
        [cp(100), cp(200), cp(300, local=Local.PRUNED, remote=Remote.UPLOADED)],
        LocalRetention(keep_last=0, keep_best=0),
        "min",
        False,
        "D K N",
        {200: ["local:latest"]},
    ),
]


@pytest.mark.parametrize(
    "views,rules,mode,upload,expected,why",
    [c[1:] for c in LOCAL_CASES],
    ids=[c[0] for c in LOCAL_CASES],
)
def test_local_rules(
    views: list[CheckpointView],
    rules: LocalRetention,
    mode: MetricMode,
    upload: bool,
    expected: str,
    why: dict[int, list[str]],
) -> None:
    p = run(views, local=rules, mode=mode, upload=upload)
    assert local_actions(p) == dict(
        zip(sorted(v.step for v in views), expand(expected), strict=True)
    )
    for step, expected_reasons in why.items():
        assert set(expected_reasons) <= set(reasons(p)[step]), (step, reasons(p)[step])


# (id, checkpoints, local rules, remote rules, expected local, expected remote, reasons subset)
TIER_CASES: list[
    tuple[str, list[CheckpointView], LocalRetention, RemoteRetention, str, str,
          dict[int, list[str]]]
]
TIER_CASES = [
    (
        "remote_rules_independent_from_local",
        [cp(s, remote=Remote.UPLOADED, metric=float(10 - s // 100)) for s in range(100, 600, 100)],
        LocalRetention(keep_last=1, keep_best=0),
        RemoteRetention(keep_last=3, keep_best=0, keep_every=0, keep_within=""),
        "D D D D K",
        "D D K K K",
        {
            300: ["local:not_kept", "remote:keep_last=3"],
            500: ["local:latest", "local:best", "remote:latest", "remote:best"],
        },
    ),
    (
        "remote_counts_only_uploaded",
        [
            cp(100, remote=Remote.UPLOADED),
            cp(200, remote=Remote.UPLOADED),
            cp(300, remote=Remote.UPLOADING),
            cp(400, remote=Remote.NONE),
        ],
        LocalRetention(keep_last=4, keep_best=0),
        RemoteRetention(keep_last=1, keep_best=0, keep_every=0, keep_within=""),
        "K K K K",
        "D K N N",
        {200: ["remote:latest", "remote:keep_last=1"], 300: ["remote:uploading"]},
    ),
    (
        "remote_never_deletes_latest_or_pinned_with_rules_off",
        [
            cp(100, remote=Remote.UPLOADED, pinned=True, local=Local.PRUNED),
            cp(200, remote=Remote.UPLOADED, local=Local.PRUNED),
            cp(300, remote=Remote.UPLOADED),
            cp(400),
        ],
        LocalRetention(keep_last=1, keep_best=0),
        OFF_REMOTE,
        "N N D K",
        "K D K N",
        {100: ["remote:pinned"], 300: ["remote:latest", "local:not_kept"]},
    ),
    (
        "remote_rules_keep_every_and_within",
        [
            cp(1000, remote=Remote.UPLOADED, local=Local.PRUNED, completed=NOW - 40 * DAY),
            cp(1500, remote=Remote.UPLOADED, local=Local.PRUNED, completed=NOW - 40 * DAY),
            cp(2500, remote=Remote.UPLOADED, local=Local.PRUNED, completed=NOW - 29 * DAY),
            cp(3000, remote=Remote.UPLOADED, local=Local.PRUNED, completed=NOW - 1 * DAY),
        ],
        OFF_LOCAL,
        RemoteRetention(keep_last=0, keep_best=0, keep_every=1000, keep_within="30d"),
        "N N N N",
        "K D K K",
        {1000: ["remote:keep_every=1000"], 2500: ["remote:keep_within=30d"]},
    ),
    (
        "remote_keep_best_and_in_use",
        [
            cp(100, remote=Remote.UPLOADED, metric=0.1, local=Local.PRUNED),
            cp(200, remote=Remote.UPLOADED, metric=0.9, local=Local.PRUNED, in_use=True),
            cp(300, remote=Remote.UPLOADED, metric=0.2, local=Local.PRUNED),
            cp(400, remote=Remote.UPLOADED, metric=0.8),
        ],
        LocalRetention(keep_last=1, keep_best=0),
        RemoteRetention(keep_last=0, keep_best=2, keep_every=0, keep_within=""),
        "N N N K",
        "K K K K",
        {
            100: ["remote:best", "remote:keep_best=2"],
            200: ["remote:in_use"],
            300: ["remote:keep_best=2"],
        },
    ),
    (
        "remote_invalid_copy_is_kept_for_a_human",
        [cp(100, remote=Remote.UPLOADED, state=State.INVALID), cp(200, remote=Remote.UPLOADED)],
        LocalRetention(keep_last=1, keep_best=0, delete_invalid=True),
        OFF_REMOTE,
        "D K",
        "K K",
        {100: ["local:delete_invalid", "remote:invalid"]},
    ),
]


@pytest.mark.parametrize(
    "views,local,remote,want_local,want_remote,why",
    [c[1:] for c in TIER_CASES],
    ids=[c[0] for c in TIER_CASES],
)
def test_tiers(
    views: list[CheckpointView],
    local: LocalRetention,
    remote: RemoteRetention,
    want_local: str,
    want_remote: str,
    why: dict[int, list[str]],
) -> None:
    p = run(views, local=local, remote=remote)
    steps = sorted(v.step for v in views)
    assert list(local_actions(p).values()) == expand(want_local)
    assert list(remote_actions(p).values()) == expand(want_remote)
    assert [i.step for i in p.items] == steps
    for step, expected_reasons in why.items():
        assert set(expected_reasons) <= set(reasons(p)[step]), (step, reasons(p)[step])


def test_checkpoints_with_no_copy_are_left_out() -> None:
    views = [
        cp(100, local=Local.PRUNED, remote=Remote.PRUNED),
        cp(200, local=Local.PRUNED),
        cp(300),
    ]
    assert [i.step for i in run(views).items] == [300]


def disk(free: int, minimum: int) -> Disk:
    return Disk(free_bytes=free * GiB, total_bytes=1000 * GiB, min_free_bytes=minimum * GiB)


KEEP_ALL = LocalRetention(keep_last=10, keep_best=0)

# (id, checkpoints (bytes in GiB), rules, disk, upload, expected local, min_free_unmet, shortfall)
MIN_FREE_CASES: list[tuple[str, list[CheckpointView], LocalRetention, Disk, bool, str, bool, int]]
MIN_FREE_CASES = [
    (
        "frees_oldest_first_and_stops_when_enough",
        [cp(s, bytes=10 * GiB) for s in (100, 200, 300, 400, 500)],
        KEEP_ALL,
        disk(5, 25),
        False,
        "D D K K K",
        False,
        0,
    ),
    (
        "stops_exactly_at_threshold",
        [cp(s, bytes=10 * GiB) for s in (100, 200, 300, 400)],
        KEEP_ALL,
        disk(5, 15),
        False,
        "D K K K",
        False,
        0,
    ),
    (
        "no_pressure_at_exact_threshold",
        [cp(s, bytes=10 * GiB) for s in (100, 200, 300)],
        KEEP_ALL,
        disk(15, 15),
        False,
        "K K K",
        False,
        0,
    ),
    (
        "planned_deletes_count_first",
        [cp(s, bytes=10 * GiB) for s in (100, 200, 300, 400)],
        LocalRetention(keep_last=2, keep_best=0),
        disk(5, 20),
        False,
        "D D K K",
        False,
        0,
    ),
    (
        "invalid_kept_ones_go_first",
        [cp(100), cp(200), cp(300, state=State.INVALID, bytes=3 * GiB), cp(400)],
        KEEP_ALL,
        disk(1, 3),
        False,
        "K K D K",
        False,
        0,
    ),
    (
        "overrides_keep_rules_but_not_the_best",
        [
            cp(1000, bytes=10 * GiB, metric=0.1),
            cp(1100, bytes=10 * GiB, metric=0.5, completed=NOW),
            cp(2000, bytes=10 * GiB, metric=0.6),
            cp(2100, bytes=10 * GiB, metric=0.7),
        ],
        LocalRetention(keep_last=3, keep_best=2, keep_every=1000, keep_within="1d"),
        disk(0, 15),
        False,
        "K D D K",
        False,
        0,
    ),
    (
        "nothing_deletable",
        [
            cp(100, pinned=True),
            cp(200, in_use=True),
            cp(300, metric=0.1),
            cp(400, state=State.PENDING),
            cp(500, remote=Remote.UPLOADING),
            cp(600),
        ],
        KEEP_ALL,
        disk(1, 10),
        True,
        "K K K K K K",
        True,
        9,
    ),
    (
        "partly_met",
        [cp(100, remote=Remote.UPLOADED, bytes=2 * GiB), cp(200), cp(300)],
        KEEP_ALL,
        disk(1, 10),
        True,
        "D K K",
        True,
        7,
    ),
]


@pytest.mark.parametrize(
    "views,rules,dsk,upload,expected,unmet,shortfall",
    [c[1:] for c in MIN_FREE_CASES],
    ids=[c[0] for c in MIN_FREE_CASES],
)
def test_min_free(
    views: list[CheckpointView],
    rules: LocalRetention,
    dsk: Disk,
    upload: bool,
    expected: str,
    unmet: bool,
    shortfall: int,
) -> None:
    p = run(views, local=rules, disk=dsk, upload=upload)
    assert list(local_actions(p).values()) == expand(expected)
    assert p.min_free_unmet is unmet
    assert p.shortfall_bytes == shortfall * GiB
    assert p.notes == ((f"local:min_free_unmet={shortfall * GiB}",) if unmet else ())


def test_min_free_reason_and_reclaimable() -> None:
    views = [cp(s, bytes=10 * GiB) for s in (100, 200, 300, 400)]
    p = run(views, local=LocalRetention(keep_last=3, keep_best=0), disk=disk(5, 25))
    assert reasons(p)[100] == ("local:not_kept",)
    assert reasons(p)[200] == ("local:min_free",)
    assert p.freed_bytes == 20 * GiB
    # 300 could still go under pressure; 400 is the latest and never can.
    assert p.reclaimable_bytes == 30 * GiB


def test_preflight_estimates_from_largest_recent_save() -> None:
    d = disk(50, 10)
    got = preflight([100 * GiB, 20 * GiB, 30 * GiB, 25 * GiB, 20 * GiB, 35 * GiB, 30 * GiB], d, 0)
    assert got.next_save_estimate == 35 * GiB  # the 100 GiB save is older than the window
    assert got.projected_free == 15 * GiB
    assert got.ok


@pytest.mark.parametrize(
    "sizes,free,reclaimable,ok",
    [([40], 50, 0, True), ([41], 50, 0, False), ([41], 50, 1, True), ([], 9, 0, False)],
)
def test_preflight_threshold(sizes: list[int], free: int, reclaimable: int, ok: bool) -> None:
    got = preflight([s * GiB for s in sizes], disk(free, 10), reclaimable * GiB)
    assert got.ok is ok
    assert got.projected_free == (free + reclaimable - max(sizes, default=0)) * GiB
    assert ("under min_free" in got.message) is not ok


def test_as_json_matches_spec_shape() -> None:
    p = run([cp(100), cp(200, remote=Remote.UPLOADED)],
            local=LocalRetention(keep_last=1, keep_best=0))
    doc = p.as_json("llm-7b")
    assert json.loads(json.dumps(doc)) == doc
    assert list(doc) == ["root", "plan"]
    assert doc["root"] == "llm-7b"
    assert doc["plan"] == [
        {"step": 100, "local": "delete", "remote": "none", "reasons": ["local:not_kept"]},
        {
            "step": 200,
            "local": "keep",
            "remote": "keep",
            "reasons": ["local:latest", "local:keep_last=1", "remote:latest"],
        },
    ]


def test_steps_lists_executor_work() -> None:
    p = run([cp(100), cp(200), cp(300)], local=LocalRetention(keep_last=1, keep_best=0))
    assert p.steps("local", Action.DELETE) == (100, 200)
    assert p.steps("local", Action.KEEP) == (300,)
    assert p.steps("remote", Action.NONE) == (100, 200, 300)


@pytest.mark.parametrize(
    "seconds,text",
    [(DAY, "1d"), (24 * HOUR, "1d"), (36 * HOUR, "1d12h"), (90.0, "1m30s"), (1.5, "1s500ms")],
)
def test_keep_within_value_reads_like_config(seconds: float, text: str) -> None:
    config = f"{round(seconds * 1000)}ms"  # the same rule, written another way
    local = LocalRetention(keep_last=0, keep_best=0, keep_within=config)
    assert local.keep_within == seconds
    p = run([cp(1, completed=NOW)], local=local)
    assert f"local:keep_within={text}" in reasons(p)[1]
    assert parse_duration(text) == seconds  # config reads it back as the same rule


@pytest.mark.parametrize("committed_only,expected", [
    # One node: the newest valid copy is latest, the best loss is best.
    (False, {100: ("local:not_kept",),
             200: ("local:not_kept", "remote:latest"),
             300: ("local:latest", "local:best", "local:keep_last=1")}),
    # Multi-node: only committed steps are latest or best (the store's answer, the same
    # function), so the newest committed copy is protected locally as the executor's net is.
    (True, {100: ("local:not_kept",),
            200: ("local:latest", "local:best", "remote:latest", "remote:best"),
            300: ("local:keep_last=1",)}),
])
def test_a_multi_node_roots_latest_and_best_are_committed_steps(
        committed_only: bool, expected: dict[int, tuple[str, ...]]) -> None:
    views = [cp(100, metric=0.3), cp(200, metric=0.2, remote=Remote.UPLOADED),
             cp(300, metric=0.1)]
    p = plan(views, LocalRetention(keep_last=1, keep_best=0), OFF_REMOTE, PLENTY, NOW,
             committed_only=committed_only)
    assert reasons(p) == expected


def test_bad_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        run([cp(1), cp(1)])
    with pytest.raises(ValueError, match="metric_mode"):
        run([cp(1)], mode="median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        LocalRetention(keep_last=-1)  # the config's own check: a count is never negative
    with pytest.raises(ValueError, match="negative"):
        Disk(free_bytes=-1, total_bytes=1, min_free_bytes=0)


def test_input_order_does_not_matter() -> None:
    views = [cp(s, metric=float(s % 7)) for s in range(100, 2000, 100)]
    rules = LocalRetention(keep_last=3, keep_best=2, keep_every=500)
    shuffled = views[:]
    random.Random(3).shuffle(shuffled)
    assert run(views, local=rules) == run(shuffled, local=rules)


# ---------------------------------------------------------------- golden scenarios


def long_run() -> tuple[list[CheckpointView], dict[str, Any]]:
    """40 saves every 500 steps, an hour apart; SPEC default rules; older ones only remote."""
    rng = random.Random(7)
    views = []
    for i in range(40):
        step = 500 * (i + 1)
        loss = 3.0 * 0.97**i + rng.uniform(-0.08, 0.08)
        views.append(
            cp(
                step,
                completed=NOW - (40 - i) * 20 * HOUR,
                metric=round(loss, 3),
                local=Local.PRESENT if i >= 34 else Local.PRUNED,
                remote=Remote.UPLOADED
                if i < 38
                else (Remote.UPLOADING if i == 38 else Remote.NONE),
                pinned=step == 5000,
            )
        )
    return views, {"local": LocalRetention(), "remote": RemoteRetention(), "upload": True}


def disk_pressure() -> tuple[list[CheckpointView], dict[str, Any]]:
    """A full disk: min_free must pick the oldest unprotected copies, compress_older is on."""
    views = [
        cp(1000, bytes=40 * GiB, metric=1.2, remote=Remote.UPLOADED, completed=NOW - 50 * HOUR),
        cp(2000, bytes=40 * GiB, metric=0.9, remote=Remote.UPLOADED, completed=NOW - 40 * HOUR),
        cp(2500, bytes=5 * GiB, state=State.INVALID, completed=NOW - 35 * HOUR),
        cp(3000, bytes=40 * GiB, metric=1.0, remote=Remote.UPLOADED, pinned=True),
        cp(4000, bytes=40 * GiB, metric=1.1, remote=Remote.UPLOADED, completed=NOW - 20 * HOUR),
        cp(5000, bytes=40 * GiB, metric=0.95, remote=Remote.UPLOADED, in_use=True),
        cp(6000, bytes=40 * GiB, metric=1.05, remote=Remote.UPLOADED, completed=NOW - 2 * HOUR),
        cp(7000, bytes=40 * GiB, metric=1.0, remote=Remote.UPLOADING, completed=NOW - 1 * HOUR),
        cp(8000, bytes=40 * GiB, state=State.PENDING, completed=NOW),
    ]
    return views, {
        "local": LocalRetention(
            keep_last=3, keep_best=2, keep_every=2000, keep_within="1d", compress_older=True
        ),
        "remote": RemoteRetention(keep_last=3, keep_best=1, keep_every=0, keep_within=""),
        "disk": disk(10, 100),
        "upload": True,
    }


def stuck_disk() -> tuple[list[CheckpointView], dict[str, Any]]:
    """Uploads are stalled and the disk is full: nothing may go, the plan says min_free is unmet."""
    views = [cp(s * 1000, bytes=30 * GiB, metric=2.0 - s / 10) for s in range(1, 7)]
    views[1] = replace(views[1], remote=Remote.UPLOADED)
    views[4] = replace(views[4], pinned=True)
    return views, {"local": LocalRetention(keep_last=1), "disk": disk(2, 50), "upload": True}


def no_metric_no_upload() -> tuple[list[CheckpointView], dict[str, Any]]:
    """A root without metric or upload: count rules, invalid and unvalidated checkpoints."""
    states = [State.VALID] * 6 + [State.INVALID, State.VALID, State.COMPLETE, State.PENDING]
    views = [
        cp(100 * (i + 1), state=st, completed=NOW - (10 - i) * HOUR) for i, st in enumerate(states)
    ]
    views[2] = replace(views[2], local=Local.COMPRESSED, bytes=GiB // 3)
    views[3] = replace(views[3], state=State.INVALID)
    rules = LocalRetention(keep_last=2, keep_every=200, keep_within="4h", compress_older=True)
    return views, {"local": rules, "remote": OFF_REMOTE}


def copies(compress_older: bool) -> tuple[list[CheckpointView], dict[str, Any]]:
    """Local compressed copies beside their originals (made for the upload and for
    compress_older): released once neither needs them, deleted with their checkpoint."""
    views = [
        cp(100, copy=True, remote=Remote.UPLOADED),  # not kept locally: goes with the local copy
        cp(200, copy=True, remote=Remote.UPLOADED, pinned=True),  # kept; upload done
        cp(300, copy=True, remote=Remote.UPLOADED, in_use=True),
        cp(400, local=Local.COMPRESSED, copy=True, remote=Remote.UPLOADED),  # the copy IS local
        cp(500, copy=True, remote=Remote.UPLOADED),
        cp(600, copy=True, remote=Remote.UPLOADING),  # the upload still needs it
        cp(700, copy=True, remote=Remote.NONE),
        cp(800, remote=Remote.UPLOADED),  # no copy: no copy decision
    ]
    local = LocalRetention(keep_last=4, keep_best=0, compress_older=compress_older)
    return views, {"local": local, "remote": RemoteRetention(keep_last=10), "upload": True}


SCENARIOS = {
    "copies_released": lambda: copies(False),
    "copies_compress_older": lambda: copies(True),
    "long_run": long_run,
    "disk_pressure": disk_pressure,
    "stuck_disk": stuck_disk,
    "no_metric_no_upload": no_metric_no_upload,
}


def scenario_plan(name: str) -> Plan:
    views, opts = SCENARIOS[name]()
    return run(
        views,
        local=opts.get("local", LocalRetention()),
        remote=opts.get("remote", RemoteRetention()),
        disk=opts.get("disk", PLENTY),
        mode=opts.get("mode", "min"),
        upload=opts.get("upload", False),
    )


def dump_plan(doc: dict[str, Any]) -> str:
    """One item per line, so a changed decision shows up as a one-line diff."""
    items = ",\n".join("  " + json.dumps(item) for item in doc["plan"])
    return f'{{"root": {json.dumps(doc["root"])}, "plan": [\n{items}\n]}}\n'


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_golden(name: str) -> None:
    doc = scenario_plan(name).as_json(name)
    path = GOLDEN / f"{name}.json"
    if os.environ.get("CKPTD_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dump_plan(doc))
    assert json.loads(path.read_text()) == doc, (
        f"plan changed; CKPTD_UPDATE_GOLDEN=1 rewrites {path}"
    )


def test_golden_scenarios_exercise_what_they_claim() -> None:
    assert scenario_plan("stuck_disk").min_free_unmet
    pressure = scenario_plan("disk_pressure")
    assert not pressure.min_free_unmet
    assert any("local:min_free" in i.reasons for i in pressure.items)
    assert Action.COMPRESS in {i.local for i in scenario_plan("no_metric_no_upload").items}
    released = {i.step: (i.copy, i.reasons) for i in scenario_plan("copies_released").items}
    assert released[100][0] is Action.DELETE and "copy:with_local" in released[100][1]
    assert released[500][0] is Action.DELETE and "copy:released" in released[500][1]
    assert released[600][0] is Action.KEEP and "copy:not_uploaded" in released[600][1]
    assert released[400][0] is Action.NONE and released[800][0] is Action.NONE
    kept = {i.step: i.copy for i in scenario_plan("copies_compress_older").items}
    assert kept[500] is Action.KEEP and kept[100] is Action.DELETE


# ---------------------------------------------------------------- randomized invariants


def random_case(rng: random.Random) -> dict[str, Any]:
    steps = sorted(rng.sample(range(0, 5000, 10), rng.randint(0, 25)))
    views = [
        CheckpointView(
            step=s,
            state=rng.choice([State.VALID] * 6 + [State.INVALID, State.PENDING, State.COMPLETE]),
            local=rng.choice([Local.PRESENT, Local.PRESENT, Local.COMPRESSED, Local.PRUNED]),
            remote=rng.choice(list(Remote)),
            completed=NOW - rng.uniform(-HOUR, 10 * DAY),
            bytes=rng.randint(0, 20) * GiB,
            metric=rng.choice([None, float(rng.randint(0, 9)), rng.random()]),
            pinned=rng.random() < 0.1,
            in_use=rng.random() < 0.1,
            copy=rng.random() < 0.5,
        )
        for s in steps
    ]
    local = LocalRetention(
        keep_last=rng.randint(0, 4),
        keep_best=rng.randint(0, 3),
        keep_every=rng.choice([0, 100, 500]),
        keep_within=rng.choice(["", "1d", "3d"]),
        compress_older=rng.random() < 0.5,
        delete_invalid=rng.random() < 0.5,
    )
    remote = RemoteRetention(
        keep_last=rng.randint(0, 4),
        keep_best=rng.randint(0, 3),
        keep_every=rng.choice([0, 1000]),
        keep_within=rng.choice(["", "5d"]),
    )
    d = disk(rng.randint(0, 60), rng.randint(0, 60))
    return {
        "views": views,
        "local": local,
        "remote": remote,
        "disk": d,
        "mode": rng.choice(["min", "max"]),
        "upload": rng.random() < 0.5,
    }


def expected_best(views: list[CheckpointView], mode: str) -> int | None:
    sign = 1 if mode == "min" else -1
    scored = [
        (sign * v.metric, -v.step)
        for v in views
        if v.state is State.VALID
        and v.metric is not None
        and (v.local is not Local.PRUNED or v.remote is Remote.UPLOADED)
    ]
    return -min(scored)[1] if scored else None


def newest_valid(views: list[CheckpointView]) -> int | None:
    return max((v.step for v in views if v.state is State.VALID), default=None)


def check_invariants(case: dict[str, Any], p: Plan) -> None:
    views: list[CheckpointView] = case["views"]
    by_step = {v.step: v for v in views}
    items: dict[int, PlanItem] = {i.step: i for i in p.items}
    assert list(items) == sorted(items)
    on_disk = [v for v in views if v.local is not Local.PRUNED]
    uploaded = [v for v in views if v.remote is Remote.UPLOADED]
    assert set(items) == {
        v.step
        for v in views
        if v.local is not Local.PRUNED or v.remote in (Remote.UPLOADED, Remote.UPLOADING)
    }
    for i in p.items:
        v = by_step[i.step]
        assert i.reasons, i
        for r in i.reasons:
            tier, _, rest = r.partition(":")
            tag = rest.partition("=")[0]
            assert tier in ("local", "remote", "copy") and tag in {*Tag, *RULES}, r
        assert (i.local is Action.NONE) == (v.local is Local.PRUNED)
        assert (i.remote is Action.NONE) == (v.remote is not Remote.UPLOADED)
        assert i.remote is not Action.COMPRESS
        assert i.local is not Action.COMPRESS or v.local is Local.PRESENT
        if v.pinned or v.in_use or v.step == expected_best(views, case["mode"]):
            assert Action.DELETE not in (i.local, i.remote), i
        if v.in_use or v.state is not State.VALID:
            assert i.local is not Action.COMPRESS, i
        if v.state in (State.PENDING, State.COMPLETE):
            assert i.local is not Action.DELETE, i
        if case["upload"] and v.state is State.VALID and v.remote is not Remote.UPLOADED:
            assert i.local is not Action.DELETE, i
        # The copy beside the originals: released only once the upload is done, compress_older
        # does not want it and no reader holds it; always deleted with its local copy.
        assert (i.copy is Action.NONE) == (not v.copy or v.local is not Local.PRESENT
                                           and v.local is not Local.PRUNED)
        if i.copy is Action.DELETE and i.local is not Action.DELETE and v.local is Local.PRESENT:
            assert v.remote is Remote.UPLOADED and not v.in_use, i
            assert not case["local"].compress_older, i
        if v.copy and v.local is Local.PRESENT and i.local is Action.DELETE:
            assert i.copy is Action.DELETE, i
    for tier_views, tier in ((on_disk, "local"), (uploaded, "remote")):
        latest = newest_valid(tier_views)
        if latest is not None:
            assert getattr(items[latest], tier) in (Action.KEEP,), (tier, items[latest])
    root_latest = newest_valid(on_disk + uploaded)
    if root_latest is not None:
        assert Action.DELETE not in (items[root_latest].local, items[root_latest].remote)
    check_min_free(case, p, by_step)


def check_min_free(case: dict[str, Any], p: Plan, by_step: dict[int, CheckpointView]) -> None:
    d: Disk = case["disk"]
    by_min_free = [i.step for i in p.items if "local:min_free" in i.reasons]
    deleted = sum(by_step[i.step].bytes for i in p.items if i.local is Action.DELETE)
    assert p.freed_bytes == deleted
    if d.free_bytes >= d.min_free_bytes:
        assert not by_min_free and not p.min_free_unmet
        return
    assert p.min_free_unmet == (d.free_bytes + deleted < d.min_free_bytes)
    assert p.shortfall_bytes == max(0, d.min_free_bytes - d.free_bytes - deleted)
    if by_min_free:
        # The documented order: invalid first, then oldest. Without the last one, still short.
        order = sorted(by_min_free, key=lambda s: (by_step[s].state is not State.INVALID, s))
        assert d.free_bytes + deleted - by_step[order[-1]].bytes < d.min_free_bytes


@pytest.mark.parametrize("seed", range(20))
def test_random_plans_hold_invariants(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        case = random_case(rng)
        p = run(
            case["views"], case["local"], case["remote"], case["disk"], case["mode"], case["upload"]
        )
        check_invariants(case, p)


# ---------------------------------------------------------------- the documented example


def doc_example() -> tuple[list[CheckpointView], Plan]:
    """The worked example of docs/RETENTION.md; the test below keeps the table honest."""
    rows = [
        (250, State.VALID, Local.PRUNED, Remote.UPLOADED, 2.90, False),
        (500, State.VALID, Local.PRUNED, Remote.UPLOADED, 2.50, True),
        (750, State.VALID, Local.PRESENT, Remote.UPLOADED, 2.10, False),
        (1000, State.VALID, Local.PRESENT, Remote.UPLOADED, 1.80, False),
        (1250, State.INVALID, Local.PRESENT, Remote.NONE, None, False),
        (1500, State.VALID, Local.PRESENT, Remote.UPLOADED, 1.95, False),
        (1750, State.VALID, Local.PRESENT, Remote.UPLOADED, 1.90, False),
        (2000, State.VALID, Local.PRESENT, Remote.UPLOADING, 1.85, False),
        (2250, State.PENDING, Local.PRESENT, Remote.NONE, None, False),
    ]
    views = [
        cp(s, state=st, local=lo, remote=re, metric=m, pinned=pin) for s, st, lo, re, m, pin in rows
    ]
    p = run(
        views,
        local=LocalRetention(keep_last=2, keep_best=1, delete_invalid=True),
        remote=RemoteRetention(keep_last=2, keep_best=1, keep_every=1000, keep_within=""),
        upload=True,
    )
    return views, p


def render_table(views: list[CheckpointView], p: Plan) -> str:
    lines = [
        "| step | state | local | remote | val_loss | pinned | → local | → remote | reasons |",
        "|---:|---|---|---|---:|---|---|---|---|",
    ]
    for v, i in zip(views, p.items, strict=True):
        metric = "" if v.metric is None else f"{v.metric:.2f}"
        why = ", ".join(f"`{r}`" for r in i.reasons)
        lines.append(
            f"| {v.step} | {v.state} | {v.local} | {v.remote} | {metric} | "
            f"{'yes' if v.pinned else ''} | **{i.local}** | **{i.remote}** | {why} |"
        )
    return "\n".join(lines)


def test_docs_example_table_matches_planner() -> None:
    views, p = doc_example()
    table = render_table(views, p)
    assert table in (REPO / "docs" / "RETENTION.md").read_text(), "docs/RETENTION.md:\n" + table


@pytest.mark.parametrize(("node", "nodes", "expected"), [
    ("n0", (("n0", "a1", "record.json"), ("n1", "b1", "")), True),  # n0 holds the record
    ("n1", (("n0", "a1", "record.json"), ("n1", "b1", "")), False),
    ("n2", (("n0", "a1", "record.json"),), False),  # not among the step's nodes
    ("n0", (("n0", "a1", ""), ("n1", "b1", "")), False),  # no commit record: nobody
    ("n0", (), False),  # a single-node manifest names no nodes
])
def test_only_the_newest_commits_coordinator_deletes_remotely(
        node: str, nodes: tuple[tuple[str, str, str], ...], expected: bool) -> None:
    assert coordinates(node, nodes) is expected

