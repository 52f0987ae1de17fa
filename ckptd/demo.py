"""`ckptd demo`: the daemon on local directories beside a small torch training loop.

Starts `ckptd run` on `config.example.toml` (two roots under ./.demo, a file:// remote), trains a
tiny model that saves with `ckptd.torch.save` and with plain `torch.save` (one save deliberately
corrupted), and shows `ckptd status` / `ckptd ls` as the pipeline goes. Ends within a minute.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ckptd import fileio, needs_torch, torch_version
from ckptd.client import Client, ClientError
from ckptd.errors import UsageError

DEMO_DIR = Path(".demo")
EXAMPLE = Path("config.example.toml")
SAVE_EVERY = 20
STEPS = 120


def run_demo() -> int:
    if torch_version() is None:  # it trains a model; the daemon itself needs no torch
        raise UsageError(f"ckptd {needs_torch('demo')}")
    config_path = _config_file()
    from ckptd.config import load_config

    cfg = load_config(config_path)
    if len(cfg.roots) < 2:
        print("the demo needs a config with two roots (native saves and single-file saves)")
        return 2
    native_root, single_root = cfg.roots[0], cfg.roots[1]
    _reset(cfg)
    env = {**os.environ, "CKPTD_SOCKET": str(cfg.daemon.socket)}
    daemon = subprocess.Popen(
        [sys.executable, "-m", "ckptd", "run", "--config", str(config_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    threading.Thread(target=_echo_daemon, args=(daemon,), daemon=True).start()
    client = Client(cfg.daemon.socket, timeout=5.0)
    try:
        if not _wait_ready(client, daemon):
            print("demo: the daemon did not come up")
            return 1
        _train(native_root, single_root, client, config_path)
        return _finish(native_root.name, single_root.name, client, config_path)
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()


def _config_file() -> Path:
    if EXAMPLE.exists():
        return EXAMPLE
    raise SystemExit("run `ckptd demo` from the repository root (it uses config.example.toml)")


def _reset(cfg: Any) -> None:
    """Start from empty demo directories (only ever inside ./.demo)."""
    for p in [cfg.daemon.state_dir, *(r.path for r in cfg.roots)]:
        p = Path(p)
        if DEMO_DIR.resolve() in p.resolve().parents and p.exists():
            fileio.remove_tree(p)
        p.mkdir(parents=True, exist_ok=True)
    for r in cfg.roots:
        url = r.upload.url
        if url.startswith("file://"):
            remote = Path(url[len("file://"):])
            if DEMO_DIR.resolve() in remote.resolve().parents and remote.exists():
                fileio.remove_tree(remote)


def _echo_daemon(proc: subprocess.Popen[str]) -> None:
    """Show the daemon's JSON log lines as one short line per event."""
    assert proc.stdout is not None
    for line in proc.stdout:
        try:
            ev = json.loads(line)
        except ValueError:
            print(f"  [daemon] {line.rstrip()}")
            continue
        keys = " ".join(f"{k}={v}" for k, v in ev.items()
                        if k not in ("event", "level", "timestamp") and v is not None)
        print(f"  [daemon] {ev.get('event', '?')} {keys}")


def _wait_ready(client: Client, proc: subprocess.Popen[str], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if client.request("GET", "/v1/health")[0] == 200:
                return True
        except ClientError:
            pass  # not listening yet
        time.sleep(0.2)
    return False


def _train(native_root: Any, single_root: Any, client: Client, config_path: Path) -> None:
    import torch

    import ckptd.torch as ct

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(256, 16)
    y = x.sum(dim=1, keepdim=True)
    for step in range(1, STEPS + 1):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        if step % SAVE_EVERY:
            continue
        val = loss.item()
        print(f"\n== step {step}: loss {val:.4f}; saving")
        ct.save(native_root.path, step, model=model, optimizer=opt, metrics={"val_loss": val},
                root_name=native_root.name, client=client)
        path = Path(single_root.path) / f"model_step_{step}.pt"
        torch.save({"model": model.state_dict(), "step": step}, path)
        if step == STEPS - SAVE_EVERY:
            _corrupt(path)
            print(f"   (flipped one byte inside a tensor of {path.name}: it must come out invalid)")
        client.register(single_root.name, step, paths=[str(path)], metrics={"val_loss": val})
        time.sleep(1.0)
        _cli("status", config_path)


def _corrupt(path: Path) -> None:
    """Flip one byte in the middle of the file (inside tensor data): torch.load misses this."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def _finish(native: str, single: str, client: Client, config_path: Path) -> int:
    last = (STEPS // SAVE_EVERY) * SAVE_EVERY
    print("\n== waiting for the pipeline to finish")
    client.wait(native, last, until="valid", timeout=30)
    client.wait(single, last, until="valid", timeout=30)
    for root in (native, single):
        print(f"\n== ckptd ls {root}")
        _cli("ls", config_path, root)
        print(f"\n== ckptd latest {root}")
        _cli("latest", config_path, root)
    corrupted = client.checkpoint(single, last - SAVE_EVERY)
    ok = corrupted is not None and corrupted["state"] == "invalid"
    print(f"\n== the corrupted save (step {last - SAVE_EVERY}) is "
          f"{corrupted['state'] if corrupted else 'unknown'}"
          f" ({corrupted['reason'] if corrupted else '-'})")
    print("demo finished" if ok else "demo: the corrupted save was not caught")
    return 0 if ok else 1


def _cli(*args: str | Path) -> None:
    cmd, config_path, *rest = args
    subprocess.run([sys.executable, "-m", "ckptd", str(cmd), *map(str, rest), "--config",
                    str(config_path)], check=False)
