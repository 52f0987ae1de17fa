"""deploy/slurm run for real, no Slurm needed: train.sbatch with a one-node stand-in for srun
starts a real daemon through ckptd-job.sh, a real trainer saves when USR1 reaches the batch
script, the drain waits until that save is in the file:// remote and stops the daemon; and a
drain gives up, saying why, when the remote does not answer. Every process is ended by its id
(its process group) even when a test fails."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support.proc import parse_events
from support.wait import wait_until

REPO = Path(__file__).resolve().parents[2]
SLURM = REPO / "deploy" / "slurm"
HELPER = SLURM / "ckptd-job.sh"
SBATCH = SLURM / "train.sbatch"
SCRIPTS = sorted([*SLURM.glob("*.sh"), *SLURM.glob("*.sbatch")])
VENV_BIN = Path(sys.executable).parent

# srun on one node: drop the options (train.sbatch writes each as --name=value) and run the
# command in place, so the PID the batch script signals is the task's, as srun forwards it.
FAKE_SRUN = """#!/bin/bash
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
exec "$@"
"""


# The trainer train.sbatch runs, without torch (train_example.py imports it: seconds per start):
# it trains until USR1, then saves one safetensors file, registers it and exits 0.
TRAINER = """
import argparse, json, pathlib, signal, struct, sys, time
from ckptd.client import Client

ap = argparse.ArgumentParser()
ap.add_argument("--root")
ap.add_argument("--root-name")
args = ap.parse_args()
stop = False
def on_usr1(signum, frame):
    global stop
    stop = True
signal.signal(signal.SIGUSR1, on_usr1)
print("training from step 0", flush=True)
step = 0
while not stop:
    step += 1
    time.sleep(0.02)
header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
root = pathlib.Path(args.root)
root.mkdir(parents=True, exist_ok=True)
(root / f"model_step_{step}.safetensors").write_bytes(
    struct.pack("<Q", len(header)) + header + bytes(16))
assert Client(strict=True).register(args.root_name, step)
print(f"saved step {step}", flush=True)
print(f"stopping after step {step} (SIGUSR1)", flush=True)
"""


class Procs:
    """Processes a test starts, each in its own process group, ended by that id at teardown."""

    def __init__(self) -> None:
        self.groups: list[subprocess.Popen[bytes]] = []
        self.pidfiles: list[Path] = []

    def popen(self, args: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        proc: subprocess.Popen[bytes] = subprocess.Popen(args, start_new_session=True, **kw)
        self.groups.append(proc)
        return proc

    def run(self, args: list[str], timeout: float, **kw: Any) -> tuple[int, str, str]:
        """(status, stdout, stderr) of a command run to its end."""
        proc = self.popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")

    def close(self) -> None:
        for pidfile in self.pidfiles:  # a daemon `start` left behind outlives its group leader
            pid = _read_pid(pidfile)
            if pid is not None and _is_ckptd(pid):
                os.kill(pid, signal.SIGKILL)
        for proc in self.groups:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)


def _read_pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _is_ckptd(pid: int) -> bool:
    """Alive (not a zombie) and running `ckptd ... run`."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in "ZX" and "ckptd" in cmd and " run " in cmd


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def job_env(tmp_path: Path, short_dir: Path) -> dict[str, str]:
    """The environment Slurm gives a one-node job, the stand-in srun first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(FAKE_SRUN)
    srun.chmod(0o755)
    ckptd = VENV_BIN / "ckptd"
    if not ckptd.exists():  # an environment without the console script
        ckptd = bin_dir / "ckptd"
        ckptd.write_text(f'#!/bin/sh\nexec {sys.executable} -m ckptd "$@"\n')
        ckptd.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "CKPTD_"))}
    env.update(
        PATH=f"{bin_dir}:{VENV_BIN}:{env.get('PATH', '/usr/bin:/bin')}",
        AWS_EC2_METADATA_DISABLED="true", PYTHONUNBUFFERED="1",
        SLURM_JOB_ID="4242", SLURM_SUBMIT_DIR=str(REPO), SLURM_JOB_NUM_NODES="1",
        SLURMD_NODENAME="node0",
        CKPTD_JOB_DIR=str(short_dir / "job"), CKPTD_BIN=str(ckptd),
        CKPTD_PYTHON=sys.executable, CKPTD_SCAN_INTERVAL="1s",
    )
    return env


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse(script: Path) -> None:
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr


def test_example_trainer_compiles() -> None:
    example = SLURM / "train_example.py"
    compile(example.read_text(), str(example), "exec")


# `scontrol show hostnames LIST` for a job whose first node is this machine.
FAKE_SCONTROL = """#!/bin/bash
[[ $1 == show && $2 == hostnames && -n $3 ]] || { echo "scontrol: unexpected: $*" >&2; exit 1; }
printf 'localhost\\nnode1\\n'
"""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ranks(procs: Procs, tmp_path: Path, run: str, argv: list[str],
           env: dict[str, str]) -> list[tuple[subprocess.Popen[bytes], Path]]:
    """train_example.py as srun starts it for a 2-task job on one node: each task its own
    SLURM_PROCID, the rendezvous left to the trainer (no MASTER_ADDR)."""
    port = str(_free_port())
    started = []
    for rank in range(2):
        out = tmp_path / f"{run}.rank{rank}.out"
        with open(out, "wb") as sink:
            started.append((procs.popen(
                [sys.executable, str(SLURM / "train_example.py"), *argv], cwd=tmp_path,
                env={**env, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
                     "MASTER_PORT": port},
                stdout=sink, stderr=subprocess.STDOUT), out))
    return started


def _wait_for_line(proc: subprocess.Popen[bytes], out: Path, line: str) -> None:
    wait_until(lambda: line in out.read_text().splitlines() or proc.poll() is not None, 60,
               repr(line), detail=out.read_text)
    assert proc.poll() is None, out.read_text()


def _meta(root: Path, step: int) -> dict[str, Any]:
    """step-<step>/meta.json, checked to name both ranks' files in the one node directory."""
    meta: dict[str, Any] = json.loads((root / f"step-{step}" / "meta.json").read_text())
    assert (meta["step"], meta["world_size"], meta["nodes"]) == (step, 2, 1)
    assert {(f["path"], f.get("rank")) for f in meta["files"]} == {
        ("model.pt", None), ("optim.rank0.pt", 0), ("optim.rank1.pt", 1),
        ("rng.rank0.pt", 0), ("rng.rank1.pt", 1)}
    return meta


class _Taken:
    """An optimizer's state as `ckptd.torch.load` hands it over. (A torch.optim optimizer here
    would import torch._dynamo on first use: seconds of this test's time, for nothing it
    checks; the trainers resume real AdamW optimizers.)"""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def test_example_trainer_runs_as_two_ranks(tmp_path: Path, procs: Procs) -> None:
    """train_example.py as two tasks of a job on this machine, no daemon: torch.distributed
    over gloo from the Slurm variables (the first node from scontrol). Both ranks save step 2;
    USR1 reaching one rank only stops both after saving the same step; a rerun resumes every
    rank from that step, each with its own optimizer state, and its save loads back."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
    (bin_dir / "scontrol").chmod(0o755)
    root = tmp_path / "ckpt" / "run1"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM", "CKPTD_", "MASTER_"))}
    env.update(PATH=f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}", PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1", SLURM_JOB_ID="4242", SLURM_NTASKS="2", SLURM_NODEID="0",
               SLURM_JOB_NODELIST="localhost,node1",
               CKPTD_SOCKET=str(tmp_path / "no-daemon.sock"))  # registering fails: a warning
    args = ["--root", str(root), "--root-name", "run1"]

    first = _ranks(procs, tmp_path, "first", [*args, "--save-every", "2",
                                              "--step-seconds", "0.05"], env)
    for rank, (proc, out) in enumerate(first):
        _wait_for_line(proc, out, f"rank {rank}/2: training from step 0")
        _wait_for_line(proc, out, f"rank {rank}: saved step 2")
    os.kill(first[1][0].pid, signal.SIGUSR1)  # one rank hears it
    stopped = set()
    for rank, (proc, out) in enumerate(first):
        assert proc.wait(timeout=60) == 0, out.read_text()
        text = out.read_text()
        saved = [int(s) for s in re.findall(rf"^rank {rank}: saved step (\d+)$", text, re.M)]
        # Every second step, then the step USR1 stopped at.
        assert saved[:-1] == list(range(2, saved[-1], 2)) and saved[-1] > 2, text
        assert f"rank {rank}: stopping after step {saved[-1]} (SIGUSR1)" in text, text
        stopped.add(saved[-1])
    step, = stopped  # the same step on every rank
    _meta(root, 2)
    _meta(root, step)

    second = _ranks(procs, tmp_path, "second", [*args, "--steps", str(step + 1)], env)
    for rank, (proc, out) in enumerate(second):
        assert proc.wait(timeout=60) == 0, out.read_text()
        lines = out.read_text().splitlines()
        assert f"rank {rank}/2: training from step {step}" in lines, lines
        assert f"rank {rank}: saved step {step + 1}" in lines, lines
    assert _meta(root, step + 1)["metrics"].keys() == {"loss"}

    import torch

    import ckptd.torch as ct

    loaded = []
    for rank in range(2):
        model, opt = torch.nn.Linear(64, 64), _Taken()
        assert ct.load(root, step + 1, model=model, optimizer=opt, rank=rank)[0] == step + 1
        loaded.append((model.state_dict(), opt.state_dict()))
    (model0, optim0), (model1, optim1) = loaded
    assert all(torch.equal(model0[k], model1[k]) for k in model0)
    assert optim0["param_groups"][0]["lr"] == optim1["param_groups"][0]["lr"] == 1e-3
    for state0, state1 in zip(optim0["state"].values(), optim1["state"].values(), strict=True):
        # Each rank's Adam state went on from the saved step: it was loaded, not started anew.
        assert float(state0["step"]) == float(state1["step"]) == step + 1
        # DDP averaged the ranks' gradients: both ranks' moments are the same, bit for bit.
        assert all(torch.equal(state0[k], state1[k]) for k in ("exp_avg", "exp_avg_sq"))


def test_scripts_pass_shellcheck() -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    res = subprocess.run(["shellcheck", "-x", *map(str, SCRIPTS)], capture_output=True,
                         text=True, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def test_usr1_saves_uploads_then_stops(tmp_path: Path, job_env: dict[str, str],
                                       procs: Procs) -> None:
    """USR1 to the batch script: the trainer saves and exits, the drain waits until that step
    is committed in the remote, the daemon stops cleanly, the script exits 0."""
    root, remote = tmp_path / "ckpt" / "run1", tmp_path / "remote"
    remote.mkdir()
    trainer = tmp_path / "trainer.py"
    trainer.write_text(TRAINER)
    env = {**job_env, "CKPTD_ROOT": str(root), "CKPTD_ROOT_NAME": "run1",
           "CKPTD_UPLOAD_URL": f"file://{remote}", "CKPTD_NODES": "1", "CKPTD_SETTLE": "200ms",
           "TRAIN_SCRIPT": str(trainer), "SAVE_GRACE": "60", "DRAIN_TIMEOUT": "60",
           "REQUEUE": "no"}
    log = tmp_path / "job.out"
    with open(log, "wb") as sink:
        batch = procs.popen(["bash", str(SBATCH)], cwd=tmp_path, env=env, stdout=sink,
                            stderr=subprocess.STDOUT)

    def text() -> str:
        return log.read_text(errors="replace")

    wait_until(lambda: "training from step 0" in text() or batch.poll() is not None, 60,
               "the trainer to start", detail=text)
    assert batch.poll() is None, text()
    os.kill(batch.pid, signal.SIGUSR1)  # what --signal=B:USR1@600 does
    assert batch.wait(timeout=120) == 0, text()

    out = text()
    saved = [int(s) for s in re.findall(r"^saved step (\d+)$", out, re.M)]
    assert len(saved) == 1 and f"stopping after step {saved[0]} (SIGUSR1)" in out, out
    step = saved[0]
    manifest = json.loads((remote / "run1" / f"step-{step}" / "MANIFEST.json").read_text())
    assert (manifest["root"], manifest["step"]) == ("run1", step)
    assert f"run1 step {step}: uploaded" in out
    assert "trainer exited 0, drain 0, ckptd 0" in out  # ckptd's own exit status, via srun
    assert parse_events(out, "daemon_stopped") and parse_events(out, "flush_requested")
    job_dir = Path(env["CKPTD_JOB_DIR"])
    assert not (job_dir / "ckptd.pid").exists() and not (job_dir / "ckptd.sock").exists()


def _refused_port() -> socket.socket:
    """A bound TCP port nobody listens on: connecting is refused at once."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    return s


def _safetensors(path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))


def test_drain_gives_up_when_the_remote_is_unreachable(tmp_path: Path, job_env: dict[str, str],
                                                      procs: Procs) -> None:
    """The remote refuses every connection: the drain stops waiting at its timeout, says which
    step and why, exits 1, and still stops the daemon."""
    root = tmp_path / "ckpt" / "r"
    root.mkdir(parents=True)
    _safetensors(root / "model_step_7.safetensors")
    with _refused_port() as port:
        roots = tmp_path / "roots.toml"
        roots.write_text(f"""
[[roots]]
name = "r"
path = "{root}"
settle = "200ms"
[roots.upload]
url = "s3://bucket/prefix"
endpoint = "http://127.0.0.1:{port.getsockname()[1]}"
region = "us-east-1"
access_key_id = "test-key"
secret_access_key = "test-secret"
connect_timeout = "1s"
attempts = 1
""")
        env = {**job_env, "CKPTD_JOB_ROOTS": str(roots)}
        job_dir = Path(env["CKPTD_JOB_DIR"])
        procs.pidfiles.append(job_dir / "ckptd.pid")
        rc, out, err = procs.run([str(HELPER), "start", "--timeout", "60"], 90, env=env)
        assert rc == 0, err
        assert f"export CKPTD_SOCKET={job_dir / 'ckptd.sock'}" in out.splitlines()
        pid = _read_pid(job_dir / "ckptd.pid")
        assert pid is not None and _is_ckptd(pid)
        rc, _, err = procs.run([str(HELPER), "start"], 30, env=env)
        assert rc == 75 and f"already runs here (pid {pid})" in err, err
        # --keep (a node's service): the same wait, over the socket, and the daemon stays up.
        service = {**env, "CKPTD_SOCKET": str(job_dir / "ckptd.sock"),
                   "CKPTD_CONFIG": str(job_dir / "ckptd.toml")}
        rc, _, err = procs.run([str(HELPER), "drain", "--keep", "--timeout", "1", "r=7"], 30,
                               env=service)
        assert rc == 1 and "r step 7 is not uploaded after 1 s" in err, err
        assert _is_ckptd(pid) and "stopping" not in err

        t0 = time.monotonic()
        rc, out, err = procs.run([str(HELPER), "drain", "--timeout", "3", "r=7"], 90, env=env)
        took = time.monotonic() - t0
    assert rc == 1, err
    assert re.search(r"r step 7 is not uploaded after 3 s \(state valid, remote \w+; last error:"
                     r" upload: .+\): giving up", err), err
    assert f"ckptd (pid {pid}) stopped" in err
    assert 3 <= took < 60, took
    wait_until(lambda: not _is_ckptd(pid), 10, "the daemon to be gone")
    log = (job_dir / "ckptd.log").read_text()
    assert parse_events(log, "daemon_stopped"), log[-3000:]


def test_drain_on_a_standby_waits_for_the_acting_daemon(tmp_path: Path, short_dir: Path,
                                                        job_env: dict[str, str],
                                                        procs: Procs) -> None:
    """Two daemons on one shared root: the second stands by. A drain there (--keep, as on a
    node's service) waits for what the acting daemon publishes; `stop` ends each by its PID."""
    root, remote = tmp_path / "shared" / "r", tmp_path / "remote"
    root.mkdir(parents=True)
    remote.mkdir()
    roots = tmp_path / "roots.toml"
    roots.write_text(f'[[roots]]\nname = "r"\npath = "{root}"\nsettle = "200ms"\n'
                     f'upload.url = "file://{remote}"\n')
    envs = []
    for node in ("a", "b"):
        env = {**job_env, "CKPTD_JOB_ROOTS": str(roots), "CKPTD_NODE": node,
               "CKPTD_JOB_DIR": str(short_dir / node)}
        procs.pidfiles.append(short_dir / node / "ckptd.pid")
        rc, _, err = procs.run([str(HELPER), "start", "--timeout", "60"], 90, env=env)
        assert rc == 0, err
        envs.append(env)
    _safetensors(root / "model_step_3.safetensors")

    standby = {**envs[1], "CKPTD_SOCKET": str(short_dir / "b" / "ckptd.sock"),
               "CKPTD_CONFIG": str(short_dir / "b" / "ckptd.toml")}
    rc, _, err = procs.run([str(HELPER), "drain", "--keep", "--timeout", "60", "r=3"], 90,
                           env=standby)
    assert rc == 0, err
    assert "r: a acts on this root" in err and "r step 3: uploaded (by a)" in err, err
    assert (remote / "r" / "step-3" / "MANIFEST.json").is_file()
    for node, env in zip("ab", envs, strict=True):
        pid = _read_pid(short_dir / node / "ckptd.pid")
        assert pid is not None and _is_ckptd(pid)
        rc, _, err = procs.run([str(HELPER), "stop"], 90, env=env)
        assert rc == 0 and f"ckptd (pid {pid}) stopped" in err, err
        assert not _is_ckptd(pid)  # `stop` returns once the process is gone


def test_helper_says_what_is_missing(tmp_path: Path, job_env: dict[str, str]) -> None:
    """No job id, no daemon, a bad argument: a clear line and the documented exit status."""
    def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(HELPER), *args], env=env, capture_output=True, text=True,
                              timeout=30, check=False)

    no_job = {k: v for k, v in job_env.items() if k not in ("SLURM_JOB_ID", "CKPTD_JOB_DIR")}
    res = run(["env"], no_job)
    assert res.returncode == 2 and "SLURM_JOB_ID is not set" in res.stderr
    res = run(["env"], job_env)
    assert res.returncode == 0 and "export CKPTD_SOCKET=" in res.stdout
    res = run(["drain", "--timeout", "1"], job_env)
    assert res.returncode == 69 and "no ckptd of this job runs on" in res.stderr
    res = run(["drain", "r=latest"], job_env)
    assert res.returncode == 2 and "not ROOT or ROOT=STEP" in res.stderr
    for bad in ("1.5", "-1", "9" * 19):  # 19 digits would overflow the deadline's arithmetic
        res = run(["drain", "--timeout", bad], job_env)
        assert res.returncode == 2 and "--timeout must be whole seconds" in res.stderr, bad
    res = run(["drain", "r=latest"], job_env)
    assert res.returncode == 2 and "not ROOT or ROOT=STEP" in res.stderr
    res = run(["start"], {**job_env, "CKPTD_ROOT": ""})
    assert res.returncode == 78 and "no roots: set CKPTD_ROOT" in res.stderr
    res = run(["frobnicate"], job_env)
    assert res.returncode == 2 and "ckptd-job.sh run" in res.stderr


# -- values from the environment -----------------------------------------------------------------

# `ckptd run` stood in for: the helper's `run` execs it once the config is written; it records
# its arguments and exits, so each case costs one bash start, not a daemon.
STUB_CKPTD = """#!/bin/sh
printf '%s\\n' "$@" > "$(dirname "$0")/argv"
"""


def _stub(where: Path) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    stub = where / "ckptd"
    stub.write_text(STUB_CKPTD)
    stub.chmod(0o755)
    return stub


def _helper_run(env: dict[str, str | bytes], cwd: Path) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["bash", str(HELPER), "run"], env=env, cwd=cwd,
                          capture_output=True, timeout=30, check=False)


def _tree(top: Path) -> set[str]:
    return {str(p.relative_to(top)) for p in top.rglob("*")}


@pytest.mark.parametrize(("name", "value"), [
    ("SLURM_JOB_ID", "../../escaped"),
    ("SLURM_JOB_ID", "1/../../escaped"),
    ("SLURM_JOB_ID", "1\n[[roots]]\nname = \"x\"\npath = \"/etc\""),
    ("SLURM_JOB_ID", ".."),
    ("HOSTNAME", "node0\n[[roots]]\nname = \"x\"\npath = \"/etc\""),
    ("CKPTD_JOB_BASE", "base/../../escaped"),
    ("CKPTD_JOB_BASE", "base\nx"),
    ("CKPTD_JOB_DIR", "job/../../escaped"),
    ("CKPTD_ROOT", "r\"\n[[roots]]\nname = \"x\"\npath = \"/etc"),
    ("CKPTD_ROOT", "../escaped"),
    ("CKPTD_ROOT_NAME", "x\"\n[[roots]]\nname = \"y"),
    ("CKPTD_ROOT_NAME", "x]]"),
    ("CKPTD_NODE", "n\"\nsocket = \"/tmp/x.sock"),
    ("CKPTD_UPLOAD_URL", "s3://b/p\"\n[[roots]]\nname = \"x\"\npath = \"/etc"),
    ("CKPTD_UPLOAD_ENDPOINT", "http://h\" \"x"),
    ("CKPTD_SETTLE", "5s\"\n[[roots]]"),
    ("CKPTD_SCAN_INTERVAL", "1s\nstate_dir = \"/etc\""),
    ("CKPTD_NODES", "2\n[[roots]]"),
    ("CKPTD_NICE", "-n 0 /bin/sh"),
    ("CKPTD_JOB_ROOTS", "roots.toml\n[[roots]]"),
])
def test_a_crafted_environment_value_is_refused_before_anything_is_written(
        tmp_path: Path, short_dir: Path, name: str, value: str) -> None:
    """A value that would lead a write out of the job's base directory or add a line to the
    config is refused, naming the variable, exit 2; nothing is written, no daemon started."""
    base, cwd = short_dir / "base", tmp_path / "cwd"
    base.mkdir()
    cwd.mkdir()
    stub = _stub(tmp_path / "bin")
    env: dict[str, str | bytes] = {
        "PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "4242", "HOSTNAME": "node0",
        "CKPTD_JOB_BASE": str(base), "CKPTD_BIN": str(stub), "CKPTD_ROOT": str(cwd / "root")}
    env[name] = value
    if name == "CKPTD_JOB_BASE":
        env[name] = f"{short_dir}/{value}"
    res = _helper_run(env, cwd)
    err = res.stderr.decode()
    assert res.returncode == 2, err
    assert "refused" in err and err.count("\n") == 1, err  # one line, the value escaped
    assert err.startswith(f"ckptd-job.sh: {name}="), err
    assert not (tmp_path / "bin" / "argv").exists()  # no daemon started
    assert _tree(base) == set() and _tree(cwd) == set()
    assert sorted(p.name for p in short_dir.iterdir()) == ["base"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "cwd"]


# Characters a crafted value would use: path separators and climbs, TOML's quotes, brackets,
# escapes and line ends, shell metacharacters, and bytes that are not UTF-8.
_NASTY = st.sampled_from([b"/", b".", b"..", b"\n", b"\r", b'"', b"'", b"[", b"]", b"]]", b"\\",
                          b"=", b" ", b"\t", b"$", b"`", b"#", b"\xff", b"\xc3\xa9", b"x", b"7",
                          b"-", b"_", b"a" * 70])
_VALUE = st.one_of(st.lists(_NASTY, max_size=8).map(b"".join),
                   st.binary(max_size=80).map(lambda b: b.replace(b"\0", b"")),
                   st.from_regex(rb"\A[A-Za-z0-9][A-Za-z0-9._-]{0,20}\Z"))
_FUZZED = ("SLURM_JOB_ID", "HOSTNAME", "CKPTD_ROOT_NAME", "CKPTD_NODE", "CKPTD_UPLOAD_URL",
           "CKPTD_UPLOAD_ENDPOINT", "CKPTD_SETTLE", "CKPTD_SCAN_INTERVAL", "CKPTD_NODES")


@settings(max_examples=int(os.environ.get("CKPTD_FUZZ_EXAMPLES", "200")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(values=st.fixed_dictionaries({}, optional=dict.fromkeys(_FUZZED, _VALUE)),
       root=_VALUE, base_suffix=st.one_of(st.just(b""), _VALUE), absolute=st.booleans())
def test_the_helpers_inputs_fuzzed(short_dir: Path, values: dict[str, bytes], root: bytes,
                                   base_suffix: bytes, absolute: bool) -> None:
    """Any values of the job id, host name, root, names, URLs and durations: the helper either
    refuses (exit 2, nothing written outside its base directory) or writes a config that
    parses with exactly the one root it was given, beneath its base directory."""
    top = Path(tempfile.mkdtemp(dir=short_dir))
    try:
        base, cwd = top / "base", top / "cwd"
        base.mkdir()
        cwd.mkdir()
        stub = _stub(top / "bin")
        job_base = bytes(base) + (b"/" + base_suffix if base_suffix else b"")
        root_value = (bytes(cwd) + b"/" if absolute else b"") + (root or b"r")
        env: dict[str, str | bytes] = {
            "PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "4242", "HOSTNAME": "node0",
            "CKPTD_JOB_BASE": job_base, "CKPTD_BIN": str(stub), "CKPTD_ROOT": root_value,
            **{k: v for k, v in values.items() if v}}
        res = _helper_run(env, cwd)
        err = res.stderr.decode(errors="replace")
        argv = top / "bin" / "argv"
        assert res.returncode in (0, 2), err
        event("refused" if res.returncode else "written")
        if res.returncode == 2:
            assert "refused" in err or "socket path" in err, err
            assert not argv.exists() and _tree(cwd) == set()
            assert sorted(p.name for p in top.iterdir()) == ["base", "bin", "cwd"]
            return
        run_args = argv.read_text().splitlines()
        assert run_args[:2] == ["run", "--config"] and run_args[3] == "--socket"
        config = Path(run_args[2])
        assert config.resolve().is_relative_to(base) and Path(run_args[4]).parent == config.parent
        doc = tomllib.loads(config.read_text(encoding="utf-8"))
        assert set(doc) == {"daemon", "roots"} and len(doc["roots"]) == 1
        (r,) = doc["roots"]
        given_path = (root_value if absolute else bytes(cwd) + b"/" + root_value).rstrip(b"/")
        assert r["path"] == given_path.decode()
        assert Path(r["path"]).resolve().is_relative_to(cwd) and Path(r["path"]).is_dir()
        name = values.get("CKPTD_ROOT_NAME") or given_path.rsplit(b"/", 1)[1]
        assert r["name"] == name.decode()
        assert Path(doc["daemon"]["state_dir"]).resolve().is_relative_to(base)
        for key, env_name in (("node", "CKPTD_NODE"), ("scan_interval", "CKPTD_SCAN_INTERVAL")):
            if values.get(env_name):
                assert doc["daemon"][key] == values[env_name].decode()
        if values.get("CKPTD_UPLOAD_URL"):
            assert r["upload"]["url"] == values["CKPTD_UPLOAD_URL"].decode()
        assert sorted(p.name for p in top.iterdir()) == ["base", "bin", "cwd"]
    finally:
        shutil.rmtree(top, ignore_errors=True)
