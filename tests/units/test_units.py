"""Durations, sizes, rates and free-space amounts: every accepted form, refusals, round trips."""

from __future__ import annotations

import pytest

from ckptd.units import (
    FreeSpace,
    format_duration,
    format_size,
    parse_duration,
    parse_free,
    parse_rate,
    parse_size,
)

KiB, MiB, GiB = 1024, 1024**2, 1024**3


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("500ms", 0.5),
        ("30s", 30.0),
        ("5m", 300.0),
        ("2h", 7200.0),
        ("7d", 604800.0),
        ("1h30m", 5400.0),
        ("1h 30m", 5400.0),
        ("1d2h3m4s5ms", 93784.005),
        ("1.5h", 5400.0),
        (".5s", 0.5),
        (" 10s ", 10.0),
        ("0", 0.0),
        ("0s", 0.0),
        (0, 0.0),
        (0.0, 0.0),
    ],
)
def test_parse_duration(text: str | float, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ("5", "has no unit"),
        (5, "has no unit"),
        (1.5, "has no unit"),
        ("5x", "is not a duration"),
        ("", "is not a duration"),
        ("s", "is not a duration"),
        ("1h30", "is not a duration"),
        ("-1s", "is not a duration"),
        ("5 minutes", "is not a duration"),
        (True, "is not a duration"),
        (None, "is not a duration"),
    ],
)
def test_parse_duration_refuses(bad: object, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_duration(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("512", 512),
        (512, 512),
        ("0", 0),
        ("512B", 512),
        ("10KB", 10_000),
        ("10kb", 10_000),
        ("10K", 10_000),
        ("200GB", 200 * 1000**3),
        ("2TB", 2 * 1000**4),
        ("64MiB", 64 * MiB),
        ("64mib", 64 * MiB),
        ("64Mi", 64 * MiB),
        ("1.5GiB", 3 * GiB // 2),
        ("1KiB", KiB),
        ("3 MB", 3_000_000),
        ("1.5KB", 1500),
    ],
)
def test_parse_size(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ("64 MiBs", "is not a size"),
        ("ten", "is not a size"),
        ("", "is not a size"),
        ("-5MB", "is not a size"),
        (-5, "negative"),
        ("1.5", "whole number of bytes"),
        ("1.0001KiB", "whole number of bytes"),
        (1.5, "is not a size"),
        (True, "is not a size"),
    ],
)
def test_parse_size_refuses(bad: object, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_size(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "rate"),
    [("200MB/s", 200_000_000), ("1GiB/s", GiB), ("512/s", 512), ("10 KiB/s", 10 * KiB)],
)
def test_parse_rate(text: str, rate: int) -> None:
    assert parse_rate(text) == rate


@pytest.mark.parametrize("bad", ["200MB", "fast/s", "0MB/s", "", "/s", 5])
def test_parse_rate_refuses(bad: object) -> None:
    with pytest.raises(ValueError, match="rate"):
        parse_rate(bad)  # type: ignore[arg-type]


def test_parse_free_percent_and_bytes() -> None:
    assert parse_free("10%") == FreeSpace(percent=10.0)
    assert parse_free("2.5 %") == FreeSpace(percent=2.5)
    assert parse_free("0%") == FreeSpace(percent=0.0)
    assert parse_free("50GiB") == FreeSpace(bytes=50 * GiB)
    assert parse_free(1024) == FreeSpace(bytes=1024)


@pytest.mark.parametrize("bad", ["100%", "-1%", "ten%", "%", "lots", True])
def test_parse_free_refuses(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_free(bad)  # type: ignore[arg-type]


def test_free_space_required_rounds_up() -> None:
    assert FreeSpace(percent=10.0).required(1001) == 101
    assert FreeSpace(percent=0.0).required(10**12) == 0
    assert FreeSpace(bytes=5 * GiB).required(1) == 5 * GiB


def test_free_space_is_one_thing() -> None:
    with pytest.raises(ValueError):
        FreeSpace()
    with pytest.raises(ValueError):
        FreeSpace(bytes=1, percent=1.0)


@pytest.mark.parametrize(
    ("size", "exact"),
    [
        (0, "0B"),
        (512, "512B"),
        (1000, "1KB"),
        (1024, "1KiB"),
        (64 * MiB, "64MiB"),
        (200 * 1000**3, "200GB"),
        (3 * GiB // 2, "1.5GiB"),
        (1234567, "1234567B"),
    ],
)
def test_format_size_exact_round_trips(size: int, exact: str) -> None:
    assert format_size(size, exact=True) == exact
    assert parse_size(exact) == size


@pytest.mark.parametrize(
    ("size", "human"),
    [(512, "512B"), (1536, "1.5KiB"), (64 * MiB, "64MiB"), (200 * 1000**3, "186.26GiB")],
)
def test_format_size_for_humans(size: int, human: str) -> None:
    assert format_size(size) == human


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.5, "500ms"),
        (30, "30s"),
        (90, "1m30s"),
        (5400, "1h30m"),
        (604800, "7d"),
        (1.1, "1s100ms"),
        (93784.005, "1d2h3m4s5ms"),
        (0.0001, "0.1ms"),
    ],
)
def test_format_duration_round_trips(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
    assert parse_duration(text) == pytest.approx(seconds)


def test_free_space_renders_back() -> None:
    assert str(FreeSpace(percent=10.0)) == "10%"
    assert str(FreeSpace(percent=2.5)) == "2.5%"
    assert str(FreeSpace(bytes=50 * GiB)) == "50GiB"
