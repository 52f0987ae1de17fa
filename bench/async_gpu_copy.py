"""On a CUDA machine: how long the copy of an async save blocks (device -> host into the arena)
beside a blocking torch.save and a blocking ckptd.torch.save of the same GPU state. No daemon:
it times the trainer's side of the hand-off, `_Arena.fill`, which is all an async save waits for.

    PYTHONPATH=. python3 bench/async_gpu_copy.py --params-mb 1024 --repeat 3 --dir /tmp/gpu

Variants (each --repeat times, medians): torch.save of {"model", "optim"} to a file (torch copies
each storage to the host, then writes); ckptd.torch.save (blocking, fsynced); the arena copy as
ckptd does it (each storage copied device -> arena, the arena registered as pinned memory,
non-blocking copies, one synchronize); the arena copy through a pinned host copy of each
component first (how it was done before); and through pageable host memory (`.to("cpu")`). Also
the host RSS peak above the start of each variant (the arena's own pages count in the first
arena variant's first run only: it is reused). `--device cpu` runs the same variants on CPU
tensors (a check that the script runs; the timings mean little there).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import ckptd.torch as ckpt
from ckptd.torch import _async, _native

MB = 1 << 20


def status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Any, repeat: int) -> dict[str, float]:
    times, peaks = [], []
    for i in range(repeat):
        sync()
        Path("/proc/self/clear_refs").write_text("5")
        base = status_mb("VmRSS")
        t = time.perf_counter()
        fn(i)
        sync()
        times.append(time.perf_counter() - t)
        peaks.append(status_mb("VmHWM") - base)
    return {"first_s": times[0], "median_s": statistics.median(times),
            "peak_rss_above_mb": max(peaks)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--params-mb", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", type=Path, default=Path("/tmp/gpu_copy"))
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    dev = args.device
    width = 4096
    layers = max(1, round(args.params_mb * MB / (width * width * 4)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    model(torch.randn(8, width, device=dev)).pow(2).mean().backward()
    opt.step()
    state_mb = 3 * sum(t.numel() * 4 for t in model.parameters()) / MB
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    arena = _async._Arena(_async.INITIAL_ARENA)

    def torch_save(i: int) -> None:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, args.dir / "t.pt")

    def ckptd_blocking(i: int) -> None:
        ckpt.save(args.dir, i, model=model, optimizer=opt, register=False)
        shutil.rmtree(args.dir / f"step-{i}")

    def arena_pinned(i: int) -> None:
        arena.fill(_native._parts(0, model, opt, None, None, None, None))

    def arena_staged(i: int) -> None:
        parts = [(n, c, (lambda b=b: _async._to_host(b()))) for n, c, b in
                 _native._parts(0, model, opt, None, None, None, None)]
        arena.fill(parts)
        empty_cache = getattr(torch._C, "_host_emptyCache", None)
        if empty_cache is not None:
            empty_cache()

    def arena_pageable(i: int) -> None:
        parts = [(n, c, (lambda b=b: _pageable(b()))) for n, c, b in
                 _native._parts(0, model, opt, None, None, None, None)]
        arena.fill(parts)

    results = {"state_mb": state_mb,
               "gpu": torch.cuda.get_device_name() if dev == "cuda" else dev,
               "torch": torch.__version__}
    for name, fn in (("torch.save to a file", torch_save),
                     ("ckptd.torch.save (blocking)", ckptd_blocking),
                     ("arena copy, straight into the arena (async save)", arena_pinned),
                     ("arena copy, pinned staging per component", arena_staged),
                     ("arena copy, pageable", arena_pageable)):
        results[name] = timed(fn, args.repeat)
        print(name, json.dumps(results[name]), flush=True)
    results["arena registered as pinned"] = {"registered": arena.pinned.span is not None,
                                             "failed": arena.pinned.failed}
    print(json.dumps(results))


def _pageable(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to("cpu")
    if isinstance(obj, dict):
        return {k: _pageable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_pageable(v) for v in obj)
    return obj


if __name__ == "__main__":
    main()
