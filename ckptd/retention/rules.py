"""The keep rules: each one registered once, under the name of its setting in
`[roots.retention.local]` / `[roots.retention.remote]` (`ckptd.config.schema`'s
`LocalRetention` / `RemoteRetention`), and applied by the planner to every tier whose table has
that setting, in the order they are registered here (the order of a plan's reasons).

A rule is `(valid copies of one tier, tier, setting, context) -> the copies it keeps`; its reason
is `<name>=<setting>` (the setting as the config reads it). A setting of None is off and the
rule is not asked; a count of 0 keeps nothing. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ckptd import units
from ckptd.errors import BadValue
from ckptd.lifecycle import answers
from ckptd.model import MetricMode, Tier


class Kept(answers.Facts, Protocol):
    """What a rule reads of a copy (the planner's `CheckpointView`)."""

    @property
    def completed(self) -> float: ...

    @property
    def metric(self) -> float | None: ...


@dataclass(frozen=True)
class Context:
    """What a plan knows beside the copies: the time, the metric's direction, the root's best
    step and whether only committed steps count (a multi-node root)."""

    now: float
    mode: MetricMode
    best: int | None
    committed_only: bool


KeepFn = Callable[[Sequence[Kept], Tier, Any, Context], Iterable[Kept]]


@dataclass(frozen=True)
class KeepRule:
    name: str
    keeps: KeepFn
    show: Callable[[Any], str]

    def reason(self, value: Any) -> str:
        return f"{self.name}={self.show(value)}"


RULES: dict[str, KeepRule] = {}


def keep_rule(name: str, show: Callable[[Any], str] = str) -> Callable[[KeepFn], KeepFn]:
    """Register a keep rule for the setting `name`; `show` writes its value in the reason."""

    def register(fn: KeepFn) -> KeepFn:
        if name in RULES:
            raise BadValue(f"keep rule {name!r} is already registered")
        RULES[name] = KeepRule(name, fn, show)
        return fn

    return register


def newest(valid: Iterable[Kept], n: int) -> list[Kept]:
    """The `n` newest copies by step."""
    return sorted(valid, key=lambda v: v.step, reverse=True)[:n]


def _metric(v: Kept) -> float | None:
    return v.metric


@keep_rule("keep_last")
def _keep_last(valid: Sequence[Kept], tier: Tier, n: int, ctx: Context) -> list[Kept]:
    return newest(valid, n)


@keep_rule("keep_best")
def _keep_best(valid: Sequence[Kept], tier: Tier, k: int, ctx: Context) -> list[Kept]:
    # A rule over this tier's copies, committed or not: the same ranking as the root's best.
    return answers.ranked(valid, _metric, ctx.mode, False, tier)[:k]


@keep_rule("keep_every")
def _keep_every(valid: Sequence[Kept], tier: Tier, m: int, ctx: Context) -> list[Kept]:
    return [v for v in valid if m and v.step % m == 0]


@keep_rule("keep_within", show=units.format_duration)
def _keep_within(valid: Sequence[Kept], tier: Tier, within: float,
                 ctx: Context) -> list[Kept]:
    # Inclusive edge, and a completion time ahead of `now` (clock skew) counts as recent.
    return [v for v in valid if ctx.now - v.completed <= within]
