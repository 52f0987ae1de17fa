"""The daemons and children of the memory benchmark (bench/memory_bench.py): a real `ckptd run`
per node with its own config, dirs and socket; a trainer that saves asynchronously and is
SIGKILLed; a fresh process per load, timed; what a daemon says of the memory it holds.

Starts and stops only its own processes, by PID; reads the daemons only through their socket,
their /proc entry and their logs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests"))  # the config helpers the tests use

import upload_bench as ub  # noqa: E402  (child timing)
from support.config import toml_value, write_layout  # noqa: E402

from ckptd.client import Client  # noqa: E402

WORKER = str(HERE / "memory_worker.py")
ROOT = "bench"
STEP = 1


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
        return Path(self.layout.roots[name])

    def start(self) -> Daemon:
        """Start it and wait until it answers."""
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


def node(work: Path, name: str, env: dict[str, str], server: Any, secret: Path) -> Daemon:
    """A daemon `name` of the pair: the shared root name and bucket, its own dirs and socket."""
    up = {"url": server.url("memory-bench"), "endpoint": server.endpoint,
          "region": server.region, "access_key_id": server.access_key,
          "secret_access_key": server.secret_key}
    return Daemon(work / name, Path(f"/tmp/ckptd-mem-{os.getpid()}-{name}.sock"),
                  [{"name": ROOT, "upload": up}], env, node=name,
                  memory={"replicas": 1, "listen": "127.0.0.1:0", "secret_file": str(secret)})


def memory_of(d: Daemon) -> dict[str, Any]:
    """The root's entry of `ckptd status --json`'s memory, and the daemon's totals."""
    doc = (d.client.status() or {}).get("memory") or {}
    root: dict[str, Any] = next((r for r in doc.get("roots", []) if r.get("name") == ROOT), {})
    return {**root, "peer_bytes_total": doc.get("peer_bytes", 0)}


def replicated(n0: Daemon, peer: str, step: int, timeout: float = 1800.0) -> float:
    """Wait until `n0` says `peer` holds its `step`; the seconds waited."""
    started = time.monotonic()
    while not any(h.get("node") == peer and h.get("step") == step
                  for h in memory_of(n0).get("held_by", [])):
        if time.monotonic() - started > timeout:
            raise SystemExit(f"{peer} never held step {step}: {n0.log_tail()}")
        time.sleep(0.05)
    return time.monotonic() - started


def replace(d: Daemon) -> None:
    """The node is lost: its daemon killed, its root and state wiped; a new daemon, same id."""
    d.stop(signal.SIGKILL)
    d.layout.socket.unlink(missing_ok=True)
    shutil.rmtree(d.root())
    d.root().mkdir()
    shutil.rmtree(d.layout.state_dir, ignore_errors=True)
    d.start()


def vm_hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def events(d: Daemon, name: str) -> list[dict[str, Any]]:
    """The JSON log events `name` of `d`, each with its time as epoch seconds (`ts`)."""
    out = []
    for line in d.log.read_text(errors="replace").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if isinstance(e, dict) and e.get("event") == name and "timestamp" in e:
            out.append({**e, "ts": datetime.fromisoformat(e["timestamp"]).timestamp()})
    return out
