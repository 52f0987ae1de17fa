"""Codec round-trip helpers and the trained weights the codec tests encode. Holds no tests."""

from __future__ import annotations

import io

import torch

from ckptd.codec import decode_stream, make_encoder
from ckptd.codec.encoder import Encoder

BLOCK = 64 << 10  # small blocks keep the tests fast while crossing many block boundaries


def encode(
    data: bytes, codec: str, chunk: int = 10_000, block_size: int = BLOCK, **kw: object
) -> tuple[Encoder, bytes]:
    out = io.BytesIO()
    enc = make_encoder(codec, out, block_size=block_size, **kw)  # type: ignore[arg-type]
    view = memoryview(data)
    for off in range(0, len(data), chunk):
        enc.update(off, view[off : off + chunk])
    enc.finish(len(data))
    return enc, out.getvalue()


def decode(codec: str, stored: bytes) -> bytes:
    dst = io.BytesIO()
    seen: list[int] = []
    total = decode_stream(codec, io.BytesIO(stored), dst, seen.append)
    assert total == sum(seen) == len(dst.getvalue())
    return dst.getvalue()


def trained_weights(dtype: torch.dtype, steps: int = 30) -> bytes:
    """Weights and Adam state of a small MLP after a few real optimizer steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(128, 64)
    for _ in range(steps):
        opt.zero_grad()
        ((model(x) - x) ** 2).mean().backward()
        opt.step()
    tensors = [p.detach() for p in model.parameters()]
    tensors += [s for st in opt.state.values() for k, s in st.items() if k != "step"]
    flat = torch.cat([t.flatten() for t in tensors]).to(dtype)
    return flat.view(torch.uint8).numpy().tobytes()
