"""Human-readable renderings of the daemon's JSON documents (status, ls) for a terminal.

Pure string building from the JSON shapes of docs/CLI.md; no I/O, no daemon access.
"""

from __future__ import annotations

from typing import Any

from ckptd.units import format_duration, format_size, progress_bar


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*headers), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def render_status(doc: dict[str, Any]) -> str:
    head = (f"ckptd {doc['version']}  {doc['status']}"
            f"  up {format_duration(round(doc['uptime_s']))}")
    rows = []
    for r in doc["roots"]:
        counts = " ".join(f"{k}={v}" for k, v in r["counts"].items() if v)
        rows.append([r["name"], _step(r["latest"]), _step(r["best"]), counts or "-",
                     str(r["queue"]), _size(r["disk_free_bytes"]),
                     _since(r.get("last_error_at")) + (r["last_error"] or "-")[:60]])
    out = [head, "", table(["ROOT", "LATEST", "BEST", "COUNTS", "QUEUE", "DISK FREE",
                            "LAST ERROR"], rows)]
    if doc.get("flushing"):
        out += ["", "flushing (preemption): " + ", ".join(
            f"{f['root']} step {f['step']}" for f in doc["flushing"])]
    if doc.get("problem"):
        out += ["", f"PROBLEM: {doc['problem']}"]
    troubled = [s for s in doc.get("services", []) if s["state"] != "running" or s["restarts"]]
    for svc in troubled:
        if svc.get("stuck"):
            c = svc["stuck"]
            item = c["step"] is not None
            what = f"{c['stage']} of {c['root']} step {c['step']}" if item else c["stage"]
            out += ["", f"service {svc['name']} STUCK: {what}: no progress for"
                        f" {c['quiet_s']:.0f} s (bound {c['bound_s']:g} s)"
                        + ("; set aside" if item else "")]
            continue
        when = "" if svc["state"] == "running" else f" ({svc['state']})"
        out += ["", f"service {svc['name']}{when}: restarted {svc['restarts']}x,"
                    f" last error: {svc['last_error']}"]
    for r in doc["roots"]:
        h = r.get("holder")
        if r.get("not_acting"):
            out += ["", f"{r['name']}: NOT ACTING: {r['not_acting']}"]
        elif r.get("acting") is False:
            who = (f"{h['node']} (pid {h['pid']} on {h['host']}, since {h['since']})" if h
                   else "no daemon yet")
            out += ["", f"{r['name']}: STANDBY: acted on by {who}; this daemon takes over"
                        " when that lease goes stale"]
        if r.get("adopted"):
            out += ["", f"{r['name']}: {r['adopted']['message']}"]
        for u in (r.get("uncommitted") or [])[:10]:
            out += ["", f"{r['name']}: step {u['step']} waits for its commit: "
                        + _waiting_for(u)]
        if r.get("unrecognised"):
            names = ", ".join(r["unrecognised"][:5])
            more = f" and {len(r['unrecognised']) - 5} more" if len(r["unrecognised"]) > 5 else ""
            out += ["", f"{r['name']}: unrecognised (look like checkpoints, match no layout;"
                        f" see docs/LAYOUTS.md): {names}{more}"]
        out += [line for b in (r.get("bad_remote") or [])[:5]
                for line in ("", f"{r['name']}: {_bad_remote(b)}")]
    warnings = [r for r in doc["roots"] if r.get("preflight") and not r["preflight"]["ok"]]
    for r in warnings:
        out += ["", f"capacity warning for {r['name']}: {r['preflight']['message']}"]
    out += _memory(doc.get("memory") or {})
    if doc["in_flight"]:
        out += ["", "in flight:"]
        for w in doc["in_flight"]:
            out.append(f"  {w['root']} step {w['step']} {w['stage']:<9} "
                       f"{progress_bar(w.get('done_bytes', 0), w.get('total_bytes', 0))} "
                       f"{_size(w.get('done_bytes'))}/{_size(w.get('total_bytes'))}")
    return "\n".join(out)


def _memory(memory: dict[str, Any]) -> list[str]:
    """Per root, the state held in memory: kept for this node's trainers, held for peers,
    and who holds whose (docs/MEMORY.md)."""
    lines = []
    for r in memory.get("roots") or []:
        held_by = ", ".join(f"{h['node']} (step {h['step']})" for h in r.get("held_by") or [])
        holding = ", ".join(f"{h['node']} (step {h['step']}, {_size(h['bytes'])})"
                            for h in r.get("holding_for") or [])
        if not (r.get("own_bytes") or r.get("peer_bytes") or held_by):
            continue
        lines.append(f"  {r['name']}: kept {_size(r.get('own_bytes'))} for this node's"
                     f" trainers, {_size(r.get('peer_bytes'))} for peers"
                     + (f"; this node's state held by {held_by}" if held_by else "")
                     + (f"; holding {holding}" if holding else ""))
    return ["", "in memory:", *lines] if lines else []


def _waiting_for(u: dict[str, Any]) -> str:
    """Which nodes' parts a multi-node step lacks, in words."""
    names = list(u.get("missing_nodes") or [])
    unseen = int(u.get("unseen_nodes") or 0)
    if unseen:
        names.append(f"{unseen} node{'s' if unseen > 1 else ''} not seen yet")
    return ("parts missing from " + ", ".join(names) if names
            else "the coordinator's commit")


def _size(n: int | None) -> str:
    return "-" if n is None else format_size(n)


def _since(at: str | None) -> str:
    return f"[{at[11:19]}] " if at else ""


def render_ls(doc: dict[str, Any]) -> str:
    rows = []
    for c in doc["checkpoints"]:
        metrics = " ".join(f"{k}={v:.4g}" for k, v in sorted(c["metrics"].items()))
        rows.append([str(c["step"]), c["state"], c["local"], c["remote"], c["layout"],
                     _size(c["bytes"]), _size(c["stored_bytes"] or None),
                     "yes" if c["pinned"] else "", metrics or "-", c["reason"] or ""])
    bad = [_bad_remote(b) for b in doc.get("bad_remote") or []]
    if not rows:
        return "\n".join([f"{doc['root']}: no checkpoints", *bad])
    return "\n".join([table(["STEP", "STATE", "LOCAL", "REMOTE", "LAYOUT", "BYTES", "STORED",
                             "PINNED", "METRICS", "REASON"], rows), *bad])


def _bad_remote(b: dict[str, Any]) -> str:
    """One remote item the listing skipped, in words."""
    return f"skipped remote {b.get('key')}: {str(b.get('error'))[:200]}"


def _step(v: Any) -> str:
    return "-" if v is None else str(v)


def render_plan(doc: dict[str, Any]) -> str:
    """The retention plan: one line per checkpoint, with the rules that decided."""
    rows = [[str(i["step"]), i["local"], i["remote"], ", ".join(i["reasons"])]
            for i in doc["plan"]]
    if not rows:
        return f"{doc['root']}: no checkpoints"
    return table(["STEP", "LOCAL", "REMOTE", "REASONS"], rows)
