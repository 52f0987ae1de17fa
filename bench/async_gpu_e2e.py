"""On a CUDA machine: async saves of a GPU model through a real daemon, end to end.

A small training loop on the GPU saves every `--every` steps with `blocking=False`; each save's
blocked time is timed beside a blocking `ckptd.torch.save` and a `torch.save` of the same state,
then every step is awaited valid in the daemon and loaded back and compared with the values the
model held when `save` returned (the parameters are changed right after each save returns).

    PYTHONPATH=.:tests python3 bench/async_gpu_e2e.py --params-mb 512 --steps 12 --every 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from support.config import write_layout
from support.proc import DaemonHandle, wait_for_state

import ckptd.torch as ckpt
from ckptd.client import Client

MB = 1 << 20


DEV = "cuda"


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def build(params_mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    width = 4096
    layers = max(1, round(params_mb * MB / (width * width * 4)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(DEV)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(64, 4096, device=DEV)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN included, which torch.equal never calls equal)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--params-mb", type=int, default=512)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    global DEV
    DEV = args.device
    base = Path(tempfile.mkdtemp(prefix="gpu-e2e-"))
    sock_dir = Path(tempfile.mkdtemp(prefix="ck-", dir="/tmp"))
    keep_all = {"local": {"keep_last": 1000}}  # every saved step stays to be loaded back
    layout = write_layout(base, sock_dir / "d.sock", [{"name": "r", "retention": keep_all}],
                          log_level="info")
    daemon = DaemonHandle(layout, base / "daemon.log").start()
    root = layout.roots["r"]
    client = Client(layout.socket, timeout=10.0)
    results: dict[str, object] = {"device": torch.cuda.get_device_name() if DEV == "cuda" else DEV,
                                  "torch": torch.__version__}
    try:
        model, opt = build(args.params_mb)
        train_step(model, opt)
        results["state_mb"] = 3 * sum(t.numel() * 4 for t in model.parameters()) / MB
        blocked, expect, handles = [], {}, []
        for step in range(1, args.steps + 1):
            train_step(model, opt)
            if step % args.every:
                continue
            sync()
            t = time.perf_counter()
            h = ckpt.save(root, step, model=model, optimizer=opt, blocking=False, client=client)
            blocked.append(time.perf_counter() - t)
            handles.append(h)
            expect[step] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
            with torch.no_grad():  # snapshot semantics: the save holds the values before this
                for prm in model.parameters():
                    prm.neg_()  # changes every value, keeps the scale (adding would overflow)
        ok = all(h.wait(600) for h in handles)
        results["async_blocked_s"] = blocked
        results["handles_ok"] = ok and all(h.error is None for h in handles)
        results["handle_errors"] = [h.error for h in handles if h.error]
        for step, state in expect.items():
            wait_for_state(client, "r", step, "valid", 300, daemon.log_text)
            m2, _ = build(args.params_mb)
            ckpt.load(root, step=step, model=m2, map_location=DEV)
            got = {k: v.cpu() for k, v in m2.state_dict().items()}
            same = all(bitwise_equal(state[k], v) for k, v in got.items())
            results[f"step_{step}_values_equal"] = same
            if not same:
                results[f"step_{step}_diff"] = {
                    k: [float((v - state[k]).abs().max()), bitwise_equal(v, -state[k])]
                    for k, v in got.items() if not bitwise_equal(v, state[k])}
            del m2
        sync()
        t = time.perf_counter()
        ckpt.save(root, 10_000, model=model, optimizer=opt, client=client)
        results["blocking_ckptd_s"] = time.perf_counter() - t
        t = time.perf_counter()
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, base / "t.pt")
        results["torch_save_s"] = time.perf_counter() - t
        results["async_blocked_median_s"] = statistics.median(blocked[1:] or blocked)
        results["ratio_async_vs_blocking"] = (results["async_blocked_median_s"]
                                              / results["blocking_ckptd_s"])
    finally:
        daemon.stop()
        print(daemon.log_text()[-3000:])
        print(json.dumps(results, indent=1))
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(sock_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
