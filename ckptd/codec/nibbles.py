"""Exponent nibbles (container version 2, plane method 2; docs/FORMAT.md "Exponent nibbles").

The top plane of a float block minus a per-block `base`, two 4-bit values per byte; 15 marks an
element whose exponent lies outside base..base+14, its value kept in an escape list in element
order. Owns packing and unpacking only (numpy, no loops per element); knows nothing of zstd,
framing or I/O.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ckptd.codec.planes import Plane, Workspace

NIBBLE_ESCAPE = 15
MAX_NIBBLE_BASE = 255 - NIBBLE_ESCAPE


def nibble_base(top: Plane) -> tuple[int, float]:
    """The base whose window base..base+14 holds most of `top`, and the share it holds."""
    hist = np.bincount(top, minlength=256)
    window = np.convolve(hist, np.ones(NIBBLE_ESCAPE, dtype=np.int64), "valid")
    base = int(np.argmax(window[: MAX_NIBBLE_BASE + 1]))
    return base, float(window[base]) / max(len(top), 1)


def pack_nibbles(top: Plane, base: int, ws: Workspace) -> tuple[Plane, Plane]:
    """(pairs, escapes): byte k of pairs holds elements 2k (low nibble) and 2k+1 (high nibble).

    An odd count leaves the last high nibble 0. `escapes` are the elements coded as 15, in order.
    """
    count = len(top)
    pairs = (count + 1) // 2
    sub = ws.get("nib_sub", np.uint8, 2 * pairs)
    np.subtract(top, np.uint8(base), out=sub[:count])
    sub[count:] = 0
    mask = ws.get("nib_mask", np.bool_, count)
    np.greater_equal(sub[:count], NIBBLE_ESCAPE, out=mask)
    # Positions, then fancy indexing on those few: 0.55 ms per 2 M elements against 0.85 ms
    # for a boolean gather plus a masked copy, and 2 ms for np.minimum.
    where = np.flatnonzero(mask)
    escapes: Plane = top[where]
    sub[where] = NIBBLE_ESCAPE
    both = sub.view(np.uint16)  # little-endian: element 2k in the low byte, 2k+1 in the high
    mixed = ws.get("nib_mixed", np.uint16, pairs)
    np.right_shift(both, 4, out=mixed)
    mixed |= both
    packed = ws.get("nib_pairs", np.uint8, pairs)
    np.copyto(packed, mixed, casting="unsafe")
    return packed, escapes


class NibblePlane:
    """The top plane rebuilt from nibble pairs one chunk at a time, as `planes.merge` asks.

    After a merge, `marks` is the number of 15s met; escapes are applied only while they match
    the list, so a caller that finds `marks != len(escapes)` knows the plane is corrupt.
    """

    def __init__(self, pairs: Plane, base: int, count: int, escapes: Plane) -> None:
        self.pairs, self.base, self.count, self.escapes = pairs, base, count, escapes
        self.marks = 0

    def __len__(self) -> int:
        return self.count

    def chunk(self, start: int, stop: int, ws: Workspace) -> Plane:
        """Elements start..stop-1 (`start` even), in a workspace array."""
        pairs = self.pairs[start // 2 : (stop + 1) // 2]
        wide = ws.get("nib_wide", np.uint16, len(pairs))
        np.left_shift(pairs, 4, out=wide, dtype=np.uint16)
        np.bitwise_or(wide, pairs, out=wide)
        wide &= 0x0F0F  # element 2k in the low byte, 2k+1 in the high: little-endian order
        top: Plane = wide.view(np.uint8)[: stop - start]
        # With no escapes declared, a stray 15 (corruption) decodes to base+15 and the block's
        # raw checksum rejects it: no search on the common path.
        marks: npt.NDArray[np.intp] = np.empty(0, np.intp)
        if len(self.escapes):
            mask = ws.get("nib_mask", np.bool_, len(top))
            marks = np.flatnonzero(np.equal(top, NIBBLE_ESCAPE, out=mask))
        wide += np.uint16(self.base * 0x0101)
        if len(marks):
            values = self.escapes[self.marks : self.marks + len(marks)]
            if len(values) == len(marks):
                top[marks] = values
            self.marks += len(marks)
        return top


def unpack_nibbles(
    pairs: Plane, base: int, count: int, escapes: Plane, ws: Workspace
) -> tuple[Plane, int]:
    """Inverse of `pack_nibbles` in one piece: the top plane (in `ws`) and the 15s it held."""
    plane = NibblePlane(pairs, base, count, escapes)
    return plane.chunk(0, count, ws), plane.marks
