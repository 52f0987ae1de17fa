"""Commit latency of a multi-node root, beside the single-node commit of the same save.

Three `ckptd run` daemons (nodes n0..n2, own root/state/socket, one file:// remote) watch a real
3-rank gloo DCP job that saves STEPS steps, rank r into node r's root. For each step: the time
from the last part landing (`_parts/*.json`, newest mtime) to `MANIFEST.json`, and from the
coordinator's `.metadata` to `MANIFEST.json`. Beside it, one daemon with `nodes = 1` watches the
same job writing every rank into one root: `.metadata` to `MANIFEST.json`. All mtimes are this
machine's clock.

    PYTHONPATH=.:tests python bench/multinode_commit_bench.py [STEPS]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.config import write_layout  # noqa: E402
from support.proc import DaemonHandle  # noqa: E402
from support.wait import wait_until  # noqa: E402
from test_multinode import WORLD, Nodes, dcp_save  # noqa: E402

KEEP = {"local": {"keep_last": 100}}  # every step stays on disk to be measured


def _committed(remote: Path, step: int) -> bool:
    return (remote / "job" / f"step-{step}" / "MANIFEST.json").exists()


def multi(base: Path, steps: list[int]) -> list[tuple[float, float]]:
    remote = base / "remote"
    cluster = Nodes(base, Path(tempfile.mkdtemp(prefix="ckb-")), {"url": f"file://{remote}"},
                    retention=KEEP)
    cluster.start()
    try:
        dcp_save(cluster.roots(), *steps)
        for s in steps:
            wait_until(lambda s=s: _committed(remote, s), 120, f"step {s} committed")
    finally:
        cluster.stop()
    out = []
    for s in steps:
        d = remote / "job" / f"step-{s}"
        last_part = max(p.stat().st_mtime for p in (d / "_parts").glob("*.json"))
        manifest = (d / "MANIFEST.json").stat().st_mtime
        meta = (cluster.root(0) / f"step-{s}" / ".metadata").stat().st_mtime
        out.append((manifest - last_part, manifest - meta))
    return out


def single(base: Path, steps: list[int]) -> list[float]:
    remote = base / "remote"
    layout = write_layout(base, Path(tempfile.mkdtemp(prefix="ckb-")) / "d.sock",
                          [{"name": "job", "upload": {"url": f"file://{remote}"},
                            "retention": KEEP}])
    d = DaemonHandle(layout, base / "daemon.log").start()
    try:
        root = layout.roots["job"]
        dcp_save([root] * WORLD, *steps)
        for s in steps:
            wait_until(lambda s=s: _committed(remote, s), 120, f"step {s} committed")
    finally:
        d.stop()
    return [(remote / "job" / f"step-{s}" / "MANIFEST.json").stat().st_mtime
            - (root / f"step-{s}" / ".metadata").stat().st_mtime for s in steps]


def _show(name: str, xs: list[float]) -> None:
    print(f"{name:48s} median {statistics.median(xs):6.2f} s   max {max(xs):6.2f} s   n={len(xs)}")


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    steps = list(range(1, n + 1))
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        m = multi(Path(tmp) / "multi", steps)
        s = single(Path(tmp) / "single", steps)
        print(f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f};"
              f" {time.monotonic() - started:.0f} s in all")
        _show("3 nodes: last part landed -> MANIFEST.json", [a for a, _b in m])
        _show("3 nodes: .metadata -> MANIFEST.json", [b for _a, b in m])
        _show("1 node (same save): .metadata -> MANIFEST.json", s)


if __name__ == "__main__":
    main()
