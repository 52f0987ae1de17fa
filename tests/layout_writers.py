"""Write real checkpoints the way each framework does, in its order, optionally cut short:
`stop="<stage>"` returns just before that stage, as a crash there would; `STAGES` lists them."""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

Stage = tuple[str, Callable[[], object]]


def tiny_model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"layer.weight": torch.randn(8, 4, generator=g),
            "layer.bias": torch.randn(8, generator=g)}


def tiny_optim(seed: int = 0) -> dict[str, Any]:
    model = tiny_model(seed)
    return {"state": {i: {"step": torch.tensor(3.0), "exp_avg": torch.zeros_like(t)}
                      for i, t in enumerate(model.values())},
            "param_groups": [{"lr": 1e-3, "params": [0, 1]}]}


def _run(stages: list[Stage], stop: str | None) -> None:
    names = [n for n, _ in stages]
    if stop is not None and stop not in names:
        raise ValueError(f"unknown stage {stop!r}; stages: {names}")
    for name, action in stages:
        if name == stop:
            return
        action()


def _json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _tsave(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path)


# --- native (ckptd.torch.save): files into step-N.tmp/, meta.json last, then rename -----------

def write_native(root: Path, step: int, *, world_size: int = 1, stop: str | None = None) -> Path:
    tmp, final = root / f"step-{step}.tmp", root / f"step-{step}"
    files = ["model.pt", *[f"optim.rank{r}.pt" for r in range(world_size)]]

    def meta() -> None:
        listed = [{"path": f, "size": (tmp / f).stat().st_size,
                   "component": "model" if f == "model.pt" else "optimizer"} for f in files]
        _json(tmp / "meta.json", {
            "format": "ckptd-native/1", "step": step, "world_size": world_size,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "metrics": {"val_loss": 1.25}, "config": {"lr": 1e-3}, "files": listed})

    stages: list[Stage] = [("model", lambda: _tsave(tiny_model(step), tmp / "model.pt"))]
    stages += [(f"optim{r}", partial(_tsave, tiny_optim(r), tmp / f"optim.rank{r}.pt"))
               for r in range(world_size)]
    stages += [("meta", meta), ("rename", lambda: tmp.rename(final))]
    _run(stages, stop)
    return final


# --- split / ranked / single: plain torch.save, one file after another ------------------------

def write_split(root: Path, step: int, *, stop: str | None = None) -> Path:
    """A typical hand-written loop: model, EMA, optimizer, then the small meta file."""
    p = {k: root / f"step_{step}_{k}.pt" for k in ("model", "ema", "optim", "meta")}
    _run([("model", lambda: _tsave(tiny_model(step), p["model"])),
          ("ema", lambda: _tsave(tiny_model(step + 1), p["ema"])),
          ("optim", lambda: _tsave(tiny_optim(step), p["optim"])),
          ("meta", lambda: _tsave({"step": step, "epoch": 1}, p["meta"]))], stop)
    return p["model"]


def write_ranked(root: Path, step: int, *, world_size: int = 2, stop: str | None = None) -> Path:
    """Rank 0 writes the model and meta_<N>.json, then every rank its optimizer shard."""
    stages: list[Stage] = [
        ("model", lambda: _tsave(tiny_model(step), root / f"model_{step}.pt")),
        ("meta", lambda: _json(root / f"meta_{step}.json", {
            "step": step, "world_size": world_size, "metrics": {"loss": 2.5}})),
    ]
    stages += [(f"rank{r}", partial(_tsave, tiny_optim(r), root / f"optim_{step}_rank{r}.pt"))
               for r in range(world_size)]
    _run(stages, stop)
    return root / f"model_{step}.pt"


def write_single(root: Path, step: int, *, stop: str | None = None) -> Path:
    """One torch.save; stopping at "finish" leaves the first half of its bytes (a torn write)."""
    path = root / f"model_step_{step}.pt"

    def torn() -> None:
        _tsave({"model": tiny_model(step), "step": step}, path)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])

    _run([("start", torn), ("finish", lambda: _tsave({"model": tiny_model(step), "step": step},
                                                      path))], stop)
    return path


# --- dcp: torch.distributed.checkpoint.save, data files first, `.metadata` by rename last ------

class _NoFinishWriter(FileSystemWriter):
    """FileSystemWriter that dies before `finish`: data written, `.metadata` never renamed in."""

    def finish(self, metadata: Any, results: Any) -> None:
        return None


def write_dcp(directory: Path, seed: int = 0, *, stop: str | None = None) -> Path:
    """A real single-process `dcp.save` (torch 2.13, `no_dist=True`)."""
    state = {"model": tiny_model(seed), "optim": tiny_optim(seed)}
    writer = FileSystemWriter(directory) if stop is None else _NoFinishWriter(directory)
    if stop not in (None, "metadata"):
        raise ValueError("dcp stages: ['data', 'metadata']")
    dcp_save(state, storage_writer=writer, no_dist=True)
    return directory


# --- Hugging Face Trainer ----------------------------------------------------------------------

def safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """The safetensors format: u64 LE header length, JSON header (space-padded to 8), data."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, t in tensors.items():
        raw = t.contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def write_hf(output_dir: Path, step: int, *, stop: str | None = None) -> Path:
    """transformers 4.57 `Trainer._save_checkpoint` order, straight into `checkpoint-<N>/`:
    `save_model` (config.json, then model.safetensors via save_pretrained, then
    training_args.bin), optimizer.pt, scheduler.pt, rng_state.pth, and trainer_state.json last."""
    d = output_dir / f"checkpoint-{step}"
    state = {"best_metric": 0.42, "best_model_checkpoint": str(d), "epoch": 1.0,
             "global_step": step, "is_local_process_zero": True, "is_world_process_zero": True,
             "log_history": [{"loss": 1.9, "step": step - 10},
                             {"eval_loss": 0.42, "eval_runtime": 1.5, "step": step}],
             "max_steps": 10 * step, "save_steps": step, "trial_name": None}

    def mkdir_config() -> None:
        _json(d / "config.json", {"model_type": "tiny", "hidden_size": 4})

    _run([("config", mkdir_config),
          ("model", lambda: (d / "model.safetensors").write_bytes(
              safetensors_bytes(tiny_model(step)))),
          ("training_args", lambda: _tsave({"output_dir": str(output_dir)},
                                           d / "training_args.bin")),
          ("optimizer", lambda: _tsave(tiny_optim(step), d / "optimizer.pt")),
          ("scheduler", lambda: _tsave({"last_epoch": step}, d / "scheduler.pt")),
          ("rng", lambda: _tsave({"python": 1, "cpu": torch.get_rng_state()},
                                 d / "rng_state.pth")),
          ("trainer_state", lambda: _json(d / "trainer_state.json", state))], stop)
    return d


# --- DeepSpeed ---------------------------------------------------------------------------------

def write_deepspeed(save_dir: Path, step: int, *, world_size: int = 2, bf16: bool = False,
                    stop: str | None = None) -> Path:
    """DeepSpeed 0.16 `engine.save_checkpoint`: `_save_checkpoint` (rank 0 writes
    mp_rank_00_model_states.pt), `_save_zero_checkpoint` (each rank its optimizer states), then
    `checkpoint_engine.commit` and rank 0 writes `latest` BEFORE the final `dist.barrier()`.
    Ranks run concurrently; here the other ranks' files come after `latest`, the worst case."""
    tag = f"global_step{step}"
    d = save_dir / tag
    prefix = "bf16_" if bf16 else ""

    def optim(rank: int) -> None:
        _tsave({"optimizer_state_dict": tiny_optim(rank), "ds_config": {}, "ds_version": "0.16.4"},
               d / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")

    stages: list[Stage] = [
        ("model", lambda: _tsave({"module": tiny_model(step), "global_steps": step,
                                  "dp_world_size": world_size, "mp_world_size": 1,
                                  "ds_version": "0.16.4"}, d / "mp_rank_00_model_states.pt")),
        ("optim0", lambda: optim(0)),
        ("latest", lambda: (save_dir / "latest").write_text(tag)),
    ]
    stages += [(f"optim{r}", partial(optim, r)) for r in range(1, world_size)]
    _run(stages, stop)
    return d


# --- Megatron-LM -------------------------------------------------------------------------------

def write_megatron(save_dir: Path, iteration: int, *, tp: int = 2, torch_dist: bool = False,
                   stop: str | None = None) -> Path:
    """Megatron-LM `save_checkpoint` (core_r0.12): every rank writes its part of
    `iter_<N:07d>/`, barrier, then rank 0 writes `latest_checkpointed_iteration.txt`.
    Legacy format: `mp_rank_<tp:02d>/model_optim_rng.pt`; torch_dist (`dist_checkpointing.save`):
    `common.pt` first, then the DCP save into the iter dir, then `metadata.json`."""
    d = save_dir / f"iter_{iteration:07d}"
    stages: list[Stage] = []
    if torch_dist:
        stages += [("common", lambda: _tsave({"iteration": iteration}, d / "common.pt")),
                   ("dcp", lambda: write_dcp(d, iteration)),
                   ("metadata_json", lambda: _json(d / "metadata.json", {
                       "sharded_backend": "torch_dist", "sharded_backend_version": 1,
                       "common_backend": "torch", "common_backend_version": 1}))]
    else:
        stages += [(f"tp{r}", partial(_tsave, {
            "iteration": iteration, "checkpoint_version": 3.0, "model": tiny_model(r),
            "optimizer": tiny_optim(r), "rng_state": [{"random_rng_state": 0}]},
            d / f"mp_rank_{r:02d}" / "model_optim_rng.pt")) for r in range(tp)]
    stages.append(("tracker", lambda: (save_dir / "latest_checkpointed_iteration.txt")
                   .write_text(str(iteration))))
    _run(stages, stop)
    return d


# --- Orbax (JAX CheckpointManager) ---------------------------------------------------------------

def write_orbax(directory: Path, step: int, *, commit_file: bool = False, tmp_ts: int | None = None,
                stop: str | None = None) -> Path:
    """orbax-checkpoint 0.11 save of one PyTree item "default" (OCDBT):
    `AtomicRenameTemporaryPath` creates `<N>.orbax-checkpoint-tmp` (older releases add
    `-<timestamp>`) with `_CHECKPOINT_METADATA`, writes the item, sets `commit_timestamp_nsecs`
    and renames to `<N>`; `CommitFileTemporaryPath` (GCS) writes `<N>/` in place and adds
    `commit_success.txt` last."""
    final = directory / str(step)
    suffix = ".orbax-checkpoint-tmp" + (f"-{tmp_ts}" if tmp_ts is not None else "")
    work = final if commit_file else directory / f"{step}{suffix}"
    meta: dict[str, Any] = {"item_handlers": {"default": "PyTreeCheckpointHandler"},
                            "metrics": {}, "performance_metrics": {},
                            "init_timestamp_nsecs": time.time_ns(),
                            "commit_timestamp_nsecs": None, "custom": {}}

    def items() -> None:
        item = work / "default"
        _json(item / "_METADATA", {"tree_metadata": {"('params', 'w')": {
            "key_metadata": [{"key": "params"}, {"key": "w"}],
            "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False}}}})
        _json(item / "_sharding", {})
        (item / "manifest.ocdbt").write_bytes(b"\x00OCDBT" + bytes(26))
        (item / "ocdbt.process_0" / "d").mkdir(parents=True)
        (item / "ocdbt.process_0" / "manifest.ocdbt").write_bytes(b"\x00OCDBT" + bytes(10))
        (item / "ocdbt.process_0" / "d" / "6c0f0ae5b3c0a57b").write_bytes(os.urandom(512))
        (item / "array_metadatas").mkdir()
        _json(item / "array_metadatas" / "process_0", {"array_metadatas": []})

    def commit_ts() -> None:
        _json(work / "_CHECKPOINT_METADATA",
              {**meta, "metrics": {"loss": 0.125}, "commit_timestamp_nsecs": time.time_ns()})

    stages: list[Stage] = [
        ("create", lambda: _json(work / "_CHECKPOINT_METADATA", meta)),
        ("items", items),
        ("commit_timestamp", commit_ts),
        ("commit_file", lambda: (final / "commit_success.txt").write_text(
            f"Checkpoint commit was successful to {final}")) if commit_file
        else ("rename", lambda: work.rename(final)),
    ]
    _run(stages, stop)
    return final


# --- NeMo 2 (Lightning ModelCheckpoint with `-unfinished` markers) -------------------------------

def write_nemo(directory: Path, step: int, *, stop: str | None = None) -> Path:
    """NeMo's ModelCheckpoint: rank 0 touches `<name>-unfinished`, the (DCP) save runs, the
    marker is removed at the end."""
    name = f"megatron_gpt--val_loss=1.23-step={step}-consumed_samples={step * 8}.0-last"
    d = directory / name
    marker = directory / f"{name}-unfinished"
    _run([("marker", marker.touch),
          ("weights", lambda: write_dcp(d / "weights", step)),
          ("context", lambda: _json(d / "context" / "io.json", {"model": "gpt"})),
          ("unmark", marker.unlink)], stop)
    return d


STAGES: dict[str, list[str]] = {
    "native": ["model", "optim0", "meta", "rename"],
    "split": ["model", "ema", "optim", "meta"],
    "ranked": ["model", "meta", "rank0", "rank1"],
    "single": ["start", "finish"],
    "dcp": ["metadata"],
    "hf": ["config", "model", "training_args", "optimizer", "scheduler", "rng", "trainer_state"],
    "deepspeed": ["model", "optim0", "latest", "optim1"],
    "megatron": ["tp0", "tp1", "tracker"],
    "megatron_torch_dist": ["common", "dcp", "metadata_json", "tracker"],
    "orbax": ["create", "items", "commit_timestamp", "rename"],
    "orbax_commit_file": ["create", "items", "commit_timestamp", "commit_file"],
    "nemo": ["marker", "weights", "context", "unmark"],
}
