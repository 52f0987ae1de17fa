"""Durations, byte sizes, rates and free-space amounts: parsing config strings, and the one
formatter of each (`format_size`, `format_duration`). Pure functions; imports nothing of ckptd,
touches no files. Bad input raises ValueError whose message is a plain sentence naming the value.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

__all__ = [
    "FreeSpace",
    "format_duration",
    "format_size",
    "parse_duration",
    "parse_free",
    "parse_rate",
    "parse_size",
    "progress_bar",
    "progress_line",
]

_DURATION_UNITS: dict[str, Decimal] = {
    "ms": Decimal("0.001"),
    "s": Decimal(1),
    "m": Decimal(60),
    "h": Decimal(3600),
    "d": Decimal(86400),
}
# Largest first: format_duration peels components off in this order.
_DURATION_ORDER = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?|\.\d+)\s*(ms|s|m|h|d)")

_SI = {"K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4, "P": 1000**5}
_IEC = {"Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4, "Pi": 1024**5}
_SIZE = re.compile(r"(\d+(?:\.\d+)?|\.\d+)\s*(?:([KMGTP]i?)B?|B)?", re.IGNORECASE)

_DURATION_HINT = 'use a number and a unit (ms, s, m, h, d), e.g. "500ms", "30s" or "1h30m"'
_SIZE_HINT = "use bytes or a unit (KB, MB, GB, TB: powers of 1000; KiB, MiB, GiB, TiB: of 1024)"


# Beyond these, a wait or an allocation would overflow somewhere: refused at the door.
MAX_DURATION_S = 10 * 365 * 86400
MAX_SIZE = 2**60


def _show(value: object) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def _is_number(value: object) -> bool:
    # bool is an int subclass, but `true` is never a sensible duration or size.
    return isinstance(value, int | float) and not isinstance(value, bool)


def parse_duration(value: str | float) -> float:
    """Seconds in a duration like "500ms", "30s", "5m", "2h", "7d" or "1h30m".

    A bare number is refused (seconds or minutes?) except 0, which is unambiguous.
    """
    if _is_number(value):
        if value == 0:
            return 0.0
        raise ValueError(f'{_show(value)} has no unit: write a string such as "{value}s"')
    if not isinstance(value, str):
        raise ValueError(f"{_show(value)} is not a duration: {_DURATION_HINT}")
    text = value.strip()
    if text == "0":
        return 0.0
    if re.fullmatch(r"\d+(\.\d+)?", text):
        raise ValueError(f'"{value}" has no unit: write e.g. "{text}s" or "{text}m"')
    total = _sum_duration_parts(text)
    if total is None:
        raise ValueError(f'"{value}" is not a duration: {_DURATION_HINT}')
    if total > MAX_DURATION_S:
        raise ValueError(f'"{value}" is longer than ckptd handles (at most 10 years)')
    return float(total)


def _sum_duration_parts(text: str) -> Decimal | None:
    pos, total, seen = 0, Decimal(0), False
    while pos < len(text):
        match = _DURATION_PART.match(text, pos)
        if match is None:
            return None
        total += Decimal(match.group(1)) * _DURATION_UNITS[match.group(2)]
        pos = match.end()
        # Allow "1h 30m" as well as "1h30m".
        while pos < len(text) and text[pos] == " ":
            pos += 1
        seen = True
    return total if seen else None


def parse_size(value: str | int) -> int:
    """Bytes in a size like "64MiB", "200GB", "1.5GiB", "10KB" or "512" (bytes)."""
    if _is_number(value) and isinstance(value, int):
        if value < 0:
            raise ValueError(f"{value} is negative: a size must be >= 0")
        if value > MAX_SIZE:
            raise ValueError(f"{value} is larger than ckptd handles (at most 1 EiB)")
        return value
    if not isinstance(value, str):
        raise ValueError(f"{_show(value)} is not a size: {_SIZE_HINT}")
    match = _SIZE.fullmatch(value.strip())
    if match is None:
        raise ValueError(f'"{value}" is not a size: {_SIZE_HINT}')
    number, unit = Decimal(match.group(1)), match.group(2)
    exact = number * _unit_factor(unit)
    if exact != exact.to_integral_value():
        raise ValueError(f'"{value}" is not a whole number of bytes')
    if exact > MAX_SIZE:
        raise ValueError(f'"{value}" is larger than ckptd handles (at most 1 EiB)')
    return int(exact)


def _unit_factor(unit: str | None) -> int:
    if unit is None:
        return 1
    prefix = unit[0].upper() + unit[1:].lower()
    return _IEC[prefix] if prefix in _IEC else _SI[prefix]


def parse_rate(value: str) -> int:
    """Bytes per second in a rate like "200MB/s" or "1GiB/s"; must be above zero."""
    if not isinstance(value, str) or not value.strip().endswith("/s"):
        raise ValueError(f'{_show(value)} is not a rate: use a size per second, e.g. "200MB/s"')
    size = value.strip()[:-2]
    try:
        rate = parse_size(size)
    except ValueError:
        raise ValueError(f'"{value}" is not a rate: {_SIZE_HINT}, then "/s"') from None
    if rate <= 0:
        raise ValueError(f'"{value}" is not a usable rate: it must be above zero')
    return rate


@dataclass(frozen=True)
class FreeSpace:
    """Free space to keep on a filesystem: an absolute byte count or a percentage of its size."""

    bytes: int | None = None
    percent: float | None = None

    def __post_init__(self) -> None:
        if (self.bytes is None) == (self.percent is None):
            raise ValueError("a free-space amount is either bytes or a percentage, not both")
        if self.bytes is not None and self.bytes < 0:
            raise ValueError(f"{self.bytes} is negative: free space must be >= 0")
        if self.percent is not None and not 0 <= self.percent < 100:
            raise ValueError(f"{self.percent}% is out of range: a percentage must be 0 to <100")

    def required(self, total_bytes: int) -> int:
        """The free bytes wanted on a filesystem of `total_bytes`, rounded up."""
        if self.bytes is not None:
            return self.bytes
        assert self.percent is not None
        return math.ceil(total_bytes * self.percent / 100)

    def __str__(self) -> str:
        if self.bytes is not None:
            return format_size(self.bytes, exact=True)
        assert self.percent is not None
        return f"{_plain_number(self.percent)}%"


def parse_free(value: str | int) -> FreeSpace:
    """A free-space amount: a percentage of the filesystem ("10%") or a size ("50GiB")."""
    if isinstance(value, str) and value.strip().endswith("%"):
        number = value.strip()[:-1].strip()
        try:
            percent = float(Decimal(number))
        except InvalidOperation:
            raise ValueError(f'"{value}" is not a percentage: use e.g. "10%"') from None
        if not 0 <= percent < 100:
            raise ValueError(f'"{value}" is out of range: a percentage must be from 0 to below 100')
        return FreeSpace(percent=percent)
    try:
        return FreeSpace(bytes=parse_size(value))
    except ValueError:
        raise ValueError(
            f"{_show(value)} is not a free-space amount: use a percentage of the filesystem "
            f'("10%") or a size ("50GiB")'
        ) from None


def _plain_number(number: float | Decimal) -> str:
    """A number without exponent or trailing zeros: 10.0 -> "10", 2.50 -> "2.5"."""
    text = format(Decimal(repr(number)) if isinstance(number, float) else number, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text


def format_size(n: int, *, exact: bool = False) -> str:
    """A byte count: ckptd's one way of showing a size to a person, in powers of 1024 rounded
    to two decimals ("1.5GiB", "186.26GiB", "512B").

    With `exact`, a different job: the config round trip (`ckptd config` printing a value back
    into a file), which must not round. The shortest spelling parse_size maps back to exactly
    `n`, in whichever unit family gives it ("64MiB", "200GB", "1234567B").
    """
    if exact:
        return _exact_size(n)
    for prefix, factor in sorted(_IEC.items(), key=lambda item: -item[1]):
        if abs(n) >= factor:
            return f"{_plain_number(round(Decimal(n) / factor, 2))}{prefix}B"
    return f"{n}B"


def _exact_size(n: int) -> str:
    # Shortest exact spelling wins, so 67108864 -> "64MiB" and 200000000000 -> "200GB".
    best = f"{n}B"
    for prefix, factor in [*_IEC.items(), *_SI.items()]:
        value = Decimal(n) / factor
        if n and value == round(value, 3):
            text = f"{_plain_number(value)}{prefix}B"
            if len(text) < len(best) or (len(text) == len(best) and "i" in text):
                best = text
    return best


def format_duration(seconds: float) -> str:
    """A duration, the one way ckptd shows one, which parse_duration reads back exactly:
    90 -> "1m30s", 0.5 -> "500ms", 0 -> "0s". For a person, round the seconds first."""
    if seconds < 0:
        return "-" + format_duration(-seconds)
    rest = Decimal(repr(float(seconds)))
    parts = []
    for unit, size in _DURATION_ORDER:
        whole = int(rest // size)
        if whole:
            parts.append(f"{whole}{unit}")
            rest -= whole * size
    if rest:
        parts.append(f"{_plain_number(rest * 1000)}ms")
    return "".join(parts) or "0s"


def progress_bar(done: int, total: int, width: int = 20) -> str:
    frac = 0.0 if total <= 0 else min(1.0, done / total)
    filled = int(frac * width)
    return f"[{'#' * filled}{'.' * (width - filled)}] {frac * 100:5.1f}%"


def progress_line(done: int, total: int, elapsed_s: float, width: int = 20) -> str:
    """One line of progress for a terminal: the bar, the bytes, the rate since the start and
    the time left at that rate ("[#####...]  25.0% 1GiB / 4GiB  100MiB/s  ETA 31s"); the rate
    and ETA read "-" until a byte has moved."""
    rate = done / elapsed_s if elapsed_s > 0 and done > 0 else 0.0
    if rate > 0:
        speed = f"{format_size(int(rate))}/s"
        eta = "ETA " + format_duration(round(max(0, total - done) / rate))
    else:
        speed, eta = "-/s", "ETA -"
    return (f"{progress_bar(done, total, width)} {format_size(done)} / {format_size(total)}"
            f"  {speed}  {eta}")
