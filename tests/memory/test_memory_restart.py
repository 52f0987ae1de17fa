"""A restarted trainer's state from this node's daemon (SPEC.md "Restoring from memory", tier
1), with real torch, a real daemon on a real socket and real trainer processes killed with
SIGKILL: served whole from the kept arena, never torn, and the next tier when it is not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptd.torch as ckpt
from ckptd.errors import NotFound

REPO = Path(__file__).resolve().parents[2]

SAVE_AND_DIE = """
import os, signal, sys, torch, ckptd.torch as ckpt
torch.manual_seed(int(sys.argv[3]))
model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 8))
opt = torch.optim.Adam(model.parameters())
model(torch.randn(4, 512)).sum().backward()
opt.step()
torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, sys.argv[2])
h = ckpt.save(sys.argv[1], int(sys.argv[4]), model=model, optimizer=opt, blocking=False,
              metrics={"loss": 0.5})
assert h.wait(60) and h.error is None, h.error
os.kill(os.getpid(), signal.SIGKILL)
"""


def run_py(code: str, sock: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "CKPTD_SOCKET": str(sock)}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=env, timeout=120, check=False)


def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(99)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 8))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    return model, opt


def saved_by_a_killed_trainer(d: Any, tmp_path: Path, step: int, seed: int = 1) -> dict[str, Any]:
    root = d.roots["r1"]
    done = run_py(SAVE_AND_DIE, d.socket, str(root), str(tmp_path / f"expected{step}.pt"),
                  str(seed), str(step))
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert d.wait_for("r1", step)["state"] == "valid"
    expected: dict[str, Any] = torch.load(tmp_path / f"expected{step}.pt", weights_only=True)
    return expected


def same(model: torch.nn.Module, opt: torch.optim.Optimizer, expected: dict[str, Any]) -> bool:
    ok = all(torch.equal(model.state_dict()[k], v) for k, v in expected["model"].items())
    got, want = opt.state_dict()["state"], expected["opt"]["state"]
    return ok and all(torch.equal(got[i][k], want[i][k]) for i in want for k in want[i])


def test_a_restarted_trainer_loads_the_latest_step_from_memory(inproc_daemon: Any,
                                                              tmp_path: Path) -> None:
    d = inproc_daemon(roots=[{"name": "r1"}])
    expected = saved_by_a_killed_trainer(d, tmp_path, 7)
    model, opt = fresh()
    step, meta = ckpt.load(d.roots["r1"], model=model, optimizer=opt, client=d.client,
                           source="memory")
    assert (step, meta["source"]) == (7, "memory")
    assert meta["metrics"] == {"loss": 0.5} and meta["step"] == 7
    assert same(model, opt, expected)
    status = d.client.status()["memory"]
    (r1,) = [r for r in status["roots"] if r["name"] == "r1"]
    assert r1["own_bytes"] == status["own_bytes"] > 0
    metrics = d.client.request("GET", "/metrics")[1]
    line = next(x for x in metrics.splitlines()
                if x.startswith('ckptd_memory_held_bytes{root="r1",tier="own"}'))
    assert float(line.split()[-1]) == r1["own_bytes"]
    from ckptd.cli.render import render_status

    assert "r1: kept " in render_status(d.client.status())  # `ckptd status` says it too
    # auto takes memory first; local says so when memory is not asked
    model2, opt2 = fresh()
    assert ckpt.load(d.roots["r1"], model=model2, optimizer=opt2,
                     client=d.client)[1]["source"] == "memory"
    assert ckpt.load(d.roots["r1"], model=model2, optimizer=opt2, client=d.client,
                     source="local")[1]["source"] == "local"


def test_a_torn_arena_falls_back_to_the_files(inproc_daemon: Any, tmp_path: Path) -> None:
    """The trainer began its next save (the arena's header says writing): the kept state is
    not whole, memory refuses it and auto reads the files, exactly."""
    from ckptd import arena

    d = inproc_daemon(roots=[{"name": "r1"}])
    expected = saved_by_a_killed_trainer(d, tmp_path, 3)
    (kept,) = d._d().memory.own.all()
    header = arena.read_header(os.pread(kept.fd, 32, 0))
    os.pwrite(kept.fd, arena.pack_header(arena.State.WRITING, header.generation + 1,
                                         header.used), 0)
    model, opt = fresh()
    with pytest.raises(NotFound, match="not whole"):
        ckpt.load(d.roots["r1"], model=model, optimizer=opt, client=d.client, source="memory")
    step, meta = ckpt.load(d.roots["r1"], model=model, optimizer=opt, client=d.client)
    assert (step, meta["source"]) == (3, "local") and same(model, opt, expected)


def test_a_flipped_byte_in_the_kept_arena_is_never_loaded(inproc_daemon: Any,
                                                         tmp_path: Path) -> None:
    d = inproc_daemon(roots=[{"name": "r1"}])
    expected = saved_by_a_killed_trainer(d, tmp_path, 4)
    (kept,) = d._d().memory.own.all()
    model_pt = next(f for f in kept.files if f.path == "model.pt")
    at = model_pt.offset + model_pt.size // 2
    byte = os.pread(kept.fd, 1, at)
    os.pwrite(kept.fd, bytes([byte[0] ^ 0x40]), at)
    model, opt = fresh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NotFound, match="hash"):
        ckpt.load(d.roots["r1"], model=model, optimizer=opt, client=d.client, source="memory")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    step, meta = ckpt.load(d.roots["r1"], model=model, optimizer=opt, client=d.client)
    assert (step, meta["source"]) == (4, "local") and same(model, opt, expected)


def test_a_restarted_daemon_holds_nothing_and_the_files_serve(daemon_factory: Any,
                                                              tmp_path: Path) -> None:
    d = daemon_factory(roots=[{"name": "r1"}])
    expected = saved_by_a_killed_trainer(d, tmp_path, 5)
    d.kill9()
    d.start()
    model, opt = fresh()
    with pytest.raises(NotFound, match="keeps no state"):
        ckpt.load(d.roots["r1"], model=model, optimizer=opt, client=d.client, source="memory")
    step, meta = ckpt.load(d.roots["r1"], model=model, optimizer=opt, client=d.client)
    assert (step, meta["source"]) == (5, "local") and same(model, opt, expected)


def test_memory_serves_only_the_chosen_step(inproc_daemon: Any, tmp_path: Path) -> None:
    """Step 6 is kept; asked for step 2 (an older valid one), memory does not serve it."""
    d = inproc_daemon(roots=[{"name": "r1"}])
    older = saved_by_a_killed_trainer(d, tmp_path, 2, seed=3)
    saved_by_a_killed_trainer(d, tmp_path, 6)
    model, opt = fresh()
    with pytest.raises(NotFound, match="not step 2"):
        ckpt.load(d.roots["r1"], 2, model=model, optimizer=opt, client=d.client,
                  source="memory")
    step, meta = ckpt.load(d.roots["r1"], 2, model=model, optimizer=opt, client=d.client)
    assert (step, meta["source"]) == (2, "local") and same(model, opt, older)


KILLED_MID_SAVE = """
import os, signal, sys, torch, ckptd.torch as ckpt
from ckptd import arena
from ckptd.torch import _async
torch.manual_seed(1)
model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 8))
opt = torch.optim.Adam(model.parameters())
model(torch.randn(4, 512)).sum().backward()
opt.step()
torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, sys.argv[2])
h = ckpt.save(sys.argv[1], 8, model=model, optimizer=opt, blocking=False)
assert h.wait(60) and h.error is None, h.error
# the next save begins: the header says writing, generation + 1 (what the trainer's copy does
# first), and the trainer is killed before that save is handed over
fd = _async._get_arena().fd
h = arena.read_header(os.pread(fd, 32, 0))
os.pwrite(fd, arena.pack_header(arena.State.WRITING, h.generation + 1, h.used), 0)
os.pwrite(fd, b"\\xff" * 4096, arena.DATA_OFFSET + 100)  # and the copy tears the old bytes
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_trainer_killed_mid_save_leaves_its_rank_on_the_files(inproc_daemon: Any,
                                                                 tmp_path: Path) -> None:
    d = inproc_daemon(roots=[{"name": "r1"}])
    done = run_py(KILLED_MID_SAVE, d.socket, str(d.roots["r1"]), str(tmp_path / "e8.pt"))
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert d.wait_for("r1", 8)["state"] == "valid"
    expected = torch.load(tmp_path / "e8.pt", weights_only=True)
    model, opt = fresh()
    with pytest.raises(NotFound, match="not whole"):
        ckpt.load(d.roots["r1"], model=model, optimizer=opt, client=d.client, source="memory")
    step, meta = ckpt.load(d.roots["r1"], model=model, optimizer=opt, client=d.client)
    assert (step, meta["source"]) == (8, "local") and same(model, opt, expected)


TWO_RANKS = """
import os, signal, sys, torch, ckptd.torch as ckpt
rank = int(sys.argv[3])
torch.manual_seed(rank)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))
opt = torch.optim.Adam(model.parameters())
model(torch.randn(4, 256)).sum().backward()
opt.step()
torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, sys.argv[2])
h = ckpt.save(sys.argv[1], 11, model=model, optimizer=opt, rank=rank, world_size=2,
              blocking=False)
assert h.wait(60) and h.error is None, h.error
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_two_ranks_restart_from_memory_each_with_its_own_optimizer(inproc_daemon: Any,
                                                                     tmp_path: Path) -> None:
    """Rank 1's load reads its own kept arena and rank 0's (the model): the model is rank
    0's, the optimizer state rank 1's own, both exactly."""
    d = inproc_daemon(roots=[{"name": "r1"}])
    env = {**os.environ, "PYTHONPATH": str(REPO), "CKPTD_SOCKET": str(d.socket)}
    procs = [subprocess.Popen([sys.executable, "-c", TWO_RANKS, str(d.roots["r1"]),
                               str(tmp_path / f"rank{r}.pt"), str(r)], env=env,
                              stderr=subprocess.PIPE, text=True) for r in (1, 0)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == -signal.SIGKILL, err[-3000:]
    assert d.wait_for("r1", 11)["state"] == "valid"
    rank0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    rank1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    for rank, own in ((0, rank0), (1, rank1)):
        torch.manual_seed(50)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))
        opt = torch.optim.Adam(model.parameters())
        model(torch.randn(4, 256)).sum().backward()
        opt.step()
        step, meta = ckpt.load(d.roots["r1"], model=model, optimizer=opt, rank=rank,
                               client=d.client, source="memory")
        assert (step, meta["source"]) == (11, "memory")
        assert same(model, opt, {"model": rank0["model"], "opt": own["opt"]})


def test_keep_false_keeps_nothing(inproc_daemon: Any, tmp_path: Path) -> None:
    d = inproc_daemon(roots=[{"name": "r1"}], start=False)
    with open(d.config, "a") as f:
        f.write("\n[memory]\nkeep = false\n")
    d.start()
    expected = saved_by_a_killed_trainer(d, tmp_path, 9)
    assert d.client.status()["memory"]["own_bytes"] == 0
    model, opt = fresh()
    with pytest.raises(NotFound, match="keep is false"):
        ckpt.load(d.roots["r1"], model=model, optimizer=opt, client=d.client, source="memory")
    step, meta = ckpt.load(d.roots["r1"], model=model, optimizer=opt, client=d.client)
    assert (step, meta["source"]) == (9, "local") and same(model, opt, expected)


def test_a_state_torn_while_it_is_read_is_torn_not_a_bad_pickle(inproc_daemon: Any,
                                                                  tmp_path: Path) -> None:
    """Whole when checked, then the trainer's next save begins and zeroes model.pt while the
    load reads it: TornState (auto goes on to the next tier), not a parse error. The arena is
    handed to the loader read-only; the test writes through its own descriptor."""
    import fcntl
    import mmap

    from ckptd import arena
    from ckptd.torch import _memory
    from ckptd.torch._load import _from_arenas, _LoadOpts

    d = inproc_daemon(roots=[{"name": "r1"}])
    saved_by_a_killed_trainer(d, tmp_path, 7)
    doc, fds = _memory.open_state(str(d.socket), "r1", 7, 0, timeout=30)
    assert fcntl.fcntl(fds[0], fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
    (kept,) = d._d().memory.own.all()
    state = _memory.MemoryState(doc, fds)  # mapped and hashed: whole
    with mmap.mmap(os.dup(kept.fd), kept.size) as mm:
        arena.set_state(mm, arena.State.WRITING, kept.generation + 1)
        f = next(f for f in kept.files if f.path == "model.pt")
        mm[f.offset:f.offset + f.size] = b"\x00" * f.size
    model, opt = fresh()
    try:
        with pytest.raises(_memory.TornState, match="while it was read"):
            _from_arenas(state, 7, (model, opt, None, None, None), 0, False,
                         _LoadOpts("cpu", True, False, False))
    finally:
        state.close()


def test_training_on_after_a_load_from_memory_leaves_the_kept_state_whole(
        inproc_daemon: Any, tmp_path: Path) -> None:
    """The loaded tensors point into the arena's pages copy-on-write (the optimizer's state
    keeps them): training on writes private copies, never the kept state, which a second
    restart loads again exactly."""
    d = inproc_daemon(roots=[{"name": "r1"}])
    expected = saved_by_a_killed_trainer(d, tmp_path, 12)
    model, opt = fresh()
    ckpt.load(d.roots["r1"], model=model, optimizer=opt, client=d.client, source="memory")
    for _ in range(3):  # in-place writes into every parameter and every Adam buffer
        opt.zero_grad()
        model(torch.randn(4, 512)).sum().backward()
        opt.step()
    assert not same(model, opt, expected)
    again, again_opt = fresh()
    step, meta = ckpt.load(d.roots["r1"], model=again, optimizer=again_opt, client=d.client,
                           source="memory")
    assert (step, meta["source"]) == (12, "memory") and same(again, again_opt, expected)
