"""Resume benchmark: a fresh process to every tensor of a step in memory and checked, from the
test SeaweedFS server, each way side by side in one run: `aws s3 cp` + dcp.load, s3torchconnector's
S3StorageReader, `ckptd restore` + dcp.load, ckptd's own DCP reader, and the native layout.

Every load is its own process from a cold cache (the server's volumes evicted); wall time and peak
RSS come from GNU time. Usage: python bench/resume_bench.py [--size 1.6GB] [--repeat 3] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests"))  # the SeaweedFS launcher the tests use

import s3server  # noqa: E402
import startup_bench  # noqa: E402  (a fresh process's start-up, its parts)
import upload_bench as ub  # noqa: E402  (eviction, child timing, the aws environment)

from ckptd.units import parse_size  # noqa: E402

WORKER = str(HERE / "resume_worker.py")
PROFILE: list[Any] = []  # under --profile: [the file prefix, how many loads ran so far]
UPLOAD_WORKER = str(HERE / "upload_worker.py")
STEP = 1
# The rows, in the order of the table; a round runs them in this order, the next one reversed.
VARIANTS = ("local dcp.load", "aws s3 cp + dcp.load", "s3torchconnector S3StorageReader",
            "ckptd restore + dcp.load", "ckptd StorageReader", "ckptd StorageReader, half 0/2",
            "ckptd StorageReader, half 1/2", "ckptd restore + ckptd.torch.load",
            "ckptd.torch.load(source=remote)")


@dataclass
class Result:
    wall_s: float = 0.0
    load_s: float = 0.0  # fetching + loading alone: no interpreter start, imports or checks
    peak_rss: int = 0  # of the loading process
    bucket_bytes: int | None = None  # bytes fetched from the bucket, where known
    server_sent: int | None = None  # what the server process wrote (its wchar), all sockets
    cpu_s: float = 0.0  # user + system of this way's own processes
    server_cpu_s: float = 0.0  # the server's, meanwhile
    phases: dict[str, float] = field(default_factory=dict)  # the loading process's, from it
    error: str = ""


@dataclass
class Bench:
    """What every variant needs: the server, the inputs, the prefixes, the environment."""

    server: Any
    env: dict[str, str]
    inputs: Path
    scratch: Path
    weed: Path
    stored: dict[str, int]  # bytes under each uploaded prefix
    cpu_s: float = 0.0  # CPU seconds of the children run so far

    def url(self, prefix: str) -> str:
        return str(self.server.url(prefix))

    def worker(self, *argv: str) -> list[str]:
        return [sys.executable, *_profiled(), WORKER, *argv, "--expect",
                str(self.inputs / "expect.json")]

    def child(self, argv: list[str]) -> tuple[dict[str, Any], float, int]:
        """One child's JSON answer, wall time and peak RSS; SystemExit with its error."""
        stdout, wall, cpu, rss = ub.run_child(argv, self.env)
        self.cpu_s += cpu
        lines = stdout.strip().splitlines()
        return (json.loads(lines[-1]) if lines else {}), wall, rss

    def load(self, *argv: str) -> tuple[dict[str, Any], float, int]:
        """One loading child; its answer carries its phases (`*_s`) as `phases`."""
        out, wall, rss = self.child(self.worker("load", *argv))
        out["phases"] = {k: v for k, v in out.items() if k.endswith("_s")}
        out["phases"]["rest_s"] = wall - sum(out["phases"].values())  # start, exit
        return out, wall, rss


def _profiled() -> list[str]:
    """Under --profile: cpu_sampler.py's command prefix, one file prefix per process."""
    if not PROFILE:
        return []
    PROFILE[1] += 1
    return [str(HERE / "cpu_sampler.py"), "--out", f"{PROFILE[0]}.{PROFILE[1]}"]


def server_cpu(server: Any) -> float:
    """CPU seconds (user + system) the server process has used so far."""
    fields = Path(f"/proc/{server.process.pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_wchar(server: Any) -> int:
    """Bytes the server process has written so far (files and sockets alike)."""
    for line in Path(f"/proc/{server.process.pid}/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


# -- the variants: each returns a Result ------------------------------------------------------


def local_load(b: Bench) -> Result:
    step = b.inputs / "dcp" / f"step-{STEP}"
    ub.evict(step)
    out, wall, rss = b.load("--how", "local", "--path", str(step))
    return Result(wall, out["load_s"], rss, phases=out["phases"])


def aws_then_load(b: Bench) -> Result:
    dl = b.scratch / "aws-dl"
    aws = ["aws", "s3", "cp", "--recursive", "--only-show-errors", "--endpoint-url",
           b.server.endpoint, b.url(f"plain/step-{STEP}/"), str(dl)]
    try:
        _, wall_dl, _ = b.child(aws)
        out, wall, rss = b.load("--how", "local", "--path", str(dl))
    finally:
        shutil.rmtree(dl, ignore_errors=True)
    return Result(wall_dl + wall, wall_dl + out["load_s"], rss, b.stored["plain"],
                  phases={"download_s": wall_dl, **out["phases"]})


def s3tc_load(b: Bench) -> Result:
    out, wall, rss = b.load("--how", "s3tc", "--path", b.url(f"plain/step-{STEP}"),
                            "--endpoint", b.server.endpoint, "--region", b.server.region)
    return Result(wall, out["load_s"], rss, phases=out["phases"])


def restore_then_load(b: Bench, prefix: str, how: str) -> Result:
    to = b.scratch / "restored"  # the manifest's paths are the root's: step-1/...
    restore = [sys.executable, UPLOAD_WORKER, "ckptd-restore", "--url", b.url(prefix),
               "--endpoint", b.server.endpoint, "--key", b.server.access_key, "--secret",
               b.server.secret_key, "--step", str(STEP), "--to", str(to)]
    try:
        _, wall_restore, _ = b.child(restore)
        out, wall, rss = b.load("--how", how, "--path", str(to / f"step-{STEP}"))
    finally:
        shutil.rmtree(to, ignore_errors=True)
    return Result(wall_restore + wall, wall_restore + out["load_s"], rss, b.stored[prefix],
                  phases={"restore_s": wall_restore, **out["phases"]})


def ckptd_load(b: Bench, part: str = "0/1") -> Result:
    out, wall, rss = b.load("--how", "ckptd", "--path", b.url("ckptd-dcp"), "--part", part)
    return Result(wall, out["load_s"], rss, out.get("bytes_read"), phases=out["phases"])


def native_remote(b: Bench) -> Result:
    out, wall, rss = b.load("--how", "native-remote", "--path", b.url("ckptd-native"))
    return Result(wall, out["load_s"], rss, out.get("bytes_read"), phases=out["phases"])


RUNS: dict[str, Callable[[Bench], Result]] = {
    VARIANTS[0]: local_load,
    VARIANTS[1]: aws_then_load,
    VARIANTS[2]: s3tc_load,
    VARIANTS[3]: lambda b: restore_then_load(b, "ckptd-dcp", "local"),
    VARIANTS[4]: ckptd_load,
    VARIANTS[5]: lambda b: ckptd_load(b, "0/2"),
    VARIANTS[6]: lambda b: ckptd_load(b, "1/2"),
    VARIANTS[7]: lambda b: restore_then_load(b, "ckptd-native", "native-local"),
    VARIANTS[8]: native_remote,
}


def run_variant(b: Bench, name: str) -> Result:
    """One variant from a cold cache; a failure is recorded with its last line, not raised."""
    ub.evict(b.weed)
    sent, cpu, server_was = server_wchar(b.server), b.cpu_s, server_cpu(b.server)
    try:
        result = RUNS[name](b)
    except SystemExit as exc:
        text = str(exc.code).strip().splitlines()
        return Result(error=text[-1][:300] if text else "failed")
    result.server_sent = server_wchar(b.server) - sent
    result.cpu_s, result.server_cpu_s = b.cpu_s - cpu, server_cpu(b.server) - server_was
    phases = ", ".join(f"{k[:-2]} {v:.1f}" for k, v in result.phases.items())
    print(f"  {name}: {result.wall_s:.1f} s ({phases}), CPU {result.cpu_s:.1f} s, server "
          f"CPU {result.server_cpu_s:.1f} s, peak RSS "
          f"{result.peak_rss / 2**20:,.0f} MiB, bytes {result.bucket_bytes}", flush=True)
    return result


# -- set-up -----------------------------------------------------------------------------------


def build_inputs(workdir: Path, size: int, dcp_files: int) -> tuple[Path, dict[str, Any]]:
    """The DCP and native saves of one state under `<workdir>/inputs`, built once and reused."""
    inputs = workdir / "inputs"
    stamp = workdir / "inputs.json"
    if stamp.exists():
        info: dict[str, Any] = json.loads(stamp.read_text())
        if info.get("size") == size and info.get("dcp_files") == dcp_files:
            return inputs, info
    shutil.rmtree(inputs, ignore_errors=True)
    inputs.mkdir(parents=True)
    stdout, wall, _, _ = ub.run_child([sys.executable, WORKER, "build", "--out", str(inputs),
                                       "--size", str(size), "--dcp-files", str(dcp_files)])
    info = json.loads(stdout.strip().splitlines()[-1]) | {
        "size": size, "dcp_files": dcp_files, "build_s": wall}
    stamp.write_text(json.dumps(info))
    return inputs, info


def upload_all(b: Bench, codec: str) -> dict[str, Any]:
    """The DCP step through ckptd and plainly with `aws s3 cp`; the native step through ckptd."""
    info: dict[str, Any] = {}
    for layout, prefix in (("dcp", "ckptd-dcp"), ("native", "ckptd-native")):
        root = b.inputs / layout
        out, wall, _ = b.child([sys.executable, WORKER, "upload", "--root", str(root),
                                "--layout", layout, "--codec", codec, "--url", b.url(prefix)])
        shutil.rmtree(root / ".ckptd", ignore_errors=True)  # the local compressed copy
        info[prefix] = out | {"wall_s": wall}
    step = b.inputs / "dcp" / f"step-{STEP}"
    try:  # without the AWS CLI, the rows that read the plain copy say why they are missing
        _, wall, _ = b.child(["aws", "s3", "cp", "--recursive", "--only-show-errors",
                              "--endpoint-url", b.server.endpoint, str(step),
                              b.url(f"plain/step-{STEP}/")])
        info["plain"] = {"wall_s": wall}
    except SystemExit as exc:
        info["plain"] = {"error": str(exc.code)[-300:]}
    for prefix in ("ckptd-dcp", "ckptd-native", "plain"):
        b.stored[prefix] = ub.prefix_bytes(b.server, prefix)
    return info


def environment(server: Any, scratch: Path) -> dict[str, str]:
    env = ub.aws_env(server, {}, scratch)
    env.update({"AWS_ENDPOINT_URL": server.endpoint, "AWS_REGION": server.region,
                "AWS_ALLOW_HTTP": "true",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                            os.environ.get("PYTHONPATH")]))})
    bench_bin = REPO / ".venv-bench" / "bin"
    if not shutil.which("aws") and (bench_bin / "aws").exists():
        env["PATH"] = f"{bench_bin}{os.pathsep}{env.get('PATH', '')}"
    # Every way starts a fresh Python that imports torch: with bytecode writing off (as some
    # environments set it) each start compiles torch from source (~4 s for torch, ~9 s with
    # torch.distributed.checkpoint, measured here) and swamps the loads. A user's install has
    # its bytecode; so do the children here, cached outside the tree and warmed once.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(scratch / "pycache")
    subprocess.run([sys.executable, "-c", "import torch, torch.distributed.checkpoint, "
                    "ckptd.dcp, ckptd.torch, ckptd.fetch.step, ckptd.cli.main"], env=env,
                   check=True)
    for aws in (shutil.which("aws", path=env.get("PATH")),):
        if aws:  # the AWS CLI is Python too
            subprocess.run([aws, "--version"], env=env, check=True, capture_output=True)
    return env


# -- the run ----------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1.6GB", help="model + Adam state, e.g. 1.6GB or 200MB")
    p.add_argument("--repeat", type=int, default=3, help="rounds; the table shows medians")
    p.add_argument("--dcp-files", type=int, default=2, help="data files of the DCP save")
    p.add_argument("--codec", default="auto", help="ckptd's codec for the upload")
    p.add_argument("--only", default="", help="comma-separated row numbers (0 = local load)")
    p.add_argument("--workdir", type=Path, default=HERE / "out" / "resume")
    p.add_argument("--json", type=Path)
    p.add_argument("--keep-inputs", action="store_true", help="keep the built checkpoint")
    p.add_argument("--profile", help="a file prefix: each loading process's CPU by stack "
                   "(cpu_sampler.py: <prefix>.<n>.1.txt for the n-th process run)")
    args = p.parse_args()
    if args.profile:
        PROFILE[:] = [str(Path(args.profile).resolve()), 0]
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    chosen = [VARIANTS[int(i)] for i in args.only.split(",") if i] or list(VARIANTS)
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    inputs, info = build_inputs(workdir, parse_size(args.size), args.dcp_files)
    scratch, weed = workdir / "scratch", workdir / "weed"
    for d in (scratch, weed):
        shutil.rmtree(d, ignore_errors=True)
    scratch.mkdir()
    server = s3server.start_server(weed)
    rounds: list[dict[str, Result]] = []
    try:
        b = Bench(server, environment(server, scratch), inputs, scratch, weed, {})
        ub.warm_up(server)
        uploads = upload_all(b, args.codec)
        startup = startup_bench.measure(args.repeat, [REPO], b.env, remote=True)
        for n in range(args.repeat):
            print(f"round {n + 1} of {args.repeat}", flush=True)
            order = chosen if n % 2 == 0 else chosen[::-1]
            rounds.append({name: run_variant(b, name) for name in order})
    finally:
        s3server.stop_server(server)
        shutil.rmtree(weed, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
        if not args.keep_inputs:
            shutil.rmtree(inputs, ignore_errors=True)
            (workdir / "inputs.json").unlink(missing_ok=True)
    doc = {"schema": "ckptd-resume-bench/1", "inputs": info, "uploads": uploads,
           "stored": b.stored, "rounds": [{k: asdict(v) for k, v in r.items()} for r in rounds],
           "startup": startup}
    doc["goals"] = goals(doc)
    print(report(doc))
    print("\nstart-up of a fresh process (bench/startup_bench.py):\n"
          + startup_bench.report(startup))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))


# -- the figures ------------------------------------------------------------------------------


def walls(doc: dict[str, Any], name: str) -> list[float]:
    return [r[name]["wall_s"] for r in doc["rounds"] if name in r and not r[name]["error"]]


def ratios(doc: dict[str, Any], num: str, den: str, key: str = "wall_s") -> list[float]:
    """Per-round num/den of `key`, over the rounds where both ran."""
    out = []
    for r in doc["rounds"]:
        a, c = r.get(num), r.get(den)
        if a and c and not a["error"] and not c["error"] and a[key] and c[key]:
            out.append(a[key] / c[key])
    return out


def errors(doc: dict[str, Any], name: str) -> str:
    return next((r[name]["error"] for r in doc["rounds"] if r.get(name, {}).get("error")), "")


def goals(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal: its figures per round and whether the median meets it (None: not measured)."""
    v = VARIANTS
    out: list[dict[str, Any]] = []

    def goal(key: str, what: str, values: list[float], limit: float | None,
             why: str = "", loading: list[float] | None = None) -> None:
        med = statistics.median(values) if values else None
        met = None if med is None or limit is None else med <= limit
        out.append({"id": key, "goal": what, "values": values, "median": med, "limit": limit,
                    "met": met, "why": "" if values else why or "not run",
                    "loading": loading or []})

    def walls_of(num: str, den: str, limit: float | None) -> None:
        key = {v[1]: "vs_aws", v[2]: "vs_s3tc", v[3]: "vs_restore", v[7]: "native"}[den]
        goal(key, f"{num} / {den}, wall", ratios(doc, num, den), limit,
             errors(doc, num) or errors(doc, den), ratios(doc, num, den, "load_s"))

    walls_of(v[4], v[1], 0.6)
    walls_of(v[4], v[2], 0.8)
    walls_of(v[4], v[3], None)
    rss = [(r[v[4]]["peak_rss"] - r[v[0]]["peak_rss"]) / 2**20 for r in doc["rounds"]
           if v[4] in r and v[0] in r and not r[v[4]]["error"] and not r[v[0]]["error"]]
    goal("rss", "ckptd reader peak RSS − local dcp.load's, MiB", rss, 128,
         errors(doc, v[4]) or errors(doc, v[0]))
    stored = doc["stored"].get("ckptd-dcp") or 0
    half = [r[n]["bucket_bytes"] / stored for r in doc["rounds"] for n in (v[5], v[6])
            if n in r and not r[n]["error"] and r[n]["bucket_bytes"] and stored]
    goal("half", "half-state load: bytes fetched / step's stored bytes, per rank", half, 0.6,
         errors(doc, v[5]) or errors(doc, v[6])
         or ("the reader reports no bytes read" if walls(doc, v[5]) else "not run"))
    walls_of(v[8], v[7], 0.7)
    return out


def fig(values: list[float], fmt: str = "{:.2f}", unit: str = "") -> str:
    if not values:
        return "—"
    med = fmt.format(statistics.median(values)) + unit
    low, high = fmt.format(min(values)), fmt.format(max(values))
    return med if low == high else f"{med} ({low}–{high})"


def report(doc: dict[str, Any]) -> str:
    info = doc["inputs"]
    lines = [f"command: python {' '.join(sys.argv)}",
             f"state: {info['state_bytes'] / 1e6:,.0f} MB fp32 MLP {info['layers']} x "
             f"{info['width']}^2 + Adam, {info['tensors']} tensors, DCP in {info['dcp_files']} "
             f"data files; stored: " + ", ".join(f"{k} {n / 1e6:,.0f} MB"
                                                 for k, n in doc["stored"].items()),
             "", "| way | wall s | / aws + dcp.load | of which loading, s | CPU s | server CPU s | "
             "peak RSS MiB | bytes from bucket | server wrote |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in VARIANTS:
        if not any(name in r for r in doc["rounds"]):
            continue
        runs = [r[name] for r in doc["rounds"] if name in r and not r[name]["error"]]
        if not runs:
            lines.append(f"| {name} | not available: {errors(doc, name)} | | | | | | | |")
            continue
        got = [x["bucket_bytes"] for x in runs if x["bucket_bytes"]]
        lines.append(
            f"| {name} | {fig(walls(doc, name), '{:.1f}')} | "
            f"{fig(ratios(doc, name, VARIANTS[1]))} | "
            f"{fig([x['load_s'] for x in runs], '{:.1f}')} | "
            f"{fig([x.get('cpu_s', 0.0) for x in runs], '{:.1f}')} | "
            f"{fig([x.get('server_cpu_s', 0.0) for x in runs], '{:.1f}')} | "
            f"{fig([x['peak_rss'] / 2**20 for x in runs], '{:,.0f}')} | "
            f"{fig([g / 1e6 for g in got], '{:,.0f}', ' MB')} | "
            f"{fig([x['server_sent'] / 1e6 for x in runs], '{:,.0f}', ' MB')} |")
    lines.append("")
    for g in doc["goals"]:
        verdict = "not measured" if g["met"] is None else ("met" if g["met"] else "NOT met")
        if g["limit"] is None:
            verdict = "no goal"
        limit = "" if g["limit"] is None else f" ≤ {g['limit']}"
        alone = f" (loading alone {fig(g['loading'])})" if g["loading"] else ""
        value = fig(g["values"], "{:+.0f}" if g["id"] == "rss" else "{:.2f}")
        lines.append(f"- {g['goal']}{limit}: {value}{alone} → {verdict}"
                     + (f" ({g['why']})" if g["why"] else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
