"""Daemon memory benchmark: a real `ckptd run` (default settings, one root uploading to the test
S3 server) takes the 2 GB checkpoint of bench/upload_bench.py from registration to `uploaded`,
while /proc/<pid>/status is sampled every 50 ms: where its resident memory goes, by phase.

Usage: python bench/daemon_rss_bench.py [--size 2GB] [--workdir DIR] [--repeat 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))  # the SeaweedFS launcher and config helpers the tests use

import s3server  # noqa: E402
from support.config import write_layout  # noqa: E402
from upload_bench import FILES, build_inputs, evict  # noqa: E402

from ckptd.client import Client  # noqa: E402
from ckptd.units import parse_size  # noqa: E402

FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM")


def status(pid: int) -> dict[str, int]:
    """The memory fields of /proc/<pid>/status, in bytes."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in FIELDS:
                out[key] = int(rest.split()[0]) * 1024
    return out


def smaps(pid: int, top: int = 8) -> list[tuple[str, int, int]]:
    """The `top` mappings by resident size: (what, Rss bytes, Anonymous bytes)."""
    out: list[tuple[str, int, int]] = []
    name, rss = "", 0
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if not head[0].endswith(":") or "-" in head[0]:
                name = head[5] if len(head) > 5 else "[anon]"
            elif head[0] == "Rss:":
                rss = int(head[1]) * 1024
            elif head[0] == "Anonymous:":
                out.append((name, rss, int(head[1]) * 1024))
    merged: dict[str, list[int]] = {}
    for n, r, a in out:
        m = merged.setdefault(n, [0, 0])
        m[0] += r
        m[1] += a
    return sorted(((n, r, a) for n, (r, a) in merged.items()), key=lambda x: -x[1])[:top]


def torch_loaded(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


class Sampler(threading.Thread):
    """Samples the daemon's memory every `interval` s, each sample tagged with the phase."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.phase = "idle"
        self.samples: list[tuple[str, float, dict[str, int]]] = []
        self.stop = threading.Event()
        self.at_peak: tuple[str, list[tuple[str, int, int]]] = ("", [])

    def run(self) -> None:
        top = 0
        while not self.stop.is_set():
            try:
                s = status(self.pid)
                self.samples.append((self.phase, time.monotonic(), s))
                if s["VmRSS"] > top:  # where the resident pages are at the highest point
                    top, self.at_peak = s["VmRSS"], (self.phase, smaps(self.pid))
            except OSError:
                return
            time.sleep(self.interval)

    def peaks(self) -> dict[str, dict[str, int]]:
        """Per phase, the largest value of each field (VmHWM: the last, it only grows)."""
        out: dict[str, dict[str, int]] = {}
        for phase, _, s in self.samples:
            cur = out.setdefault(phase, {})
            for k, v in s.items():
                cur[k] = max(cur.get(k, 0), v)
        return out


def one_run(server: s3server.S3Server, src: Path, base: Path, n: int) -> dict[str, Any]:
    """Start a daemon on a fresh root holding (hard links to) the checkpoint; register; wait."""
    shutil.rmtree(base, ignore_errors=True)
    root = base / "root"
    (root / "step-1").mkdir(parents=True)
    for f in FILES:
        os.link(src / f, root / "step-1" / f)
    evict(root)
    upload = {"url": server.url(f"daemon-rss-r{n}"), "endpoint": server.endpoint,
              "region": server.region, "access_key_id": server.access_key,
              "secret_access_key": server.secret_key}
    lay = write_layout(base, Path(f"/tmp/ckptd-rss-{os.getpid()}.sock"),
                       [{"name": "bench", "path": str(root), "layout": "registered",
                         "upload": upload}], log_level="info")
    log = open(base / "daemon.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "ckptd", "run", "--config", str(lay.config)],
                            stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, AWS_EC2_METADATA_DISABLED="true"))
    sampler = Sampler(proc.pid)
    try:
        client = Client(lay.socket, timeout=10.0)
        deadline = time.monotonic() + 60
        while client.health() is None:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit(f"daemon did not start: {(base / 'daemon.log').read_text()}")
            time.sleep(0.1)
        time.sleep(1.0)
        sampler.start()
        time.sleep(1.0)
        started = time.monotonic()
        sampler.phase = "validate+compress"
        client.register("bench", 1, [f"step-1/{f}" for f in FILES])
        if not client.wait("bench", 1, "valid", timeout=900):
            raise SystemExit("not valid")
        valid = time.monotonic()
        sampler.phase = "upload"
        if not client.wait("bench", 1, "uploaded", timeout=900):
            raise SystemExit(f"not uploaded: {(base / 'daemon.log').read_text()[-3000:]}")
        done = time.monotonic()
        sampler.phase = "after"
        time.sleep(1.0)
        torch = torch_loaded(proc.pid)
    finally:
        sampler.stop.set()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    peaks = sampler.peaks()
    hwm = max(s["VmHWM"] for _, _, s in sampler.samples)
    return {"valid_s": valid - started, "upload_s": done - valid, "total_s": done - started,
            "vm_hwm": hwm, "torch_loaded": torch, "peaks": peaks, "at_peak": sampler.at_peak}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="2GB")
    p.add_argument("--workdir", type=Path, default=HERE / "out" / "upload")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    root, _ = build_inputs(workdir, parse_size(args.size))
    weed = workdir / "weed-rss"
    shutil.rmtree(weed, ignore_errors=True)
    server = s3server.start_server(weed)
    runs = []
    try:
        for n in range(args.repeat):
            runs.append(one_run(server, root / "step-1", workdir / "daemon-rss", n))
    finally:
        s3server.stop_server(server)
        shutil.rmtree(weed, ignore_errors=True)
        shutil.rmtree(workdir / "daemon-rss", ignore_errors=True)
    report(runs, args)


def report(runs: list[dict[str, Any]], args: argparse.Namespace) -> None:
    mib = 1 << 20
    print("command: python " + " ".join(sys.argv))
    print("| run | phase | VmRSS peak | RssAnon peak | RssFile peak | VmHWM | s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for n, r in enumerate(runs):
        secs = {"validate+compress": r["valid_s"], "upload": r["upload_s"]}
        for phase, pk in r["peaks"].items():
            s = f"{secs[phase]:.1f}" if phase in secs else ""
            print(f"| {n} | {phase} | {pk['VmRSS'] / mib:.0f} MiB | {pk['RssAnon'] / mib:.0f} MiB"
                  f" | {pk['RssFile'] / mib:.0f} MiB | {pk['VmHWM'] / mib:.0f} MiB | {s} |")
        print(f"run {n}: peak (VmHWM) {r['vm_hwm'] / mib:.0f} MiB, total {r['total_s']:.1f} s, "
              f"torch mapped in the daemon: {r['torch_loaded']}")
        phase, maps = r["at_peak"]
        print(f"run {n}: largest mappings at the highest VmRSS ({phase}): " + ", ".join(
            f"{Path(name).name} {rss / mib:.0f} MiB" for name, rss, _ in maps))
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
