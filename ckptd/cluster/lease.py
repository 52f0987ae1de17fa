"""The root lease, decided: which daemon acts on a root, from what each daemon has seen of the
root's lease files. Pure: no file system, no clock (the caller passes what it saw and `now`).

The files (written by `ckptd.service.lease`), in `<root>/.ckptd/`:

- `lease.claim.<G>`: created create-only (O_EXCL) by the daemon that takes generation G; it
  holds that daemon's token. The highest G names the holder: two daemons that both see a stale
  lease both try to create the next claim, and exactly one succeeds.
- `lease.json`: who holds generation G (node, pid, host, boot, since) for people and for the
  other daemons. The holder renews it every few seconds by touching it (no new blocks: renewing
  works on a full disk); it marks it `released` when it stops cleanly.

A standby judges the lease stale when nothing about `lease.json` or the top claim changed for
`lease_timeout` of its own clock (no clock is compared across machines), at once when the holder
marked it released, and at once when the holder ran on this machine and its process is gone
(a holder naming this daemon's own process with a token no lease service of this process has
is a forgery: that holder is gone too, `ckptd.service.lease`). A claim is judged by what its
holder shows over time, never by its generation alone: one nobody renews is stale after
`lease_timeout` whatever its number, and a claim at the last generation there can be is
retired (renamed away, which succeeds for one taker only) and numbering starts again at 1, so
no claim written by hand keeps a root from every daemon for good.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ckptd import inputs
from ckptd.errors import BadInput, Malformed

FORMAT = "ckptd-lease/1"
LEASE_FILE = "lease.json"
CLAIM_PREFIX = "lease.claim."
MAX_BYTES = inputs.LEASE.cap
MAX_GENERATION = 2**62
MAX_SINCE = 1e11  # seconds since the epoch (year 5138): NaN, infinities and overflows refused
_CLAIM = re.compile(r"^lease\.claim\.([1-9][0-9]{0,18})$", re.ASCII)
_TOKEN = re.compile(r"^[0-9a-f]{16,64}$", re.ASCII)


def claim_name(gen: int) -> str:
    return f"{CLAIM_PREFIX}{gen}"


def claim_generation(name: str) -> int | None:
    """G for a file named `lease.claim.G`, else None."""
    m = _CLAIM.match(name)
    return int(m.group(1)) if m and int(m.group(1)) < MAX_GENERATION else None


def valid_token(token: str) -> bool:
    return bool(_TOKEN.match(token))


@dataclass(frozen=True)
class Holder:
    """Who holds one generation of a root's lease (the body of lease.json)."""

    gen: int
    token: str
    node: str
    pid: int
    host: str
    boot: str
    since: float  # wall-clock seconds, for people only
    released: bool = False

    def as_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "gen": self.gen, "token": self.token, "node": self.node,
                "pid": self.pid, "host": self.host, "boot": self.boot, "since": self.since,
                "released": self.released}

    @classmethod
    def from_json(cls, doc: Any) -> Holder:
        """Parse a lease.json body; ValueError names what is wrong."""
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise Malformed(f"not a {FORMAT} document")
        fields = {"token": str, "node": str, "host": str, "boot": str, "released": bool}
        out: dict[str, Any] = {}
        for key, kind in fields.items():
            value = doc.get(key)
            if not isinstance(value, kind):
                raise Malformed(f"{key!r} is missing or not {kind.__name__}")
            if isinstance(value, str) and len(value) > 256:
                raise Malformed(f"{key!r} is too long")
            out[key] = value
        try:  # numbers bounded where they enter (`ckptd.inputs`): never a crash, never inf
            out["gen"] = inputs.check_int(doc.get("gen"), "'gen'", 1, MAX_GENERATION - 1)
            out["pid"] = inputs.check_int(doc.get("pid"), "'pid'", 1, 2**31 - 1)
            out["since"] = inputs.check_float(doc.get("since"), "'since'", 0.0, MAX_SINCE)
        except BadInput as exc:
            raise Malformed(str(exc)) from None
        if not valid_token(out["token"]):
            raise Malformed("'token' is not valid")
        return cls(**out)


@dataclass(frozen=True)
class Seen:
    """One look at a root's lease files."""

    top: int  # the highest claimed generation; 0 when none
    top_token: str | None  # what its claim file holds (None: unreadable or being written)
    holder: Holder | None  # lease.json, when it parses
    key: tuple[Any, ...]  # changes whenever lease.json or the top claim changes (renewals too)


@dataclass(frozen=True)
class Me:
    token: str
    host: str
    boot: str


class Verdict(StrEnum):
    HOLD = "hold"  # ours: act on the root, renew the lease
    TAKE = "take"  # nobody's or stale: try to claim generation top + 1
    STANDBY = "standby"  # another daemon's and alive: do not act


@dataclass(frozen=True)
class Judgement:
    verdict: Verdict
    why: str


def judge(me: Me, seen: Seen, changed_at: float, now: float, timeout: float,
          process_alive: bool | None) -> Judgement:
    """What this daemon does about one root's lease.

    `changed_at` is when (on this daemon's own clock) `seen.key` last changed; `process_alive`
    says whether the holder's pid is alive, when the holder ran on this machine in this boot
    (None otherwise: a pid on another machine means nothing here).
    """
    if seen.top == 0:
        return Judgement(Verdict.TAKE, "no daemon has held the root")
    h = seen.holder
    current = h is not None and h.gen == seen.top and h.token == seen.top_token
    if current and h is not None and h.released:
        # Ours too: a released lease is never resumed, or this daemon and one taking it now
        # would both act; a new generation, claimed create-only, decides between them.
        return Judgement(Verdict.TAKE, "released by its holder")
    if h is not None and h.gen > seen.top:
        # A torn look: the claims were listed before another daemon claimed a newer
        # generation, lease.json read after it wrote it. Whatever the old top claim says, the
        # root is not ours to renew; look again. Only time takes it (claims deleted by hand).
        if now - changed_at >= timeout:
            return Judgement(Verdict.TAKE, f"generation {h.gen} never claimed, not renewed"
                                           f" for {now - changed_at:.0f}s")
        return Judgement(Verdict.STANDBY, "a newer generation is being claimed")
    if seen.top_token == me.token:
        return Judgement(Verdict.HOLD, "ours")
    if current and process_alive is False:
        return Judgement(Verdict.TAKE, "its holder's process on this machine is gone")
    if now - changed_at >= timeout:
        return Judgement(Verdict.TAKE, f"not renewed for {now - changed_at:.0f}s")
    return Judgement(Verdict.STANDBY, "held by another daemon")


def same_machine(me: Me, holder: Holder | None) -> bool:
    """The holder ran on this machine since its last boot (so its pid can be checked here)."""
    return holder is not None and holder.host == me.host and holder.boot == me.boot != ""
