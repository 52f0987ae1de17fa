"""Time to safe, end to end: from the moment a finished checkpoint appears in a watched root
(renamed in, as a trainer commits a save) until ckptd has it verified in the bucket, against
what a user would otherwise run, side by side in one run into the same SeaweedFS server on
loopback, alternating per round.

Two inputs: `many` is a real `dcp.save` of 10,000 tensors with one file per tensor (about
0.6 GB), against `aws s3 cp --recursive` of the same files; `big` is a 2.1 GB fp32 model + Adam
state in one torch file per component (registered through the client as it lands, as
`ckptd.torch.save` does), against the script a user would write to keep it safe
compressed (`sha256sum; zstd -T0 -3; aws s3 cp`, upload_bench's). For ckptd
the daemon runs as a service does (its own process, a fresh state directory each round) and
the breakdown per stage comes from its own transitions (detected, settled, valid, compressed,
uploaded, verified).

Usage: python bench/time_to_safe_bench.py [--case many|big|both] [--files 10000]
       [--repeat 3] [--workdir DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))  # the SeaweedFS launcher the tests use
sys.path.insert(0, str(HERE))

import s3server  # noqa: E402
from upload_bench import (  # noqa: E402
    aws_env,
    drop_prefix,
    evict,
    scripted_upload,
    warm_up,
)

ROOT = "bench"
STEP = 100


# -- inputs -------------------------------------------------------------------------------------


def build_many(out: Path, files: int) -> dict[str, Any]:
    """A real dcp.save with one file per tensor: `files` fp32 tensors of 4-120 KiB."""
    if (out / ".metadata").exists():
        return json.loads((out.parent / "many.json").read_text())
    import numpy as np
    import torch
    import torch.distributed.checkpoint as dcp

    rng = np.random.default_rng(0)
    sizes = rng.integers(1024, 30 * 1024, size=files - 1)  # elements; the .metadata is the last
    state = {f"layer{i:05d}.weight": torch.from_numpy(
        rng.standard_normal(int(n), dtype=np.float32) * 0.02) for i, n in enumerate(sizes)}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp), single_file_per_rank=False,
                                                         thread_count=1))
    tmp.rename(out)
    n = sum(1 for p in out.rglob("*") if p.is_file())
    info = {"files": n, "bytes": sum(p.stat().st_size for p in out.rglob("*") if p.is_file())}
    (out.parent / "many.json").write_text(json.dumps(info))
    return info


def build_big(out: Path, size: int) -> dict[str, Any]:
    """model.pt + optim.pt (fp32 Adam: two moments), `size` bytes in all, as upload_bench."""
    if (out / "optim.pt").exists():
        return json.loads((out.parent / "big.json").read_text())
    subprocess.run([sys.executable, str(HERE / "upload_worker.py"), "build", "--ckpt", str(out),
                    "--size", str(size)], check=True, stdout=subprocess.DEVNULL)
    files = [p for p in out.rglob("*") if p.is_file()]
    info = {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}
    (out.parent / "big.json").write_text(json.dumps(info))
    return info


# -- ckptd --------------------------------------------------------------------------------------


def config(work: Path, server: s3server.S3Server, prefix: str, layout: str) -> Path:
    text = f"""
[daemon]
state_dir = "{work}/state"
socket = "{work}/ckptd.sock"
log_format = "json"
log_level = "warning"

[defaults]
settle = "1s"

[defaults.upload]
url = "{server.url(prefix)}"
endpoint = "{server.endpoint}"
region = "{server.region}"
access_key_id = "{server.access_key}"
secret_access_key = "{server.secret_key}"

[defaults.retention.local]
keep_last = 5

[[roots]]
name = "{ROOT}"
path = "{work}/root"
layout = "{layout}"
"""
    path = work / "ckptd.toml"
    path.write_text(text)
    return path


def run_ckptd(server: s3server.S3Server, source: Path, work: Path, prefix: str,
              layout: str, name: str, register: bool = False) -> dict[str, Any]:
    """One round: a fresh daemon; the step renamed into its root; wall time until the step is
    remote-verified, as the daemon reports it; the stage breakdown from its transitions."""
    shutil.rmtree(work, ignore_errors=True)
    (work / "root").mkdir(parents=True)
    staged = work / "root" / f".incoming-{STEP}"
    subprocess.run(["cp", "-r", str(source), str(staged)], check=True)
    evict(staged)
    cfg = config(work, server, prefix, layout)
    env = {**os.environ, "AWS_EC2_METADATA_DISABLED": "true"}
    log = open(work / "daemon.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "ckptd", "run", "--config", str(cfg)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        from ckptd.client import Client, ClientError
        client = Client(work / "ckptd.sock", timeout=10.0, strict=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                client.status()
                break
            except Exception:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError((work / "daemon.log").read_text()[-3000:]) from None
                time.sleep(0.05)
        print(f"daemon answers after {time.monotonic() - deadline + 60:.1f} s", flush=True)
        t0 = time.time()
        staged.rename(work / "root" / name)
        if register:  # files with no commit record of their own: the trainer says it is done
            client.register(ROOT, STEP, paths=sorted(f"{name}/{p.name}" for p in source.iterdir()))
        while True:
            try:
                rec = client.checkpoint(ROOT, STEP)
            except ClientError:  # not seen yet
                rec = None
            if rec is not None and rec.get("remote") == "uploaded":
                break
            if rec is not None and rec.get("state") == "invalid":
                raise RuntimeError(f"step invalid: {rec}")
            if proc.poll() is not None:
                raise RuntimeError((work / "daemon.log").read_text()[-3000:])
            time.sleep(0.02)
        wall = time.time() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
    return {"wall_s": wall, "stages": stages(work / "state" / "state.db", t0)}


def stages(db: Path, t0: float, step: int = STEP) -> dict[str, float]:
    """Seconds from the rename to each first transition of the step, by target."""
    con = sqlite3.connect(db)
    try:
        rows = con.execute("SELECT event, target, at FROM transitions WHERE root=? AND step=?"
                           " ORDER BY id", (ROOT, step)).fetchall()
        created = con.execute("SELECT created FROM checkpoints WHERE root=? AND step=?"
                              " ORDER BY id LIMIT 1", (ROOT, step)).fetchone()
    finally:
        con.close()
    out: dict[str, float] = {}
    if created:
        out["detected"] = created[0] - t0
    for event, target, at in rows:
        if at >= t0:  # transitions recorded with no time of their own are left out
            out.setdefault(f"{event}->{target}", at - t0)
    return out


def run_aws(server: s3server.S3Server, source: Path, prefix: str, scratch: Path) -> float:
    evict(source)
    scratch.mkdir(parents=True, exist_ok=True)
    env = aws_env(server, {}, scratch)
    t0 = time.monotonic()
    subprocess.run(["aws", "s3", "cp", "--recursive", "--only-show-errors", "--endpoint-url",
                    server.endpoint, str(source), server.url(prefix)], check=True, env=env,
                   timeout=1800)
    return time.monotonic() - t0


BASELINE = {"many": "aws s3 cp --recursive", "big": "sha256sum; zstd -T0 -3; aws s3 cp"}


def run_script(server: s3server.S3Server, source: Path, prefix: str, scratch: Path) -> float:
    """The big case's baseline: upload_bench's script (hash, compress, upload) on the files."""
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    return scripted_upload(server, source, scratch, prefix).wall_s


# -- main ---------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=("many", "big", "both"), default="both")
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--size", default="2.1GB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckptd-tts"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only", choices=("ckptd", "aws", "both"), default="both")
    args = ap.parse_args()
    from ckptd.units import parse_size

    args.workdir.mkdir(parents=True, exist_ok=True)
    cases = ["many", "big"] if args.case == "both" else [args.case]
    server = s3server.start_server(args.workdir / "s3")
    results: dict[str, Any] = {}
    try:
        warm_up(server)
        for case in cases:
            inputs = args.workdir / "inputs"
            inputs.mkdir(exist_ok=True)
            if case == "many":
                source, info = inputs / "many", build_many(inputs / "many", args.files)
                layout, name = "dcp", f"step-{STEP}"
            else:
                source = inputs / "big"
                info = build_big(source, int(parse_size(args.size)))
                layout, name = "auto", f"step_{STEP}"
            rows: dict[str, list[Any]] = {"ckptd": [], "aws": []}
            for r in range(args.repeat):
                order = ("aws", "ckptd") if r % 2 == 0 else ("ckptd", "aws")
                for who in order:
                    if args.only not in (who, "both"):
                        continue
                    prefix = f"{who}-{case}-{r}"
                    if who == "ckptd":
                        rows["ckptd"].append(run_ckptd(server, source, args.workdir / "ckptd",
                                                       prefix, layout, name, case == "big"))
                    elif case == "many":
                        rows["aws"].append(run_aws(server, source, prefix, args.workdir / "aws"))
                    else:
                        rows["aws"].append(run_script(server, source, prefix,
                                                      args.workdir / "aws"))
                    drop_prefix(server, prefix)
                print(f"{case} round {r}: aws {rows['aws'][-1:]} ckptd "
                      f"{[x['wall_s'] for x in rows['ckptd'][-1:]]}", flush=True)
            results[case] = {"inputs": info, "baseline": BASELINE[case], **rows}
            report(case, info, rows)
    finally:
        s3server.stop_server(server)
        # The server keeps deleted objects' space (14 GB after three rounds of both cases):
        # what it and the daemons wrote goes; the inputs stay for the next run.
        for scratch in ("s3", "ckptd", "aws"):
            shutil.rmtree(args.workdir / scratch, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def report(case: str, info: dict[str, Any], rows: dict[str, list[Any]]) -> None:
    print(f"\n## {case}: {info['files']} files, {info['bytes'] / 1e9:.2f} GB")
    aws = rows["aws"]
    ck = [x["wall_s"] for x in rows["ckptd"]]
    if aws:
        print(f"{BASELINE[case]}: median {statistics.median(aws):.1f} s "
              f"({min(aws):.1f}-{max(aws):.1f})")
    if ck:
        print(f"ckptd rename -> remote-verified: median {statistics.median(ck):.1f} s "
              f"({min(ck):.1f}-{max(ck):.1f})")
    if aws and ck:
        ratios = [c / a for c, a in zip(ck, aws, strict=False)]
        print(f"ratio ckptd/aws: median {statistics.median(ratios):.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f})")
    if rows["ckptd"]:
        print("stages (s after the rename, last round):")
        for k, v in rows["ckptd"][-1]["stages"].items():
            print(f"  {k:40s} {v:7.2f}")


if __name__ == "__main__":
    main()
