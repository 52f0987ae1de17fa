"""Async saves: how long a save blocks a CPU training loop, the loop's extra memory and its step
time, for torch.save, blocking ckptd.torch.save, DCP async_save (process mode) and
ckptd.torch.save(blocking=False), side by side on the same state.

    PYTHONPATH=. .venv/bin/python bench/async_save_bench.py --params-mb 128 --runs 3

Starts one `ckptd run` daemon (its roots are the two ckptd variants' directories), then runs
each variant `--runs` times, each in a fresh process: build an MLP of --params-mb fp32 weights
with Adam (state = 3x the weights), train --steps steps and save every --every steps, then wait
for the last save to be written. Reports medians over the runs of: the time each save call
blocked the loop (the median save, and the first), the loop's mean step time (saves included),
the median step without a save (what writing in the background costs the steps), the peak RSS
above the RSS before the first save, and the RSS growth from the first save to the last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MB = 1 << 20
VARIANTS = ["no saves", "torch.save", "ckptd blocking", "DCP async_save (process)",
            "ckptd blocking=False"]
SLUG = dict(zip(VARIANTS, ["none", "torch-save", "ckptd-blocking", "dcp-async", "ckptd-async"],
                strict=True))


def status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


# -- one run, in its own process ----------------------------------------------------------------


def child(variant: str, out: Path, params_mb: int, steps: int, every: int) -> dict[str, Any]:
    import torch

    width = 2048
    layers = max(1, round(params_mb * MB / (width * width * 4)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    x = torch.randn(64, width)

    def train_step() -> None:
        opt.zero_grad(set_to_none=False)
        model(x).pow(2).mean().backward()
        opt.step()

    train_step()  # Adam's state exists from here on
    save, finish = _saver(variant, out, model, opt)
    state_mb = sum(t.numel() * t.element_size() for t in _tensors(model, opt)) / MB
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    baseline = status_mb("VmRSS")
    blocked, after_save, step_s, compute_s = [], [], [], []
    started = time.perf_counter()
    for i in range(1, steps + 1):
        t0 = time.perf_counter()
        train_step()
        if i % every == 0 and save is not None:
            t1 = time.perf_counter()
            save(i)
            blocked.append(time.perf_counter() - t1)
            after_save.append(status_mb("VmRSS"))
        else:
            compute_s.append(time.perf_counter() - t0)
        step_s.append(time.perf_counter() - t0)
    loop_s = time.perf_counter() - started
    t2 = time.perf_counter()
    finish()
    return {"state_mb": state_mb, "blocked_s": blocked, "step_s": statistics.mean(step_s),
            "compute_s": statistics.median(compute_s),
            "loop_s": loop_s, "drain_s": time.perf_counter() - t2,
            "peak_above_mb": status_mb("VmHWM") - baseline,
            "growth_mb": (after_save[-1] - after_save[0]) if after_save else 0.0}


def _tensors(model: Any, opt: Any) -> list[Any]:
    import torch

    out = list(model.state_dict().values())
    for s in opt.state_dict()["state"].values():
        out += [v for v in s.values() if isinstance(v, torch.Tensor)]
    return out


def _saver(variant: str, out: Path, model: Any, opt: Any) -> tuple[Any, Any]:
    import torch

    import ckptd.torch as ckpt

    if variant == "no saves":
        return None, lambda: None
    if variant == "torch.save":
        return (lambda i: torch.save({"model": model.state_dict(), "optim": opt.state_dict()},
                                     out / f"step_{i}.pt"), lambda: None)
    if variant == "ckptd blocking":
        return (lambda i: ckpt.save(out, i, model=model, optimizer=opt), lambda: None)
    if variant == "ckptd blocking=False":
        return (lambda i: ckpt.save(out, i, model=model, optimizer=opt, blocking=False),
                lambda: _check(ckpt.flush(600)))
    return _dcp_saver(out, model, opt)


def _dcp_saver(out: Path, model: Any, opt: Any) -> tuple[Any, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{out}/.pg", rank=0, world_size=1)
    pending: list[Any] = []

    def save(i: int) -> None:
        if pending:  # one save in flight, as with ckptd's default
            pending.pop().result()
        msd, osd = get_state_dict(model, opt)
        pending.append(dcp.async_save({"model": msd, "optim": osd},
                                      checkpoint_id=str(out / f"step_{i}"),
                                      async_checkpointer_type=AsyncCheckpointerType.PROCESS))

    def finish() -> None:
        if pending:
            pending.pop().result()

    return save, finish


def _check(ok: bool) -> None:
    if not ok:
        raise SystemExit("an async save failed")


# -- the parent: a daemon, the runs, the table ----------------------------------------------------


def start_daemon(base: Path, sock: Path, roots: dict[str, Path]) -> subprocess.Popen[bytes]:
    tables = "".join(f'[[roots]]\nname = "{n}"\npath = "{p}"\n\n' for n, p in roots.items())
    config = base / "ckptd.toml"
    config.write_text(f'[daemon]\nstate_dir = "{base / "state"}"\nsocket = "{sock}"\n'
                      f'log_format = "json"\n\n{tables}')
    log = open(base / "daemon.log", "ab")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen([sys.executable, "-m", "ckptd", "run", "--config", str(config)],
                            stdout=log, stderr=subprocess.STDOUT)
    for _ in range(300):
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(sock))
            return proc
        except OSError:
            time.sleep(0.1)
    raise SystemExit("the daemon did not start: see " + str(base / "daemon.log"))


def run_once(variant: str, out: Path, sock: Path, args: argparse.Namespace) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, __file__, "--child", variant, "--dir", str(out), "--params-mb",
           str(args.params_mb), "--steps", str(args.steps), "--every", str(args.every)]
    env = {**os.environ, "CKPTD_SOCKET": str(sock)}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{res.stderr[-3000:]}")
    for p in out.iterdir():  # keep the disk from filling; the daemon sees them vanish
        if p.name != ".ckptd":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    return dict(json.loads(res.stdout.splitlines()[-1]))


def summarise(runs: list[dict[str, Any]]) -> dict[str, float]:
    med = statistics.median
    blocked = [r["blocked_s"] for r in runs if r["blocked_s"]]
    return {"state_mb": runs[0]["state_mb"],
            "blocked_first": med(b[0] for b in blocked) if blocked else 0.0,
            "blocked_later": med(med(b[1:]) for b in blocked) if blocked else 0.0,
            "step_s": med(r["step_s"] for r in runs), "drain_s": med(r["drain_s"] for r in runs),
            "compute_s": med(r["compute_s"] for r in runs),
            "peak_above_mb": med(r["peak_above_mb"] for r in runs),
            "growth_mb": med(r["growth_mb"] for r in runs)}


def table(results: dict[str, dict[str, float]]) -> str:
    ref = results["ckptd blocking"]["blocked_later"]
    base = results["no saves"]
    lines = ["| variant | blocked per save, median (s) | / ckptd blocking | first save (s) "
             "| mean step (s) | / no saves | median step without a save (s) | / no saves "
             "| peak RSS above start (MiB) "
             "| extra over the loop without saves (MiB) | / state bytes "
             "| RSS growth, first to last save (MiB) | wait for last save (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        extra = r["peak_above_mb"] - base["peak_above_mb"]
        lines.append(
            f"| {name} | {r['blocked_later']:.3f} | {r['blocked_later'] / ref:.3f}x "
            f"| {r['blocked_first']:.3f} | {r['step_s']:.3f} "
            f"| {r['step_s'] / base['step_s']:.2f}x | {r['compute_s']:.3f} "
            f"| {r['compute_s'] / base['compute_s']:.2f}x | {r['peak_above_mb']:.0f} | {extra:.0f} "
            f"| {extra / r['state_mb']:.2f}x | {r['growth_mb']:.0f} | {r['drain_s']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-mb", type=int, default=128, help="model weights, MiB (fp32)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("bench/out/async_save"))
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.dir, args.params_mb, args.steps, args.every)))
        return
    base = args.dir.resolve()
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    dirs = {v: base / SLUG[v] for v in VARIANTS}
    sock_dir = Path(tempfile.mkdtemp(prefix="ckb-", dir="/tmp"))
    # ckptd.torch names the root after its directory: the config's names match.
    roots = {p.name: p for p in (dirs["ckptd blocking"], dirs["ckptd blocking=False"])}
    for p in roots.values():
        p.mkdir(parents=True)
    daemon = start_daemon(base, sock_dir / "ckptd.sock", roots)
    try:
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
        for _ in range(args.runs):  # interleaved, so a slow spell of the machine hits all alike
            for v in VARIANTS:
                runs[v].append(run_once(v, dirs[v], sock_dir / "ckptd.sock", args))
        results = {v: summarise(r) for v, r in runs.items()}
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
        shutil.rmtree(sock_dir, ignore_errors=True)
    print(json.dumps(results, indent=1))
    print(machine())
    print(table(results))


def machine() -> str:
    import platform

    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    mem = Path("/proc/meminfo").read_text().split()[1]
    return (f"{cpu}, {os.cpu_count()} cores, {int(mem) // 1024} MiB RAM, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
