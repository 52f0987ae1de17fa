"""Memory benchmark: what restoring from memory gains (SPEC.md "Restoring from memory"), each
way beside its baseline in one run, on real `ckptd run` daemons (bench/memory_nodes.py):

1. restart: a trainer saves model + Adam asynchronously and is SIGKILLed; fresh processes load
   the step from this node's daemon's memory, and from local files with a cold page cache.
2. peers: two daemons (n0, n1) share a root's name and a bucket (the test SeaweedFS server);
   n1 holds n0's replica; n0 is replaced (killed, disks wiped, a new daemon with the same id)
   and a fresh trainer loads from its peer, and from the bucket (source="remote").
3. a training loop's step time while n0 sends a new step to n1, against the loop idle.
4. n1's peak RSS beyond the replica bytes it holds.

Every load is its own process; `load_s` is the load call alone, timed inside the child; wall
time and peak RSS come from GNU time. Usage (a check in under a minute: --size 64MB --repeat 1
--only restart): python bench/memory_bench.py [--size 1.6GB] [--repeat 3] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests"))  # the SeaweedFS launcher the tests use

import s3server  # noqa: E402
import upload_bench as ub  # noqa: E402  (eviction, child timing)
from memory_nodes import (  # noqa: E402
    ROOT,
    STEP,
    Daemon,
    Result,
    environment,
    events,
    load_child,
    memory_of,
    node,
    replace,
    replicated,
    save_and_kill,
    show,
    vm_hwm,
    worker,
)

from ckptd.units import parse_size  # noqa: E402

RESTART = ("memory", "local")  # the rows of the restart, in a round's order (next one reversed)
PEER = ("peer", "bucket")  # a replaced node's load: from its peer, or with source=remote
PARTS = ("restart", "peers")
TRAIN_BEFORE_S = 3.0  # the training loop's idle steps before n1 starts
TRAIN_AFTER = 30  # and after the send


# -- 1. a restart on a healthy node: this node's daemon vs local files, cold cache -------------


def restart(work: Path, env: dict[str, str], size: int, repeat: int) -> dict[str, Any]:
    base = work / "restart"
    shutil.rmtree(base, ignore_errors=True)
    d = Daemon(base, Path(f"/tmp/ckptd-mem-{os.getpid()}.sock"), [{"name": ROOT}], env).start()
    expect = base / "expect.json"
    rounds: list[dict[str, Any]] = []
    try:
        saved = save_and_kill(d, size, expect)
        step_dir = d.root() / f"step-{STEP}"
        for n in range(repeat):
            print(f"restart: round {n + 1} of {repeat}", flush=True)
            got: dict[str, Result] = {}
            for source in (RESTART if n % 2 == 0 else RESTART[::-1]):
                ub.evict(step_dir)  # the files cold for both; memory never reads them
                got[source] = load_child(d.env, d.root(), source, expect)
                show(source, got[source])
            rounds.append({k: asdict(v) for k, v in got.items()})
    finally:
        d.stop()
    info = json.loads(expect.read_text())
    files = sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())
    return {"state_bytes": info["state_bytes"], "width": info["width"],
            "layers": info["layers"], "files_bytes": files, "save": saved, "rounds": rounds}


# -- 2-4. a replaced node from its peer; training beside replication; the peer's memory --------


def peers(work: Path, env: dict[str, str], size: int, repeat: int, train_rounds: int,
          server: Any, weed: Path) -> dict[str, Any]:
    """n0 saves and is SIGKILLed, its step uploaded and held by n1; then, each round, n0 is
    replaced before each load (else its new daemon keeps the fetched state as its own and the
    next load reads tier 1). n1's VmHWM is read after the loads, before the training rounds
    restart it."""
    base = work / "peers"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    secret = base / "secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    n1 = node(base, "n1", env, server, secret).start()
    n0 = node(base, "n0", env, server, secret).start()
    expect = base / "expect.json"
    try:
        saved = save_and_kill(n0, size, expect)
        n0.wait(STEP, "uploaded")
        saved["replicated_s"] = replicated(n0, "n1", STEP)
        saved["warnings"] = [f"{e['event']}: {e.get('error', '')}"[:300] for e in
                             events(n0, "memory_replica_failed")
                             + events(n0, "memory_directory_failed")]
        files = sum(p.stat().st_size for p in (n0.root() / f"step-{STEP}").rglob("*")
                    if p.is_file())
        held = [h for h in memory_of(n1).get("holding_for", []) if h.get("node") == "n0"]
        rounds = []
        for n in range(repeat):
            print(f"peers: round {n + 1} of {repeat}", flush=True)
            got: dict[str, Result] = {}
            for way in (PEER if n % 2 == 0 else PEER[::-1]):
                replace(n0)
                ub.evict(weed)  # the bucket's volumes cold
                got[way] = load_child(n0.env, n0.root(), "auto" if way == "peer" else "remote",
                                      expect, "--config", str(n0.layout.config))
                if way == "peer" and got[way].source not in ("", "peer:n1"):
                    got[way].error = f"served by {got[way].source}, not peer:n1"
                show(way, got[way])
            rounds.append({k: asdict(v) for k, v in got.items()})
        rss = {"vm_hwm": vm_hwm(n1.proc.pid) if n1.proc else 0,
               "peer_bytes": memory_of(n1)["peer_bytes_total"]}
        training = [train_round(base, n0, n1, size, expect, 10 + k)
                    for k in range(train_rounds)]
    finally:
        n0.stop()
        n1.stop()
    info = json.loads(expect.read_text())
    return {"state_bytes": info["state_bytes"], "files_bytes": files, "save": saved,
            "replica_bytes": sum(h.get("bytes", 0) for h in held), "holding_for": held,
            "rounds": rounds, "rss": rss, "training": training}


def train_round(base: Path, n0: Daemon, n1: Daemon, size: int, expect: Path,
                step: int) -> dict[str, Any]:
    """The training loop beside n0 sending a new step to n1. Both daemons run on this machine,
    so both ends of the replica compete with the one trainer, as on a node of a ring that
    sends its own state and takes its neighbour's."""
    got = beside(base, n0, n1, size, expect, step)
    print(f"  training: {statistics.median(got['idle']):.3f} s a step idle, "
          f"{statistics.median(got['busy']) if got['busy'] else float('nan'):.3f} s beside the "
          f"send ({len(got['busy'])} steps over {got['window_s']:.1f} s)", flush=True)
    return got


def beside(base: Path, n0: Daemon, n1: Daemon, size: int, expect: Path, step: int
           ) -> dict[str, Any]:
    """One training loop's step times while n0 sends `step` to n1 (`busy`), and in the same
    loop before n1 starts and after the send (`idle`): the machine is shared, so idle steps
    are taken next to the busy ones. The peer is down while the step is saved and uploaded
    (n0's send to it fails at connect), so what runs beside the loop is the replication
    alone, started by bringing n1 back."""
    n1.stop()
    save_and_kill(n0, size, expect, step)
    n0.wait(step, "uploaded")
    ready, until = base / "train-ready", base / "train-until"
    for f in (ready, until):
        f.unlink(missing_ok=True)
    loop = subprocess.Popen(worker("train", "--ready", str(ready), "--until", str(until),
                                   "--steps", str(TRAIN_AFTER)), stdout=subprocess.PIPE,
                            env=n0.env)
    try:
        while not ready.exists() and loop.poll() is None:
            time.sleep(0.01)
        time.sleep(TRAIN_BEFORE_S)
        started = time.time()
        n1.start()
        replicated(n0, "n1", step)
    finally:
        until.write_text("stop")
        got, _ = loop.communicate(timeout=600)
    steps = json.loads(got.decode().strip().splitlines()[-1])["steps"]
    window = next(((e["ts"] - e["seconds"], e["ts"]) for e in events(n0, "memory_replicated")
                   if e.get("step") == step and e.get("peer") == "n1"), None)
    if window is None:
        raise SystemExit(f"n0 logged no replication of step {step}")
    return {"busy": [b - a for a, b in steps if b > window[0] and a < window[1]],
            "idle": [b - a for a, b in steps if b < started or a > window[1]],
            "window_s": window[1] - window[0]}


def with_server(work: Path, env: dict[str, str], size: int, repeat: int,
                train_rounds: int) -> dict[str, Any]:
    """The peer rows against a fresh test SeaweedFS server; why not, when peers are missing."""
    try:
        import ckptd.memory.peerclient  # noqa: F401
    except ImportError as exc:
        return {"error": f"this ckptd has no peer tier ({exc})"}
    weed = work / "weed"
    shutil.rmtree(weed, ignore_errors=True)
    server = s3server.start_server(weed)
    try:
        ub.warm_up(server)
        return peers(work, env, size, repeat, train_rounds, server, weed)
    finally:
        s3server.stop_server(server)
        shutil.rmtree(weed, ignore_errors=True)


# -- the figures ---------------------------------------------------------------------------------


def per_round(rounds: list[dict[str, Any]], num: str, den: str, key: str) -> list[float]:
    out = []
    for r in rounds:
        a, b = r.get(num), r.get(den)
        if a and b and not a["error"] and not b["error"] and b[key]:
            out.append(a[key] / b[key])
    return out


def first_error(rounds: list[dict[str, Any]], *names: str) -> str:
    return next((r[n]["error"] for r in rounds for n in names if r.get(n, {}).get("error")), "")


def goal(gid: str, what: str, values: list[float], limit: float, why: str = "",
         **more: Any) -> dict[str, Any]:
    met = statistics.median(values) <= limit if values else None
    return {"id": gid, "goal": what, "values": values, "limit": limit, "met": met,
            "why": "" if values else (why or "not run"), **more}


def goals(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    if "restart" in doc:
        rounds = doc["restart"]["rounds"]
        out.append(goal("restart", "restart from this node's memory / local files (cold), load"
                        " call", per_round(rounds, "memory", "local", "load_s"), 0.25,
                        first_error(rounds, "memory", "local"),
                        walls=per_round(rounds, "memory", "local", "wall_s")))
    pd = doc.get("peers")
    if pd is None:
        return out
    rounds, why = pd.get("rounds", []), pd.get("error", "")
    out.append(goal("peer", "a replaced node from its peer / from the bucket, load call",
                    per_round(rounds, "peer", "bucket", "load_s"), 0.5,
                    why or first_error(rounds, "peer", "bucket"),
                    walls=per_round(rounds, "peer", "bucket", "wall_s")))
    sent = [pd["replica_bytes"] / pd["files_bytes"]] if pd.get("replica_bytes") else []
    out.append(goal("peer_bytes", "bytes on the peer link (the replica n1 holds) / the step's "
                    "files", sent, 0.9, why or "n1 reported no replica bytes"))
    def slowdown() -> list[float]:
        return [statistics.median(t["busy"]) / statistics.median(t["idle"])
                for t in pd.get("training", []) if t["busy"] and t["idle"]]

    out.append(goal("train", "training step time while n0 replicates to n1 (both on this "
                    "machine) / idle", slowdown(), 1.05,
                    why or "no training step overlapped a replication"))
    rss = [(pd["rss"]["vm_hwm"] - pd["rss"]["peer_bytes"]) / 2**20] if "rss" in pd else []
    out.append(goal("rss", "n1's peak RSS (VmHWM) − the replica bytes it holds, MiB", rss, 200,
                    why))
    return out


def fig(values: list[float], fmt: str = "{:.2f}", unit: str = "") -> str:
    if not values:
        return "—"
    med = fmt.format(statistics.median(values)) + unit
    low, high = fmt.format(min(values)), fmt.format(max(values))
    return med if low == high else f"{med} ({low}–{high}, {len(values)} runs)"


def table(name: str, rounds: list[dict[str, Any]], rows: tuple[str, ...]) -> list[str]:
    lines = [f"| {name} | load call s | wall s | CPU s | peak RSS MiB | source |",
             "|---|---:|---:|---:|---:|---|"]
    for row in rows:
        runs = [r[row] for r in rounds if row in r and not r[row]["error"]]
        if not runs:
            lines.append(f"| {row} | failed: {first_error(rounds, row)} | | | | |")
            continue
        lines.append(f"| {row} | {fig([x['load_s'] for x in runs])} | "
                     f"{fig([x['wall_s'] for x in runs], '{:.1f}')} | "
                     f"{fig([x['cpu_s'] for x in runs], '{:.1f}')} | "
                     f"{fig([x['peak_rss'] / 2**20 for x in runs], '{:,.0f}')} | "
                     f"{', '.join(sorted({x['source'] for x in runs}))} |")
    return lines


def report(doc: dict[str, Any]) -> str:
    lines = [f"command: python {' '.join(sys.argv)}"]
    if "restart" in doc:
        r = doc["restart"]
        lines += [f"restart: {r['state_bytes'] / 1e6:,.0f} MB fp32 MLP {r['layers']} x "
                  f"{r['width']}^2 + Adam, files {r['files_bytes'] / 1e6:,.0f} MB", "",
                  *table("restart", r["rounds"], RESTART), ""]
    pd = doc.get("peers", {})
    if pd.get("rounds"):
        lines += [f"peers: state {pd['state_bytes'] / 1e6:,.0f} MB, files "
                  f"{pd['files_bytes'] / 1e6:,.0f} MB, replica held by n1 "
                  f"{pd['replica_bytes'] / 1e6:,.0f} MB, replicated "
                  f"{pd['save']['replicated_s']:.1f} s after the step was uploaded", "",
                  *table("replaced node", pd["rounds"], PEER), ""]
    elif pd:
        lines += [f"peers: not measured: {pd.get('error', '')}", ""]
    for g in doc["goals"]:
        verdict = "not measured" if g["met"] is None else ("met" if g["met"] else "NOT met")
        walls = f" (child wall {fig(g['walls'])})" if g.get("walls") else ""
        fmt = "{:.0f}" if g["id"] == "rss" else "{:.2f}"
        lines.append(f"- {g['goal']} ≤ {g['limit']}: {fig(g['values'], fmt)}{walls} → {verdict}"
                     + (f" ({g['why']})" if g["why"] else ""))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1.6GB", help="model + Adam state, e.g. 1.6GB or 64MB")
    p.add_argument("--repeat", type=int, default=3, help="rounds; the table shows medians")
    p.add_argument("--train-rounds", type=int, default=0, help="training-loop rounds (0: as"
                   " --repeat)")
    p.add_argument("--only", default="", help="comma-separated parts: " + ",".join(PARTS))
    p.add_argument("--workdir", type=Path, default=HERE / "out" / "memory")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    parts = set(filter(None, args.only.split(","))) or set(PARTS)
    work = args.workdir.resolve()
    scratch = work / "scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    env = environment(scratch)
    size = parse_size(args.size)
    doc: dict[str, Any] = {"schema": "ckptd-memory-bench/1", "size": size,
                           "repeat": args.repeat}
    try:
        if "restart" in parts:
            doc["restart"] = restart(work, env, size, args.repeat)
        if "peers" in parts:
            doc["peers"] = with_server(work, env, size, args.repeat,
                                       args.train_rounds or args.repeat)
    finally:
        for part in PARTS:
            shutil.rmtree(work / part, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    doc["goals"] = goals(doc)
    print(report(doc))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
