"""`ckptd probe live|ready`: one look at the daemon's `/v1/health` turned into the yes or no a
container runtime acts on (Kubernetes probes, Docker's HEALTHCHECK). Decides from the health
document alone, in a pure function; asks nothing else of the daemon and changes nothing."""

from __future__ import annotations

from typing import Any

LIVE, READY = "live", "ready"
# A service in these states is not doing its work (crashed and waiting to restart, or ended).
_DOWN = frozenset({"restarting", "stopped"})


def verdict(kind: str, health: dict[str, Any]) -> str | None:
    """None when the daemon whose health this is is `kind` (live or ready), else why not.

    ready: it answers and serves clients: not stopping, still acting on its roots, each of
    which can act (a root whose lease cannot be taken is not; one another daemon holds is
    standing by, and ready; a stuck call is degraded health, set aside, and still ready).
    live: what the systemd watchdog vouches for, as far as health shows it: no service down,
    the scan loop turning, at least one stage worker free of a stuck call, the state database
    still its own. A daemon that is stopping is live: a restart would not stop it sooner."""
    status = health.get("status")
    problem = health.get("problem")
    if kind == READY:
        if status == "stopping":
            return "the daemon is stopping"
        if problem:
            return f"the daemon stopped acting on its roots: {problem}"
        return _not_acting(health)
    if status == "stopping":
        return None
    if problem:
        return f"the daemon stopped acting on its roots: {problem}"
    services = [s for s in health.get("services") or [] if isinstance(s, dict)]
    down = [str(s.get("name")) for s in services if s.get("state") in _DOWN]
    if down:
        return f"not running: {', '.join(down)} (see service_crashed in the daemon's log)"
    if any(s.get("name") == "scan" and s.get("state") == "stuck" for s in services):
        return "the scan loop is stuck"
    workers = [s for s in services if str(s.get("name", "")).startswith("worker-")]
    if workers and all(s.get("state") == "stuck" for s in workers):
        return f"every stage worker is stuck: {_stuck_items(workers)}"
    return None


def _not_acting(health: dict[str, Any]) -> str | None:
    roots = [r for r in health.get("roots_not_acting") or [] if isinstance(r, dict)]
    if not roots:
        return None
    return "; ".join(f"root {r.get('root')} cannot act: {r.get('problem')}" for r in roots)


def _stuck_items(workers: list[dict[str, Any]]) -> str:
    items = []
    for w in workers:
        call = w.get("stuck") or {}
        items.append(f"{w.get('name')} in {call.get('stage', '?')} of {call.get('root', '?')}"
                     f" step {call.get('step', '?')}")
    return "; ".join(items)
