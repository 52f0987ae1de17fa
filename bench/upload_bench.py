"""Upload benchmark: ckptd (validate + compress in one read pass, each object sent as soon as it
is finished, then upload_step, as the daemon does) against the pipeline a user would script
(sha256sum + zstd -T0 -3 + aws s3 cp), side by side in one run against the same SeaweedFS
server on loopback; then restore (ckptd vs aws s3 cp + zstd -d).

Every run is its own process; wall time and peak RSS (descendants included) come from wait4.
Usage: python bench/upload_bench.py [--size 2GB] [--workdir DIR] [--threads 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))  # the SeaweedFS launcher the tests use

import s3server  # noqa: E402

from ckptd.units import parse_size  # noqa: E402

WORKER = str(HERE / "upload_worker.py")
FILES = ("model.pt", "optim.pt", "model_bf16.pt")
STEP = 1


@dataclass
class Run:
    name: str
    wall_s: float
    cpu_s: float
    peak_rss: int
    sent_bytes: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def run_child(argv: list[str], env: dict[str, str] | None = None) -> tuple[str, float, float, int]:
    """stdout, wall s, CPU s and peak RSS in bytes of one command, descendants included.

    Measured by GNU time around the command: rusage read in this (large) process would carry
    its own RSS over fork and exec into every child's maximum.
    """
    with tempfile.TemporaryDirectory() as tmp:
        usage_file = Path(tmp) / "usage"
        timed = ["/usr/bin/time", "-f", "%M %U %S", "-o", str(usage_file), *argv]
        started = time.perf_counter()
        proc = subprocess.run(timed, capture_output=True, env=env, check=False)
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            tail = proc.stderr.decode(errors="replace")[-3000:]
            raise SystemExit(f"{argv[:3]} failed ({proc.returncode}):\n{tail}")
        max_kib, user, system = usage_file.read_text().split()[-3:]
    return proc.stdout.decode(), wall, float(user) + float(system), int(max_kib) * 1024


def evict(top: Path) -> None:
    """Write back and drop the cached pages of every file under `top`: cold-cache runs."""
    for dirpath, _, names in os.walk(top):
        for name in names:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def phases(stdout: str) -> dict[str, float]:
    """Durations between the `phase NAME EPOCH` lines a script printed."""
    marks = [
        (p[1], float(p[2]))
        for line in stdout.splitlines()
        if (p := line.split()) and p[0] == "phase"
    ]
    return {name: t - marks[i][1] for i, (name, t) in enumerate(marks[1:])}


SCRIPTED_UPLOAD = """
set -euo pipefail
t() { date +%s.%N; }
echo "phase start $(t)"
cd "$CKPT"
sha256sum model.pt optim.pt model_bf16.pt > "$OUT/SHA256SUMS"
echo "phase sha256sum $(t)"
for f in model.pt optim.pt model_bf16.pt; do zstd -T0 -3 -q -f "$f" -o "$OUT/$f.zst"; done
echo "phase zstd $(t)"
aws s3 cp --recursive --only-show-errors --endpoint-url "$EP" "$OUT" "$DEST"
echo "phase upload $(t)"
"""

SCRIPTED_RESTORE = """
set -euo pipefail
t() { date +%s.%N; }
echo "phase start $(t)"
aws s3 cp --recursive --only-show-errors --endpoint-url "$EP" "$DEST" "$DL"
echo "phase download $(t)"
for f in model.pt optim.pt model_bf16.pt; do zstd -d -q -f "$DL/$f.zst" -o "$TO/$f"; done
echo "phase unzstd $(t)"
"""


def aws_env(server: s3server.S3Server, extra: dict[str, str], scratch: Path) -> dict[str, str]:
    env = dict(os.environ, **extra)
    env.update(
        {
            "AWS_ACCESS_KEY_ID": server.access_key,
            "AWS_SECRET_ACCESS_KEY": server.secret_key,
            "AWS_DEFAULT_REGION": server.region,
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": str(scratch / "aws-config"),  # none of the user's profiles
            "AWS_SHARED_CREDENTIALS_FILE": str(scratch / "aws-credentials"),
            "EP": server.endpoint,
        }
    )
    return env


def prefix_bytes(server: s3server.S3Server, prefix: str) -> int:
    from ckptd.backends import make_backend

    b = make_backend(
        server.url(prefix),
        endpoint=server.endpoint,
        region=server.region,
        access_key_id=server.access_key,
        secret_access_key=server.secret_key,
    )
    return sum(m.size for m in b.list(""))


def worker(command: str, server: s3server.S3Server, url: str, **kw: Any) -> list[str]:
    argv = [
        sys.executable,
        WORKER,
        command,
        "--url",
        url,
        "--endpoint",
        server.endpoint,
        "--key",
        server.access_key,
        "--secret",
        server.secret_key,
    ]
    for k, v in kw.items():
        argv += [f"--{k}", str(v)]
    return argv


@dataclass(frozen=True)
class Variant:
    """One ckptd configuration: compression threads, part size, requests in flight."""

    threads: int = 1
    part_size: int = 64 << 20
    concurrency: int = 4

    @classmethod
    def parse(cls, spec: str) -> Variant:
        kv = dict(item.split("=", 1) for item in spec.split(",") if item)
        return cls(
            threads=int(kv.get("threads", 1)),
            part_size=parse_size(kv.get("part", "64MiB")),
            concurrency=int(kv.get("concurrency", 4)),
        )

    @property
    def name(self) -> str:
        return f"ckptd threads={self.threads} part={self.part_size >> 20}MiB"

    @property
    def prefix(self) -> str:
        return f"ckptd-t{self.threads}-p{self.part_size >> 20}-c{self.concurrency}"


def scripted_upload(server: s3server.S3Server, ckpt: Path, scratch: Path, prefix: str) -> Run:
    out = scratch / "scripted-out"
    out.mkdir(parents=True)
    dest = server.url(f"{prefix}/step-{STEP}/")
    env = aws_env(server, {"CKPT": str(ckpt), "OUT": str(out), "DEST": dest}, scratch)
    evict(ckpt)
    stdout, wall, cpu, rss = run_child(["bash", "-c", SCRIPTED_UPLOAD], env)
    shutil.rmtree(out)
    return Run("scripted", wall, cpu, rss, prefix_bytes(server, prefix), phases(stdout))


def ckptd_upload(server: s3server.S3Server, root: Path, v: Variant, codec: str, prefix: str) -> Run:
    evict(root)
    argv = worker(
        "ckptd-upload",
        server,
        server.url(prefix),
        root=root,
        step=STEP,
        threads=v.threads,
        codec=codec,
        concurrency=v.concurrency,
        **{"part-size": v.part_size},
    )
    stdout, wall, cpu, rss = run_child(argv)
    info = json.loads(stdout.strip().splitlines()[-1])
    shutil.rmtree(root / ".ckptd", ignore_errors=True)  # the local compressed copy
    phase = {"validate+compress": info["compress_s"], "upload_step": info["upload_s"]}
    extra = {
        "codecs": info["codecs"],
        "upload_step_sent_bytes": info["sent_bytes"],
        "peak_rss_after_compress": info["peak_rss_after_compress"],
    }
    return Run(v.name, wall, cpu, rss, prefix_bytes(server, prefix), phase, extra)


def scripted_restore(server: s3server.S3Server, scratch: Path, weed: Path, prefix: str) -> Run:
    dl, to = scratch / "dl", scratch / "restored-scripted"
    dl.mkdir()
    to.mkdir()
    dest = server.url(f"{prefix}/step-{STEP}/")
    env = aws_env(server, {"DL": str(dl), "TO": str(to), "DEST": dest}, scratch)
    evict(weed)
    stdout, wall, cpu, rss = run_child(["bash", "-c", SCRIPTED_RESTORE], env)
    shutil.rmtree(dl)
    shutil.rmtree(to)
    return Run("scripted restore", wall, cpu, rss, phases=phases(stdout))


def ckptd_restore(server: s3server.S3Server, scratch: Path, weed: Path, prefix: str) -> Run:
    to = scratch / "restored-ckptd"
    evict(weed)
    argv = worker("ckptd-restore", server, server.url(prefix), step=STEP, to=to)
    _, wall, cpu, rss = run_child(argv)
    shutil.rmtree(to)
    return Run("ckptd restore", wall, cpu, rss)


def drop_prefix(server: s3server.S3Server, prefix: str) -> None:
    from ckptd.backends import make_backend

    b = make_backend(
        server.url(prefix),
        endpoint=server.endpoint,
        region=server.region,
        access_key_id=server.access_key,
        secret_access_key=server.secret_key,
    )
    for m in list(b.list("")):
        b.delete(m.key)


def one_round(
    server: s3server.S3Server,
    root: Path,
    scratch: Path,
    weed: Path,
    args: argparse.Namespace,
    n: int,
) -> list[Run]:
    """Every upload once (the order flips each round), then both restores; then clean up."""
    variants: list[Variant] = args.variants
    scripted = f"scripted-r{n}"
    ups: list[Run] = []
    for what in ["scripted", *variants] if n % 2 == 0 else [*variants, "scripted"]:
        if isinstance(what, Variant):
            ups.append(ckptd_upload(server, root, what, args.codec, f"{what.prefix}-r{n}"))
        else:
            ups.append(scripted_upload(server, root / f"step-{STEP}", scratch, scripted))
    ups.sort(key=lambda r: r.name != "scripted")
    restores = [
        scripted_restore(server, scratch, weed, scripted),
        ckptd_restore(server, scratch, weed, f"{variants[0].prefix}-r{n}"),
    ]
    for prefix in [scripted, *(f"{v.prefix}-r{n}" for v in variants)]:
        drop_prefix(server, prefix)
    return ups + restores


def warm_up(server: s3server.S3Server) -> None:
    """One 64 MiB object in and out first, so no run pays for the server's first volume."""
    from ckptd.backends import make_backend

    b = make_backend(
        server.url("warm-up"),
        endpoint=server.endpoint,
        region=server.region,
        access_key_id=server.access_key,
        secret_access_key=server.secret_key,
    )
    b.put("x", os.urandom(64 << 20))
    b.delete("x")


def build_inputs(workdir: Path, size: int) -> tuple[Path, dict[str, Any]]:
    """The checkpoint under `<workdir>/root/step-1/`, built once per size and reused."""
    root = workdir / "root"
    ckpt = root / f"step-{STEP}"
    stamp = workdir / "inputs.json"
    if stamp.exists():
        info: dict[str, Any] = json.loads(stamp.read_text())
        if info.get("size") == size and all((ckpt / f).exists() for f in FILES):
            return root, info
    shutil.rmtree(root, ignore_errors=True)
    stdout, wall, _, rss = run_child(
        [sys.executable, WORKER, "build", "--ckpt", str(ckpt), "--size", str(size)]
    )
    info = json.loads(stdout.strip().splitlines()[-1]) | {"size": size, "build_s": wall}
    stamp.write_text(json.dumps(info))
    return root, info


def median(same: list[Run]) -> Run:
    """The run with the median wall time; peak RSS is the largest of the rounds."""
    ordered = sorted(same, key=lambda r: r.wall_s)
    mid = ordered[(len(ordered) - 1) // 2]
    walls = [round(r.wall_s, 2) for r in same]
    extra = dict(mid.extra, walls=walls)
    return Run(
        mid.name,
        mid.wall_s,
        mid.cpu_s,
        max(r.peak_rss for r in same),
        mid.sent_bytes,
        mid.phases,
        extra,
    )


def mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def table(runs: list[Run], raw: int) -> str:
    lines = [
        "| run | wall s | CPU s | peak RSS | bytes sent | phases (s) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in runs:
        sent = f"{mb(r.sent_bytes)} ({r.sent_bytes / raw:.1%})" if r.sent_bytes else ""
        ph = ", ".join(f"{k} {v:.1f}" for k, v in r.phases.items())
        lines.append(
            f"| {r.name} | {r.wall_s:.1f} | {r.cpu_s:.1f} | {mb(r.peak_rss)} | {sent} | {ph} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="2GB", help="checkpoint size, e.g. 2GB or 512MB")
    p.add_argument("--workdir", type=Path, default=HERE / "out" / "upload")
    p.add_argument(
        "--ckptd",
        action="append",
        default=[],
        help='a ckptd variant, e.g. "threads=2,part=16MiB,concurrency=4"; repeatable '
        "(default: threads=1, the config's defaults)",
    )
    p.add_argument("--repeat", type=int, default=1, help="rounds; the table shows medians")
    p.add_argument("--codec", default="auto")
    p.add_argument("--json", type=Path)
    p.add_argument("--keep-inputs", action="store_true", help="keep the built checkpoint")
    args = p.parse_args()
    args.variants = [Variant.parse(spec) for spec in args.ckptd] or [Variant()]
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    size = parse_size(args.size)
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    root, inputs = build_inputs(workdir, size)
    raw = int(inputs["total"])
    scratch = workdir / "scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    weed_dir = workdir / "weed"
    shutil.rmtree(weed_dir, ignore_errors=True)
    server = s3server.start_server(weed_dir)
    rounds: list[list[Run]] = []
    try:
        warm_up(server)
        for n in range(args.repeat):
            rounds.append(one_round(server, root, scratch, weed_dir, args, n))
    finally:
        s3server.stop_server(server)
        shutil.rmtree(weed_dir, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
        if not args.keep_inputs:
            shutil.rmtree(root, ignore_errors=True)
            (workdir / "inputs.json").unlink(missing_ok=True)
    runs = [median(list(same)) for same in zip(*rounds, strict=True)]
    report(runs, raw, inputs, args)


def report(runs: list[Run], raw: int, inputs: dict[str, Any], args: argparse.Namespace) -> None:
    print("command: python " + " ".join(sys.argv) + f"  (medians of {args.repeat} rounds)")
    print(
        f"checkpoint: {mb(raw)} in {len(FILES)} files {inputs['sizes']} "
        f"(MLP {inputs['layers']} x {inputs['width']}^2 fp32 + Adam + bf16 copy)"
    )
    print(
        f"cpus: {os.cpu_count()}, zstd: {_version(['zstd', '--version'])}, "
        f"aws: {_version(['aws', '--version'])}"
    )
    print(table(runs, raw))
    scripted, restore_s, restore_c = runs[0], runs[-2], runs[-1]
    for r in runs[1:-2]:
        print(
            f"{r.name}: upload wall ratio ckptd/scripted = {r.wall_s / scripted.wall_s:.2f}, "
            f"bytes sent ratio = {r.sent_bytes / scripted.sent_bytes:.3f}"
        )
    print(f"restore wall ratio ckptd/scripted = {restore_c.wall_s / restore_s.wall_s:.2f}")
    if args.json:
        args.json.write_text(
            json.dumps({"raw": raw, "inputs": inputs, "runs": [asdict(r) for r in runs]}, indent=1)
        )


def _version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, check=False)
    except OSError:
        return "not installed"
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr) else ""


if __name__ == "__main__":
    main()
