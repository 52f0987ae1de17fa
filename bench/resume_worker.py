"""Child processes of the resume benchmark: build the training state (saved with dcp.save and
ckptd.torch.save), upload a step through ckptd, and load a step into memory each way, checking
every tensor against the digests taken at save time. Each prints one JSON line on stdout.

Every load runs in a fresh process; the parent measures wall time and peak RSS around it.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

T0 = time.perf_counter()  # before torch is imported: `ready_s` counts from here

import torch  # noqa: E402
import xxhash  # noqa: E402

ROOT_NAME = "bench"
STEP = 1
TRAIN_STEPS = 2


def digest(t: torch.Tensor) -> str:
    """xxh3-128 of a tensor's bytes, with its shape and dtype."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return f"{tuple(t.shape)}:{t.dtype}:{xxhash.xxh3_128_hexdigest(flat.numpy().data)}"


def _model(width: int, layers: int, device: str = "cpu") -> torch.nn.Module:
    from torch import nn

    with torch.device(device):
        blocks: list[nn.Module] = []
        for _ in range(layers):
            blocks += [nn.Linear(width, width), nn.GELU()]
        return nn.Sequential(*blocks)


def flat_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The model and its Adam state as one flat dict of tensors (the DCP save's state)."""
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    for idx, state in opt.state_dict()["state"].items():
        for name, value in state.items():
            out[f"optim.{idx}.{name}"] = value
    return out


def build(out: Path, size: int, dcp_files: int) -> dict[str, Any]:
    """An fp32 MLP and its Adam state (12 bytes a parameter, about `size` bytes in all), saved
    as DCP under `out/dcp/step-1/` and natively under `out/native/step-1/`."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    import ckptd.torch

    torch.manual_seed(0)
    params = size // 12
    width = 4096 if params >= 2 * 4096 * 4096 else 2048
    layers = max(1, round(params / (width * width + width)))
    model = _model(width, layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for _ in range(TRAIN_STEPS):
        model(torch.randn(8, width)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = flat_state(model, opt)
    writer = FileSystemWriter(str(out / "dcp" / f"step-{STEP}"), thread_count=dcp_files)
    save(state, storage_writer=writer)
    ckptd.torch.save(out / "native", STEP, model=model, optimizer=opt, register=False)
    expect = {k: digest(v) for k, v in state.items()}
    (out / "expect.json").write_text(json.dumps({"width": width, "layers": layers,
                                                 "tensors": expect}))
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    return {"width": width, "layers": layers, "tensors": len(state), "state_bytes": nbytes}


def upload(args: argparse.Namespace) -> dict[str, Any]:
    """What the daemon does for one step: validate + compress in one read pass, upload_step."""
    from ckptd.backends import make_backend, wrap_backend
    from ckptd.copies.store import objects_dir
    from ckptd.heap import return_large_buffers
    from ckptd.model import Candidate
    from ckptd.stages.compress import Stager
    from ckptd.stages.upload import upload_step
    from ckptd.stages.validate import validate

    return_large_buffers()
    root = Path(args.root)
    step_dir = root / f"step-{STEP}"
    files = tuple(sorted(str(p.relative_to(root)) for p in step_dir.rglob("*") if p.is_file()))
    cand = Candidate(args.layout, STEP, f"step-{STEP}", files, complete=True)
    stager = Stager(root, ROOT_NAME, STEP, args.layout, codec=args.codec, level=3, threads=1,
                    min_saving=0.03)
    result = validate(root, cand, extra_sinks=stager.sinks_for)
    if not result.valid:
        raise SystemExit(f"invalid: {result.reason} {result.message}")
    manifest = stager.commit(result.files, {})
    backend = wrap_backend(make_backend(args.url))
    up = upload_step(backend, ROOT_NAME, objects_dir(root, STEP), manifest, concurrency=4)
    return {"raw": manifest.size, "stored": manifest.stored_size, "sent_bytes": up.sent_bytes,
            "codecs": sorted({f.codec for f in manifest.files})}


# -- loading ------------------------------------------------------------------------------------


def _expected(args: argparse.Namespace) -> dict[str, str]:
    doc = json.loads(Path(args.expect).read_text())
    tensors: dict[str, str] = doc["tensors"]
    return {k: tensors[k] for k in part_keys(tensors, args.part)}


def part_keys(tensors: dict[str, str], part: str) -> list[str]:
    """The keys of part `i/n` of a resharded load: tensors dealt by size, largest first, each
    to the part holding fewest bytes so far ("0/1": every key)."""
    i, n = (int(x) for x in part.split("/"))
    loads = [0] * n
    mine: list[str] = []
    for key in sorted(tensors, key=lambda k: (-_nbytes(tensors[k]), k)):
        j = loads.index(min(loads))
        loads[j] += _nbytes(tensors[key])
        if j == i:
            mine.append(key)
    return sorted(mine)


def _shape_dtype(d: str) -> tuple[tuple[int, ...], torch.dtype]:
    shape_s, dtype_s, _ = d.split(":")
    shape = tuple(int(x) for x in shape_s.strip("()").split(",") if x.strip())
    return shape, getattr(torch, dtype_s.removeprefix("torch."))


def _nbytes(d: str) -> int:
    shape, dtype = _shape_dtype(d)
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


def template(expect: dict[str, str]) -> dict[str, torch.Tensor]:
    """Empty tensors of the saved shapes and dtypes, as a resuming trainer holds them."""
    out = {}
    for key, d in expect.items():
        shape, dtype = _shape_dtype(d)
        out[key] = torch.empty(shape, dtype=dtype)
    return out


def check(state: dict[str, torch.Tensor], expect: dict[str, str]) -> int:
    bad = [k for k, d in expect.items() if digest(state[k]) != d]
    if bad or set(state) != set(expect):
        raise SystemExit(f"loaded state differs from the saved one: {bad[:5]} ({len(bad)})")
    return len(expect)


def _dcp_load(state: dict[str, torch.Tensor], reader: Any) -> None:
    from torch.distributed.checkpoint.state_dict_loader import load

    load(state, storage_reader=reader)


def load_dcp(args: argparse.Namespace) -> dict[str, Any]:
    """dcp.load of the step through the reader named by --how, then every tensor checked."""
    import torch.distributed.checkpoint  # noqa: F401  (imported before the clock starts)

    expect = _expected(args)
    state = template(expect)
    started = time.perf_counter()
    reader = _reader(args)
    _dcp_load(state, reader)
    return timed(started, lambda: check(state, expect)) | read_stats(reader)


def timed(started: float, checking: Callable[[], int]) -> dict[str, Any]:
    """The phases of a load that began at `started`: imports and set-up before it, the load,
    then the check of every tensor (`checking` returns how many it checked)."""
    loaded = time.perf_counter()
    checked = checking()
    return {"ready_s": started - T0, "load_s": loaded - started,
            "check_s": time.perf_counter() - loaded, "checked": checked}


def read_stats(reader: Any) -> dict[str, int]:
    """What a reader says it fetched: `bytes_read`, or `stats` (stored bytes, requests, blocks)."""
    got = getattr(reader, "bytes_read", None)
    if isinstance(got, int):
        return {"bytes_read": got}
    stats = getattr(reader, "stats", None)
    out = {name: getattr(stats, attr) for name, attr in (
        ("bytes_read", "stored_bytes"), ("requests", "requests"), ("blocks", "blocks"))
        if isinstance(getattr(stats, attr, None), int)}
    return out


def _reader(args: argparse.Namespace) -> Any:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    if args.how == "local":
        return FileSystemReader(args.path)
    if args.how == "s3tc":
        return s3tc_reader(args.path, args.endpoint, args.region)
    from ckptd.dcp import StorageReader  # type: ignore[import-not-found,unused-ignore]

    return StorageReader(ROOT_NAME, step=STEP, remote=args.path)


def s3tc_reader(url: str, endpoint: str, region: str) -> Any:
    """s3torchconnector's DCP reader pointed at an S3-compatible endpoint: S3StorageReader takes
    no endpoint, so its file system gets a client built with one (path-style addressing)."""
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3StorageReader

    config = S3ClientConfig(force_path_style=True)
    reader = S3StorageReader(region, url, s3client_config=config)
    reader.fs._client = S3Client(region, endpoint=endpoint, s3client_config=config)
    return reader


def load_native(args: argparse.Namespace) -> dict[str, Any]:
    """ckptd.torch.load into a model and an Adam optimizer, then every tensor checked."""
    import ckptd.torch

    doc = json.loads(Path(args.expect).read_text())
    model = _model(doc["width"], doc["layers"], "meta").to_empty(device="cpu")
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    started = time.perf_counter()
    if args.how == "native-local":
        ckptd.torch.load(args.path, model=model, optimizer=opt)
    else:
        ckptd.torch.load(ROOT_NAME, STEP, model=model, optimizer=opt,  # type: ignore[call-arg,unused-ignore]
                         source="remote", remote=args.path)
    return timed(started, lambda: check(flat_state(model, opt), doc["tensors"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["build", "upload", "load"])
    p.add_argument("--out")
    p.add_argument("--size", type=int, default=0)
    p.add_argument("--dcp-files", type=int, default=2)
    p.add_argument("--root")
    p.add_argument("--layout", default="dcp")
    p.add_argument("--codec", default="auto")
    p.add_argument("--url")
    p.add_argument("--how", choices=["local", "s3tc", "ckptd", "native-local", "native-remote"])
    p.add_argument("--path", help="a local directory or a remote URL, as --how reads it")
    p.add_argument("--endpoint", default="")
    p.add_argument("--region", default="us-east-1")
    p.add_argument("--expect")
    p.add_argument("--part", default="0/1", help="i/n: load only part i of n of the state")
    args = p.parse_args()
    if args.command == "build":
        out = build(Path(args.out), args.size, args.dcp_files)
    elif args.command == "upload":
        out = upload(args)
    elif args.how in ("native-local", "native-remote"):
        out = load_native(args)
    else:
        out = load_dcp(args)
    out["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(out))


if __name__ == "__main__":
    main()
