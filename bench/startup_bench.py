"""Start-up benchmark: what a fresh training process pays before the first byte of a resume is
read. Each round runs, in fresh processes: the interpreter alone (`python -c pass`), then one
that imports torch, then ckptd.torch, then loads a tiny local step (and, with --remote, one
from a file:// remote), timing each part from inside; the parent times the whole process.

Also: ckptd's import by top-level package (`-X importtime`, self times summed), and which of
the modules a load never needs it imported (the verdict; tests/torch/test_lazy_imports.py pins
the same). `--tree DIR` (repeatable) compares ckptd trees side by side, rounds interleaved.

Usage: python bench/startup_bench.py [--repeat 5] [--tree /path/to/other/ckptd] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# Modules no load imports, wherever from (a load from a bucket URL needs backends and codec).
NEVER = ("pydantic", "structlog", "rich", "ckptd.config", "ckptd.layouts", "ckptd.store",
         "ckptd.service", "ckptd.api", "ckptd.daemon", "ckptd.cli", "ckptd.stages",
         "ckptd.retention", "ckptd.watch", "sqlite3", "ckptd.arena_write", "ckptd.torch._async")
LOCAL_NEVER = (*NEVER, "obstore", "zstandard", "ckptd.backends", "ckptd.codec", "ckptd.fetch")

CHILD = """
import sys, time, json
t0 = time.perf_counter()
import torch
t1 = time.perf_counter(); before = set(sys.modules)
import ckptd.torch
t2 = time.perf_counter(); own = set(sys.modules) - before
how, where = sys.argv[1], sys.argv[2]
model = torch.nn.Linear(8, 8)
if how == "local":
    ckptd.torch.load(where, model=model)
else:
    ckptd.torch.load(sys.argv[3], model=model, source="remote", remote=where)
t3 = time.perf_counter()
print(json.dumps({"torch_s": t1 - t0, "ckptd_s": t2 - t1, "load_s": t3 - t2,
                  "imported": sorted(own), "after_load": sorted(sys.modules)}))
"""


def env_for(tree: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(base if base is not None else os.environ)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO)]
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *rest])
    env["CKPTD_SOCKET"] = "/nonexistent/ckptd.sock"  # no daemon: memory is not asked
    env["AWS_EC2_METADATA_DISABLED"] = "true"
    return env


def _timed(argv: list[str], env: dict[str, str]) -> tuple[str, float]:
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300,
                          check=False, cwd="/")  # `-c` puts the cwd first on sys.path
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{argv[:4]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout, wall


def offenders(modules: list[str], never: tuple[str, ...]) -> list[str]:
    """The entries of `never` that `modules` holds (a package or any module under it)."""
    return sorted(n for n in never if any(m == n or m.startswith(n + ".") for m in modules))


def one_round(env: dict[str, str], step: Path, remote: tuple[str, Path] | None
              ) -> dict[str, Any]:
    """The parts of one fresh process's start, and what its load imported beyond the import."""
    _, interp = _timed([sys.executable, "-c", "pass"], env)
    out, wall = _timed([sys.executable, "-c", CHILD, "local", str(step)], env)
    doc = json.loads(out.strip().splitlines()[-1])
    res = {"interpreter_s": interp, "torch_s": doc["torch_s"], "ckptd_s": doc["ckptd_s"],
           "load_s": doc["load_s"], "wall_s": wall, "modules": len(doc["imported"]),
           "offenders": offenders(doc["after_load"], LOCAL_NEVER)}
    if remote is not None:
        out, wall = _timed([sys.executable, "-c", CHILD, "remote", remote[0], str(remote[1])],
                           env)
        far = json.loads(out.strip().splitlines()[-1])
        res |= {"remote_load_s": far["load_s"], "remote_wall_s": wall, "offenders": sorted(
            {*res["offenders"], *offenders(far["after_load"], NEVER)})}
    return res


def by_package(env: dict[str, str]) -> dict[str, float]:
    """`import ckptd.torch` after torch, by top-level package (ckptd's by its own packages and
    top modules): self times summed, ms."""
    code = "import torch, sys; sys.stderr.write('--mark--\\n'); import ckptd.torch"
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", code], env=env, cwd="/",
                          capture_output=True, text=True, timeout=300, check=True)
    tail = done.stderr.split("--mark--\n", 1)[-1]
    out: dict[str, float] = {}
    for line in tail.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[0].startswith("import time:") and parts[0][12:].strip(
                ).isdigit():
            name = parts[2].strip().split(".")
            top = ".".join(name[:2]) if name[0] == "ckptd" else name[0]
            out[top] = out.get(top, 0.0) + int(parts[0][12:]) / 1000
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def make_step(work: Path, with_remote: bool) -> tuple[Path, tuple[str, Path] | None]:
    """A tiny native step (ckptd.torch.save) under `work`, and its file:// remote if asked."""
    code = ("import sys, torch, ckptd.torch; torch.manual_seed(0); "
            "ckptd.torch.save(sys.argv[1], 1, model=torch.nn.Linear(8, 8), register=False)")
    _timed([sys.executable, "-c", code, str(work / "r")], env_for(REPO))
    if not with_remote:
        return work / "r" / "step-1", None
    sys.path.insert(0, str(REPO / "tests"))
    from support.published import publish

    from ckptd.backends import LocalBackend

    publish(work / "r", "r", 1, LocalBackend(str(work / "remote")))
    return work / "r" / "step-1", (f"file://{work / 'remote'}", work / "far" / "r")


def measure(repeat: int, trees: list[Path], base_env: dict[str, str] | None = None,
            remote: bool = False) -> dict[str, Any]:
    """`repeat` rounds per tree, the trees interleaved; the medians and the package split."""
    with tempfile.TemporaryDirectory(prefix="ckptd-startup-") as tmp:
        step, far = make_step(Path(tmp), remote)
        envs = {str(t): env_for(t, base_env) for t in trees}
        for env in envs.values():  # with bytecode writing off, every start compiles ckptd
            env.pop("PYTHONDONTWRITEBYTECODE", None)  # an install has its bytecode
            env.setdefault("PYTHONPYCACHEPREFIX", str(Path(tmp) / "pycache"))
        for env in envs.values():  # bytecode written once, as an installed package has it
            one_round(env, step, far)
        rounds: dict[str, list[dict[str, Any]]] = {t: [] for t in envs}
        for n in range(repeat):
            for t in (list(envs) if n % 2 == 0 else list(envs)[::-1]):
                rounds[t].append(one_round(envs[t], step, far))
        return {"schema": "ckptd-startup-bench/1", "trees": {
            t: {"rounds": rounds[t], "median": medians(rounds[t]),
                "by_package_ms": by_package(envs[t])} for t in envs}}


def medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k in rounds[0] if k.endswith("_s") or k == "modules"]
    out: dict[str, Any] = {k: statistics.median(r[k] for r in rounds) for k in keys}
    out["offenders"] = sorted({m for r in rounds for m in r["offenders"]})
    return out


def report(doc: dict[str, Any]) -> str:
    lines = ["| ckptd tree | interpreter s | torch import s | ckptd import s | ckptd / torch "
             "| local load s | whole process s | remote load s | modules | never-needed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for tree, t in doc["trees"].items():
        m = t["median"]
        lines.append(
            f"| {tree} | {m['interpreter_s']:.3f} | {m['torch_s']:.3f} | {m['ckptd_s']:.3f} | "
            f"{m['ckptd_s'] / m['torch_s']:.3f} | {m['load_s']:.3f} | {m['wall_s']:.3f} | "
            f"{m.get('remote_load_s', float('nan')):.3f} | {m['modules']:.0f} | "
            f"{', '.join(m['offenders']) or 'none'} |")
    for tree, t in doc["trees"].items():
        split = ", ".join(f"{k} {v:.1f}" for k, v in list(t["by_package_ms"].items())[:8])
        lines.append(f"- {tree}: ckptd's import by package, ms (self times): {split}")
    return "\n".join(lines)


def table_row(doc: dict[str, Any]) -> tuple[str, str, str, str, str, str, str]:
    """The `make bench` row of the first tree: its parts, ckptd's import against torch's."""
    rounds = next(iter(doc["trees"].values()))["rounds"]
    m = medians(rounds)
    ratios = sorted(r["ckptd_s"] / r["torch_s"] for r in rounds)
    spread = f"{statistics.median(ratios):.3f}× " + (
        f"({ratios[0]:.3f}–{ratios[-1]:.3f}, {len(ratios)} rounds)" if len(ratios) > 1
        else "(1 round)")
    bad = m["offenders"]
    return ("start-up: fresh process to first byte (a tiny local step)", "torch import",
            f"{m['torch_s']:.2f} s", f"{m['wall_s']:.2f} s (interpreter {m['interpreter_s']:.2f},"
            f" torch {m['torch_s']:.2f}, ckptd {m['ckptd_s'] * 1000:.0f} ms, load "
            f"{m['load_s'] * 1000:.0f} ms)", spread, "import nothing the load does not need",
            "met" if not bad else f"NOT met: {', '.join(bad[:4])}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--tree", type=Path, action="append", default=[],
                   help="another ckptd tree to compare (this one is always first)")
    p.add_argument("--remote", action="store_true", help="also a load from a file:// remote")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    doc = measure(args.repeat, [REPO, *(t.resolve() for t in args.tree)], remote=args.remote)
    print(f"command: python {' '.join(sys.argv)}")
    print(report(doc))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
