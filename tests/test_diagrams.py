"""The pictures are the code's: DESIGN.md's lifecycle diagram shows every transition of the
table, its architecture diagram the import contract's layers and the real imports between
packages, both as `tools/diagrams.py` draws them now."""

from __future__ import annotations

import importlib.util
import re
import sys
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

