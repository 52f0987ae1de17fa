"""Peak RSS above a training process's baseline: ckptd.torch.save vs one-dict torch.save.

    .venv/bin/python bench/save_rss_bench.py --params-mb 300 --dir bench/out

Each variant runs in a fresh process that builds the same state (an MLP of --params-mb fp32
weights with gradients, Adam after one step, StepLR, GradScaler), resets the kernel's peak-RSS
mark, saves, and reports VmHWM minus the RSS just before the save. Also reports how much of what
was written is still in the page cache afterwards (fincore), i.e. training data pushed out.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

VARIANTS = {
    "torch.save one dict": "one-dict",
    "torch.save one dict via BytesIO": "bytesio",
    "ckptd.torch.save": "ckptd",
}
MB = 1 << 20


def status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def build_state(params_mb: int) -> dict[str, Any]:
    import torch

    width = 2048
    layers = max(1, round(params_mb * MB / (width * width * 4)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(8, width)).pow(2).mean().backward()
    opt.step()  # Adam's exp_avg and exp_avg_sq now exist: 2x the weights
    return {"model": model, "optimizer": opt,
            "scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=10),
            "scaler": torch.amp.GradScaler("cpu")}


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_one_dict(state: dict[str, Any], out: Path, buffered: bool) -> None:
    """The common pattern: one dict of every state_dict, one torch.save, then fsync."""
    import torch

    blob = {"model": state["model"].state_dict(), "optimizer": state["optimizer"].state_dict(),
            "scheduler": state["scheduler"].state_dict(), "scaler": state["scaler"].state_dict(),
            "step": 100}
    path = out / "ckpt.pt"
    if not buffered:
        torch.save(blob, path)
    else:  # serialize first, then write: what atomic-write and object-store helpers do
        buf = io.BytesIO()
        torch.save(blob, buf)
        path.write_bytes(buf.getvalue())
    fsync_file(path)


def child(variant: str, out: Path, params_mb: int) -> dict[str, Any]:
    import torch

    import ckptd.torch as ckpt

    torch.set_num_threads(1)
    state = build_state(params_mb)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    baseline = status_mb("VmRSS")
    started = time.perf_counter()
    if variant == "ckptd":
        ckpt.save(out, 100, register=False, **state)
    else:
        save_one_dict(state, out, buffered=variant == "bytesio")
    seconds = time.perf_counter() - started
    files = [p for p in out.rglob("*") if p.is_file()]
    return {"baseline_mb": baseline, "peak_above_mb": status_mb("VmHWM") - baseline,
            "seconds": seconds, "written_mb": sum(p.stat().st_size for p in files) / MB,
            "cached_mb": cached_mb(files)}


def cached_mb(files: list[Path]) -> float | None:
    """Bytes of these files resident in the page cache, per util-linux's fincore."""
    if not files or shutil.which("fincore") is None:
        return None
    res = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES",
                          *map(str, files)], capture_output=True, text=True, check=True)
    return sum(int(x) for x in res.stdout.split()) / MB


def run_variant(variant: str, out: Path, params_mb: int) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [sys.executable, __file__, "--child", variant, "--dir", str(out),
           "--params-mb", str(params_mb)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    shutil.rmtree(out, ignore_errors=True)
    return dict(json.loads(res.stdout.splitlines()[-1]))


def table(results: dict[str, dict[str, Any]]) -> str:
    plain = results["torch.save one dict"]["peak_above_mb"]
    buffered = results["torch.save one dict via BytesIO"]["peak_above_mb"]
    lines = ["| variant | RSS before save (MiB) | peak above it (MiB) | / one dict "
             "| / one dict via BytesIO | written (MiB) | left in page cache (MiB) | seconds |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        peak = r["peak_above_mb"]
        cached = "n/a" if r["cached_mb"] is None else f"{r['cached_mb']:.0f}"
        lines.append(f"| {name} | {r['baseline_mb']:.0f} | {peak:.1f} | {peak / plain:.2f}x "
                     f"| {peak / buffered:.4f}x | {r['written_mb']:.0f} | {cached} "
                     f"| {r['seconds']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-mb", type=int, default=300, help="model weights, MiB (fp32)")
    parser.add_argument("--dir", type=Path, default=Path("bench/out/save_rss"))
    parser.add_argument("--child", choices=sorted(VARIANTS.values()), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.dir, args.params_mb)))
        return
    results = {name: run_variant(v, args.dir / v, args.params_mb) for name, v in VARIANTS.items()}
    print(table(results))


if __name__ == "__main__":
    main()
