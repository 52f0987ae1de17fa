"""`make bench`: every row of the performance table, ckptd beside its real baseline, from one
run of the benchmarks in bench/ (each run its own process), medians over --repeat rounds with
their spread; printed, and written into docs/PERFORMANCE.md between the make-bench markers,
its ratios drawn into docs/performance.svg (bench/plot.py).

Usage: python bench/bench_all.py [--repeat 3] [--size 2GB] [--files 10000] [--skip codec]
       [--resume-size 1.6GB] [--memory-size 1.6GB] [--steps-files N] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import plot  # bench/plot.py: the table's ratios drawn as docs/performance.svg
import startup_bench  # bench/startup_bench.py: its row of the table
import steps_bench  # bench/steps_bench.py: ten steps in one root, its command and its rows

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DOC = REPO / "docs" / "PERFORMANCE.md"
BEGIN, END = "<!-- make-bench:begin -->", "<!-- make-bench:end -->"
MiB = 1 << 20


class Failed(Exception):
    """One benchmark script exited with an error."""


@dataclass
class Row:
    measure: str
    baseline: str
    base_fig: str
    ckptd_fig: str
    ratio: str  # ckptd / baseline: median (spread)
    goal: str
    met: str


def spread(values: Sequence[float], fmt: str = "{:.2f}", unit: str = "", of: str = "run") -> str:
    """'median unit (min–max, n runs)' of `values` (`of`: what each value is one of)."""
    if not values:
        return "—"
    med = fmt.format(statistics.median(values)) + unit
    if len(values) == 1:
        return f"{med} (1 {of})"
    return f"{med} ({fmt.format(min(values))}–{fmt.format(max(values))}, {len(values)} {of}s)"


def verdict(ok: bool | None) -> str:
    return "—" if ok is None else ("**met**" if ok else "**not met**")


def run(argv: list[str], log: Path) -> float:
    """Run one benchmark script (its output kept in `log`); its wall time."""
    print(f"$ {shlex.join(argv)}", flush=True)
    started = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise Failed(f"{argv[1]} failed ({proc.returncode}):\n{tail}")
    print(f"  done in {wall:.0f} s (output: {log})", flush=True)
    return wall


# -- the rows, from each benchmark's JSON -------------------------------------------------------


def upload_rows(doc: dict[str, Any]) -> list[Row]:
    size = f"{doc['raw'] / 1e9:.1f} GB"
    runs = {r["name"]: r for r in doc["runs"]}
    scripted, ckptd = runs["scripted"], next(r for n, r in runs.items() if n.startswith("ckptd "))
    save = [c / s for c, s in zip(ckptd["extra"]["walls"], scripted["extra"]["walls"],
                                  strict=True)]
    rs, rc = runs["scripted restore"], runs["ckptd restore"]
    restore = [c / s for c, s in zip(rc["extra"]["walls"], rs["extra"]["walls"], strict=True)]
    def secs(r: dict[str, Any]) -> str:
        return spread(r["extra"]["walls"], "{:.1f}", " s")

    def sent(r: dict[str, Any]) -> str:
        return f"{secs(r)}, {r['sent_bytes'] / 1e6:,.0f} MB sent"

    return [
        Row(f"the in-process save, {size} fp32 model+Adam into the test S3 server: one read"
            " pass (validate+compress, each object sent as it is finished), then the upload"
            " stage (the daemon's stages in one process; its whole path is the time-to-safe"
            " row)",
            "`sha256sum; zstd -T0 -3; aws s3 cp`", sent(scripted), sent(ckptd),
            f"wall {spread(save)}; bytes {ckptd['sent_bytes'] / scripted['sent_bytes']:.3f}",
            "≤ 0.5× wall", verdict(statistics.median(save) <= 0.5)),
        Row("restore of the same", "`aws s3 cp` + `zstd -d`", secs(rs), secs(rc),
            spread(restore), "≤ 0.7×", verdict(statistics.median(restore) <= 0.7)),
    ]


def rss_rows(runs: list[dict[str, Any]]) -> list[Row]:
    peaks = [r["vm_hwm"] / MiB for r in runs]
    upload = [r["peaks"]["upload"]["RssAnon"] / MiB for r in runs]
    return [Row("daemon peak RSS on that save (a real `ckptd run`, defaults)", "—", "—",
                f"VmHWM {spread(peaks, '{:.0f}', ' MiB')}; anonymous memory during the upload "
                f"{spread(upload, '{:.0f}', ' MiB')}", "—", "≤ 200 MiB",
                verdict(max(peaks) <= 200))]


def many_rows(doc: dict[str, Any]) -> list[Row]:
    rounds = doc["rounds"]
    ratios = [r["ckptd"] / r["aws"] for r in rounds]
    return [Row(f"{doc['inputs']['files']:,}-file checkpoint upload", "`aws s3 cp --recursive`",
                spread([r["aws"] for r in rounds], "{:.1f}", " s"),
                spread([r["ckptd"] for r in rounds], "{:.1f}", " s"), spread(ratios),
                "≤ 1.5×", verdict(statistics.median(ratios) <= 1.5))]


def safe_rows(doc: dict[str, Any]) -> list[Row]:
    """Rows from `bench/time_to_safe_bench.py --json`: a step renamed into a root until
    remote-verified, against `aws s3 cp --recursive` of the same files (many files) or the
    scripted hash + zstd + upload (one 2.1 GB checkpoint)."""
    rows: list[Row] = []
    for case, res in doc.items():
        aws, ck = res.get("aws", []), [r["wall_s"] for r in res.get("ckptd", [])]
        if not aws or not ck:
            continue
        ratios = [c / a for c, a in zip(ck, aws, strict=False)]
        info = res["inputs"]
        goal = 1.5 if case == "many" else 0.5
        baseline = res.get("baseline", "aws s3 cp --recursive")
        rows.append(Row(f"time to safe: {info['files']:,}-file step ({info['bytes'] / 1e9:.2f} GB"
                        f", {case}), renamed in → remote-verified", f"`{baseline}`",
                        spread(aws, "{:.1f}", " s"), spread(ck, "{:.1f}", " s"),
                        spread(ratios), f"≤ {goal}×",
                        verdict(statistics.median(ratios) <= goal)))
    return rows


def codec_rows(doc: Any) -> list[Row]:
    """Rows from `bench/compress_bench.py --runs N --json` (schema `ckptd-compress-bench/1`):
    its `checks` carry each input's verdict against the targets, its `rows` the medians of the
    N rounds; the spread shown is over inputs (each input's own round-to-round spread is in
    compress_bench's log)."""
    if not isinstance(doc, dict) or doc.get("schema") != "ckptd-compress-bench/1":
        return [hook("compress_bench --json gave no document of schema ckptd-compress-bench/1")]
    checks = [c for c in doc.get("checks", []) if isinstance(c, dict)]
    by = {(r["input"], r["encoder"]): r for r in doc.get("rows", []) if isinstance(r, dict)}
    if not any(e == "zipnn" for _, e in by):
        return [hook("zipnn was not available to compress_bench (pip install --no-deps zipnn)")]

    def picked(target: str, dtypes: tuple[str, ...]) -> list[dict[str, Any]]:
        return [c for c in checks if c["target"] == target and c["input"].endswith(dtypes)]

    def speed_ratio(inp: str) -> float:
        return float(by[(inp, "ckptd-auto")]["compress_mb_s"]["median"]
                     / by[(inp, "zipnn")]["compress_mb_s"]["median"])

    out: list[Row] = []
    for what, dtypes in (("bf16", ("-bf16",)), ("fp16", ("-fp16",))):
        ratio = picked("ratio <= zipnn", dtypes)
        speed = picked("compress >= 1.2x zipnn", dtypes)
        names = ", ".join(c["input"] for c in ratio)
        if ratio:
            sizes = [by[(c["input"], "ckptd-auto")]["stored_bytes"]
                     / by[(c["input"], "zipnn")]["stored_bytes"] for c in ratio]
            out.append(Row(f"{what} weights: ratio ({names})", "zipnn", "", "",
                           spread(sizes, "{:.4f}", "× zipnn's size", "input"),
                           "≤ zipnn's on every input", verdict(all(c["met"] for c in ratio))))
        if speed:
            out.append(Row(f"{what} weights: compress speed, one thread", "zipnn", "", "",
                           spread([speed_ratio(c["input"]) for c in speed], "{:.2f}",
                                  "× zipnn's MB/s/core", "input"), "≥ 1.2×",
                           verdict(all(c["met"] for c in speed))))
    fp32 = picked("compress >= 1.2x zipnn", ("-fp32",))
    if fp32:
        out.append(Row("fp32: compress speed, one thread", "zipnn", "", "",
                       spread([speed_ratio(c["input"]) for c in fp32], "{:.2f}",
                              "× zipnn's MB/s/core", "input"), "keep ≥ 1.2×",
                       verdict(all(c["met"] for c in fp32))))
    for what, dtypes in (("bf16", ("-bf16",)), ("fp32", ("-fp32",))):
        per = picked("decode >= 1.5x zipnn", dtypes)
        if per:
            mine = [by[(c["input"], "ckptd-auto")]["decompress_mb_s"]["median"] for c in per]
            theirs = [by[(c["input"], "zipnn")]["decompress_mb_s"]["median"] for c in per]
            out.append(Row(f"decode per core, {what} transformer weights "
                           f"({', '.join(c['input'] for c in per)}; from disk, one thread)",
                           "zipnn", spread(theirs, "{:.0f}", " MB/s/core", "input"),
                           spread(mine, "{:.0f}", " MB/s/core", "input"),
                           spread([statistics.median(c["values"]) for c in per], "{:.2f}",
                                  "× zipnn's per CPU second", "input"), "≥ 1.5×",
                           verdict(all(c["met"] for c in per))))
    today = picked("encode >= today's", ("",))
    if today:
        same = picked("ratio <= today's", ("",))
        out.append(Row(f"encode per core ({len(today)} inputs; stored bytes no more than "
                       "today's on " f"{sum(c['met'] for c in same)} of {len(same)})",
                       "ckptd with its numpy kernels (the codec before the compiled ones)",
                       "", "", spread([statistics.median(c["values"]) for c in today], "{:.2f}",
                                      "× today's MB/s/core", "input"),
                       "≥ 1× (no slower)", verdict(all(c["met"] for c in today)
                                                    and all(c["met"] for c in same))))
    dec = picked("decompress >= 1500 MB/s/core", ("",))
    dec_speeds = [by[(c["input"], "ckptd-auto")]["decompress_mb_s"]["median"] for c in dec]
    zip_dec = [r["decompress_mb_s"]["median"] for (i, e), r in by.items()
               if e == "zipnn" and r.get("decompress_mb_s")]
    if dec:
        out.append(Row(f"decompress, one thread (ckptd, {len(dec)} inputs, from disk)", "zipnn",
                       spread(zip_dec, "{:.0f}", " MB/s/core", "input") if zip_dec else "",
                       spread(dec_speeds, "{:.0f}", " MB/s/core", "input"), "—",
                       "≥ 1.5 GB/s on every input", verdict(all(c["met"] for c in dec))))
    return out or [hook("compress_bench --json held no codec checks")]


def resume_rows(doc: dict[str, Any]) -> list[Row]:
    """Rows from `bench/resume_bench.py --json` (schema `ckptd-resume-bench/1`): a fresh process
    to every tensor of a step in memory and checked, each way in every round."""
    if doc.get("schema") != "ckptd-resume-bench/1":
        return [Row("resume from the bucket", "", "", "", "—", "—",
                    "not measured: resume_bench --json gave no ckptd-resume-bench/1 document")]
    goals = {g["id"]: g for g in doc["goals"]}
    size = f"{doc['inputs']['state_bytes'] / 1e9:.1f} GB"

    def runs(name: str, what: str = "wall_s") -> list[float]:
        return [r[name][what] for r in doc["rounds"] if name in r and not r[name]["error"]]

    def secs(name: str) -> str:
        return spread(runs(name), "{:.1f}", " s") if runs(name) else "not available"

    def mib(name: str) -> str:
        return spread([x / MiB for x in runs(name, "peak_rss")], "{:,.0f}", " MiB")

    def ratio(key: str, fmt: str = "{:.2f}", unit: str = "", of: str = "run") -> str:
        g = goals[key]
        if not g["values"]:
            return f"— ({g['why'][:120]})"
        alone = g.get("loading") or []
        return spread(g["values"], fmt, unit, of) + (
            f"; loading alone {spread(alone, fmt, unit)}" if alone else "")

    def met(key: str) -> str:
        g = goals[key]
        return verdict(g["met"]) if g["met"] is not None else "not measured"

    reader, native = "ckptd StorageReader", "ckptd.torch.load(source=remote)"
    stored = doc["stored"].get("ckptd-dcp", 0)
    halves = [x / 1e6 for n in ("ckptd StorageReader, half 0/2", "ckptd StorageReader, half 1/2")
              for x in runs(n, "bucket_bytes") if x]
    return [
        Row(f"resume a DCP step from the bucket into memory, {size} fp32 model+Adam",
            "`aws s3 cp` + `dcp.load`", secs("aws s3 cp + dcp.load"),
            f"{secs(reader)} (`ckptd.dcp.StorageReader`)", ratio("vs_aws"), "≤ 0.6×",
            met("vs_aws")),
        Row("the same, against s3torchconnector", "`S3StorageReader` (plain copy)",
            secs("s3torchconnector S3StorageReader"), secs(reader), ratio("vs_s3tc"), "≤ 0.8×",
            met("vs_s3tc")),
        Row("the same, against today's way", "`ckptd restore` + `dcp.load`",
            secs("ckptd restore + dcp.load"), secs(reader), ratio("vs_restore"), "—", "—"),
        Row("peak RSS of that load", "local `dcp.load`, cold cache", mib("local dcp.load"),
            mib(reader), ratio("rss", "{:+.0f}", " MiB"), "≤ +128 MiB", met("rss")),
        Row("half the state (one rank of two, resharded): bytes fetched", "the step's stored "
            "bytes", f"{stored / 1e6:,.0f} MB", spread(halves, "{:,.0f}", " MB", "rank"),
            ratio("half", "{:.2f}", of="rank load"), "≤ 0.6×", met("half")),
        Row("resume a native step (`ckptd.torch.save`) into model and optimizer",
            "`ckptd restore` + `ckptd.torch.load`", secs("ckptd restore + ckptd.torch.load"),
            secs(native), ratio("native"), "≤ 0.7×", met("native")),
    ] + ([Row(*startup_bench.table_row(doc["startup"]))] if "startup" in doc else [])


def memory_rows(doc: dict[str, Any]) -> list[Row]:
    """Rows from `bench/memory_bench.py --json` (`ckptd-memory-bench/1`): a restart from this
    node's daemon's memory, a replaced node from its peer, training beside the replication and
    the peer daemon's memory, on real `ckptd run` daemons."""
    if doc.get("schema") != "ckptd-memory-bench/1":
        return [Row("restoring from memory", "", "", "", "—", "—",
                    "not measured: memory_bench --json gave no ckptd-memory-bench/1 document")]
    goals, peers = {g["id"]: g for g in doc["goals"]}, doc.get("peers", {})

    def loads(part: str, name: str) -> str:
        got = [r[name]["load_s"] for r in doc.get(part, {}).get("rounds", [])
               if name in r and not r[name]["error"]]
        return spread(got, "{:.2f}", " s") if got else "not available"

    def ratio(key: str, fmt: str = "{:.2f}", unit: str = "×", also: str = "walls",
              said: str = "child wall") -> str:
        g = goals.get(key) or {"values": [], "why": "not run"}
        extra = f"; {said} {spread(g[also], fmt, unit)}" if g.get(also) else ""
        return spread(g["values"], fmt, unit) + extra if g["values"] else f"— ({g['why'][:120]})"

    def met(key: str) -> str:
        g = goals.get(key)
        return "not measured" if g is None or g["met"] is None else verdict(g["met"])

    def steps(key: str) -> str:
        return spread([statistics.median(t[key]) for t in peers.get("training", []) if t[key]],
                      "{:.3f}", " s")

    rows, rss = [], peers.get("rss", {})
    if "restart" in doc:
        gb = doc["restart"]["state_bytes"] / 1e9
        rows.append(Row(f"restart from this node's memory, {gb:.2f} GB fp32 model+Adam state, "
                        "from the load call to the state in place (a trainer SIGKILLed after "
                        "an async save)", "`ckptd.torch.load(source=\"local\")`, the step's "
                        "files evicted from the page cache", loads("restart", "local"),
                        loads("restart", "memory"), ratio("restart"), "≤ 0.25×", met("restart")))
    if "error" in peers:
        rows.append(Row("a replaced node from its peer", "", "", "", "—", "—",
                        f"not measured: {peers['error'][:160]}"))
    if not peers or "error" in peers:
        return rows
    return [*rows,
            Row(f"a replaced node from its peer, {peers['state_bytes'] / 1e9:.2f} GB (n0's daemon "
                "killed, its disks wiped, a new daemon with the same id; source auto, served by "
                "`peer:n1`)", "`source=\"remote\"` from the test S3 server, cold",
                loads("peers", "bucket"), loads("peers", "peer"), ratio("peer"), "≤ 0.5×",
                met("peer")),
            Row("bytes on the peer link (the replica n1 holds)", "the step's files",
                f"{peers['files_bytes'] / 1e6:,.0f} MB",
                f"{peers.get('replica_bytes', 0) / 1e6:,.0f} MB", ratio("peer_bytes", "{:.3f}"),
                "≤ 0.9×", met("peer_bytes")),
            Row("training step time (CPU matmuls, both cores) while n0 sends a step to n1 on the"
                " same machine", "the same loop's steps before and after the send",
                steps("idle"), steps("busy"), ratio("train"), "≤ 1.05×", met("train")),
            Row("peer daemon's peak RSS beyond the replica bytes it holds (n1)", "—", "—",
                f"VmHWM {rss.get('vm_hwm', 0) / MiB:,.0f} MiB, holding "
                f"{rss.get('peer_bytes', 0) / MiB:,.0f} MiB", ratio("rss", "{:+.0f}", " MiB"),
                "≤ 200 MiB", met("rss"))]


def hook(why: str) -> Row:
    return Row("codec rows (bf16/fp32 ratio and speed, decompress)", "zipnn", "", "", "—", "—",
               f"not measured: {why}")


# -- the run ------------------------------------------------------------------------------------


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor())
    mem = int(Path("/proc/meminfo").read_text().split()[1]) / (1 << 20)
    versions = [_version(["zstd", "--version"]), _version(["aws", "--version"])]
    return (f"{os.cpu_count()} vCPUs ({cpu}), {mem:.0f} GiB RAM, Linux {platform.release()}, "
            f"Python {platform.python_version()}; {'; '.join(versions)}")


def _version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, check=False)
    except OSError:
        return f"{argv[0]}: not installed"
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if text else argv[0]


def collect(args: argparse.Namespace, out: Path) -> tuple[list[Row], list[str]]:
    py = sys.executable
    rows: list[Row] = []
    notes: list[str] = []
    steps: list[tuple[str, list[str], Callable[[Any], list[Row]]]] = [
        ("upload", [py, str(HERE / "upload_bench.py"), "--size", args.size, "--repeat",
                    str(args.repeat), "--keep-inputs", "--workdir", str(args.workdir / "upload")],
         upload_rows),
        ("rss", [py, str(HERE / "daemon_rss_bench.py"), "--size", args.size, "--repeat",
                 str(args.repeat), "--workdir", str(args.workdir / "upload")], rss_rows),
        ("many", [py, str(HERE / "many_files_bench.py"), "--files", str(args.files),
                  "--repeat", str(args.repeat), "--workdir", str(args.workdir / "many-files")],
         many_rows),
        ("safe", [py, str(HERE / "time_to_safe_bench.py"), "--case", "both", "--files",
                  str(args.files), "--size", args.size, "--repeat", str(args.repeat), "--workdir",
                  str(args.workdir / "time-to-safe")], safe_rows),
        ("steps", steps_bench.bench_all_argv(py, args), steps_bench.bench_all_rows),
        ("codec", [py, str(HERE / "compress_bench.py"), "--runs", str(args.repeat),
                   "--encoders", "ckptd-auto,ckptd-auto+hash+crc,pyzstd-1,zipnn,"
                   "ckptd-auto@numpy",
                   "--workdir", str(args.workdir / "compress")], codec_rows),
        ("resume", [py, str(HERE / "resume_bench.py"), "--size", args.resume_size, "--repeat",
                    str(args.repeat), "--keep-inputs", "--workdir", str(args.workdir / "resume")],
         resume_rows),
        ("memory", [py, str(HERE / "memory_bench.py"), "--size", args.memory_size, "--repeat",
                    str(args.repeat), "--workdir", str(args.workdir / "memory")], memory_rows),
    ]
    for name, argv, to_rows in steps:
        if name in args.skip:
            notes.append(f"{name}: skipped (--skip)")
            continue
        result = out / f"{name}.json"
        result.unlink(missing_ok=True)
        try:
            wall = run([*argv, "--json", str(result)], out / f"{name}.log")
        except Failed as exc:  # the other rows still stand; this one says why it is missing
            print(exc, file=sys.stderr)
            notes.append(f"{Path(argv[1]).name} FAILED: see {out / f'{name}.log'}")
            continue
        notes.append(f"{Path(argv[1]).name}: {wall / 60:.1f} min")
        rows += to_rows(json.loads(result.read_text()))
    return rows, notes


def render(rows: list[Row], notes: list[str], args: argparse.Namespace, loads: list[float],
           started: str) -> str:
    lines = [
        BEGIN,
        f"Written by `make bench` ({started}; command: `python bench/bench_all.py "
        f"{' '.join(shlex.quote(a) for a in sys.argv[1:])}`).",
        "",
        f"Machine: {machine()}. Shared with other work: load average {loads[0]:.1f} at the "
        f"start, {loads[1]:.1f} at the end; read ratios, not absolute times. Each ratio is "
        f"the median of the per-round ratios (ckptd and its baseline run in the same round, "
        f"alternating order), with the lowest and highest round.",
        "",
        "| measure | baseline | baseline | ckptd | ckptd / baseline | goal | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {r.measure} | {r.baseline} | {r.base_fig} | {r.ckptd_fig} | {r.ratio} | "
              f"{r.goal} | {r.met} |" for r in rows]
    lines += ["", *(f"- {n}" for n in notes), END]
    return "\n".join(lines)


def write_doc(block: str) -> None:
    text = DOC.read_text()
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        marker = "\n## Compression\n"
        head, tail = text.split(marker, 1) if marker in text else (text, "")
        text = (head.rstrip("\n") + "\n\n## The table (`make bench`)\n\n" + block + "\n"
                + (marker + tail if tail else ""))
    DOC.write_text(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--size", default="2GB")
    p.add_argument("--files", type=int, default=10_000)
    p.add_argument("--resume-size", default="1.6GB", help="the resume benchmark's state")
    p.add_argument("--memory-size", default="1.6GB", help="the memory benchmark's state")
    p.add_argument("--steps-files", type=int, default=0, help="the steps row's (--files)")
    p.add_argument("--skip", default="", help="comma-separated: upload,rss,many,safe,steps,"
                   "codec,resume,memory")
    p.add_argument("--no-write", action="store_true", help="print only; leave the doc alone")
    p.add_argument("--workdir", type=Path, default=HERE / "out",
                   help="inputs (built once, kept) and results go under here")
    args = p.parse_args()
    args.skip = set(filter(None, args.skip.split(",")))
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO),
                                                             os.environ.get("PYTHONPATH")]))
    out = args.workdir / "bench-all"
    out.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load0 = os.getloadavg()[0]
    rows, notes = collect(args, out)
    block = render(rows, notes, args, [load0, os.getloadavg()[0]], started)
    print(block)
    if not args.no_write:
        write_doc(block)
        print(f"written into {DOC}")
        print(f"{plot.write()} ratios drawn into {plot.SVG}")


if __name__ == "__main__":
    main()
