"""The two Mermaid pictures of docs/DESIGN.md, drawn from the code's own tables.

Owns the drawing of the lifecycle's state diagram (from `ckptd.lifecycle.table.TABLE`) and of the
architecture diagram (the layers of the first import-linter contract in pyproject.toml, with
the real package-level imports as grimp, which lint-imports uses, finds them), and writing both
between their markers in DESIGN.md. Never decides anything itself and never touches the rest of
the document: `python tools/diagrams.py` (`make diagrams`) rewrites only the generated blocks,
`--check` only compares them.
"""

from __future__ import annotations

import re
import sys
import tomllib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout: the package beside it
    sys.path.insert(0, str(ROOT))

from ckptd.lifecycle.table import (  # noqa: E402
    STATUSES,
    TABLE,
    Event,
    Row,
    Status,
    Transition,
)

DESIGN = ROOT / "docs" / "DESIGN.md"
COMMAND = "make diagrams (python tools/diagrams.py)"
BLOCKS = ("lifecycle", "architecture")
END = "<!-- end generated -->"

# -- the lifecycle -------------------------------------------------------------------------------

# The words of a status that vary inside one state, each a region of that state's box.
DIMENSIONS = ("local", "remote", "copy")


def dim_value(s: Status, dim: str) -> str:
    if dim == "copy":
        return "held" if s.copy else "none"
    return str(getattr(s, dim))


def state_id(state: str, dim: str | None = None, value: str | None = None) -> str:
    """The diagram's id of a state's box, or of one value of one of its regions."""
    return state if dim is None else f"{state}_{dim}_{value}"


@dataclass(frozen=True)
class Lifecycle:
    """The table projected for drawing: edges between states (with their events), and per
    state the regions (dimensions with more than one value) and the edges inside each."""

    top: dict[tuple[str, str], set[str]]  # (from box, to box) -> events
    regions: dict[str, dict[str, list[str]]]  # state -> dimension -> values, in enum order
    inner: dict[tuple[str, str, str, str], set[str]]  # (state, dim, from, to) -> events
    unchanged: dict[str, set[str]]  # state -> events that leave each of its statuses as it is


# The values of each region in the order a checkpoint meets them.
VALUES = ["none", "held", "present", "compressed", "uploading", "uploaded", "pruned"]


def _order(dim: str) -> list[str]:
    return sorted({dim_value(s, dim) for s in STATUSES}, key=VALUES.index)


def project() -> Lifecycle:
    top: dict[tuple[str, str], set[str]] = defaultdict(set)
    inner: dict[tuple[str, str, str, str], set[str]] = defaultdict(set)
    same: list[tuple[Status, Event]] = []
    regions: dict[str, dict[str, list[str]]] = {}
    for st in dict.fromkeys(str(s.state) for s in STATUSES):
        members = [s for s in STATUSES if str(s.state) == st]
        regions[st] = {d: [v for v in _order(d) if v in {dim_value(s, d) for s in members}]
                       for d in DIMENSIONS}
        regions[st] = {d: vs for d, vs in regions[st].items() if len(vs) > 1}
    for (source, event), out in TABLE.items():
        if not isinstance(out, Transition):
            continue
        frm = "[*]" if source is None else str(source.state)  # None: NEW, no row yet
        if out.row is Row.SUPERSEDE:
            top[(frm, "superseded")].add(event.value)
        elif out.row is Row.DELETE:
            top[(frm, "forgotten")].add(event.value)
        else:
            assert out.to is not None
            to = str(out.to.state)
            if source is None or frm != to:
                top[(frm, to)].add(event.value)
            elif source == out.to:
                same.append((source, event))
            else:
                for d in regions[frm]:
                    a, b = dim_value(source, d), dim_value(out.to, d)
                    if a != b:
                        inner[(frm, d, a, b)].add(event.value)
    unchanged: dict[str, set[str]] = defaultdict(set)
    for source, event in same:
        # Where the event changes something elsewhere in this state, its no-change shows as a
        # loop on the source's value in that region; an event that never changes anything here
        # is listed with the state itself.
        st = str(source.state)
        dims = {d for (s2, d, _, _), evs in inner.items() if s2 == st and event.value in evs}
        for d in sorted(dims):
            v = dim_value(source, d)
            inner[(st, d, v, v)].add(event.value)
        if not dims:
            unchanged[st].add(event.value)
    return Lifecycle(dict(top), regions, dict(inner), dict(unchanged))


def _events(evs: set[str]) -> str:
    """Events in the table's own order."""
    return ", ".join(e.value for e in Event if e.value in evs)


def lifecycle_mermaid() -> str:
    p = project()
    out = ["stateDiagram-v2"]
    for st, dims in p.regions.items():
        if not dims:
            continue
        out.append(f"    state {st} {{")
        for i, (d, values) in enumerate(dims.items()):
            if i:
                out.append("        --")
            for v in values:
                out.append(f'        state "{d} {v}" as {state_id(st, d, v)}')
            for (s2, d2, a, b), evs in sorted(
                    p.inner.items(), key=lambda kv: (VALUES.index(kv[0][2]),
                                                     VALUES.index(kv[0][3]))):
                if (s2, d2) == (st, d):
                    out.append(f"        {state_id(st, d, a)} --> {state_id(st, d, b)} : "
                               f"{_events(evs)}")
        out.append("    }")
    for (a, b), evs in sorted(p.top.items(), key=lambda kv: _top_order(kv[0])):
        out.append(f"    {a} --> {b} : {_events(evs)}")
    for st, evs in p.unchanged.items():
        if p.regions.get(st):
            out.append(f"    note right of {st} : {_events(evs)} leaves every status as it is")
        else:
            out.append(f"    {st} --> {st} : {_events(evs)}")
    out += ["    superseded --> [*]", "    forgotten --> [*]"]
    return "\n".join(out) + "\n"


def _top_order(edge: tuple[str, str]) -> tuple[int, int]:
    order = ["[*]", "pending", "complete", "valid", "invalid", "superseded", "forgotten"]
    return order.index(edge[0]), order.index(edge[1])


# -- the architecture ----------------------------------------------------------------------------

def contract_layers() -> list[list[str]]:
    """The first import-linter contract's layers, top down, each its packages as listed."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    first = config["contracts"][0]
    assert first["type"] == "layers" and first.get("containers") == ["ckptd"], first["name"]
    return [[n.strip() for n in re.split(r"[|:]", layer)] for layer in first["layers"]]


def package_imports() -> set[tuple[str, str]]:
    """(importer, imported) for each pair of ckptd's packages (a top-level module counts as a
    package of one) where some module of the first imports some module of the second."""
    import grimp  # the layer checker's own graph builder; only the drawing needs it

    graph = grimp.build_graph("ckptd", cache_dir=None)
    out = set()
    for module in graph.modules:
        if not module.startswith("ckptd."):
            continue
        for imported in graph.find_modules_directly_imported_by(module):
            a, b = module.split(".")[1], imported.split(".")
            if b[0] == "ckptd" and len(b) > 1 and b[1] != a:
                out.add((a, b[1]))
    return out


def reduce(edges: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """The edges no other path implies (the layers forbid circles, so this is unique)."""
    succ: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        succ[a].add(b)

    def reaches(a: str, b: str, skip: tuple[str, str]) -> bool:
        seen: set[str] = set()
        todo = [n for n in succ[a] if (a, n) != skip]
        while todo:
            n = todo.pop()
            if n == b:
                return True
            if n not in seen:
                seen.add(n)
                todo.extend(succ[n])
        return False

    return {(a, b) for a, b in edges if not reaches(a, b, (a, b))}


def node_id(package: str) -> str:
    return "pkg_" + package.strip("_")


def architecture_mermaid() -> str:
    layers = contract_layers()
    out = ["flowchart TB"]
    for i, layer in enumerate(layers, 1):
        out.append(f'    subgraph layer{i} ["layer {i}"]')
        out.append("        direction LR")
        out += [f'        {node_id(p)}["{p}"]' for p in layer]
        out.append("    end")
    # Unseen links keep the layers in the contract's order, top down.
    out += [f"    layer{i} ~~~ layer{i + 1}" for i in range(1, len(layers))]
    rank = {p: i for i, layer in enumerate(layers) for p in layer}
    edges = sorted(reduce(package_imports()), key=lambda e: (rank[e[0]], e[0], rank[e[1]], e[1]))
    out += [f"    {node_id(a)} --> {node_id(b)}" for a, b in edges]
    return "\n".join(out) + "\n"


# -- DESIGN.md -----------------------------------------------------------------------------------

def render() -> dict[str, str]:
    return {"lifecycle": lifecycle_mermaid(), "architecture": architecture_mermaid()}


def _block(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- generated: {name} -->\n)(.*?)({re.escape(END)})", re.S)


def fenced(body: str) -> str:
    return f"```mermaid\n{body}```\n"


def in_design(text: str) -> dict[str, str | None]:
    """The body of each generated block as DESIGN.md holds it (None: no such block)."""
    found = {name: _block(name).search(text) for name in BLOCKS}
    return {name: m.group(2) if m else None for name, m in found.items()}


def write(text: str, drawn: dict[str, str]) -> str:
    for name, body in drawn.items():
        def put(m: re.Match[str], body: str = body) -> str:
            return m.group(1) + fenced(body) + m.group(3)

        text, n = _block(name).subn(put, text)
        if n != 1:
            raise SystemExit(f"{DESIGN}: expected one '<!-- generated: {name} -->' block")
    return text


def main(argv: list[str]) -> int:
    text = DESIGN.read_text()
    new = write(text, render())
    if "--check" in argv:
        if new != text:
            print(f"{DESIGN.name}'s generated diagrams are out of date: run {COMMAND}")
            return 1
        return 0
    if new != text:
        DESIGN.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
