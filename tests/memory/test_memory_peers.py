"""A replaced node's state from a peer's memory (SPEC.md "Restoring from memory", tier 2), with
real `ckptd run` daemons on loopback (one per simulated node: its own root, state dir, socket
and peer port; one shared file:// bucket), real trainer processes killed with SIGKILL, and the
faults a peer can have: a flipped byte, dead mid-transfer, slow, holding an older step, down.
Each ends in the exact state of the chosen step from the next tier, with a warning naming what
was skipped, within the configured timeout."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.wait import wait_until

REPO = Path(__file__).resolve().parents[2]
SECRET = b"0123456789abcdef0123456789abcdef-test-secret"

SAVE_AND_DIE = """
import os, signal, sys, torch, ckptd.torch as ckpt
torch.manual_seed(int(sys.argv[3]))
model = torch.nn.Sequential(torch.nn.Linear(384, 384), torch.nn.Linear(384, 8))
opt = torch.optim.Adam(model.parameters())
model(torch.randn(4, 384)).sum().backward()
opt.step()
torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, sys.argv[2])
blocking = sys.argv[5] == "blocking"
h = ckpt.save(sys.argv[1], int(sys.argv[4]), model=model, optimizer=opt, blocking=blocking)
assert blocking or (h.wait(60) and h.error is None), h.error
os.kill(os.getpid(), signal.SIGKILL)
"""

LOAD = """
import json, sys, time, torch, ckptd.torch as ckpt
torch.manual_seed(99)
model = torch.nn.Sequential(torch.nn.Linear(384, 384), torch.nn.Linear(384, 8))
opt = torch.optim.Adam(model.parameters())
model(torch.randn(4, 384)).sum().backward()
opt.step()
t = time.monotonic()
step, meta = ckpt.load(sys.argv[1], model=model, optimizer=opt, source=sys.argv[3])
took = time.monotonic() - t
want = torch.load(sys.argv[2], weights_only=True)
same = all(torch.equal(model.state_dict()[k], v) for k, v in want["model"].items())
got, exp = opt.state_dict()["state"], want["opt"]["state"]
same = same and all(torch.equal(got[i][k], exp[i][k]) for i in exp for k in exp[i])
print(json.dumps({"step": step, "source": meta["source"], "same": same, "seconds": took}))
"""


class Node:
    """One simulated node: a `ckptd run` with root `job`, a [memory] table, node id."""

    def __init__(self, tmp: Path, socks: Path, name: str, remote: Path, secret: Path,
                 timeout: str = "5s", replicas: int = 1) -> None:
        from support.config import write_layout
        from support.proc import DaemonHandle

        self.name, self.tmp = name, tmp / name
        layout = write_layout(self.tmp, socks / f"{name}.sock",
                              [{"name": "job", "upload": {"url": f"file://{remote}"}}],
                              node=name)
        with open(layout.config, "a") as f:
            f.write(f'\n[memory]\nreplicas = {replicas}\nlisten = "127.0.0.1:0"\n'
                    f'secret_file = "{secret}"\ntimeout = "{timeout}"\n')
        self.handle = DaemonHandle(layout, self.tmp / "daemon.log")

    @property
    def root(self) -> Path:
        return self.handle.roots["job"]

    def run(self, code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PYTHONPATH": str(REPO), "CKPTD_SOCKET": str(self.handle.socket),
               "CKPTD_CONFIG": str(self.handle.config)}
        return subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                              text=True, env=env, timeout=timeout, check=False)

    def save(self, step: int, expected: Path, seed: int = 1, how: str = "async") -> None:
        done = self.run(SAVE_AND_DIE, str(self.root), str(expected), str(seed), str(step), how)
        assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]

    def load(self, expected: Path, source: str = "auto") -> dict[str, Any]:
        done = self.run(LOAD, str(self.root), str(expected), source)
        assert done.returncode == 0, done.stderr[-4000:]
        doc: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        doc["stderr"] = done.stderr
        return doc

    def memory(self) -> dict[str, Any]:
        status = self.handle.client.status() or {}
        (root,) = [r for r in status["memory"]["roots"] if r["name"] == "job"]
        return root  # type: ignore[no-any-return]

    def wait_uploaded(self, step: int) -> None:
        assert self.handle.client.wait("job", step, until="uploaded", timeout=60)

    def wait_held_by(self, peer: str, step: int) -> None:
        wait_until(lambda: {"node": peer, "step": step} in self.memory()["held_by"], 60,
                   f"{self.name}'s step {step} held by {peer}",
                   detail=lambda: self.handle.log_text()[-4000:])

    def replace(self) -> None:
        """The node is lost: its daemon killed, its disks empty; a new daemon, same node id."""
        self.handle.kill9()
        for child in self.root.iterdir():
            shutil.rmtree(child) if child.is_dir() else child.unlink()
        shutil.rmtree(self.handle.state_dir)
        self.handle.start()


@pytest.fixture
def cluster(tmp_path: Path, short_dir: Path) -> Iterator[Any]:
    secret = tmp_path / "job.secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    made: list[Node] = []

    def make(*names: str, **kw: Any) -> list[Node]:
        nodes = [Node(tmp_path, short_dir, n, tmp_path / "remote", secret, **kw) for n in names]
        made.extend(nodes)
        for n in nodes:
            n.handle.start()
        return nodes

    yield make
    for n in made:
        n.handle.stop()


def test_a_replaced_node_gets_its_state_back_from_its_peer(cluster: Any, tmp_path: Path) -> None:
    n0, n1 = cluster("n0", "n1")
    expected = tmp_path / "expected.pt"
    n0.save(5, expected)
    n0.wait_uploaded(5)
    n0.wait_held_by("n1", 5)
    holding = n1.memory()["holding_for"]
    assert [(h["node"], h["step"]) for h in holding] == [("n0", 5)] and holding[0]["bytes"] > 0
    raw = n0.memory()["own_bytes"]
    assert n1.memory()["peer_bytes"] == holding[0]["bytes"] <= raw  # compressed, not bigger
    n0.replace()
    wait_until(lambda: (n0.handle.client.checkpoints("job") or [None])[-1] is not None, 30,
               "the new daemon to find step 5 in the bucket")
    got = n0.load(expected)
    assert got == {**got, "step": 5, "source": "peer:n1", "same": True}, got["stderr"][-3000:]
    # now kept in the new daemon's memory: a second restart reads it there
    assert n0.load(expected, "memory")["source"] == "peer:n1"
    # `ckptd memory fetch` does what the replaced node did, for an operator
    out = tmp_path / "fetched"
    done = subprocess.run([sys.executable, "-m", "ckptd", "memory", "fetch", "job", "5",
                           "--node", "n0", "--to", str(out), "--config",
                           str(n0.handle.config), "--json"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["complete"] and doc["ranks"] == [0] and doc["sources"] == ["peer:n1"]
    assert (out / "step-5" / "meta.json").is_file()
    model = torch.nn.Sequential(torch.nn.Linear(384, 384), torch.nn.Linear(384, 8))
    import ckptd.torch as ckpt

    ckpt.load(out / "step-5", model=model, source="local")
    want = torch.load(expected, weights_only=True)["model"]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())


def test_a_peer_holding_an_older_step_or_down_is_skipped(cluster: Any, tmp_path: Path) -> None:
    n0, n1 = cluster("n0", "n1")
    n0.save(3, tmp_path / "e3.pt", seed=3)
    n0.wait_uploaded(3)
    n0.wait_held_by("n1", 3)
    # step 7 is saved in the trainer's own process (no arena kept): n1 still holds step 3
    n0.save(7, tmp_path / "e7.pt", seed=7, how="blocking")
    n0.wait_uploaded(7)
    assert [(h["node"], h["step"]) for h in n1.memory()["holding_for"]] == [("n0", 3)]
    n0.replace()
    wait_until(lambda: any(c["step"] == 7 for c in n0.handle.client.checkpoints("job") or []),
               30, "step 7 found in the bucket")
    started = time.monotonic()
    got = n0.load(tmp_path / "e7.pt")
    assert (got["step"], got["source"], got["same"]) == (7, "remote", True), got["stderr"]
    assert time.monotonic() - started < 60
    assert "peer n1" in got["stderr"], got["stderr"]  # the skipped peer is named
    assert "step 3" in got["stderr"], got["stderr"]  # and what it holds instead
    n1.handle.kill9()  # the peer is down: skipped as fast, the bucket serves
    n0.handle.kill9()
    n0.handle.start()
    got = n0.load(tmp_path / "e7.pt")
    assert (got["step"], got["source"], got["same"]) == (7, "remote", True), got["stderr"]
    assert "peer n1" in got["stderr"], got["stderr"]


def _serve_once(behave: str, stop: threading.Event) -> tuple[str, threading.Thread]:
    """A fake peer on loopback that accepts and then misbehaves: `slow` sends nothing,
    `dies` sends a response head and a few body bytes, then closes."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)

    def run() -> None:
        conns = []
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conns.append(conn)
            if behave == "dies":
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n\x10\x00")
                conn.close()
        for c in conns:
            c.close()
        listener.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    host, port = listener.getsockname()
    return f"{host}:{port}", t


@pytest.mark.parametrize("behave", ["slow", "dies"])
def test_a_slow_or_dying_peer_is_skipped_within_the_timeout(cluster: Any, tmp_path: Path,
                                                            behave: str) -> None:
    from ckptd.backends import make_backend
    from ckptd.memory import directory

    (n0,) = cluster("n0", timeout="2s", replicas=0)
    n0.save(4, tmp_path / "e4.pt")
    n0.wait_uploaded(4)
    stop = threading.Event()
    address, thread = _serve_once(behave, stop)
    try:
        backend = make_backend(f"file://{tmp_path / 'remote'}")
        directory.publish(backend, "job", directory.PeerEntry("n9", address, time.time(), ()),
                          SECRET)
        n0.replace()
        wait_until(lambda: any(c["step"] == 4 for c in n0.handle.client.checkpoints("job") or []),
                   30, "step 4 found in the bucket")
        started = time.monotonic()
        got = n0.load(tmp_path / "e4.pt")
        took = time.monotonic() - started
    finally:
        stop.set()
        thread.join(5)
    assert (got["step"], got["source"], got["same"]) == (4, "remote", True), got["stderr"]
    assert "peer n9" in got["stderr"]
    assert took < 30, took  # the 2 s timeout, not a hang


def test_a_request_without_the_secret_or_for_another_node_gets_no_state(cluster: Any,
                                                                      tmp_path: Path) -> None:
    from ckptd.memory.peerclient import PeerClient, PeerError

    n0, n1 = cluster("n0", "n1")
    n0.save(2, tmp_path / "e2.pt")
    n0.wait_held_by("n1", 2)
    from ckptd.backends import make_backend
    from ckptd.memory import directory

    entries = {e.node: e.address for e in directory.peers(
        make_backend(f"file://{tmp_path / 'remote'}"), "job", secret=SECRET)}
    host, port = entries["n1"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"GET /v1/peer/replicas/job/n0/0/2 HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 401") and len(answer) < 2000
    wrong = PeerClient(b"not the secret at all, not at all", "n0", 5.0)
    with pytest.raises(PeerError, match="401"):
        wrong.index(entries["n1"], "job")
    other = PeerClient(SECRET, "n2", 5.0)  # holds the secret, asks for n0's state
    with pytest.raises(PeerError, match="403"):
        other.index(entries["n1"], "job", "n0")
    with pytest.raises(PeerError, match="403"):
        with other.open_replica(entries["n1"], "job", 0, 2, "n0"):
            pass


def test_a_flipped_byte_in_a_peers_copy_is_skipped(cluster: Any, tmp_path: Path) -> None:
    """A peer (holding the secret) serves this node's replica with one byte flipped inside a
    file's stored bytes: the replaced node refuses it before a byte is used, names the peer,
    and the next tier gives the exact state."""
    from ckptd.backends import make_backend
    from ckptd.memory import directory, proof
    from ckptd.memory.peerclient import PeerClient
    from ckptd.memory.peerserver import PeerServer
    from ckptd.memory.replicas import Replicas

    n0, n1 = cluster("n0", "n1")
    n0.save(6, tmp_path / "e6.pt")
    n0.wait_uploaded(6)
    n0.wait_held_by("n1", 6)
    backend = make_backend(f"file://{tmp_path / 'remote'}")
    address = {e.node: e.address for e in directory.peers(backend, "job", secret=SECRET)}["n1"]
    with PeerClient(SECRET, "n0", 5.0).open_replica(address, "job", 0, 6) as stream:
        body = bytearray(stream.read())
    head_len = int.from_bytes(body[:4], "little")
    at = 4 + head_len + 8 + (len(body) - head_len) // 2  # well inside the files' frames
    body[at] ^= 0x01
    n1.handle.kill9()
    held = Replicas(1 << 30)
    held.put("job", "n0", 0, 6, [bytes(body)], len(body))
    server = PeerServer(("127.0.0.1", 0), proof.Verifier(SECRET), held, "n9", timeout_s=5.0)
    server.start()
    try:
        host, port = server.address[:2]
        directory.publish(backend, "job", directory.PeerEntry("n9", f"{host}:{port}",
                                                              time.time(), ()), SECRET)
        n0.replace()
        wait_until(lambda: any(c["step"] == 6 for c in n0.handle.client.checkpoints("job") or []),
                   30, "step 6 found in the bucket")
        got = n0.load(tmp_path / "e6.pt")
    finally:
        server.stop()
        server.close()
    assert (got["step"], got["source"], got["same"]) == (6, "remote", True), got["stderr"]
    assert "peer n9" in got["stderr"] and "peer n1" in got["stderr"], got["stderr"]
    assert '"memory_peer_skipped"' in n0.handle.log_text()


def test_a_replica_for_a_root_this_daemon_lacks_is_refused(cluster: Any, tmp_path: Path) -> None:
    from ckptd.backends import make_backend
    from ckptd.memory import directory
    from ckptd.memory.peerclient import PeerClient, PeerError

    (n1,) = cluster("n1")
    wait_until(lambda: any(e.node == "n1" for e in directory.peers(
        make_backend(f"file://{tmp_path / 'remote'}"), "job", secret=SECRET)), 30,
        "n1's entry in the bucket")
    address = {e.node: e.address for e in directory.peers(
        make_backend(f"file://{tmp_path / 'remote'}"), "job", secret=SECRET)}["n1"]
    head = json.dumps({"root": "other", "node": "n0", "rank": 0, "step": 1}).encode()
    with pytest.raises(PeerError, match="404"):
        PeerClient(SECRET, "n0", 5.0).put_replica(address, "other", 0, 1, head, [b"x" * 100])
    assert n1.memory()["peer_bytes"] == 0
