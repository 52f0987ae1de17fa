"""Memory benchmark: what restoring from memory gains (SPEC.md "Restoring from memory"), each
way beside its baseline in one run. A trainer saves a model + Adam state asynchronously into a
root of a real `ckptd run` daemon and is SIGKILLed; fresh processes then load it from the
daemon's memory and, with the step's files evicted from the page cache, from local files.

Every load is its own process; `load_s` is the load call alone, timed inside the child; wall
time and peak RSS come from GNU time. Usage (a check in under a minute: --size 64MB --repeat 1):
python bench/memory_bench.py [--size 1.6GB] [--repeat 3] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests"))  # the config helpers the tests use

import upload_bench as ub  # noqa: E402  (eviction, child timing)
from support.config import write_layout  # noqa: E402

from ckptd.client import Client  # noqa: E402
from ckptd.units import parse_size  # noqa: E402

WORKER = str(HERE / "memory_worker.py")
ROOT = "bench"
STEP = 1
RESTART = ("memory", "local")  # the rows of the restart, in a round's order (next one reversed)


@dataclass
class Result:
    wall_s: float = 0.0
    load_s: float = 0.0  # the load call alone, in the child
    peak_rss: int = 0
    cpu_s: float = 0.0
    source: str = ""  # meta["source"]: which tier served it
    error: str = ""


class Daemon:
    """One `ckptd run` process with its config; stopped by its PID."""

    def __init__(self, base: Path, sock: Path, roots: list[dict[str, Any]], env: dict[str, str],
                 memory: dict[str, Any] | None = None, **daemon_keys: Any) -> None:
        self.layout = write_layout(base, sock, roots, log_level="info", **daemon_keys)
        if memory:
            from support.config import toml_value

            with open(self.layout.config, "a") as f:
                f.write("\n[memory]\n" + "".join(f"{k} = {toml_value(v)}\n"
                                                 for k, v in memory.items()))
        self.env = dict(env, CKPTD_SOCKET=str(sock))
        self.log = base / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def client(self) -> Client:
        return Client(self.layout.socket, timeout=30.0)

    def root(self, name: str = ROOT) -> Path:
        return self.layout.roots[name]

    def start(self) -> Daemon:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "ckptd", "run", "--config",
                                          str(self.layout.config)], stdout=log,
                                         stderr=subprocess.STDOUT, env=self.env)
        c = Client(self.layout.socket, timeout=1.0)
        deadline = time.monotonic() + 60
        while not self.layout.socket.exists() or c.health() is None:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit(f"the daemon did not start: {self.log_tail()}")
            time.sleep(0.05)
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def wait(self, step: int, until: str, timeout: float = 1800.0) -> None:
        if not self.client.wait(ROOT, step, until, timeout=timeout):
            raise SystemExit(f"step {step} never {until}: {self.log_tail()}")


def environment(scratch: Path) -> dict[str, str]:
    """The children's environment; their bytecode cached (as a user's install has it) and
    warmed once, so no timed start compiles torch."""
    env = dict(os.environ, AWS_EC2_METADATA_DISABLED="true")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(scratch / "pycache")
    subprocess.run([sys.executable, "-c", "import torch, xxhash, ckptd.torch, ckptd.cli.main, "
                    "ckptd.backends"], env=env, check=True)
    return env


def worker(*argv: str) -> list[str]:
    return [sys.executable, WORKER, *argv]


def save_and_kill(d: Daemon, size: int, expect: Path, step: int = STEP) -> dict[str, Any]:
    """A trainer saves `step` with blocking=False into `d`'s root and is SIGKILLed; returns
    what it said (its copy and persist times) once the daemon holds the step valid."""
    proc = subprocess.run(worker("save", "--root", str(d.root()), "--step", str(step), "--size",
                                 str(size), "--expect", str(expect)),
                          capture_output=True, env=d.env, check=False)
    if proc.returncode != -signal.SIGKILL:
        raise SystemExit(f"the saving trainer exited {proc.returncode}:\n"
                         f"{proc.stderr.decode(errors='replace')[-3000:]}")
    d.wait(step, "valid")
    lines = proc.stdout.decode().strip().splitlines()
    return json.loads(lines[-1]) if lines else {}


def load_child(env: dict[str, str], root: Path, source: str, expect: Path,
               *extra: str) -> Result:
    """One fresh process loading the step from `source`; a failure is recorded, not raised."""
    try:
        stdout, wall, cpu, rss = ub.run_child(worker("load", "--root", str(root), "--step",
                                                     str(STEP), "--source", source, "--expect",
                                                     str(expect), *extra), env)
    except SystemExit as exc:
        text = str(exc.code).strip().splitlines()
        return Result(error=text[-1][:300] if text else "failed")
    out = json.loads(stdout.strip().splitlines()[-1])
    return Result(wall, out["load_s"], rss, cpu, out["source"])


def show(name: str, r: Result) -> None:
    if r.error:
        print(f"  {name}: FAILED: {r.error}", flush=True)
        return
    print(f"  {name}: load {r.load_s:.2f} s, wall {r.wall_s:.1f} s, CPU {r.cpu_s:.1f} s, "
          f"peak RSS {r.peak_rss / 2**20:,.0f} MiB, source {r.source}", flush=True)


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
    for g in doc["goals"]:
        verdict = "not measured" if g["met"] is None else ("met" if g["met"] else "NOT met")
        walls = f" (child wall {fig(g['walls'])})" if g.get("walls") else ""
        lines.append(f"- {g['goal']} ≤ {g['limit']}: {fig(g['values'])}{walls} → {verdict}"
                     + (f" ({g['why']})" if g["why"] else ""))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1.6GB", help="model + Adam state, e.g. 1.6GB or 64MB")
    p.add_argument("--repeat", type=int, default=3, help="rounds; the table shows medians")
    p.add_argument("--only", default="", help="comma-separated parts: restart")
    p.add_argument("--workdir", type=Path, default=HERE / "out" / "memory")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    parts = set(filter(None, args.only.split(","))) or {"restart"}
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
    finally:
        shutil.rmtree(work / "restart", ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    doc["goals"] = goals(doc)
    print(report(doc))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
