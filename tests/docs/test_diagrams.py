"""The pictures are the code's and the table's: DESIGN.md's lifecycle diagram shows every
transition of the table, its architecture diagram the import contract's layers and the real
imports between packages, both as `tools/diagrams.py` draws them now; docs/performance.svg has
a bar for each ratio of PERFORMANCE.md's `make bench` table, as `bench/plot.py` draws it."""

from __future__ import annotations

import importlib.util
import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from types import ModuleType

from support.docs import DOCS, ROOT

from ckptd.lifecycle.table import NEW, TABLE, Row, Transition


def _tool(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.replace("/", "_")[:-3], ROOT / path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


diagrams = _tool("tools/diagrams.py")
plot = _tool("bench/plot.py")
ARROW = re.compile(r"^\s*(\S+) --> (\S+)(?: : (.*))?$")


def arrows(mermaid: str) -> dict[tuple[str, str], set[str]]:
    """(from, to) -> the events on the arrow, for each arrow of a diagram."""
    out: dict[tuple[str, str], set[str]] = defaultdict(set)
    for line in mermaid.splitlines():
        m = ARROW.match(line)
        if m:
            out[(m[1], m[2])] |= {e.strip() for e in (m[3] or "").split(",") if e.strip()}
    return dict(out)


def test_design_md_holds_the_diagrams_as_drawn_now() -> None:
    held = diagrams.in_design((DOCS / "DESIGN.md").read_text())
    for name, body in diagrams.render().items():
        assert held[name] is not None, f"DESIGN.md has no '<!-- generated: {name} -->' block"
        assert held[name] == diagrams.fenced(body), (
            f"DESIGN.md's {name} diagram is out of date: run {diagrams.COMMAND}")


def test_every_transition_of_the_table_is_drawn() -> None:
    """Each transition is an arrow between the boxes of its states, or an arrow inside its box
    for each word it changes, or (changing nothing) a loop or the box's note."""
    text = diagrams.lifecycle_mermaid()
    drawn = arrows(text)
    notes = dict(re.findall(r"note right of (\w+) : (.*)", text))
    missing = []
    for (source, event), out in TABLE.items():
        if not isinstance(out, Transition):
            continue
        frm = "[*]" if source is NEW else str(source.state)
        want: list[tuple[str, str]] = []
        if out.row is Row.SUPERSEDE:
            want = [(frm, "superseded")]
        elif out.row is Row.DELETE:
            want = [(frm, "forgotten")]
        elif source is None or source.state != out.to.state:
            want = [(frm, str(out.to.state))]
        elif source != out.to:
            want = [(diagrams.state_id(frm, d, diagrams.dim_value(source, d)),
                     diagrams.state_id(frm, d, diagrams.dim_value(out.to, d)))
                    for d in diagrams.DIMENSIONS
                    if diagrams.dim_value(source, d) != diagrams.dim_value(out.to, d)]
        else:
            loops = [(a, b) for (a, b), evs in drawn.items()
                     if a == b and event.value in evs and a.startswith(frm)]
            if loops or event.value in notes.get(frm, "").split(" leaves")[0].split(", "):
                continue
            missing.append(f"{event} from {source}: no loop or note")
            continue
        missing += [f"{event} from {source}: {a} --> {b}" for a, b in want
                    if event.value not in drawn.get((a, b), set())]
    assert not missing, f"transitions the state diagram does not show: {missing}"
    # and nothing drawn that the table does not have
    events = {e for evs in drawn.values() for e in evs}
    noted = {e for note in notes.values() for e in note.split(" leaves")[0].split(", ")}
    table = {e.value for (_, e), o in TABLE.items() if isinstance(o, Transition)}
    assert events <= table and events | noted == table


def _closure(edges: set[tuple[str, str]]) -> set[tuple[str, str]]:
    succ: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        succ[a].add(b)
    out = set()
    for start in list(succ):
        todo, seen = list(succ[start]), set()
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo.extend(succ[n])
        out |= {(start, n) for n in seen}
    return out


def test_the_architecture_is_the_contract_and_the_imports() -> None:
    text = diagrams.architecture_mermaid()
    layers = diagrams.contract_layers()
    names = dict(re.findall(r'(pkg_\w+)\["([^"]+)"\]', text))
    assert sorted(names.values()) == sorted(p for layer in layers for p in layer)
    drawn = {(names[a], names[b]) for a, b in arrows(text)}
    real = diagrams.package_imports()
    assert drawn <= real, f"arrows with no import behind them: {sorted(drawn - real)}"
    assert _closure(drawn) == _closure(real), "the arrows do not reach what the imports reach"
    rank = {p: i for i, layer in enumerate(layers) for p in layer}
    assert all(rank[a] < rank[b] for a, b in drawn), "an arrow points up or across a layer"
    assert ("cli", "daemon") in drawn and ("daemon", "service") in drawn


def test_check_mode_names_the_command(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """A stale block makes `--check` fail with the command that redraws it."""
    stale = tmp_path / "DESIGN.md"
    text = (DOCS / "DESIGN.md").read_text()
    stale.write_text(text.replace("stateDiagram-v2\n", "stateDiagram-v2\n    old --> older\n", 1))
    monkeypatch.setattr(diagrams, "DESIGN", stale)
    assert diagrams.main(["--check"]) == 1
    assert "make diagrams" in capsys.readouterr().out
    assert diagrams.main([]) == 0 and stale.read_text() == text


def test_the_performance_plot_has_a_bar_per_ratio_row() -> None:
    doc = (DOCS / "PERFORMANCE.md").read_text()
    table = doc.split("<!-- make-bench:begin -->")[1].split("<!-- make-bench:end -->")[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()
            if line.startswith("| ")]
    col = rows[0].index("ckptd / baseline")
    ratios = [r for r in rows[1:] if re.match(r"(?:[a-z]+ )?\d", r[col])
              and "MiB" not in r[col].split("(")[0]]
    svg = ET.parse(DOCS / "performance.svg").getroot()  # well-formed, or this raises
    ns = "{http://www.w3.org/2000/svg}"
    assert svg.tag == f"{ns}svg"
    bars = [r for r in svg.iter(f"{ns}rect") if r.get("class") == "bar"]
    assert len(bars) == len(ratios) >= 8, (len(bars), len(ratios))
    assert [b.findtext(f"{ns}title", "").rsplit(": ", 1)[0] for b in bars] == [r[0] for r in ratios]
    # A goal marker for every row whose goal is a ratio (a row may show a ratio with no goal:
    # "against today's way", or the start-up row's import share).
    goal_col = rows[0].index("goal")
    with_goal = [r for r in ratios if plot._GOAL.search(r[goal_col])]
    assert len(with_goal) >= 8
    assert len([p for p in svg.iter(f"{ns}path") if p.get("class") == "goal"]) == len(with_goal)
    assert "(performance.svg)" in doc, "PERFORMANCE.md does not show the plot"
    assert (DOCS / "performance.svg").read_text() == plot.svg(plot.bars(doc)), (
        "docs/performance.svg is not the table's: run python bench/plot.py")


def test_the_plot_reads_ratios_goals_and_verdicts() -> None:
    doc = "\n".join([
        "<!-- make-bench:begin -->",
        "| measure | baseline | baseline | ckptd | ckptd / baseline | goal | verdict |",
        "|---|---|---|---|---|---|---|",
        "| save | aws | 30 s | 17 s | wall 0.59 (0.54–0.82, 3 runs); bytes 0.883 | ≤ 0.5× wall |"
        " **not met** |",
        "| rss | — | — | 171 MiB | — | ≤ 200 MiB | **met** |",
        "| bf16 | zipnn |  |  | 0.9994× zipnn's size (0.9989–0.9998, 2 inputs) |"
        " ≤ zipnn's on every input | **met** |",
        "| speed | zipnn |  |  | 1.94× zipnn's MB/s/core (1.19–2.69, 2 inputs) | keep ≥ 1.2× |"
        " **met** |",
        "| resume rss | — | — | — | +40 MiB (+38–+41, 3 runs) | ≤ +128 MiB | **met** |",
        "<!-- make-bench:end -->"])
    got = [(b.measure, b.ratio, b.low, b.high, b.goal, b.goal_text, b.met)
           for b in plot.bars(doc)]
    assert got == [("save", 0.59, 0.54, 0.82, 0.5, "≤ 0.5×", False),
                   ("bf16", 0.9994, 0.9989, 0.9998, 1.0, "≤ 1.0×", True),
                   ("speed", 1.94, 1.19, 2.69, 1.2, "≥ 1.2×", True)]
    ET.fromstring(plot.svg(plot.bars(doc)))
