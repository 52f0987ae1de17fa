"""Child processes of the upload benchmark: build the input checkpoint, run ckptd's upload path
(validate + compress in one read pass, then upload_step), run ckptd's restore.

Each subcommand prints one JSON line on stdout; the parent measures wall time and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

FILES = ("model.pt", "optim.pt", "model_bf16.pt")
ROOT_NAME = "bench"


def build(ckpt: Path, size: int) -> dict[str, object]:
    """An fp32 MLP trained a few Adam steps: model.pt (fp32), optim.pt (Adam state, 2x the
    model), model_bf16.pt (bf16 weights); together about `size` bytes (14 bytes a parameter)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    params = size // 14
    width = 4096 if params >= 2 * 4096 * 4096 else 2048
    layers = max(1, round(params / (width * width + width)))
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.GELU()]
    model = nn.Sequential(*blocks)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for _ in range(3):
        loss = model(torch.randn(16, width)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    ckpt.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), ckpt / "model.pt")
    torch.save(opt.state_dict(), ckpt / "optim.pt")
    bf16 = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    torch.save(bf16, ckpt / "model_bf16.pt")
    sizes = {f: (ckpt / f).stat().st_size for f in FILES}
    return {"layers": layers, "width": width, "sizes": sizes, "total": sum(sizes.values())}


def _backend(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from ckptd.backends import make_backend, wrap_backend

    inner = make_backend(
        args.url,
        endpoint=args.endpoint,
        region="us-east-1",
        access_key_id=args.key,
        secret_access_key=args.secret,
        concurrency=args.concurrency,
        part_size=args.part_size,
    )
    return wrap_backend(inner)


def ckptd_upload(args: argparse.Namespace) -> dict[str, object]:
    """What the daemon does for one step of a single-node root: validate + compress (one read
    pass), each object sent as soon as it is finished (the early sender, large objects as
    multipart uploads), then the upload stage, which takes those over, verifies and commits."""
    from ckptd.copies.store import objects_dir
    from ckptd.heap import return_large_buffers
    from ckptd.model import Candidate
    from ckptd.stages.compress import Stager
    from ckptd.stages.sending.early import EarlySender
    from ckptd.stages.upload import upload_step
    from ckptd.stages.validate import validate

    return_large_buffers()  # as `ckptd run` does
    root = Path(args.root)
    step = args.step
    files = tuple(f"step-{step}/{f}" for f in FILES)
    cand = Candidate("registered", step, f"step-{step}", files, complete=True)
    stager = Stager(
        root,
        ROOT_NAME,
        step,
        "registered",
        codec=args.codec,
        level=3,
        threads=args.threads,
        min_saving=0.03,
    )
    backend = _backend(args)
    started = time.perf_counter()
    stager.send_early(EarlySender(backend, ROOT_NAME, step, stager.staging, args.concurrency),
                      lambda sent: None)  # a valid step: nothing sent early is discarded
    result = validate(root, cand, extra_sinks=stager.sinks_for)
    if not result.valid:
        raise SystemExit(f"invalid: {result.reason} {result.message}")
    manifest = stager.commit(result.files, {})
    compressed = time.perf_counter()
    rss_compress = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    up = upload_step(backend, ROOT_NAME, objects_dir(root, step), manifest,
                     concurrency=args.concurrency)
    done = time.perf_counter()
    return {
        "compress_s": compressed - started,
        "upload_s": done - compressed,
        "raw": manifest.size,
        "stored": manifest.stored_size,
        "sent_bytes": up.sent_bytes,
        "codecs": sorted({f.codec for f in manifest.files}),
        "peak_rss_after_compress": rss_compress,
    }


def ckptd_restore(args: argparse.Namespace) -> dict[str, object]:
    from ckptd.fetch.source import read_remote_manifest
    from ckptd.heap import return_large_buffers
    from ckptd.restore.files import restore_remote

    return_large_buffers()  # as `ckptd restore` does
    started = time.perf_counter()
    backend = _backend(args)
    manifest = read_remote_manifest(backend, ROOT_NAME, args.step)
    paths = restore_remote(backend, manifest, Path(args.to), concurrency=args.concurrency)
    return {"restore_s": time.perf_counter() - started, "files": len(paths)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["build", "ckptd-upload", "ckptd-restore"])
    p.add_argument("--ckpt")
    p.add_argument("--size", type=int, default=0)
    p.add_argument("--root")
    p.add_argument("--step", type=int, default=1)
    p.add_argument("--to")
    p.add_argument("--url")
    p.add_argument("--endpoint")
    p.add_argument("--key")
    p.add_argument("--secret")
    p.add_argument("--codec", default="auto")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--part-size", type=int, default=64 << 20)
    args = p.parse_args()
    if args.command == "build":
        out = build(Path(args.ckpt), args.size)
    elif args.command == "ckptd-upload":
        out = ckptd_upload(args)
    else:
        out = ckptd_restore(args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
