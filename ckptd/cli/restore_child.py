"""`python -m ckptd.cli.restore_child ROOT STEP TO [--root-dir D] [--config C]`: one step
restored for `ckptd.torch.load` in a child process, so the training process never imports the
backends, the config or the object-store library. Answers one JSON line (`restore.answer`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ckptd.errors import CkptdError
from ckptd.restore import answer
from ckptd.restore.files import restore_checkpoint


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckptd.cli.restore_child")
    p.add_argument("root")
    p.add_argument("step", type=int)
    p.add_argument("to", type=Path)
    p.add_argument("--root-dir", type=Path)
    p.add_argument("--config", type=Path)
    args = p.parse_args(argv)
    try:
        paths = restore_checkpoint(args.root, args.step, args.to, args.root_dir, args.config)
    except CkptdError as exc:
        print(answer.failed(exc))
        return 1
    print(answer.done([str(p) for p in paths]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
