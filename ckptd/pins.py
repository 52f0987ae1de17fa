"""Pins kept beside each root (`<root>/.ckptd/pins.json`), so a lost state database never
loses them: written after every pin or unpin, read at start.

Owns the file's format; the store holds the pins the daemon acts on.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

from ckptd import fileio, inputs
from ckptd.errors import BadInput
from ckptd.log import get_logger
from ckptd.model import CKPTD_DIR

FORMAT = "ckptd-pins/1"
PINS_FILE = "pins.json"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_BYTES = inputs.PINS.cap


def pins_path(root: Path) -> Path:
    return root / CKPTD_DIR / PINS_FILE


def read_pins(root: Path) -> set[int]:
    """The steps pinned beside `root`; a missing file is no pins, a damaged one is logged and
    read as no pins (the store's pins still stand)."""
    path = pins_path(root)
    try:  # the bounded reader: a regular file (never a FIFO or a link), strict JSON
        doc = _read_beside(root)
        steps = doc.get("steps") if isinstance(doc, dict) and doc.get("format") == FORMAT else None
        if not isinstance(steps, list):
            raise ValueError("not a ckptd pins file")
        return {inputs.check_int(s, f"{path}: a pinned step") for s in steps}
    except FileNotFoundError:
        return set()
    except (OSError, ValueError, BadInput) as exc:
        get_logger().warning("pins_unreadable", path=str(path), error=str(exc))
        return set()


def _read_beside(root: Path) -> Any:
    """pins.json read beneath the root: `.ckptd` opened without following a link (one
    leading out of the root is never read), then the file through the bounded reader."""
    rfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            dfd = os.open(CKPTD_DIR, _DIR_FLAGS, dir_fd=rfd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise BadInput(f"{root / CKPTD_DIR} is not a directory (a link is never"
                               " followed)") from None
            raise
    finally:
        os.close(rfd)
    try:
        return inputs.read_json(PINS_FILE, inputs.PINS, dir_fd=dfd)
    finally:
        os.close(dfd)


def write_pins(root: Path, steps: set[int]) -> None:
    path = pins_path(root)
    path.parent.mkdir(exist_ok=True)
    fileio.atomic_write_json(path, {"format": FORMAT, "steps": sorted(steps)})
