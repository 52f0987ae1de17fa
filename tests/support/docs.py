"""What the doc checks share: where the docs are, their lines with `file:line`, the code spans
in them, and the spec beside the checkout (skipped where a clean clone has none)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SPEC = ROOT.parent / "shared" / "SPEC.md"
SPAN = re.compile(r"`([^`\n]+)`")
MiB = 1024 * 1024


def name(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def where(path: Path, text: str, offset: int) -> str:
    """`file:line` of `offset` in `text`, the contents of `path`."""
    return f"{name(path)}:{text.count(chr(10), 0, offset) + 1}"


def doc_lines(*paths: Path) -> Iterator[tuple[str, str]]:
    """(`file:line`, line) of each doc."""
    for path in paths:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            yield f"{name(path)}:{n}", line


def all_docs() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def spec() -> Path:
    if not SPEC.exists():
        pytest.skip(f"{SPEC} is not beside this checkout (a clean clone has no ../shared)")
    return SPEC
