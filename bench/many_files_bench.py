"""Many-small-files upload benchmark: ckptd's `upload_step` of a 10,000-object step against
`aws s3 cp --recursive` of the same local compressed copy, side by side in one run, into the
same SeaweedFS server on loopback. Builds the checkpoint and ckptd's compressed copy once.

Every timed run is its own process, measured from outside (wall time, descendants included).
Usage: python bench/many_files_bench.py [--files 10000] [--repeat 3] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))  # the SeaweedFS launcher the tests use
sys.path.insert(0, str(REPO))

import s3server  # noqa: E402
from upload_bench import aws_env, drop_prefix, evict, warm_up  # noqa: E402

ROOT_NAME = "bench"
STEP = 1
RANKS = 8


# -- the inputs ---------------------------------------------------------------------------------


def build_checkpoint(ckpt: Path, files: int, seed: int = 0) -> dict[str, Any]:
    """`files` DCP-like shards of a few KiB each: fp32 tensors (1-8 KiB, normal values, so they
    compress the way weights do), spread over RANKS directories as per-rank writers leave them."""
    import numpy as np

    rng = np.random.default_rng(seed)
    sizes = rng.integers(256, 2048, size=files) * 4  # 1 KiB to 8 KiB of fp32
    names: list[str] = []
    for i, size in enumerate(sizes):
        rel = f"rank{i % RANKS}/__{i % RANKS}_{i // RANKS:05d}.distcp"
        path = ckpt / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.standard_normal(int(size) // 4, dtype=np.float32).tobytes())
        names.append(rel)
    return {"files": files, "total": int(sizes.sum()), "names": names}


def compress_copy(root: Path, names: list[str]) -> dict[str, Any]:
    """ckptd's local compressed copy, as the daemon makes it: validate + compress, one pass."""
    from ckptd.model import Candidate
    from ckptd.stages.compress import Stager
    from ckptd.stages.validate import validate

    files = tuple(f"step-{STEP}/{n}" for n in names)
    cand = Candidate("registered", STEP, f"step-{STEP}", files, complete=True)
    stager = Stager(root, ROOT_NAME, STEP, "registered", codec="auto", level=3, threads=1,
                    min_saving=0.03)
    started = time.perf_counter()
    result = validate(root, cand, extra_sinks=stager.sinks_for)
    if not result.valid:
        raise SystemExit(f"invalid: {result.reason} {result.message}")
    manifest = stager.commit(result.files, {})
    return {
        "compress_s": time.perf_counter() - started,
        "stored": manifest.stored_size,
        "codecs": sorted({f.codec for f in manifest.files}),
    }


def build_inputs(workdir: Path, files: int) -> tuple[Path, dict[str, Any]]:
    """`<workdir>/root/step-1/` and its compressed copy, built once per file count."""
    from ckptd.copies.store import objects_dir

    root = workdir / "root"
    stamp = workdir / "inputs.json"
    if stamp.exists():
        info: dict[str, Any] = json.loads(stamp.read_text())
        if info.get("files") == files and (objects_dir(root, STEP) / "MANIFEST.json").exists():
            return root, info
    shutil.rmtree(root, ignore_errors=True)
    info = build_checkpoint(root / f"step-{STEP}", files)
    info |= compress_copy(root, info.pop("names"))
    stamp.write_text(json.dumps(info))
    return root, info


# -- the timed runs -----------------------------------------------------------------------------


def ckptd_child(args: argparse.Namespace) -> None:
    """In a child process: upload_step of the compressed copy, as the daemon calls it."""
    from ckptd.backends import make_backend, wrap_backend
    from ckptd.copies.store import objects_dir, read_local_manifest
    from ckptd.stages.upload import upload_step

    started = time.perf_counter()
    root = Path(args.root)
    manifest = read_local_manifest(root, STEP)
    assert manifest is not None
    backend = wrap_backend(make_backend(
        args.url, endpoint=args.endpoint, region="us-east-1", access_key_id=args.key,
        secret_access_key=args.secret, concurrency=args.concurrency,
    ))
    result = upload_step(backend, ROOT_NAME, objects_dir(root, STEP), manifest,
                         concurrency=args.concurrency)
    print(json.dumps({"upload_s": time.perf_counter() - started,
                      "uploaded": result.uploaded_objects, "skipped": result.skipped_objects,
                      "sent_bytes": result.sent_bytes}))


def timed(argv: list[str], env: dict[str, str] | None = None) -> tuple[str, float]:
    started = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, env=env, check=False)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        tail = proc.stderr.decode(errors="replace")[-3000:]
        raise SystemExit(f"{argv[:3]} failed ({proc.returncode}):\n{tail}")
    return proc.stdout.decode(), wall


def run_ckptd(server: s3server.S3Server, root: Path, prefix: str, concurrency: int,
              wrapper: list[str], fresh: bool = True) -> tuple[float, dict[str, Any]]:
    from ckptd.copies.store import objects_dir

    if fresh:
        for ledger in objects_dir(root, STEP).glob(".upload-ledger*"):
            ledger.unlink()  # a fresh prefix: nothing to resume
    evict(objects_dir(root, STEP))
    argv = [*wrapper, sys.executable, __file__, "_ckptd", "--root", str(root),
            "--url", server.url(prefix), "--endpoint", server.endpoint,
            "--key", server.access_key, "--secret", server.secret_key,
            "--concurrency", str(concurrency)]
    stdout, wall = timed(argv)
    last = [line for line in stdout.splitlines() if line.startswith("{")][-1]  # not a wrapper's
    info: dict[str, Any] = json.loads(last)
    return wall, info


def run_aws(server: s3server.S3Server, root: Path, prefix: str, scratch: Path) -> float:
    from ckptd.copies.store import objects_dir

    src = objects_dir(root, STEP)
    evict(src)
    dest = server.url(f"{prefix}/{ROOT_NAME}/step-{STEP}/")
    argv = ["aws", "s3", "cp", "--recursive", "--only-show-errors", "--endpoint-url",
            server.endpoint, "--exclude", ".upload-ledger*", str(src), dest]
    _, wall = timed(argv, aws_env(server, {}, scratch))
    return wall


def count_objects(server: s3server.S3Server, prefix: str) -> int:
    from ckptd.backends import make_backend

    b = make_backend(server.url(prefix), endpoint=server.endpoint, region=server.region,
                     access_key_id=server.access_key, secret_access_key=server.secret_key)
    return sum(1 for _ in b.list(""))


def one_round(server: s3server.S3Server, root: Path, scratch: Path, args: argparse.Namespace,
              n: int) -> dict[str, float]:
    """aws and ckptd once each (the order flips each round), into fresh prefixes."""
    walls: dict[str, float] = {}
    for who in ("aws", "ckptd") if n % 2 == 0 else ("ckptd", "aws"):
        prefix = f"{who}-r{n}"
        if who == "aws":
            walls["aws"] = run_aws(server, root, prefix, scratch)
        else:
            wrapper = shlex.split(args.wrap) if n == 0 else []
            walls["ckptd"], info = run_ckptd(server, root, prefix, args.concurrency, wrapper)
            walls["ckptd_in_process"] = info["upload_s"]
        walls[f"{who}_objects"] = count_objects(server, prefix)
        if who == "ckptd":
            walls["resume"] = resume(server, root, prefix, args.concurrency)
        drop_prefix(server, prefix)
    return walls


def resume(server: s3server.S3Server, root: Path, prefix: str, concurrency: int) -> float:
    """ckptd again after its MANIFEST.json is removed: a re-run after a kill just before the
    commit, where the ledger vouches for every object (nothing is sent again)."""
    from ckptd.backends import make_backend

    b = make_backend(server.url(prefix), endpoint=server.endpoint, region=server.region,
                     access_key_id=server.access_key, secret_access_key=server.secret_key)
    b.delete(f"{ROOT_NAME}/step-{STEP}/MANIFEST.json")
    wall, info = run_ckptd(server, root, prefix, concurrency, [], fresh=False)
    assert info["uploaded"] == 0, info
    return wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=10_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4, help="ckptd's requests in flight")
    p.add_argument("--workdir", type=Path, default=HERE / "out" / "many-files")
    p.add_argument("--wrap", default="", help="a command prefix for the first ckptd run, e.g. "
                   '"py-spy record -o ckptd.txt -f raw --" (that run then times the profiler too)')
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    root, inputs = build_inputs(workdir, args.files)
    scratch = workdir / "scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    weed_dir = workdir / "weed"
    shutil.rmtree(weed_dir, ignore_errors=True)
    server = s3server.start_server(weed_dir)
    rounds: list[dict[str, float]] = []
    try:
        warm_up(server)
        for n in range(args.repeat):
            rounds.append(one_round(server, root, scratch, args, n))
            print(json.dumps(rounds[-1]), flush=True)
    finally:
        s3server.stop_server(server)
        shutil.rmtree(weed_dir, ignore_errors=True)
    report(rounds, inputs, args)


def report(
    rounds: list[dict[str, float]], inputs: dict[str, Any], args: argparse.Namespace
) -> None:
    print(f"command: python {' '.join(sys.argv)}")
    print(f"checkpoint: {inputs['files']} files, {inputs['total'] / 1e6:.1f} MB raw, "
          f"{inputs['stored'] / 1e6:.1f} MB stored ({', '.join(inputs['codecs'])}); "
          f"compressed copy built in {inputs['compress_s']:.1f} s")
    print(f"cpus: {os.cpu_count()}, load: {os.getloadavg()[0]:.1f}, ckptd concurrency "
          f"{args.concurrency}, aws: {_aws_version()} (default 10 requests in flight)")
    print("| round | aws s3 cp s | ckptd s (in process) | ratio ckptd/aws | ckptd re-run s |")
    print("|---:|---:|---:|---:|---:|")
    for n, r in enumerate(rounds):
        print(f"| {n} | {r['aws']:.1f} | {r['ckptd']:.1f} ({r['ckptd_in_process']:.1f}) | "
              f"{r['ckptd'] / r['aws']:.2f} | {r['resume']:.1f} |")
    ratios = [r["ckptd"] / r["aws"] for r in rounds]
    print(f"ratio range {min(ratios):.2f}-{max(ratios):.2f}")
    if args.json:
        args.json.write_text(json.dumps({"inputs": inputs, "rounds": rounds}, indent=1))


def _aws_version() -> str:
    out = subprocess.run(["aws", "--version"], capture_output=True, text=True, check=False)
    return (out.stdout or out.stderr).split()[0] if (out.stdout or out.stderr) else "?"


def child_main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("command")
    for flag in ("--root", "--url", "--endpoint", "--key", "--secret"):
        p.add_argument(flag)
    p.add_argument("--concurrency", type=int, default=4)
    ckptd_child(p.parse_args())


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_ckptd":
        child_main()
    else:
        main()
