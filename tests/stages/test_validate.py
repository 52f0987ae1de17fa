"""The validate stage on real torch-written checkpoints, intact and damaged."""

from __future__ import annotations

import collections
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import writers
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.cli.verify import verify_path
from ckptd.errors import CkptdError, ValidationFailed
from ckptd.model import Candidate, RankFiles, ValidationResult
from ckptd.stages.deep import deepscan
from ckptd.stages.validate import validate


def _cand(*files: str, **kw: object) -> Candidate:
    return Candidate("test", 1, files[0], tuple(files), complete=True, **kw)  # type: ignore[arg-type]


def _invalid(res: ValidationResult, reason: str) -> None:
    assert not res.valid, res
    assert res.reason == reason, res
    assert res.message
    assert "/proc/self" not in res.message, res.message  # the file by its name in the root


@pytest.fixture(scope="module")
def torch_file(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The bytes of one real torch.save of a model + Adam state (written once per module)."""
    return writers.save_torch(tmp_path_factory.mktemp("src") / "m.pt").read_bytes()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    r.mkdir()
    return r


def test_valid_torch_file_gets_size_and_hash(root: Path, torch_file: bytes) -> None:
    (root / "step_1.pt").write_bytes(torch_file)
    res = validate(root, _cand("step_1.pt", metrics={"loss": 1.5}))
    assert res.valid and res.reason == "" and res.metrics == {"loss": 1.5}
    [rec] = res.files
    assert (rec.path, rec.size, rec.hash_alg) == ("step_1.pt", len(torch_file), "xxh3-128")
    assert rec.hash == xxhash.xxh3_128(torch_file).hexdigest()


def test_flipped_tensor_byte_is_crc_mismatch(root: Path, torch_file: bytes) -> None:
    p = root / "step_1.pt"
    p.write_bytes(torch_file)
    offset, size = writers.member_data_offset(p, "/data/1")
    writers.flip_byte(p, offset + size - 1)
    torch.load(p, weights_only=True, mmap=True)  # loads fine: only the CRC catches it
    res = validate(root, _cand("step_1.pt"))
    _invalid(res, "crc_mismatch")
    assert "data/1" in res.message


def test_truncated_empty_and_garbage(root: Path, torch_file: bytes) -> None:
    (root / "cut.pt").write_bytes(torch_file[: len(torch_file) - 100])
    _invalid(validate(root, _cand("cut.pt")), "truncated")
    (root / "empty.pt").write_bytes(b"")
    _invalid(validate(root, _cand("empty.pt")), "empty_file")
    # Seeded, and led by a byte that is no pickle opcode: random bytes may begin with one and
    # then read as a protocol-0 pickle (unsafe_pickle rather than bad_header).
    junk = np.random.default_rng(7).bytes(999).replace(b"\x80", b"\x00")
    (root / "garbage.pt").write_bytes(b"\xff" + junk)
    _invalid(validate(root, _cand("garbage.pt")), "bad_header")


def test_presence_and_sizes_come_first(root: Path, torch_file: bytes) -> None:
    (root / "a.pt").write_bytes(torch_file)
    _invalid(validate(root, _cand("a.pt", "b.pt")), "missing_file")
    n = len(torch_file)
    _invalid(validate(root, _cand("a.pt", expected_sizes={"a.pt": n + 1})), "size_mismatch")
    _invalid(validate(root, _cand("a.pt", min_sizes={"a.pt": n + 1})), "truncated")
    assert validate(root, _cand("a.pt", expected_sizes={"a.pt": n}, min_sizes={"a.pt": n})).valid
    (root / "marker").write_bytes(b"")
    assert validate(root, _cand("a.pt", "marker")).valid  # an empty file nobody expects bytes of
    _invalid(validate(root, _cand("a.pt", "marker", min_sizes={"marker": 1})), "empty_file")


def test_symlink_out_of_the_root_is_unsafe_path(root: Path, torch_file: bytes) -> None:
    outside = root.parent / "outside.pt"
    outside.write_bytes(torch_file)
    (root / "step_1.pt").symlink_to(outside)
    _invalid(validate(root, _cand("step_1.pt")), "unsafe_path")
    _invalid(validate(root, _cand("../outside.pt")), "unsafe_path")


def test_a_checkpoint_without_files_is_invalid(root: Path) -> None:
    _invalid(validate(root, Candidate("test", 1, "x", (), complete=True)), "missing_file")


def test_layouts_own_verdict_is_kept(root: Path) -> None:
    res = validate(root, _cand("x", invalid_reason="bad_metadata", invalid_message="meta.json"))
    _invalid(res, "bad_metadata")


@pytest.mark.parametrize("payload", ["shell", "exec"])
@pytest.mark.parametrize("deep", [False, True])
def test_hostile_pickle_is_unsafe_and_never_runs(root: Path, payload: str, deep: bool) -> None:
    marker = root.parent / "pwned"
    obj = (writers.RunsShell(f"touch {marker}") if payload == "shell"
           else writers.RunsExec(f"open({str(marker)!r}, 'w').close()"))
    writers.save_torch(root / "step_1.pt", writers.hostile_state(obj))
    res = validate(root, _cand("step_1.pt"), deep=deep)
    _invalid(res, "unsafe_pickle")
    assert not marker.exists()


def test_deep_finds_nan_weights_and_names_the_tensor(root: Path) -> None:
    state = writers.small_state()
    state["model"]["2.bias"][1] = float("nan")
    writers.save_torch(root / "step_1.pt", state)
    assert validate(root, _cand("step_1.pt")).valid  # shallow checks cannot see NaN
    res = validate(root, _cand("step_1.pt"), deep=True)
    _invalid(res, "nan")
    assert "step_1.pt" in res.message and "model.2.bias" in res.message


def test_deep_passes_clean_checkpoints_with_numpy_and_bf16(root: Path) -> None:
    state = writers.small_state()
    state["extra"]["rng"] = np.random.get_state()
    state["extra"]["bf16"] = torch.randn(4, 4).to(torch.bfloat16).t()  # non-contiguous too
    writers.save_torch(root / "step_1.pt", state)
    assert validate(root, _cand("step_1.pt"), deep=True).valid
    state["extra"]["bf16"][0, 0] = float("inf")
    writers.save_torch(root / "step_2.pt", state)
    _invalid(validate(root, _cand("step_2.pt"), deep=True), "nan")


def test_legacy_torch_format(root: Path) -> None:
    writers.save_torch(root / "old.pt", _use_new_zipfile_serialization=False)
    assert validate(root, _cand("old.pt"), deep=True).valid


# --- DCP -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return writers.save_dcp(tmp_path_factory.mktemp("dcp") / "step-5")


def _dcp_copy(root: Path, src: Path) -> Candidate:
    (root / "step-5").mkdir()
    files = []
    for p in sorted(src.iterdir()):
        (root / "step-5" / p.name).write_bytes(p.read_bytes())
        files.append(f"step-5/{p.name}")
    return Candidate("dcp", 5, "step-5", tuple(files), complete=True)


def test_dcp_checkpoint_is_valid(root: Path, dcp_dir: Path) -> None:
    res = validate(root, _dcp_copy(root, dcp_dir))
    assert res.valid, res
    assert {f.path for f in res.files} == {f"step-5/{p.name}" for p in dcp_dir.iterdir()}


def test_dcp_flipped_byte_in_data_is_crc_mismatch(root: Path, dcp_dir: Path) -> None:
    cand = _dcp_copy(root, dcp_dir)
    data = root / "step-5" / "__0_0.distcp"
    writers.flip_byte(data, data.stat().st_size // 2)
    _invalid(validate(root, cand), "crc_mismatch")


def test_dcp_data_shorter_than_referenced_is_truncated(root: Path, dcp_dir: Path) -> None:
    cand = _dcp_copy(root, dcp_dir)
    data = root / "step-5" / "__0_0.distcp"
    writers.truncate(data, data.stat().st_size - 1)
    res = validate(root, cand)
    _invalid(res, "truncated")


def test_dcp_metadata_swapped_for_a_hostile_pickle(root: Path, dcp_dir: Path) -> None:
    import pickle

    cand = _dcp_copy(root, dcp_dir)
    marker = root.parent / "pwned"
    (root / "step-5" / ".metadata").write_bytes(
        pickle.dumps(writers.RunsShell(f"touch {marker}"), protocol=4))
    _invalid(validate(root, cand, deep=True), "unsafe_pickle")
    assert not marker.exists()


def test_dcp_metadata_of_another_save_is_caught(root: Path, dcp_dir: Path) -> None:
    cand = _dcp_copy(root, dcp_dir)
    # Fewer items: every range fits inside the data file, but not on its archive boundaries.
    other = writers.save_dcp(root.parent / "other", {"model": writers.small_state()["model"]})
    (root / "step-5" / ".metadata").write_bytes((other / ".metadata").read_bytes())
    _invalid(validate(root, cand), "bad_metadata")


# --- safetensors, JSON ---------------------------------------------------------------------


def test_safetensors_valid_broken_and_deep(root: Path) -> None:
    w = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)
    writers.write_safetensors(root / "model.safetensors", {"w": w, "b": np.zeros(3, np.float16)})
    assert validate(root, _cand("model.safetensors"), deep=True).valid
    w[3, 3] = np.nan
    writers.write_safetensors(root / "nan.safetensors", {"w": w})
    assert validate(root, _cand("nan.safetensors")).valid
    res = validate(root, _cand("nan.safetensors"), deep=True)
    _invalid(res, "nan")
    assert "tensor w" in res.message
    bf16_inf = np.array([0x3F80, 0x7F80], dtype=np.uint16)  # 1.0, +inf
    writers.write_safetensors(root / "bf.safetensors", {"x": bf16_inf}, dtypes={"x": "BF16"})
    _invalid(validate(root, _cand("bf.safetensors"), deep=True), "nan")
    writers.truncate(root / "model.safetensors", 100)
    _invalid(validate(root, _cand("model.safetensors")), "truncated")


def test_json_files_must_parse(root: Path, torch_file: bytes) -> None:
    (root / "step-1").mkdir()
    (root / "step-1" / "model.pt").write_bytes(torch_file)
    (root / "step-1" / "meta.json").write_text(json.dumps({"step": 1}))
    cand = _cand("step-1/meta.json", "step-1/model.pt")
    assert validate(root, cand).valid
    (root / "step-1" / "meta.json").write_text('{"step": 1')
    _invalid(validate(root, cand), "bad_metadata")
    (root / "step-1" / "meta.json").write_text("[" * 100_000 + "]" * 100_000)
    _invalid(validate(root, cand), "bad_metadata")


def test_torch_named_zip_without_a_pickle_is_bad_header(root: Path) -> None:
    import zipfile

    with zipfile.ZipFile(root / "step_1.pt", "w") as z:
        z.writestr("readme.txt", "not a checkpoint")
    _invalid(validate(root, _cand("step_1.pt")), "bad_header")


# --- one pass, extra sinks ------------------------------------------------------------------


class Counter:
    """An extra sink, as the compress stage plugs in: counts what the single pass delivers."""

    def __init__(self, log: dict[str, list[tuple[int, int]]], rel: str) -> None:
        self.log, self.rel = log, rel

    def update(self, offset: int, view: memoryview) -> None:
        self.log.setdefault(self.rel, []).append((offset, len(view)))

    def finish(self, total: int) -> None:
        self.log.setdefault(self.rel, []).append((total, -1))


def test_each_file_is_read_once_and_shared_with_extra_sinks(root: Path, dcp_dir: Path) -> None:
    cand = _dcp_copy(root, dcp_dir)
    log: dict[str, list[tuple[int, int]]] = {}
    res = validate(root, cand, extra_sinks=lambda rel: [Counter(log, rel)])
    assert res.valid
    for rec in res.files:
        calls = log[rec.path]
        assert calls[-1] == (rec.size, -1)  # finished once, with the size
        offsets = [o for o, _ in calls[:-1]]
        assert offsets == sorted(set(offsets))  # each offset once, in order
        assert sum(n for _, n in calls[:-1]) == rec.size


def test_verify_a_file_and_a_dir(root: Path, torch_file: bytes, dcp_dir: Path) -> None:
    (root / "x.pt").write_bytes(torch_file)
    assert verify_path(root / "x.pt")["valid"]
    assert verify_path(dcp_dir)["valid"]
    gone = verify_path(root / "nope.pt")
    assert not gone["valid"] and gone["reason"] == "missing_file"


def test_hf_training_args_object_is_opaque_but_a_weights_file_is_not(tmp_path: Path) -> None:
    """Real Trainer checkpoints pickle a TrainingArguments object into training_args.bin;
    resume never loads it, so it must not make the checkpoint invalid. The same pickle in a
    file that is loaded (optimizer.pt) is refused."""
    import sys
    import types

    import torch

    from ckptd import layouts
    from ckptd.model import FileInfo, RootOptions, Snapshot

    mod = types.ModuleType("transformers.training_args")

    class TrainingArguments:
        def __init__(self) -> None:
            self.output_dir = "out"
            self.learning_rate = 1e-4

    TrainingArguments.__module__ = mod.__name__
    TrainingArguments.__qualname__ = "TrainingArguments"
    mod.TrainingArguments = TrainingArguments  # type: ignore[attr-defined]
    parent = types.ModuleType("transformers")
    parent.training_args = mod  # type: ignore[attr-defined]
    added = [n for n in ("transformers", mod.__name__) if n not in sys.modules]
    sys.modules.setdefault("transformers", parent)
    sys.modules[mod.__name__] = mod
    try:
        ck = tmp_path / "checkpoint-10"
        ck.mkdir()
        torch.save(TrainingArguments(), ck / "training_args.bin")
        torch.save({"state": {}, "param_groups": []}, ck / "optimizer.pt")
        (ck / "trainer_state.json").write_text('{"global_step": 10, "log_history": []}')
        files = {}
        for p in ck.iterdir():
            rel = f"checkpoint-10/{p.name}"
            files[rel] = FileInfo(rel, p.stat().st_size, 0.0, 0.0)
        contents = {"checkpoint-10/trainer_state.json": (ck / "trainer_state.json").read_bytes()}
        snap = Snapshot(files=files, dirs=frozenset({"checkpoint-10"}), contents=contents)
        (cand,) = layouts.detect(snap, RootOptions(settle=0), 100.0)
        assert cand.layout == "hf" and cand.complete
        assert cand.opaque == ("checkpoint-10/training_args.bin",)
        assert validate(tmp_path, cand).valid
        torch.save(TrainingArguments(), ck / "optimizer.pt")
        res = validate(tmp_path, cand)
        assert not res.valid and res.reason == "unsafe_pickle"
    finally:
        for n in added:
            sys.modules.pop(n, None)


def test_every_untrusted_global_is_named_in_one_message(root: Path) -> None:
    """A file that needs several globals trusted names them all at once: one round of
    `trusted_globals` edits, not one per re-validation."""
    import argparse

    marker = root.parent / "pwned"
    state = writers.hostile_state(writers.RunsShell(f"touch {marker}"))
    state["extra"].update(args=argparse.Namespace(lr=0.1), hook=writers.RunsExec("1"),
                          again=writers.RunsShell("true"))
    writers.save_torch(root / "step_1.pt", state)
    res = validate(root, _cand("step_1.pt"))
    _invalid(res, "unsafe_pickle")
    names = [n for n in ("argparse.Namespace", "builtins.exec", "posix.system")
             if n in res.message]
    assert len(names) == 3 and res.message.count("posix.system") == 1, res.message
    assert "which are not on the allow-list" in res.message
    assert not marker.exists()
    # Trusting the plain-data one leaves the two that run code, still in one message.
    res = validate(root, _cand("step_1.pt"), trusted=frozenset({"argparse.Namespace"}))
    _invalid(res, "unsafe_pickle")
    assert "argparse" not in res.message and "exec" in res.message and "system" in res.message


def _ds_like(root: Path, dp: object, ranks: list[int], prefix: str = "") -> Candidate:
    """A DeepSpeed-shaped tag dir: model states recording `dp_world_size`, optimizer files for
    `ranks`; the candidate asks for one optimizer file per recorded rank."""
    d = root / "global_step5"
    d.mkdir()
    torch.save({"module": {"w": torch.ones(2)}, "dp_world_size": dp, "mp_world_size": 1},
               d / "mp_rank_00_model_states.pt")
    for r in ranks:
        torch.save({"optimizer_state_dict": {"step": r}},
                   d / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    files = sorted(str(p.relative_to(root)) for p in d.iterdir())
    need = RankFiles("global_step5/mp_rank_00_model_states.pt", "dp_world_size",
                     f"global_step5/{prefix}zero_pp_rank_", "_mp_rank_00_optim_states.pt")
    return Candidate("deepspeed", 5, "global_step5", tuple(files), complete=True,
                     rank_files=(need,))


def test_rank_files_recorded_in_a_member_are_all_required(root: Path) -> None:
    """The layout may call a tag complete without knowing the data-parallel size (it reads no
    large file); validation reads it from the model states and names every missing shard."""
    res = validate(root, _ds_like(root, 4, [0, 2]))
    _invalid(res, "missing_file")
    assert "dp_world_size = 4" in res.message
    assert ("global_step5/zero_pp_rank_1_mp_rank_00_optim_states.pt, "
            "global_step5/zero_pp_rank_3_mp_rank_00_optim_states.pt") in res.message


@pytest.mark.parametrize(("dp", "ranks", "reason"), [
    (2, [0, 1], ""), (1, [0], ""), (None, [0], ""),  # None: not recorded, not checked
    (0, [0], "bad_metadata"), ("2", [0], "bad_metadata"), (1 << 40, [0], "bad_metadata"),
    (True, [0], "bad_metadata"),
])
def test_rank_counts(root: Path, dp: object, ranks: list[int], reason: str) -> None:
    res = validate(root, _ds_like(root, dp, ranks, prefix="bf16_"))
    assert (res.valid, res.reason) == (not reason, reason), res


def test_deepspeed_checkpoints_trust_deepspeeds_plain_data_classes(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An optimizer file pickling DeepSpeed's loss scaler, stage enum and fragment address
    (stand-ins registered under DeepSpeed's names, only so that pickle writes those names) is
    valid in a `deepspeed` checkpoint with no configuration, and nowhere else; any other
    foreign global in it is still refused."""
    import argparse
    import enum
    import sys
    import types

    def register(module: str, obj: type) -> type:
        parts = module.split(".")
        for i in range(1, len(parts) + 1):  # pickle imports the module, parents first
            name = ".".join(parts[:i])
            if name not in sys.modules:
                monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        obj.__module__, obj.__qualname__ = module, obj.__name__
        monkeypatch.setattr(sys.modules[module], obj.__name__, obj, raising=False)
        return obj

    class LossScaler:
        def __init__(self) -> None:
            self.cur_scale, self.dynamic = 1.0, False

    class ZeroStageEnum(int, enum.Enum):
        gradients = 2

    class fragment_address:  # noqa: N801 - DeepSpeed's name
        def __init__(self) -> None:
            self.numel, self.start = 338, 0

    scaler = register("deepspeed.runtime.fp16.loss_scaler", LossScaler)
    stage = register("deepspeed.runtime.zero.config", ZeroStageEnum)
    frag = register("deepspeed.utils.tensor_fragment", fragment_address)
    d = root / "global_step3"
    d.mkdir()
    optim = d / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"loss_scaler": scaler(), "zero_stage": stage(2),
                                         "param_slice_mappings": [{"0.weight": frag()}]}},
               optim)
    rel = "global_step3/" + optim.name
    ds = Candidate("deepspeed", 3, "global_step3", (rel,), complete=True)
    assert validate(root, ds).valid
    res = validate(root, _cand(rel))  # another layout: not trusted
    _invalid(res, "unsafe_pickle")
    assert all(n in res.message for n in ("LossScaler", "ZeroStageEnum", "fragment_address"))
    torch.save({"loss_scaler": scaler(), "args": argparse.Namespace(lr=1)}, optim)
    res = validate(root, ds)
    _invalid(res, "unsafe_pickle")
    assert "argparse.Namespace, which is not" in res.message


@pytest.mark.skipif(shutil.which("fincore") is None, reason="needs util-linux fincore")
def test_a_just_written_checkpoint_leaves_the_page_cache_once_valid(tmp_path: Path) -> None:
    """The trainer's own writes leave the file's pages dirty in the cache; the read pass cannot
    drop dirty pages, so they go once validation has fsynced the file."""
    root = tmp_path
    path = root / "step_1.pt"
    torch.save({"w": torch.randn(16 << 20)}, path)  # through the page cache, no fsync
    assert _resident(path) > (64 << 20) // 2
    assert validate(root, _cand("step_1.pt")).valid
    assert _resident(path) < (64 << 20) // 10, _resident(path)


def _resident(path: Path) -> int:
    out = subprocess.run(["fincore", "-b", "-n", "-o", "RES", str(path)], check=True,
                         capture_output=True, text=True).stdout
    return int(out.split()[0])


def test_deep_validation_loads_torch_in_a_child_process(tmp_path: Path) -> None:
    # A fresh interpreter, as the daemon is: a NaN is found, and torch never enters it.
    torch.save({"w": torch.tensor([1.0, float("nan")])}, tmp_path / "model.pt")
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from ckptd.cli.verify import verify_path\n"
        f"r = verify_path(Path({str(tmp_path / 'model.pt')!r}), deep=True)\n"
        "print(r['reason'], 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.split() == ["nan", "False"], out.stderr


# --- deep: time bounded by the file, not by the view -----------------------------------------


class _View:
    """Pickles as torch's own tensor rebuild over `storage` with the sizes and strides given,
    as a hostile writer can make a torch file claim any view of a small storage."""

    def __init__(self, storage: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...]
                 ) -> None:
        self.storage, self.size, self.stride = storage, size, stride

    def __reduce__(self) -> tuple[Any, ...]:
        typed = torch.storage.TypedStorage(wrap_storage=self.storage.untyped_storage(),
                                           dtype=self.storage.dtype, _internal=True)
        return (torch._utils._rebuild_tensor_v2,
                (typed, 0, self.size, self.stride, False, collections.OrderedDict()))


def _overlapping(n: int, views: int) -> dict[str, torch.Tensor]:
    base = torch.zeros(n)
    return {f"v{i}": base[i : n - views + i] for i in range(views)}


@pytest.mark.parametrize(("name", "make", "reason"), [
    # Real torch.save of views that reuse or skip elements, or have many small rows.
    ("expand", lambda: torch.zeros(1).expand(10**12), ""),
    ("expand3d", lambda: torch.zeros(1).expand(10**6, 10**6, 10**6), ""),
    ("transposed", lambda: torch.zeros(2, 2 * 10**6).t(), ""),
    # 3,000 overlapping views of one 32 MiB storage: each element scanned about once.
    ("many_views", lambda: _overlapping(8 * 10**6, 3000), ""),
    ("many_dims", lambda: torch.zeros([2] * 22).permute(*reversed(range(22))), ""),
    ("nan_in_many_dims", lambda: torch.zeros([2] * 22).index_fill_(5, torch.tensor([1]),
                                                                   float("nan")).permute(
        *reversed(range(22))), "nan"),
    # Crafted pickles: sizes far beyond the storage, with and without stride 0.
    ("claims_stride0", lambda: _View(torch.zeros(4), (2**40, 2**20), (0, 0)), ""),
    ("claims_beyond", lambda: _View(torch.zeros(4), (10**9,), (1,)), "bad"),
    ("claims_overflow", lambda: _View(torch.zeros(4), (2**62, 2**62), (0, 1)), "bad"),
])
def test_deep_validation_is_bounded_by_the_file_not_the_view(
        root: Path, name: str, make: Any, reason: str) -> None:
    """Decided in seconds: the scan's work follows the bytes the file holds, whatever the
    tensor's shape claims (a 16 MiB 22-dimension permutation took minutes row by row)."""
    torch.save({"w": make()}, root / "step_1.pt")
    started = time.monotonic()
    res = validate(root, _cand("step_1.pt"), deep=True)
    assert time.monotonic() - started < 40, name
    if reason == "":
        assert res.valid, res
    elif reason == "bad":
        assert not res.valid and res.reason in ("bad_header", "bad_metadata"), res
    else:
        _invalid(res, reason)


@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=6), data=st.data())
@settings(max_examples=200, deadline=None)
def test_deep_scan_pieces_cover_every_element_once(shape: list[int], data: Any) -> None:
    """The scan's pieces of any permuted, sliced view cover its elements exactly once, so a
    NaN anywhere is found and none is counted where there is none."""
    base = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    order = data.draw(st.permutations(range(len(shape))))
    view = base.permute(*order)[tuple(slice(None, None, data.draw(st.integers(1, 2)))
                                      for _ in shape)]
    block = data.draw(st.integers(1, 9))
    old, deepscan._SCAN_BLOCK = deepscan._SCAN_BLOCK, block
    try:
        pieces = list(deepscan._blocks(view))
    finally:
        deepscan._SCAN_BLOCK = old
    assert all(p.numel() <= block for p in pieces)
    seen = sorted(int(v) for p in pieces for v in p.reshape(-1).tolist())
    assert seen == sorted(int(v) for v in view.reshape(-1).tolist())
    assert len(pieces) <= 2 * view.numel() // block + 2 * view.dim() + 2


@given(views=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 60), st.integers(1, 3),
                                st.booleans()), min_size=1, max_size=8),
       nan_at=st.none() | st.integers(0, 119), budget=st.sampled_from([0, 10**9]),
       data=st.data())
@settings(max_examples=200, deadline=None)
def test_deep_scan_of_views_sharing_storage_misses_no_nan(
        views: list[tuple[int, int, int, bool]], nan_at: int | None, budget: int,
        data: Any) -> None:
    """Views sharing a storage, each checked once what they read was found finite: a NaN any
    of them reads is found, and (within the budget) none is reported that none of them reads."""
    storage = torch.zeros(120, dtype=torch.float32)
    if nan_at is not None:
        storage[nan_at] = float("nan")
    tensors = []
    for start, length, step, square in views:
        v = storage[start : start + length : step]
        if square and v.numel() >= 4:
            side = int(math.isqrt(v.numel()))
            v = v[: side * side].reshape(side, side).t()  # strided, not contiguous
        tensors.append(v)
    old, deepscan._CLEAN_BLOCK = deepscan._CLEAN_BLOCK, data.draw(st.integers(1, 16))
    try:
        seen = deepscan._Scanned(budget)
        found = any([seen.nonfinite(t) for t in tensors])  # every view, as the scan goes on
    finally:
        deepscan._CLEAN_BLOCK = old
    truth = any(bool(torch.isnan(t).any()) for t in tensors)
    assert found or not truth
    if budget:
        assert found == truth


def test_a_hung_deep_check_is_stopped_and_frees_the_slot(tmp_path: Path) -> None:
    """A child that never answers (here it waits for a writer on a FIFO) is killed past its
    limit: the job fails (to be retried), the checkpoint is not judged, and the next deep check
    gets the one slot."""
    fifo = tmp_path / "hang.pt"
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        t0 = time.monotonic()
        with pytest.raises(CkptdError, match="longer than 3s") as info:
            deepscan.scan_torch_file(fd, "hang.pt", timeout=3.0)
        assert not isinstance(info.value, ValidationFailed)
        assert time.monotonic() - t0 < 30
    finally:
        os.close(fd)
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(3)}, good)
    gfd = os.open(good, os.O_RDONLY)
    try:
        deepscan.scan_torch_file(gfd, "good.pt")
    finally:
        os.close(gfd)
    assert deepscan.child_timeout(10 << 30) > 600
