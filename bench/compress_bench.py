"""Compression benchmark: ckptd's codecs against zstd (CLI and binding) and zipnn, side by side
in one run on the same inputs; prints markdown tables and the checks against the codec targets.

Every encoder runs in its own process from a cold page cache; nothing here is a timed test.
With `--runs N` every measurement is repeated N times (all encoders once per round, so noise
hits them alike) and each figure is the median, with the min-max spread beside it.
`--json -` prints one JSON document instead of the tables (schema in `report`).
Usage: python bench/compress_bench.py [--workdir DIR] [--runs 3] [--encoders A,B] [--json FILE|-]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash
from bench_sys import ChildRun, Input, evict, resident_bytes, run_child

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "bench_worker.py")
INPUTS = str(HERE / "bench_inputs.py")
CKPTD = ("ckptd-auto", "ckptd-bytegroup", "ckptd-none")
# `@numpy`: the same encoder with the codec's numpy kernels (CKPTD_CODEC_KERNELS=numpy), the
# codec as it was before the compiled ones: what "no slower than today" is measured against.
TODAY = "ckptd-auto@numpy"
ALL_CKPTD = (*CKPTD, "ckptd-auto+hash+crc", TODAY)
REPEATS = "2"
BASELINES = ("zstd-cli-3", "pyzstd-3", "pyzstd-1", "zipnn")
ENCODERS = ", ".join((*ALL_CKPTD, *BASELINES))
SUFFIX = {"zstd-bytegroup": ".zbg", "zstd": ".zst", "none": ""}


@dataclass
class Row:
    input: str
    encoder: str
    raw: int
    stored: int = 0
    comp_cpu_s: float = 0.0
    comp_wall_s: float = 0.0
    decomp_cpu_s: float = 0.0
    rss: int = 0
    cached: int = 0
    codec: str = ""
    ok: bool = True
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    comp_runs: list[float] = field(default_factory=list)  # CPU seconds, one per round
    decomp_runs: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.stored / self.raw if self.raw else 1.0

    def speed(self, seconds: float) -> float:
        return self.raw / seconds / 1e6 if seconds > 0 else float("inf")

    def speeds(self, runs: list[float]) -> list[float]:
        return [self.speed(t) for t in runs if t > 0]


def merge_rounds(rounds: list[list[Row]]) -> list[Row]:
    """One row per (input, encoder): medians of the rounds' CPU times, every round kept."""
    merged: dict[tuple[str, str], Row] = {}
    for rows in rounds:
        for r in rows:
            key = (r.input, r.encoder)
            if key not in merged:
                merged[key] = Row(**{**r.__dict__, "comp_runs": [], "decomp_runs": []})
            m = merged[key]
            m.comp_runs.append(r.comp_cpu_s)
            m.decomp_runs.append(r.decomp_cpu_s)
            m.ok = m.ok and r.ok and r.stored == m.stored
            m.rss, m.cached = max(m.rss, r.rss), max(m.cached, r.cached)
    for m in merged.values():
        m.comp_cpu_s = statistics.median(m.comp_runs)
        m.decomp_cpu_s = statistics.median(m.decomp_runs)
    return list(merged.values())


def spread(values: list[float]) -> str:
    """`median (min-max)` of speeds, or the one value."""
    if not values:
        return "—"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.0f}"
    return f"{med:.0f} ({min(values):.0f}–{max(values):.0f})"


def available(encoder: str) -> str | None:
    """Why `encoder` cannot run here, or None."""
    if encoder == "zstd-cli-3" and shutil.which("zstd") is None:
        return "no zstd command line tool"
    if encoder == "zipnn" and importlib.util.find_spec("zipnn") is None:
        return "zipnn not installed"
    return None


def file_digest(path: str) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _worker(*args: str, repeats: str = REPEATS) -> tuple[dict[str, Any], int]:
    """Run one worker; its peak RSS is VmHWM after the warm-up where the kernel can reset it."""
    run = run_child([sys.executable, WORKER, *args, repeats])
    if run.returncode != 0:
        raise RuntimeError(f"worker {args[:2]} failed: {run.stderr[-2000:]}")
    res = json.loads(run.stdout.strip().splitlines()[-1])
    return res, res.get("peak_rss") or run.max_rss_bytes


def measure(inp: Input, encoder: str, outdir: Path, want_digest: str) -> Row:
    row = Row(inp.name, encoder, os.path.getsize(inp.path))
    stored = str(outdir / f"{inp.name}.{encoder}")
    evict(inp.path)
    if encoder == "zstd-cli-3":
        _cli_compress(inp, stored, row)
    else:
        res, row.rss = _worker(
            "compress", encoder, inp.path, stored, inp.zipnn_dtype, "1" if inp.is_zip else "0"
        )
        row.comp_cpu_s, row.comp_wall_s = res["cpu_s"], res["wall_s"]
        row.codec = res.get("codec", "zstd" if encoder.startswith("pyzstd") else encoder)
        row.note = res.get("reader", "")
    row.cached = resident_bytes(inp.path)
    row.stored = os.path.getsize(stored)
    if not encoder.endswith("+hash+crc"):
        _decompress(inp, encoder, stored, row, want_digest)
    os.unlink(stored)
    return row


def _cli(argv: list[str], evict_path: str, stdout_path: str | None = None) -> ChildRun:
    """Best of REPEATS runs of a command line tool, each from a cold page cache."""
    runs = []
    for _ in range(int(REPEATS)):
        evict(evict_path)
        run = run_child(argv, stdout_path)
        if run.returncode != 0:
            raise RuntimeError(run.stderr)
        runs.append(run)
    return min(runs, key=lambda r: r.cpu_s)


def _cli_compress(inp: Input, stored: str, row: Row) -> None:
    run = _cli(["zstd", "-3", "-T1", "-q", "-f", "-o", stored, inp.path], inp.path)
    row.comp_cpu_s, row.comp_wall_s, row.rss = run.cpu_s, run.wall_s, run.max_rss_bytes
    row.codec = "zstd"


def _decompress(inp: Input, encoder: str, stored: str, row: Row, want: str) -> None:
    evict(stored)
    if encoder == "zstd-cli-3":
        run = _cli(["zstd", "-d", "-q", "-c", stored], stored, stdout_path=os.devnull)
        row.decomp_cpu_s = run.cpu_s
        return
    res, rss = _worker("decompress", encoder, stored, row.codec, inp.zipnn_dtype, "0")
    row.decomp_cpu_s = res["cpu_s"]
    row.extra["decomp_rss"] = rss
    row.ok = res["digest"] == want and res["size"] == row.raw


def run_all(inputs: list[Input], encoders: list[str], outdir: Path) -> list[Row]:
    rows = []
    for inp in inputs:
        want = file_digest(inp.path)
        for encoder in encoders:
            rows.append(measure(inp, encoder, outdir, want))
            print(_progress(rows[-1]), file=sys.stderr, flush=True)
    return rows


def _progress(r: Row) -> str:
    return (
        f"{r.input:14} {r.encoder:22} ratio {r.ratio:.4f} "
        f"c {r.speed(r.comp_cpu_s):6.0f} MB/s d {r.speed(r.decomp_cpu_s):6.0f} MB/s "
        f"rss {r.rss >> 20} MiB cached {r.cached / max(r.raw, 1):.0%} ok={r.ok}"
    )


def run_memory(inputs: list[Input], encoders: list[str]) -> list[Row]:
    """The codecs alone: input in memory, output in memory, no file I/O in the timings."""
    rows = []
    for inp in inputs:
        for encoder in encoders:
            res, rss = _worker("memory", encoder, inp.path, "-", inp.zipnn_dtype, "0")
            row = Row(inp.name, encoder, os.path.getsize(inp.path), stored=res["stored"])
            row.comp_cpu_s, row.decomp_cpu_s, row.rss, row.ok = (
                res["cpu_s"],
                res["decomp_cpu_s"],
                rss,
                res["ok"],
            )
            rows.append(row)
            print(_progress(row), file=sys.stderr, flush=True)
    return rows


def memory_table(rows: list[Row]) -> str:
    lines = [
        "| input | codec | ratio | compress MB/s/core | decompress MB/s/core | round trip |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.input} | {r.encoder} | {r.ratio:.4f} | {spread(r.speeds(r.comp_runs))} | "
            f"{spread(r.speeds(r.decomp_runs))} | {'ok' if r.ok else 'FAILED'} |"
        )
    return "\n".join(lines)


def table(rows: list[Row]) -> str:
    lines = [
        "| input | encoder | stored as | ratio | compress MB/s/core | decompress MB/s/core "
        "| peak RSS MiB | input left in page cache | round trip |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.input} | {r.encoder} | {r.codec} | {r.ratio:.4f} | "
            f"{spread(r.speeds(r.comp_runs))} | {spread(r.speeds(r.decomp_runs))} | "
            f"{r.rss / 2**20:.0f} | {r.cached / max(r.raw, 1):.1%} | {'ok' if r.ok else 'FAILED'} |"
        )
    return "\n".join(lines)


# The codec targets: ratio at most zipnn's, compress at least 1.2x zipnn's speed (one thread),
# decompress at least 1.5 GB/s per core, no input left in page cache, one read pass.
SPEEDUP = 1.2
DECODE_VS_ZIPNN = 1.5  # decode per CPU second, bf16 and fp32 weights
DECOMPRESS_MB_S = 1500.0
CACHED_SHARE = 0.05
ONE_PASS = 1.16


@dataclass
class Check:
    input: str
    target: str
    measured: str
    met: bool
    values: list[float] = field(default_factory=list)  # per round, where the target is a speed

    def line(self) -> str:
        return f"{self.input}: {self.target}: {self.measured}: {'met' if self.met else 'MISSED'}"


def checks(rows: list[Row]) -> list[Check]:
    by = {(r.input, r.encoder): r for r in rows}
    out: list[Check] = []
    for name in sorted({r.input for r in rows}):
        auto = by.get((name, "ckptd-auto"))
        if auto is not None:
            out += _input_checks(name, auto, by)
    return out


def _input_checks(name: str, auto: Row, by: dict[tuple[str, str], Row]) -> list[Check]:
    out = []
    zip_row, z1 = by.get((name, "zipnn")), by.get((name, "pyzstd-1"))
    if z1:
        ok = auto.ratio <= z1.ratio + 1e-4
        out.append(Check(name, "ratio <= zstd -1", f"{auto.ratio:.4f} vs {z1.ratio:.4f}", ok))
    if zip_row and name != "random":
        ok = auto.ratio <= zip_row.ratio
        out.append(Check(name, "ratio <= zipnn", f"{auto.ratio:.4f} vs {zip_row.ratio:.4f}", ok))
        pairs = zip(zip_row.comp_runs, auto.comp_runs, strict=False)
        ups = [z / a for z, a in pairs if a > 0]  # same round: the same noise for both
        med = statistics.median(ups) if ups else 0.0
        out.append(
            Check(name, f"compress >= {SPEEDUP}x zipnn", f"{spread_x(ups)}", med >= SPEEDUP, ups)
        )
    if zip_row and name.endswith(("-bf16", "-fp32")):
        ups = [z / a for z, a in zip(zip_row.decomp_runs, auto.decomp_runs, strict=False) if a > 0]
        med = statistics.median(ups) if ups else 0.0
        out.append(Check(name, f"decode >= {DECODE_VS_ZIPNN}x zipnn", spread_x(ups),
                         med >= DECODE_VS_ZIPNN, ups))
    today = by.get((name, TODAY))
    if today is not None:
        ups = [t / a for t, a in zip(today.comp_runs, auto.comp_runs, strict=False) if a > 0]
        med = statistics.median(ups) if ups else 0.0
        out.append(Check(name, "encode >= today's", spread_x(ups), med >= 1.0, ups))
        ok = auto.ratio <= today.ratio + 1e-9
        out.append(Check(name, "ratio <= today's", f"{auto.ratio:.4f} vs {today.ratio:.4f}", ok))
    speeds = auto.speeds(auto.decomp_runs)
    med = statistics.median(speeds) if speeds else 0.0
    target = f"decompress >= {DECOMPRESS_MB_S:.0f} MB/s/core"
    out.append(Check(name, target, spread(speeds), med >= DECOMPRESS_MB_S, speeds))
    share = auto.cached / max(auto.raw, 1)
    out.append(Check(name, "page cache after <= 5%", f"{share:.1%}", share <= CACHED_SHARE))
    one_pass = by.get((name, "ckptd-auto+hash+crc"))
    if one_pass and auto.comp_cpu_s:
        over = one_pass.comp_cpu_s / auto.comp_cpu_s
        out.append(
            Check(name, f"hash+CRC+encode <= {ONE_PASS}x encode", f"{over:.2f}", over <= ONE_PASS)
        )
    return out


def spread_x(values: list[float]) -> str:
    if not values:
        return "—"
    med = statistics.median(values)
    return f"{med:.2f}x ({min(values):.2f}–{max(values):.2f})" if len(values) > 1 else f"{med:.2f}x"


def build_inputs(*args: str) -> tuple[list[Input], list[str]]:
    run = run_child([sys.executable, INPUTS, *args])
    if run.returncode != 0:
        raise RuntimeError(f"building inputs failed: {run.stderr[-3000:]}")
    got = json.loads(run.stdout.strip().splitlines()[-1])
    return [Input(**i) for i in got["inputs"]], got["notes"]


def big_case(workdir: Path, size_gb: float, steps: int, random_mb: int) -> list[str]:
    """Peak RSS of ckptd encoding a file of `size_gb` GB (output discarded to spare disk)."""
    [big], _ = build_inputs(str(workdir), str(steps), str(random_mb), str(size_gb))
    evict(big.path)
    res, rss = _worker("compress", "ckptd-auto", big.path, os.devnull, "bfloat16", "0", repeats="1")
    size = os.path.getsize(big.path)
    cached = resident_bytes(big.path) / size
    return [
        f"{big.name}: peak RSS {rss / 2**20:.0f} MiB encoding {size / 1e9:.1f} GB "
        f"(target < 200 MiB): {'met' if rss < 200 * 2**20 else 'MISSED'}; "
        f"{size / res['cpu_s'] / 1e6:.0f} MB/s/core; page cache after {cached:.1%}",
    ]


def report(
    args: argparse.Namespace, rows: list[Row], memory: list[Row], notes: list[str]
) -> dict[str, Any]:
    """The machine-readable result (`--json`), schema `ckptd-compress-bench/1`: speeds in MB/s
    per core (input bytes / CPU seconds), each as median, min, max and the per-round values."""

    def figure(row: Row, runs: list[float]) -> dict[str, Any] | None:
        speeds = row.speeds(runs)
        if not speeds:
            return None
        med = statistics.median(speeds)
        return {"median": med, "min": min(speeds), "max": max(speeds), "runs": speeds}

    def as_json(r: Row) -> dict[str, Any]:
        return {
            "input": r.input,
            "encoder": r.encoder,
            "codec": r.codec,
            "raw_bytes": r.raw,
            "stored_bytes": r.stored,
            "ratio": r.ratio,
            "compress_mb_s": figure(r, r.comp_runs),
            "decompress_mb_s": figure(r, r.decomp_runs),
            "peak_rss_bytes": r.rss,
            "input_cached_share": r.cached / max(r.raw, 1),
            "round_trip_ok": r.ok,
        }

    return {
        "schema": "ckptd-compress-bench/1",
        "command": " ".join(["python", "bench/compress_bench.py", *sys.argv[1:]]),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_average": os.getloadavg(),
        },
        "runs": args.runs,
        "rows": [as_json(r) for r in rows],
        "memory_rows": [as_json(r) for r in memory],
        "checks": [c.__dict__ for c in checks(rows)],
        "notes": notes,
    }


def _encoders(args: argparse.Namespace, notes: list[str]) -> list[str]:
    wanted = args.encoders.split(",") if args.encoders else [*ALL_CKPTD, *BASELINES]
    encoders = []
    for enc in wanted:
        why = available(enc)
        if why:
            notes.append(f"{enc} skipped: {why}")
        else:
            encoders.append(enc)
    return encoders


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workdir", default="/tmp/ckptd-bench", help="inputs are kept here")
    ap.add_argument("--steps", type=int, default=300, help="Adam steps for the small model")
    ap.add_argument("--random-mb", type=int, default=64)
    ap.add_argument("--big-gb", type=float, default=0.0, help="also encode a file this big")
    ap.add_argument("--only", default="", help="comma-separated input names")
    ap.add_argument("--encoders", default="", help=f"comma-separated, of {ENCODERS}")
    ap.add_argument("--runs", type=int, default=1, help="rounds; figures are their medians")
    ap.add_argument("--json", default="", help="write the result as JSON here ('-': stdout)")
    args = ap.parse_args()
    # The tree first; then whatever the caller put on the path (a baseline installed aside).
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), str(HERE), *kept])
    workdir = Path(args.workdir)
    inputs, notes = build_inputs(str(workdir), str(args.steps), str(args.random_mb))
    if args.only:
        inputs = [i for i in inputs if i.name in args.only.split(",")]
    encoders = _encoders(args, notes)
    outdir = workdir / "out"
    outdir.mkdir(exist_ok=True)
    in_memory = [e for e in ("ckptd-auto", "pyzstd-1", "zipnn") if e in encoders]
    rounds, memory_rounds = [], []
    for _ in range(args.runs):
        rounds.append(run_all(inputs, encoders, outdir))
        memory_rounds.append(run_memory(inputs, in_memory))
    rows, memory = merge_rounds(rounds), merge_rounds(memory_rounds)
    if args.big_gb:
        notes += big_case(workdir, args.big_gb, args.steps, args.random_mb)
    result = report(args, rows, memory, notes)
    if args.json == "-":
        print(json.dumps(result, indent=1))
        return
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    rounds_note = f"{args.runs} rounds: median (min–max)"
    print(f"Files on disk, each run from a cold page cache ({rounds_note}):\n")
    print(table(rows))
    print("\nCodecs alone, in memory (no file I/O timed):\n")
    print(memory_table(memory))
    print()
    for line in [*(c.line() for c in checks(rows)), *notes]:
        print(f"- {line}")


if __name__ == "__main__":
    main()
