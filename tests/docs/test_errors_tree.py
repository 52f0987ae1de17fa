"""Every exception ckptd raises comes from its one tree (`ckptd.errors`), read from the source
with `ast`: a class of its own derives from the tree; a plain ValueError or RuntimeError is
raised only where listed below, with the reason; a broad `except` re-raises, or says on its
line (or the line above) `# broad:` and why catching everything is the point there.
"""

from __future__ import annotations

import ast
import builtins
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ckptd"
TREE = "errors.py"

# (file under ckptd/, function): why the builtin stays. Kept small; a stale entry fails too.
PLAIN_RAISES = {
    ("units.py", f): "units imports nothing of ckptd (it sits beside errors in the layers"
                     " contract); its parsers back pydantic validators and argparse types,"
                     " which turn a ValueError into the field's or the argument's error"
    for f in ("parse_duration", "parse_size", "parse_rate", "parse_free", "__post_init__")
}
PLAIN = {"ValueError", "RuntimeError"}
BROAD = {"Exception", "BaseException"}


def _modules() -> Iterator[tuple[str, ast.Module, list[str]]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(text), text.splitlines()


def _name(node: ast.expr) -> str:
    """The last name of a base or a raised type (`pickle.UnpicklingError` -> its last part)."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    """Every node with the name of the innermost function holding it (`<module>` outside)."""
    def walk(node: ast.AST, where: str) -> Iterator[tuple[str, ast.AST]]:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) \
                else where
            yield inner, child
            yield from walk(child, inner)
    yield from walk(tree, "<module>")


def _builtin_exception(name: str) -> bool:
    kind = getattr(builtins, name, None)
    return isinstance(kind, type) and issubclass(kind, BaseException)


def test_every_exception_class_derives_from_the_tree() -> None:
    classes: dict[str, list[tuple[str, list[str]]]] = {}
    for rel, tree, _lines in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append((rel, [_name(b) for b in node.bases]))
    in_tree = {name for name, defs in classes.items() if any(r == TREE for r, _ in defs)}
    assert {"CkptdError", "Signal", "Interrupt"} <= in_tree

    def kind(name: str, seen: frozenset[str] = frozenset()) -> str:
        """'tree', 'foreign' (an exception from outside the tree) or '' (not an exception)."""
        if name in in_tree:
            return "tree"
        if _builtin_exception(name) or name.endswith(("Error", "Exception", "Warning")):
            return "foreign" if name not in classes else _of(name, seen)
        return _of(name, seen) if name in classes and name not in seen else ""

    def _of(name: str, seen: frozenset[str]) -> str:
        kinds = {kind(b, seen | {name}) for _rel, bases in classes[name] for b in bases}
        return "tree" if "tree" in kinds else "foreign" if "foreign" in kinds else ""

    outside = sorted(f"{rel}: class {name}({', '.join(bases)})"
                     for name, defs in classes.items() for rel, bases in defs
                     if rel != TREE and any(kind(b) == "foreign" for b in bases)
                     and not any(kind(b) == "tree" for b in bases))
    assert not outside, "exception classes outside ckptd.errors' tree:\n" + "\n".join(outside)


def test_plain_value_and_runtime_errors_only_where_listed() -> None:
    found: dict[tuple[str, str], list[int]] = {}
    for rel, tree, _lines in _modules():
        for where, node in _functions(tree):
            if isinstance(node, ast.Raise) and node.exc is not None \
                    and _name(node.exc) in PLAIN:
                found.setdefault((rel, where), []).append(node.lineno)
    unlisted = sorted(f"{rel}:{lines[0]} in {where}" for (rel, where), lines in found.items()
                      if (rel, where) not in PLAIN_RAISES)
    assert not unlisted, ("raise a class of ckptd.errors (BadValue, Malformed, ...) instead of"
                          " a plain ValueError/RuntimeError:\n" + "\n".join(unlisted))
    stale = sorted(f"{rel} {where}" for rel, where in PLAIN_RAISES if (rel, where) not in found)
    assert not stale, "allowed plain raises that are gone (drop them from the list):\n" + \
        "\n".join(stale)


def test_broad_excepts_re_raise_or_say_why() -> None:
    silent = []
    for rel, tree, lines in _modules():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ExceptHandler):
                continue
            types = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
            if not any(t is None or _name(t) in BROAD for t in types):
                continue
            if any(isinstance(n, ast.Raise) for stmt in node.body for n in ast.walk(stmt)):
                continue  # clean-up, or a translation: the failure goes on up
            said = lines[node.lineno - 1] + (lines[node.lineno - 2] if node.lineno > 1 else "")
            if "# broad:" not in said:
                silent.append(f"{rel}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not silent, ("a broad except that swallows the error: catch what can occur, or say"
                        " `# broad: why` on its line or the line above:\n" + "\n".join(silent))
