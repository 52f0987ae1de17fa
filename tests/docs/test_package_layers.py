"""DESIGN.md's package map is the import contract: the same packages, in the same layers, in
the same order, as the first import-linter contract in pyproject.toml (which lint-imports
checks against the code)."""

from __future__ import annotations

import re
import tomllib

from support.docs import DOCS, ROOT


def contract_layers() -> list[set[str]]:
    """The first contract's layers, each a set of package names (`__main__` left out: the map
    lists what `ls ckptd` shows a reader)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    first = config["contracts"][0]
    assert first["type"] == "layers" and first.get("containers") == ["ckptd"], first["name"]
    layers = [{n.strip() for n in re.split(r"[|:]", layer)} - {"__main__"}
              for layer in first["layers"]]
    return [layer for layer in layers if layer]


def map_layers() -> list[set[str]]:
    """The package map's layers: the names of its first column, a blank line between layers."""
    text = (DOCS / "DESIGN.md").read_text()
    block = re.search(r"## The packages.*?```\n(.*?)```", text, re.S)
    assert block, "DESIGN.md has no package map"
    layers: list[set[str]] = [set()]
    for line in block.group(1).splitlines():
        if not line.strip():
            layers.append(set())
            continue
        head = re.match(r"(\S.*?)(?: {2,}|$)", line)
        if head:
            layers[-1] |= {n.strip().rstrip("/") for n in head.group(1).split(",")}
    return [layer for layer in layers if layer]


def test_package_map_is_the_layers_contract() -> None:
    contract, design = contract_layers(), map_layers()
    assert design == contract, (
        "DESIGN.md's package map and pyproject.toml's first import contract differ:\n"
        + "\n".join(f"  {sorted(d)}  vs  {sorted(c)}"
                    for d, c in zip(design, contract, strict=False) if d != c)
        + (f"\n  {len(design)} layers vs {len(contract)}" if len(design) != len(contract) else ""))
