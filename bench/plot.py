"""The performance table as a picture: docs/performance.svg, one horizontal bar per row of
docs/PERFORMANCE.md's `make bench` table that has a ckptd / baseline ratio, with the baseline
(1.0), each row's goal and the lowest-to-highest round.

Owns reading the ratios and goals back from the table and drawing the SVG (by hand: no plotting
library). Never measures anything and never edits PERFORMANCE.md: `make bench` (bench_all.py)
writes the table, then calls this; `python bench/plot.py` redraws from the table as it stands.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from html import escape
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "PERFORMANCE.md"
SVG = REPO / "docs" / "performance.svg"
BEGIN, END = "<!-- make-bench:begin -->", "<!-- make-bench:end -->"

# A ratio cell: an optional word ("wall"), the median, an optional ×, then "(low–high, n ...)".
_RATIO = re.compile(r"^(?:[a-z]+ )?(\d+(?:\.\d+)?)(×?)(?![\d.]| MiB)(.*)$")
_SPREAD = re.compile(r"\((\d+(?:\.\d+)?)–(\d+(?:\.\d+)?),")
_GOAL = re.compile(r"([≤≥])\s*(?:(\d+(?:\.\d+)?)×|zipnn's)")


@dataclass(frozen=True)
class Bar:
    measure: str
    ratio: float
    low: float | None
    high: float | None
    goal: float | None
    goal_text: str  # "≤ 0.5×"; "" where the goal is not a ratio
    met: bool | None


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def bars(doc: str) -> list[Bar]:
    """The rows of the `make bench` table whose ratio column holds a number, in table order."""
    block = doc.split(BEGIN, 1)[1].split(END, 1)[0] if BEGIN in doc else ""
    rows = [cells(line) for line in block.splitlines() if line.startswith("| ")]
    if not rows:
        return []
    head = rows[0]
    col = {name: head.index(name) for name in ("measure", "ckptd / baseline", "goal", "verdict")}
    out = []
    for row in rows[1:]:
        m = _RATIO.match(row[col["ckptd / baseline"]])
        if not m:
            continue
        spread = _SPREAD.search(m.group(3).split(";")[0])
        goal = _GOAL.search(row[col["goal"]])
        verdict = row[col["verdict"]].strip("*")
        out.append(Bar(
            measure=row[col["measure"]],
            ratio=float(m.group(1)),
            low=float(spread.group(1)) if spread else None,
            high=float(spread.group(2)) if spread else None,
            goal=(float(goal.group(2)) if goal.group(2) else 1.0) if goal else None,
            goal_text=(f"{goal.group(1)} {goal.group(2) or '1.0'}×" if goal else ""),
            met={"met": True, "not met": False}.get(verdict)))
    return out


# The drawing's geometry, in pixels.
WIDTH, LABEL, RIGHT, TOP, ROW, BAR = 960, 360, 130, 70, 34, 16
COLOUR = {True: "#2e7d32", False: "#e65100", None: "#757575"}


def _short(text: str, n: int = 58) -> str:
    text = re.sub(r"`", "", text)
    return text if len(text) <= n else text[: n - 1] + "…"


def svg(rows: list[Bar]) -> str:
    """The chart, deterministic for the same rows (no dates: the table above it has its own)."""
    top = max([2.0, *(b.high or b.ratio for b in rows), *(b.goal or 0 for b in rows)]) * 1.1
    plot_w = WIDTH - LABEL - RIGHT
    height = TOP + ROW * len(rows) + 50

    def x(v: float) -> float:
        return round(LABEL + plot_w * v / top, 1)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">',
        "<title>ckptd / baseline, per row of the make bench table</title>",
        f'<rect width="{WIDTH}" height="{height}" fill="#ffffff"/>',
        f'<text x="{LABEL}" y="22" font-size="14" font-weight="bold">ckptd / baseline '
        "(docs/PERFORMANCE.md, make bench)</text>",
        f'<text x="{LABEL}" y="40" fill="#555555">bar: median ratio; whisker: lowest to highest '
        "round; ◆: the row's goal; green met, orange not met</text>",
    ]
    step = 0.5 if top <= 4 else 1.0
    tick = 0.0
    while tick <= top:
        out.append(f'<line x1="{x(tick)}" y1="{TOP - 8}" x2="{x(tick)}" '
                   f'y2="{TOP + ROW * len(rows)}" stroke="#eeeeee"/>')
        out.append(f'<text x="{x(tick)}" y="{TOP + ROW * len(rows) + 16}" '
                   f'text-anchor="middle" fill="#555555">{tick:g}</text>')
        tick += step
    base = x(1.0)
    out += [f'<line x1="{base}" y1="{TOP - 12}" x2="{base}" y2="{TOP + ROW * len(rows)}" '
            'stroke="#212121" stroke-dasharray="4 3"/>',
            f'<text x="{base + 4}" y="{TOP - 14}" fill="#212121">baseline = 1.0</text>']
    for i, b in enumerate(rows):
        y = TOP + ROW * i + (ROW - BAR) / 2
        mid = round(y + BAR / 2, 1)
        out.append(f'<text x="{LABEL - 8}" y="{mid + 4}" text-anchor="end">'
                   f"<title>{escape(b.measure)}</title>{escape(_short(b.measure))}</text>")
        out.append(f'<rect class="bar" x="{LABEL}" y="{y}" width="{round(x(b.ratio) - LABEL, 1)}"'
                   f' height="{BAR}" fill="{COLOUR[b.met]}"><title>{escape(b.measure)}: '
                   f"{b.ratio:g}</title></rect>")
        if b.low is not None and b.high is not None:
            out.append(f'<line x1="{x(b.low)}" y1="{mid}" x2="{x(b.high)}" y2="{mid}" '
                       'stroke="#212121" stroke-width="1.5"/>')
        label_x = max(x(b.ratio), x(b.high or 0)) + 6
        goal = f" (goal {escape(b.goal_text)})" if b.goal_text else ""
        out.append(f'<text x="{label_x}" y="{mid + 4}" stroke="#ffffff" stroke-width="3" '
                   f'paint-order="stroke">{b.ratio:g}{goal}</text>')
        if b.goal is not None:
            gx, gy = x(b.goal), mid
            out.append(f'<path class="goal" d="M{gx} {gy - 7} L{gx + 6} {gy} L{gx} {gy + 7} '
                       f'L{gx - 6} {gy} Z" fill="#1565c0"><title>goal {escape(b.goal_text)}'
                       "</title></path>")
    out += [
        f'<text x="{LABEL}" y="{height - 10}" fill="#555555">under 1.0: less than the baseline '
        "(time, bytes); over 1.0: more (speed)</text>",
        "</svg>",
    ]
    return "\n".join(out) + "\n"


def write(doc: Path = DOC, out: Path = SVG) -> int:
    """Draw the table of `doc` into `out`; the number of bars."""
    rows = bars(doc.read_text())
    out.write_text(svg(rows))
    return len(rows)


if __name__ == "__main__":
    n = write()
    print(f"{n} bars written into {SVG}")
    sys.exit(0 if n else 1)
