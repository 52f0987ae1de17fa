"""Compression benchmark: ckptd's codecs against zstd (CLI and binding) and zipnn, side by side
in one run on the same inputs; prints a markdown table and the checks against issue 3's targets.

Every encoder runs in its own process from a cold page cache; nothing here is a timed test.
Usage: python bench/compress_bench.py [--workdir DIR] [--big-gb 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
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
REPEATS = "2"
BASELINES = ("zstd-cli-3", "pyzstd-3", "pyzstd-1", "zipnn")
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

    @property
    def ratio(self) -> float:
        return self.stored / self.raw if self.raw else 1.0

    def speed(self, seconds: float) -> float:
        return self.raw / seconds / 1e6 if seconds > 0 else float("inf")


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
            f"| {r.input} | {r.encoder} | {r.ratio:.4f} | {r.speed(r.comp_cpu_s):.0f} | "
            f"{r.speed(r.decomp_cpu_s):.0f} | {'ok' if r.ok else 'FAILED'} |"
        )
    return "\n".join(lines)


def table(rows: list[Row]) -> str:
    lines = [
        "| input | encoder | stored as | ratio | compress MB/s/core | decompress MB/s/core "
        "| peak RSS MiB | input left in page cache | round trip |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        decomp = f"{r.speed(r.decomp_cpu_s):.0f}" if r.decomp_cpu_s else "—"
        lines.append(
            f"| {r.input} | {r.encoder} | {r.codec} | {r.ratio:.4f} | "
            f"{r.speed(r.comp_cpu_s):.0f} | {decomp} | {r.rss / 2**20:.0f} | "
            f"{r.cached / max(r.raw, 1):.1%} | {'ok' if r.ok else 'FAILED'} |"
        )
    return "\n".join(lines)


def checks(rows: list[Row]) -> list[str]:
    """Issue 3's targets, each with the measured figures and a verdict."""
    by = {(r.input, r.encoder): r for r in rows}
    out = []
    for name in sorted({r.input for r in rows}):
        auto = by.get((name, "ckptd-auto"))
        if auto is None:
            continue
        out += _input_checks(name, auto, by)
    return out


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _input_checks(name: str, auto: Row, by: dict[tuple[str, str], Row]) -> list[str]:
    out = []
    zip_row, z1 = by.get((name, "zipnn")), by.get((name, "pyzstd-1"))
    if z1:
        ok = auto.ratio <= z1.ratio + 1e-4
        out.append(f"{name}: ratio {auto.ratio:.4f} vs zstd-1 {z1.ratio:.4f}: {_verdict(ok)}")
    if zip_row and name != "random":
        ok = auto.ratio <= zip_row.ratio
        out.append(f"{name}: ratio {auto.ratio:.4f} vs zipnn {zip_row.ratio:.4f}: {_verdict(ok)}")
        speedup = zip_row.comp_cpu_s / auto.comp_cpu_s if auto.comp_cpu_s else 0.0
        out.append(
            f"{name}: compress speed {speedup:.2f}x zipnn (target >= 1.2x): "
            f"{_verdict(speedup >= 1.2)}"
        )
    dspeed = auto.speed(auto.decomp_cpu_s)
    out.append(
        f"{name}: decompress {dspeed:.0f} MB/s/core (target >= 1000): {_verdict(dspeed >= 1000)}"
    )
    if name == "random":
        cspeed = auto.speed(auto.comp_cpu_s)
        out.append(
            f"random: pass-through {cspeed:.0f} MB/s/core (target >= 2000): "
            f"{_verdict(cspeed >= 2000)}"
        )
    share = auto.cached / max(auto.raw, 1)
    out.append(f"{name}: page cache after {share:.1%} (target <= 5%): {_verdict(share <= 0.05)}")
    one_pass = by.get((name, "ckptd-auto+hash+crc"))
    if one_pass:
        over = one_pass.comp_cpu_s / auto.comp_cpu_s
        out.append(
            f"{name}: hash+CRC+encode / encode = {over:.2f} CPU (target <= 1.15): "
            f"{_verdict(over <= 1.15)}"
        )
    return out


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
        f"(target < 200 MiB): {_verdict(rss < 200 * 2**20)}; "
        f"{size / res['cpu_s'] / 1e6:.0f} MB/s/core; page cache after {cached:.1%}",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workdir", default="/tmp/ckptd-bench", help="inputs are kept here")
    ap.add_argument("--steps", type=int, default=300, help="Adam steps for the small model")
    ap.add_argument("--random-mb", type=int, default=64)
    ap.add_argument("--big-gb", type=float, default=0.0, help="also encode a file this big")
    ap.add_argument("--only", default="", help="comma-separated input names")
    ap.add_argument("--json", default="", help="write raw figures here")
    args = ap.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), str(HERE)])
    workdir = Path(args.workdir)
    inputs, notes = build_inputs(str(workdir), str(args.steps), str(args.random_mb))
    if args.only:
        inputs = [i for i in inputs if i.name in args.only.split(",")]
    encoders = [*CKPTD, "ckptd-auto+hash+crc"]
    for enc in BASELINES:
        why = available(enc)
        if why:
            notes.append(f"{enc} skipped: {why}")
        else:
            encoders.append(enc)
    outdir = workdir / "out"
    outdir.mkdir(exist_ok=True)
    rows = run_all(inputs, encoders, outdir)
    memory = run_memory(
        inputs,
        [e for e in ("ckptd-auto", "pyzstd-1", "zipnn") if e in encoders or e == "ckptd-auto"],
    )
    print("Files on disk, each run from a cold page cache:\n")
    print(table(rows))
    print("\nCodecs alone, in memory (no file I/O timed):\n")
    print(memory_table(memory))
    print()
    for line in [*checks(rows), *notes]:
        print(f"- {line}")
    if args.big_gb:
        for line in big_case(workdir, args.big_gb, args.steps, args.random_mb):
            print(f"- {line}")
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in rows + memory], indent=1))


if __name__ == "__main__":
    main()
