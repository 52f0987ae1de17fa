"""Pins kept beside each root (`<root>/.ckptd/pins.json`), so a lost state database never
loses them: written after every pin or unpin, read at start.

Owns the file's format; the store holds the pins the daemon acts on.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ckptd import fileio, inputs
from ckptd.errors import BadInput, Malformed, UnsafePath
from ckptd.log import get_logger
from ckptd.model import CKPTD_DIR

FORMAT = "ckptd-pins/1"
PINS_FILE = "pins.json"
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
            raise Malformed("not a ckptd pins file")
        return {inputs.check_int(s, f"{path}: a pinned step") for s in steps}
    except FileNotFoundError:
        return set()
    except (OSError, ValueError, BadInput, UnsafePath) as exc:
        get_logger().warning("pins_unreadable", path=str(path), error=str(exc))
        return set()


def _read_beside(root: Path) -> Any:
    """pins.json opened beneath the root (`fileio.open_beneath`: no link followed anywhere,
    a regular file only), then read and parsed by the bounded reader."""
    fd = fileio.open_beneath(root, f"{CKPTD_DIR}/{PINS_FILE}")
    try:
        return inputs.loads(inputs.read_fd(fd, inputs.PINS, str(pins_path(root))),
                            str(pins_path(root)))
    finally:
        os.close(fd)


def write_pins(root: Path, steps: set[int]) -> None:
    path = pins_path(root)
    path.parent.mkdir(exist_ok=True)
    fileio.atomic_write_json(path, {"format": FORMAT, "steps": sorted(steps)})
