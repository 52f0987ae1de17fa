"""One rescan of a root that keeps K finished steps, as the scan service runs it: a real inotify
watcher on the root (its events only mark what changed), K DCP-named steps of N files each.

Per K, best of --repeat: `quiet` is a rescan with nothing changed; `write` a rescan after one
file of the newest step was rewritten in place (what each scan sees while a step is written).
Run with PYTHONPATH at two trees to compare them in one shell run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from ckptd.clock import SYSTEM
from ckptd.model import RootOptions
from ckptd.watch.inotify import Inotify
from ckptd.watch.scanner import RootScanner

SETTLE_S = 0.05  # for the watcher's thread to read the events of a write


def write_step(root: Path, step: int, files: int) -> Path:
    d = root / f"step-{step}"
    d.mkdir()
    for i in range(files):
        (d / f"__0_{i}.distcp").write_bytes(b"y")
    (d / ".metadata").write_bytes(b"x")
    return d


def timed_scan(sc: RootScanner, now: float) -> float:
    t = time.perf_counter()
    sc.scan(now)
    return time.perf_counter() - t


def measure(root: Path, k: int, files: int, repeat: int) -> dict[str, float]:
    watcher = Inotify(lambda: None, SYSTEM)
    watcher.start()
    try:
        sc = RootScanner("r", root, "dcp", RootOptions(settle=0.0))
        watcher.watch(root, sc.open_files)
        newest = root / f"step-{k * 100}" / "__0_0.distcp"
        now = time.time()
        for i in range(3):  # the first walks list every directory; then listings are reused
            sc.scan(now + i)
        quiet = min(timed_scan(sc, now + 3 + i) for i in range(repeat))
        write = []
        for i in range(repeat):
            newest.write_bytes(b"z" * (i + 2))
            time.sleep(SETTLE_S)
            write.append(timed_scan(sc, now + 10 + i))
        return {"k": k, "quiet_ms": quiet * 1000, "write_ms": min(write) * 1000}
    finally:
        watcher.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--max-k", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="ckptd-rescan-"))
    rows = []
    try:
        for k in range(1, args.max_k + 1):
            write_step(base, k * 100, args.files)
            rows.append(measure(base, k, args.files, args.repeat))
            r = rows[-1]
            print(f"K={k}: quiet {r['quiet_ms']:.1f} ms, write {r['write_ms']:.1f} ms", flush=True)
    finally:
        shutil.rmtree(base)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
