"""Ten steps in one root: does a step's time to safe grow with what the root already holds?

One daemon, one watched root, one SeaweedFS server on loopback: N real `dcp.save` steps (one
file per tensor, time_to_safe_bench's `many` input) are renamed in one after another, each once
the previous one is remote-verified (the earlier steps stay on disk, in the store, in the bucket,
and retention works on them as on a trainer's). Per step: rename -> complete, -> valid,
-> verified (the daemon's own transitions), the wall time until the client sees it uploaded, and
the daemon's CPU seconds over that step (/proc/<pid>/stat, its children included). Optionally
`aws s3 cp --recursive` of the same files, for chosen steps, right after that step.

Each round is a fresh daemon, root and bucket prefix; `bench_all.py` runs one per round and
times `aws` for the first and the last step only (`--aws 1,10`).

`--profile PREFIX` runs the daemon under `cpu_sampler.py`: step i's CPU by stack is written to
`PREFIX.<2i>.txt` (odd parts are the time between steps).

Usage: python bench/steps_bench.py [--steps 10] [--files 10000] [--aws 1,10] [--repeat 1]
       [--workdir DIR] [--json FILE] [--profile PREFIX]
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
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(HERE))

import s3server  # noqa: E402
from time_to_safe_bench import ROOT, build_many, config, run_aws, stages  # noqa: E402
from upload_bench import drop_prefix, evict, warm_up  # noqa: E402

FIRST = 100  # the first step's number; the next ones follow by 100
SCHEMA = "ckptd-steps-bench/1"
SAMPLER = ["-m", "ckptd"]
PROFILED: list[str] = []  # cpu_sampler.py's command prefix under --profile


def cpu_seconds(pid: int) -> float:
    """utime + stime + cutime + cstime of a process, in seconds."""
    return sum(cpu_split(pid))


def cpu_split(pid: int) -> tuple[float, float]:
    """A process's user and system CPU seconds (its waited-for children included)."""
    f = [int(x) for x in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11:15]]
    tick = os.sysconf("SC_CLK_TCK")
    return (f[0] + f[2]) / tick, (f[1] + f[3]) / tick


def memory_state() -> dict[str, float]:
    """The machine's free memory and page cache (GB), and the total time tasks stalled on
    memory so far (s, /proc/pressure/memory `some`): what reclaim costs whoever allocates."""
    info = {k: int(v.split()[0]) for k, v in
            (line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())}
    out = {"free_gb": info["MemFree"] / 1e6, "cache_gb": info["Cached"] / 1e6}
    try:
        some = Path("/proc/pressure/memory").read_text().split("\n")[0]
        out["stall_s"] = int(some.rsplit("total=", 1)[1]) / 1e6
    except (OSError, IndexError, ValueError):
        pass
    return out


def start_daemon(cfg: Path, work: Path) -> tuple[subprocess.Popen[bytes], Any]:
    from ckptd.client import Client

    env = {**os.environ, "AWS_EC2_METADATA_DISABLED": "true"}
    log = open(work / "daemon.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, *PROFILED, *SAMPLER, "run", "--config", str(cfg)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    client = Client(work / "ckptd.sock", timeout=10.0, strict=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            client.status()
            return proc, client
        except Exception:
            if time.monotonic() > deadline or proc.poll() is not None:
                log.close()
                raise RuntimeError((work / "daemon.log").read_text()[-3000:]) from None
            time.sleep(0.05)


def wait_uploaded(client: Any, proc: subprocess.Popen[bytes], work: Path, step: int) -> None:
    from ckptd.client import ClientError

    while True:
        try:
            rec = client.checkpoint(ROOT, step)
        except ClientError:  # not seen yet
            rec = None
        if rec is not None and rec.get("remote") == "uploaded":
            return
        if rec is not None and rec.get("state") == "invalid":
            raise RuntimeError(f"step invalid: {rec}")
        if proc.poll() is not None:
            raise RuntimeError((work / "daemon.log").read_text()[-3000:])
        time.sleep(0.02)


def cut(proc: subprocess.Popen[bytes]) -> None:
    """Under --profile: the sampler writes what it gathered since the last cut."""
    if PROFILED:
        os.kill(proc.pid, signal.SIGUSR2)


def pick(st: dict[str, float], *keys: str) -> float | None:
    for k in keys:
        for name, v in st.items():
            if name.startswith(k):
                return v
    return None


def run_steps(server: s3server.S3Server, source: Path, work: Path, prefix: str, steps: int,
              aws_at: set[int], aws_scratch: Path) -> list[dict[str, Any]]:
    """One daemon, one root, `steps` steps renamed in one after another; one row per step."""
    shutil.rmtree(work, ignore_errors=True)
    (work / "root").mkdir(parents=True)
    (work / "staging").mkdir()
    cfg = config(work, server, prefix, "dcp")
    proc, client = start_daemon(cfg, work)
    rows: list[dict[str, Any]] = []
    try:
        for i in range(1, steps + 1):
            step = FIRST * i
            staged = work / "staging" / f"step-{step}"  # same filesystem, outside the root
            subprocess.run(["cp", "-r", str(source), str(staged)], check=True)
            evict(staged)
            time.sleep(1.0)  # let the daemon go idle after the copy's page-cache churn
            cpu0, scans0 = cpu_seconds(proc.pid), client.status()["scans"]
            split0, mem0 = cpu_split(proc.pid), memory_state()
            server0 = cpu_seconds(server.process.pid)
            cut(proc)
            t0 = time.time()
            staged.rename(work / "root" / f"step-{step}")
            wait_uploaded(client, proc, work, step)
            wall = time.time() - t0
            cut(proc)
            cpu = cpu_seconds(proc.pid) - cpu0
            split, mem = cpu_split(proc.pid), memory_state()
            scans = client.status()["scans"] - scans0
            server_cpu = cpu_seconds(server.process.pid) - server0
            st = stages(work / "state" / "state.db", t0, step)
            row = {"step": i, "t0": t0, "wall_s": wall, "cpu_s": cpu, "server_cpu_s": server_cpu,
                   "user_s": split[0] - split0[0], "sys_s": split[1] - split0[1],
                   "free_gb": mem0["free_gb"], "cache_gb": mem0["cache_gb"],
                   "stall_s": mem.get("stall_s", 0.0) - mem0.get("stall_s", 0.0),
                   "scans": scans, "stages": st,
                   "complete_s": pick(st, "found_complete->", "detected"),
                   "valid_s": pick(st, "validated->"), "verified_s": pick(st, "uploaded->")}
            if i in aws_at:
                aws_prefix = f"{prefix}-aws-{i}"
                row["aws_s"] = run_aws(server, source, aws_prefix, aws_scratch)
                drop_prefix(server, aws_prefix)
            rows.append(row)
            print(line(row), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return rows


def fmt(v: float | None) -> str:
    return "     -" if v is None else f"{v:6.1f}"


def line(row: dict[str, Any]) -> str:
    aws = f"  aws {row['aws_s']:6.1f}" if "aws_s" in row else ""
    return (f"step {row['step']:2d}: complete {fmt(row['complete_s'])}  valid "
            f"{fmt(row['valid_s'])}  verified {fmt(row['verified_s'])}  wall "
            f"{row['wall_s']:6.1f}  cpu {row['cpu_s']:6.1f} (sys {row.get('sys_s', 0):5.1f})  "
            f"server cpu {row['server_cpu_s']:6.1f}  scans {row['scans']:3d}  free "
            f"{row.get('free_gb', 0):5.1f} GB  stall {row.get('stall_s', 0):5.2f}{aws}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--aws", default="", help="steps (1-based, comma-separated) to time aws on")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckptd-steps"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--profile", help="a file prefix: the daemon's CPU by stack, per step")
    args = ap.parse_args()
    if args.profile:
        PROFILED[:] = [str(HERE / "cpu_sampler.py"), "--out", str(Path(args.profile).resolve())]
    aws_at = {int(x) for x in args.aws.split(",") if x}
    args.workdir.mkdir(parents=True, exist_ok=True)
    inputs = args.workdir / f"inputs-{args.files}"
    inputs.mkdir(exist_ok=True)
    info = build_many(inputs / "many", args.files)
    server = s3server.start_server(args.workdir / "s3")
    rounds: list[list[dict[str, Any]]] = []
    try:
        warm_up(server)
        for r in range(args.repeat):
            rows = run_steps(server, inputs / "many", args.workdir / "ckptd", f"steps-{r}",
                             args.steps, aws_at, args.workdir / "aws")
            drop_prefix(server, f"steps-{r}")
            rounds.append(rows)
            print(f"round {r}: {info['files']} files, {info['bytes'] / 1e9:.2f} GB per step; "
                  f"last/first {rows[-1]['wall_s'] / rows[0]['wall_s']:.2f}x", flush=True)
    finally:
        s3server.stop_server(server)
        for scratch in ("s3", "ckptd", "aws"):
            shutil.rmtree(args.workdir / scratch, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps({"schema": SCHEMA, "inputs": info, "rounds": rounds},
                                        indent=1))


# -- bench_all's rows ---------------------------------------------------------------------------


def bench_all_argv(py: str, args: argparse.Namespace) -> list[str]:
    """bench_all's command for its steps row: ten steps once per round, `aws` timed after the
    first and the last; `--steps-files` (default: its `--files`) files per step."""
    return [py, str(HERE / "steps_bench.py"), "--steps", "10", "--aws", "1,10", "--files",
            str(args.steps_files or args.files), "--repeat", str(args.repeat), "--workdir",
            str(args.workdir / "time-to-safe")]


def bench_all_rows(doc: dict[str, Any]) -> list[Any]:
    """bench_all's rows from `--json`: the last step of one root against its first (goal
    <= 1.1x), and every step against `aws s3 cp --recursive` of the same files, the aws time of
    its round (the median of the steps it was timed on; goal <= 1.5x for every step)."""
    from bench_all import Row as row  # the table's own row and figures
    from bench_all import spread, verdict

    rounds = [r for r in doc.get("rounds", []) if len(r) >= 2]
    if doc.get("schema") != SCHEMA or not rounds:
        return [row("ten steps in one root", "", "", "", "—", "—",
                    "not measured: steps_bench --json gave no rounds")]
    n, info = len(rounds[0]), doc["inputs"]
    first, last = [r[0]["wall_s"] for r in rounds], [r[-1]["wall_s"] for r in rounds]
    growth = [b / a for a, b in zip(first, last, strict=True)]
    out = [row(f"{n} steps of {info['files']:,} files renamed one after another into one root "
               "of one daemon: the last step's time to safe against the first's",
               "the first step", spread(first, "{:.1f}", " s"), spread(last, "{:.1f}", " s"),
               spread(growth), "≤ 1.1×", verdict(statistics.median(growth) <= 1.1))]
    aws = [statistics.median(s["aws_s"] for s in r if "aws_s" in s) for r in rounds
           if any("aws_s" in s for s in r)]
    if len(aws) == len(rounds):
        worst = [max(s["wall_s"] for s in r) / a for r, a in zip(rounds, aws, strict=True)]
        walls = [s["wall_s"] for r in rounds for s in r]
        out.append(row(f"the same {n} steps, each against `aws s3 cp --recursive` of the "
                       "step (timed after the first and the last); the ratio of the slowest "
                       "step", "`aws s3 cp --recursive`", spread(aws, "{:.1f}", " s"),
                       spread(walls, "{:.1f}", " s", "step"), spread(worst), "≤ 1.5× every step",
                       verdict(max(worst) <= 1.5)))
    return out


if __name__ == "__main__":
    main()
