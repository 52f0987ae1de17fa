"""Run a module under a CPU-weighted stack sampler: which code the process spends its CPU in.

Every `--interval` seconds a thread reads each thread's stack and its CPU clock
(`pthread_getcpuclockid`); the CPU a thread used since the last sample is charged to the stack
it is in now, so work that ends between two samples (a 4 MiB block decoded in 3 ms) is charged
to where the thread waits next: an idle pool worker's loop or a condition wait shows CPU that
was spent in the work before it. SIGUSR2 writes the stacks gathered so far to
`<out>.<n>.txt` (collapsed: one `frame;frame;... cpu_ms` line per stack, biggest first) and
starts again, so a bench can cut one file per step; the rest is written at exit. Sampling
costs the process some CPU itself (it holds the GIL while it walks the stacks), so compare
files of one run, not absolute times.

Usage: python bench/cpu_sampler.py --out PREFIX [--interval 0.005] (-m MODULE | SCRIPT) [ARGS...]
"""

from __future__ import annotations

import argparse
import atexit
import collections
import runpy
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType


class Sampler:
    def __init__(self, out: str, interval: float) -> None:
        self.out, self.interval = out, interval
        self.stacks: collections.Counter[str] = collections.Counter()
        self.cpu: dict[int, float] = {}
        self.parts = 0
        self.lock = threading.Lock()
        self.me = 0  # the sampling thread, which never samples itself

    @staticmethod
    def _stack(frame: FrameType | None) -> str:
        names = []
        while frame is not None:
            code = frame.f_code
            mod = frame.f_globals.get("__name__", "?")
            names.append(f"{mod}.{code.co_qualname}")
            frame = frame.f_back
        return ";".join(reversed(names))

    def sample(self) -> None:
        frames = sys._current_frames()  # noqa: SLF001 - the sampler's one source
        names = {t.ident: t.name for t in threading.enumerate()}
        seen = {}
        for ident, frame in frames.items():
            if ident == self.me:
                continue
            try:
                cpu = time.clock_gettime(time.pthread_getcpuclockid(ident))
            except (OSError, ProcessLookupError):
                continue
            seen[ident] = cpu
            used = cpu - self.cpu.get(ident, cpu)
            if used > 0:
                thread = names.get(ident, "?").split("(")[0].rstrip("0123456789_-")
                with self.lock:
                    self.stacks[f"[{thread}];{self._stack(frame)}"] += used
        self.cpu = seen

    def run(self) -> None:
        self.me = threading.get_ident()
        while True:
            time.sleep(self.interval)
            try:
                self.sample()
            except Exception:  # noqa: BLE001, S112 - a sample lost, never the process
                continue

    def dump(self, *_: object) -> None:
        with self.lock:
            stacks, self.stacks = self.stacks, collections.Counter()
            self.parts += 1
            n = self.parts
        with open(f"{self.out}.{n}.txt", "w") as f:
            for stack, cpu in stacks.most_common():
                f.write(f"{stack} {cpu * 1000:.1f}\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--interval", type=float, default=0.005)
    ap.add_argument("-m", dest="module")
    args, rest = ap.parse_known_args()
    if not args.module and not rest:
        ap.error("name a module (-m) or a script")
    sampler = Sampler(args.out, args.interval)
    threading.Thread(target=sampler.run, name="cpu-sampler", daemon=True).start()
    signal.signal(signal.SIGUSR2, sampler.dump)
    atexit.register(sampler.dump)
    if args.module:
        sys.argv = [args.module, *rest]
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = rest
        sys.path.insert(0, str(Path(rest[0]).resolve().parent))
        runpy.run_path(rest[0], run_name="__main__")


if __name__ == "__main__":
    main()
