"""Child processes of the memory benchmark: a trainer that saves its state asynchronously into a
daemon's root and is SIGKILLed, a fresh trainer that loads it back from a chosen tier (timed
from the load call to its return, then every tensor checked), and a training loop of fixed work
per step. Each prints one JSON line on stdout.

Runs only what the parent asks; never touches the daemon except through ckptd.torch and the
client, as a trainer does.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import time
from pathlib import Path
from typing import Any

T0 = time.perf_counter()  # before torch is imported: `ready_s` counts from here

import torch  # noqa: E402
from resume_worker import _model, check, digest, flat_state  # noqa: E402

import ckptd.torch  # noqa: E402

TRAIN_STEPS = 2


def shape(size: int) -> tuple[int, int]:
    """(width, layers) of an fp32 MLP whose parameters and Adam state take about `size` bytes
    (12 bytes a parameter: the weight and Adam's two moments)."""
    params = size // 12
    width = 4096 if params >= 2 * 4096 * 4096 else 2048
    return width, max(1, round(params / (width * width + width)))


def save_and_die(args: argparse.Namespace) -> None:
    """Train a little, save with blocking=False, wait until the daemon has the files, note
    what was saved in `--expect`, then SIGKILL this process: a trainer that dies on a healthy
    node after its last save."""
    torch.manual_seed(args.seed)
    width, layers = shape(args.size)
    model = _model(width, layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for _ in range(TRAIN_STEPS):
        model(torch.randn(8, width)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = flat_state(model, opt)
    Path(args.expect).write_text(json.dumps({
        "width": width, "layers": layers, "tensors": {k: digest(v) for k, v in state.items()},
        "state_bytes": sum(v.numel() * v.element_size() for v in state.values())}))
    started = time.perf_counter()
    handle = ckptd.torch.save(args.root, args.step, model=model, optimizer=opt,
                              blocking=False, metrics={"loss": 0.5})
    copied = time.perf_counter()
    if not handle.wait(args.timeout) or handle.error is not None:
        raise SystemExit(f"the async save did not finish: {handle.error}")
    print(json.dumps({"copy_s": copied - started, "persist_s": time.perf_counter() - copied}),
          flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def load(args: argparse.Namespace) -> dict[str, Any]:
    """A fresh trainer's model and Adam optimizer, filled by ckptd.torch.load from `--source`;
    `load_s` is the load call alone, then every tensor is checked against the saved digests."""
    doc = json.loads(Path(args.expect).read_text())
    model = _model(doc["width"], doc["layers"], "meta").to_empty(device="cpu")
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    started = time.perf_counter()
    step, meta = ckptd.torch.load(args.root, args.step, model=model, optimizer=opt,
                                  source=args.source, remote=args.remote or None,
                                  config=args.config or None)
    loaded = time.perf_counter()
    checked = check(flat_state(model, opt), doc["tensors"])
    if step != args.step:
        raise SystemExit(f"loaded step {step}, not {args.step}")
    return {"ready_s": started - T0, "load_s": loaded - started,
            "check_s": time.perf_counter() - loaded, "checked": checked,
            "source": meta.get("source", "")}


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Steps of fixed work (matmuls of a `--width` square on the CPU): `--steps` of them, or
    with `--until` (a file) as many as run until it appears, then `--steps` more. Writes
    `--ready` (a file) after a warm-up step, so the parent can start what the loop is to run
    beside; each step's start and end (epoch seconds) are returned."""
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    a = torch.randn(args.width, args.width)
    b = torch.randn(args.width, args.width)
    (a @ b).sum().item()
    if args.ready:
        Path(args.ready).write_text("ready")
    steps: list[tuple[float, float]] = []
    last = 0 if args.until else int(args.steps)

    def more() -> bool:
        nonlocal last
        if not last and (Path(args.until).exists() or len(steps) >= 100_000):
            last = len(steps) + int(args.steps)
        return not last or len(steps) < last

    while more():
        t = time.time()
        c = a
        for _ in range(args.matmuls):
            c = torch.tanh(c @ b)
        c.sum().item()
        steps.append((t, time.time()))
    return {"steps": steps, "threads": torch.get_num_threads()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["save", "load", "train"])
    p.add_argument("--root", default="")
    p.add_argument("--step", type=int, default=1)
    p.add_argument("--size", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--expect", default="")
    p.add_argument("--source", default="auto", choices=["auto", "memory", "local", "remote"])
    p.add_argument("--remote", default="", help="the root's remote url, for source=remote")
    p.add_argument("--config", default="", help="the daemon's config, for the root's remote")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--matmuls", type=int, default=4)
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    p.add_argument("--ready", default="", help="a file written once warmed up")
    p.add_argument("--until", default="", help="run steps until this file exists")
    args = p.parse_args()
    if args.command == "save":
        save_and_die(args)
        return
    out = load(args) if args.command == "load" else train(args)
    out["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(out))


if __name__ == "__main__":
    main()
