"""ckptd.torch with real torch on the CPU: full-state round trips, resume after kill -9 without a
jump, two ranks (gloo and file rendezvous), prefixes, bf16, meta device, legacy and unsafe files,
and saving with the daemon absent, hung or running."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from support.torch_state import net, same, trained
from support.wait import wait_until
from torch.optim.swa_utils import AveragedModel

import ckptd.torch as ckpt
from ckptd.errors import CkptdError, ConfigError, NotFound, ValidationFailed

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


@pytest.fixture(autouse=True)
def no_daemon(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Nothing here talks to a daemon unless a test starts one: the socket path is absent."""
    sock = tmp_path / "absent.sock"
    monkeypatch.setenv("CKPTD_SOCKET", str(sock))
    return sock


def run_py(args: list[str], timeout: float = 60, **kw: Any) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kw)


def finish(proc: subprocess.Popen[str], rc: int = 0) -> list[dict[str, Any]]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == rc, err[-3000:]
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def check_meta(step_dir: Path, step: int, world: int) -> dict[str, Any]:
    """The native layout's promises: meta.json lists every other file at its exact size."""
    meta: dict[str, Any] = json.loads((step_dir / "meta.json").read_text())
    assert meta["format"] == "ckptd-native/1" and meta["step"] == step
    assert meta["world_size"] == world and meta["created"].endswith("Z")
    listed = {f["path"]: f for f in meta["files"]}
    on_disk = {p.name for p in step_dir.iterdir()} - {"meta.json"}
    assert set(listed) == on_disk
    for name, entry in listed.items():
        assert (step_dir / name).stat().st_size == entry["size"]
        assert ("rank" in entry) == name.startswith(("optim.rank", "rng.rank"))
    assert not step_dir.with_name(step_dir.name + ".tmp").exists()
    return meta


# ------------------------------------------------------------------------- round trip, resume


def test_resume_after_kill9_continues_the_loss_curve_exactly(tmp_path: Path) -> None:
    """train K, save, kill -9, resume in a fresh process: same curve as never stopping."""
    script = str(EXAMPLES / "train_native.py")
    args = ["--steps", "12", "--save-every", "4"]
    full = run_py([script, "--root", str(tmp_path / "a"), *args])
    crashed = run_py([script, "--root", str(tmp_path / "b"), *args, "--crash-at", "6"])
    uninterrupted = finish(full)
    first = finish(crashed, rc=-9)
    second = finish(run_py([script, "--root", str(tmp_path / "b"), *args]))

    assert second[0] == {"event": "resumed", "step": 4}
    curve = {r["step"]: r["loss"] for r in uninterrupted if "loss" in r}
    resumed = {r["step"]: r["loss"] for r in first[:4] + second if "loss" in r}
    assert len(curve) == 12 and resumed == curve  # bitwise: floats compared exactly
    # EMA weights, GradScaler scale (grown 4 times) and LR schedule also ended up identical.
    assert uninterrupted[-1] == second[-1] and uninterrupted[-1]["scale"] == 2.0**20
    meta = check_meta(tmp_path / "b" / "step-4", 4, 1)
    assert {f["component"] for f in meta["files"]} == {
        "model", "ema", "optimizer", "scheduler", "scaler", "rng"}
    assert meta["config"]["save_every"] == 4 and "loss" in meta["metrics"]


def test_round_trip_restores_every_component(tmp_path: Path) -> None:
    model, opt = trained()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()
    sched.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    ema = AveragedModel(model)
    ema.update_parameters(model)
    path = ckpt.save(tmp_path, 9, model=model, optimizer=opt, scheduler=sched, scaler=scaler,
                     ema=ema, extra={"epoch": 3, "seen": torch.arange(3)}, metrics={"v": 0.5})
    assert path == tmp_path / "step-9"
    check_meta(path, 9, 1)
    expected_rng = torch.get_rng_state()
    torch.rand(5)  # move the RNG on; restore_rng must bring it back

    model2, opt2 = trained(seed=1, steps=1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    scaler2 = torch.amp.GradScaler("cpu")
    ema2 = AveragedModel(model2)
    step, meta = ckpt.load(tmp_path, model=model2, optimizer=opt2, scheduler=sched2,
                           scaler=scaler2, ema=ema2, restore_rng=True)
    assert step == 9 and meta["metrics"] == {"v": 0.5} and meta["extra"]["epoch"] == 3
    assert same(meta["extra"]["seen"], torch.arange(3))
    for a, b in ((model, model2), (opt, opt2), (sched, sched2), (scaler, scaler2), (ema, ema2)):
        assert same(a.state_dict(), b.state_dict()), type(a)
    assert torch.equal(torch.get_rng_state(), expected_rng)


def test_missing_component_is_a_clear_error(tmp_path: Path) -> None:
    model, _ = trained()
    ckpt.save(tmp_path, 1, model=model)
    with pytest.raises(NotFound, match="no scaler state"):
        ckpt.load(tmp_path, 1, model=net(), scaler=torch.amp.GradScaler("cpu"))


# --------------------------------------------------------------------------------- two ranks


RANK_SCRIPT = """
import sys, torch, ckptd.torch as ckpt
root, rank = sys.argv[1], int(sys.argv[2])
torch.manual_seed(rank)
model = torch.nn.Linear(64, 64)
opt = torch.optim.Adam(model.parameters())
model(torch.randn(2, 64)).sum().backward()
opt.step()
torch.save(opt.state_dict(), f"{root}/expect.rank{rank}.pt")
ckpt.save(root, 3, model=model, optimizer=opt, rank=rank, world_size=2, timeout=60)
"""


def test_file_rendezvous_two_processes_over_a_stale_leftover(tmp_path: Path) -> None:
    """No torch.distributed: ranks meet through marker files. Rank 1 first writes into the
    leftover of a crashed save; rank 0 clears it and rank 1 must write again, not be lost."""
    tmp = tmp_path / "step-3.tmp"
    tmp.mkdir()
    (tmp / ".ready").write_text(json.dumps({"token": "crashed"}))
    (tmp / ".done.rank1").write_text(json.dumps({"token": "crashed", "files": []}))
    (tmp / "optim.rank1.pt").write_bytes(b"half-written")
    rank1 = run_py(["-c", RANK_SCRIPT, str(tmp_path), "1"])

    def rank1_wrote() -> bool:
        assert rank1.poll() is None, "rank 1 exited before writing"
        return json.loads((tmp / ".done.rank1").read_text())["files"] != []

    wait_until(rank1_wrote, 60, "rank 1 to write its files again")
    finish(run_py(["-c", RANK_SCRIPT, str(tmp_path), "0"]))
    finish(rank1)

    meta = check_meta(tmp_path / "step-3", 3, 2)
    assert "save_id" in meta and not tmp.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    for rank in (0, 1):
        got = torch.load(tmp_path / "step-3" / f"optim.rank{rank}.pt", weights_only=True)
        assert same(got, torch.load(tmp_path / f"expect.rank{rank}.pt", weights_only=True))


def test_file_rendezvous_times_out_with_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CkptdError, match="rank 1"):
        ckpt.save(tmp_path, 1, model=net(), rank=0, world_size=2, timeout=0.3)
    assert not (tmp_path / "step-1").exists()


# ------------------------------------------------------------------- prefixes, dtypes, devices


def test_compiled_model_prefix_both_ways(tmp_path: Path) -> None:
    """torch.compile wraps lazily (no compilation until the first call), so this stays fast;
    its state_dict carries the real `_orig_mod.` prefix."""
    model, _ = trained()
    compiled = cast(torch.nn.Module, torch.compile(model))
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    ckpt.save(tmp_path, 1, model=compiled)
    keys = torch.load(tmp_path / "step-1" / "model.pt", weights_only=True).keys()
    assert not any("_orig_mod" in k for k in keys)

    plain = net(3)
    ckpt.load(tmp_path, 1, model=plain)  # compiled save -> plain model
    assert same(plain.state_dict(), model.state_dict())
    into_compiled = cast(torch.nn.Module, torch.compile(net(4)))
    ckpt.load(tmp_path, 1, model=into_compiled)  # plain keys -> compiled model
    prefixed = {"_orig_mod." + k: v for k, v in model.state_dict().items()}
    assert same(into_compiled.state_dict(), prefixed)

    legacy = tmp_path / "compiled.pt"  # a plain torch.save of a compiled model's state_dict
    torch.save({"model": compiled.state_dict()}, legacy)
    plain2 = net(5)
    ckpt.load(legacy, model=plain2)
    assert same(plain2.state_dict(), model.state_dict())


def test_bf16_upcast_and_meta_device_assign(tmp_path: Path) -> None:
    model = net().to(torch.bfloat16)
    ckpt.save(tmp_path, 2, model=model)
    with torch.device("meta"):
        fresh = net()
    ckpt.load(tmp_path, 2, model=fresh, upcast_bf16=True, assign=True)
    for (name, p), ref in zip(fresh.named_parameters(), model.parameters(), strict=True):
        assert p.device.type == "cpu" and p.dtype == torch.float32, name
        assert torch.equal(p.detach(), ref.detach().float())
    assert fresh(torch.randn(2, 6)).shape == (2, 3)

    with torch.device("meta"):
        kept = net()
    ckpt.load(tmp_path, 2, model=kept, assign=True)  # without upcast the bf16 tensors stay
    assert {p.dtype for p in kept.parameters()} == {torch.bfloat16}


def test_meta_device_model_gets_real_tensors_with_assign(tmp_path: Path) -> None:
    model, _ = trained()
    ckpt.save(tmp_path, 1, model=model)
    with torch.device("meta"):
        fresh = net()
    assert all(p.is_meta for p in fresh.parameters())
    ckpt.load(tmp_path, 1, model=fresh, assign=True)
    assert same(fresh.state_dict(), model.state_dict())
    assert not any(p.is_meta for p in fresh.parameters())


# ------------------------------------------------------------------------- legacy and safety


def test_legacy_single_file(tmp_path: Path) -> None:
    model, opt = trained()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    path = tmp_path / "ckpt.pt"
    torch.save({"model_state_dict": model.state_dict(), "optimizer_state_dict": opt.state_dict(),
                "scheduler": sched.state_dict(), "global_step": 120, "epoch": 3,
                "best_acc": 0.5}, path)
    model2, opt2 = trained(seed=1, steps=1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1)
    step, meta = ckpt.load(path, model=model2, optimizer=opt2, scheduler=sched2)
    assert step == 120 and meta["format"] == "legacy"
    assert meta["extra"] == {"global_step": 120, "epoch": 3, "best_acc": 0.5}
    for a, b in ((model, model2), (opt, opt2), (sched, sched2)):
        assert same(a.state_dict(), b.state_dict())

    bare = tmp_path / "weights_step_7.pt"  # just a state_dict; the step comes from the name
    torch.save(model.state_dict(), bare)
    assert ckpt.load(bare, model=net(2))[0] == 7


class Payload:
    """Pickles to a call of os.system: what a hostile checkpoint would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_hostile_legacy_file_is_refused_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pt"
    torch.save({"model": net().state_dict(), "x": Payload(marker)}, path)
    with pytest.raises(ValidationFailed, match="refused") as err:
        ckpt.load(path, model=net())
    assert err.value.reason == "unsafe_pickle" and not marker.exists()
    with pytest.raises(TypeError, match="extra"):  # and save will not write such a thing
        ckpt.save(tmp_path / "r", 1, extra={"x": Payload(marker)})


def test_every_torch_load_is_weights_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    model, opt = trained()
    ckpt.save(tmp_path, 1, model=model, optimizer=opt, extra={"a": 1})
    torch.save({"model": model.state_dict()}, tmp_path / "legacy.pt")
    calls: list[Any] = []
    real = torch.load

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("weights_only"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    ckpt.load(tmp_path, model=net(), optimizer=opt, restore_rng=True)
    ckpt.load(tmp_path / "legacy.pt", model=net())
    assert len(calls) == 5 and set(calls) == {True}


# ---------------------------------------------------------------------- commit and resolution


def test_leftover_tmp_cleared_and_resave_replaces(tmp_path: Path) -> None:
    leftover = tmp_path / "step-5.tmp"
    leftover.mkdir()
    (leftover / "model.pt").write_bytes(b"truncated")
    (leftover / "junk.bin").write_bytes(b"x")
    first, _ = trained(seed=1)
    ckpt.save(tmp_path, 5, model=first)
    assert not leftover.exists()
    check_meta(tmp_path / "step-5", 5, 1)

    second, _ = trained(seed=2)
    ckpt.save(tmp_path, 5, model=second)  # the same step again: old dir swapped out, removed
    check_meta(tmp_path / "step-5", 5, 1)
    loaded = net(9)
    ckpt.load(tmp_path, 5, model=loaded)
    assert same(loaded.state_dict(), second.state_dict())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-5"]


def test_latest_prefers_daemon_word_then_scans_complete_dirs(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        ckpt.save(tmp_path, step, model=trained(seed=step)[0])
    with open(tmp_path / "step-6" / "model.pt", "r+b") as f:
        f.truncate(100)  # no longer the size meta.json promises: not complete
    (tmp_path / "step-8.tmp").mkdir()
    assert ckpt.resolve(tmp_path) == tmp_path / "step-4"
    with pytest.raises(NotFound):
        ckpt.resolve(tmp_path, 6)

    (tmp_path / ".ckptd").mkdir()
    (tmp_path / ".ckptd" / "latest.json").write_text(
        json.dumps({"step": 2, "path": "step-2", "updated": "2026-01-01T00:00:00Z"}))
    assert ckpt.resolve(tmp_path) == tmp_path / "step-2"  # the daemon validated only step 2
    assert ckpt.load(tmp_path, model=net())[0] == 2


def test_compressed_latest_is_restored_then_loaded(tmp_path: Path) -> None:
    """latest.json names a step kept only as a local compressed copy: load restores it under
    .ckptd/restored/ (verifying every hash) and loads it, with no daemon."""
    from ckptd import layouts
    from ckptd.copies import store as copies
    from ckptd.model import RootOptions
    from ckptd.stages import compress
    from ckptd.stages.validate import validate
    from ckptd.watch.scanner import RootScanner

    model, opt = trained()
    path = ckpt.save(tmp_path, 4, model=model, optimizer=opt, register=False)
    _, found = RootScanner("r", tmp_path, "auto", RootOptions(settle=0)).scan(time.time())
    (cand, _fp), = [(c, f) for c, f in found if c.step == 4]
    assert cand.layout == layouts.get("native").name
    stager = compress.Stager(tmp_path, "r", 4, "native", "auto", 3, 1, 0.03)
    result = validate(tmp_path, cand, extra_sinks=stager.sinks_for)
    manifest = stager.commit(result.files, result.metrics)
    from support.nets import no_nets

    from ckptd.model import Local, Remote
    from ckptd.retention import executor

    nets = no_nets()
    target = executor.Target(4, cand.path, tuple(cand.files), Local.PRESENT, Remote.NONE, False)
    out = executor.replace_originals(tmp_path, target, nets, lambda: copies.check_replaceable(
        tmp_path, manifest, list(cand.files)))
    assert out.action == "deleted", out
    assert not path.exists()
    (tmp_path / ".ckptd" / "latest.json").write_text(
        json.dumps({"step": 4, "path": str(path), "local": "compressed"}))
    fresh = net()
    step, _ = ckpt.load(tmp_path, model=fresh)
    assert step == 4
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                  model.state_dict().values(), strict=True))


def test_a_failed_restore_raises_its_own_error_in_the_trainer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The restore runs in a child process (the trainer never imports the backends or the
    config): its error reaches the caller with its class and message."""
    (tmp_path / ".ckptd").mkdir()
    (tmp_path / ".ckptd" / "latest.json").write_text(
        json.dumps({"step": 4, "path": "step-4", "local": "compressed"}))
    monkeypatch.delenv("CKPTD_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)  # no ./ckptd.toml either
    with pytest.raises(ConfigError, match="no config to find the remote"):
        ckpt.load(tmp_path, model=net())


# --------------------------------------------------------------------------------- the daemon


def test_save_with_daemon_absent_or_hung_is_quick(tmp_path: Path, short_dir: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    model, opt = trained()
    started = time.monotonic()
    ckpt.save(tmp_path, 1, model=model, optimizer=opt)
    assert time.monotonic() - started < 1.0
    assert "register" in caplog.text

    hung = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # accepts, never answers
    hung.bind(str(short_dir / "hung.sock"))
    hung.listen(8)
    monkeypatch.setenv("CKPTD_SOCKET", str(short_dir / "hung.sock"))
    try:
        started = time.monotonic()
        path = ckpt.save(tmp_path, 2, model=model, optimizer=opt)
        assert time.monotonic() - started < 2.0
    finally:
        hung.close()
    check_meta(path, 2, 1)


def test_register_and_resume_through_a_running_daemon(inproc_daemon: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    d = inproc_daemon(roots=[{"name": "r1"}])
    monkeypatch.setenv("CKPTD_SOCKET", str(d.socket))
    root = d.roots["r1"]
    model, opt = trained()
    ckpt.save(root, 3, model=model, optimizer=opt, metrics={"val_loss": 1.25})
    info = d.wait_for("r1", 3)
    assert info["state"] == "valid" and info["layout"] == "native"
    assert info["metrics"].get("val_loss") == 1.25
    model2, opt2 = trained(seed=1, steps=1)
    assert ckpt.load(root, model=model2, optimizer=opt2)[0] == 3
    assert same(opt2.state_dict(), opt.state_dict())


# ---------------------------------------------------------------------------------- examples


def test_two_rank_gloo_save_and_load_per_rank_shards(tmp_path: Path) -> None:
    """The DDP + ZeRO example under torch.multiprocessing.spawn: each rank writes and then
    loads back its own optimizer shard; rank 0 writes the model and commits."""
    rows = finish(run_py([str(EXAMPLES / "ddp_gloo_native.py"), "--root", str(tmp_path),
                          "--steps", "3"]))
    assert sorted(r["rank"] for r in rows) == [0, 1]
    assert all(r["restored"] and r["step"] == 3 and r["world_size"] == 2 for r in rows)
    meta = check_meta(tmp_path / "step-3", 3, 2)
    ranks = {(f["component"], f.get("rank")) for f in meta["files"]}
    assert ranks == {("model", None), ("optimizer", 0), ("optimizer", 1), ("rng", 0), ("rng", 1)}
    shards = {f["path"]: f["size"] for f in meta["files"] if f["component"] == "optimizer"}
    assert shards["optim.rank0.pt"] != shards["optim.rank1.pt"]  # ZeRO: different shards
    assert set(meta["metrics"]) == {"loss"}


def test_example_dcp_register(tmp_path: Path) -> None:
    rows = finish(run_py([str(EXAMPLES / "dcp_register.py"), "--root", str(tmp_path),
                          "--steps", "2"]))
    assert rows[0]["restored"] and rows[0]["registered"] is False  # no daemon here
    assert rows[0]["files"] == ["step-2/.metadata", "step-2/__0_0.distcp"]


def test_non_finite_metrics_are_left_out_of_meta(tmp_path: Path) -> None:
    ckpt.save(tmp_path, 1, model=net(), metrics={"nan": float("nan"), "ok": 2})
    meta = json.loads((tmp_path / "step-1" / "meta.json").read_text())
    assert meta["metrics"] == {"ok": 2.0}  # JSON has no NaN; a bad metric must not cost the save


@pytest.mark.parametrize("kind", ["fifo", "huge", "nan"])
def test_hostile_meta_json_is_a_clear_error_not_a_hang(tmp_path: Path, kind: str) -> None:
    model = torch.nn.Linear(2, 2)
    ckpt.save(tmp_path, 5, model=model)
    meta = tmp_path / "step-5" / "meta.json"
    meta.unlink()
    if kind == "fifo":
        os.mkfifo(meta)  # a plain open() would wait for a writer forever
    elif kind == "huge":
        meta.write_bytes(b'{"step": 5, "pad": "' + b"x" * (2 << 20) + b'"}')
    else:
        meta.write_bytes(b'{"step": NaN}')
    t0 = time.monotonic()
    with pytest.raises(CkptdError, match="step-5"):  # never a complete checkpoint
        ckpt.load(tmp_path / "step-5", model=model)
    with pytest.raises(CkptdError, match="step-5"):
        ckpt.load(tmp_path, 5, model=model)
    assert time.monotonic() - t0 < 30
