"""Every delete of checkpoint bytes goes through the retention executor.

A walk over ckptd/'s syntax trees finds every call that deletes (os.unlink, os.remove,
os.rmdir, shutil.rmtree, Path.unlink/rmdir, a backend's delete): each must sit in a module
or function of the allow-list below, which says why it is not a checkpoint's bytes. A new
delete anywhere else fails here. Then the executor's entry points, each behind its nets, on
real files; and the re-save of a step held as a compressed copy, on a real daemon.
"""

from __future__ import annotations

import ast
from pathlib import Path

CKPTD = Path(__file__).resolve().parent.parent / "ckptd"

# Attribute calls that delete whatever they are called on (a Path, a backend, os, shutil).
_DELETING_ATTRS = {"unlink", "rmdir", "rmtree", "removedirs", "delete"}
# Plain names that are (or wrap) a delete.
_DELETING_NAMES = {"rmtree", "unlink", "rmdir", "_remove_tree", "_unlink_quietly"}

# Whole modules allowed to delete: the executor itself, the storage primitives beneath it.
ALLOWED_MODULES = {
    "ckptd.retention.executor": "the executor: the one place checkpoint bytes are deleted",
    "ckptd.backends.base": "the storage contract (delete is one of its operations)",
    "ckptd.backends.local": "file:// backend primitive (and its own lock/temp files)",
    "ckptd.backends.objstore": "object-store backend primitive",
    "ckptd.backends.wrappers": "backend wrappers forwarding delete to the wrapped backend",
    "ckptd.backends.mapped": "backend wrapper forwarding delete",
    "ckptd.fileio": "atomic-write primitive: its own temp file",
}

# Single functions allowed to delete, with what they delete (never a checkpoint's bytes
# outside the executor's entry points).
ALLOWED_FUNCTIONS = {
    ("ckptd.stages.upload", "delete_step"):
        "the remote-step delete protocol; only ever passed to the executor "
        "(execute_remote, replace_remote) as its DeleteStep",
    ("ckptd.stages.compress", "remove_stale_staging"): "compress staging dirs a crash left",
    ("ckptd.stages.compress", "Stager.abort"): "this Stager's own staging dir",
    ("ckptd.stages.compress", "_ObjectSink.discard"): "a staged object's temp file",
    ("ckptd.stages.upload_local", "Ledger._open"): "the upload ledger's old-format file",
    ("ckptd.stages.parts", "_probe"): "the create-only probe object it just wrote",
    ("ckptd.stages.persist", "_commit"):
        "the save door acts for the trainer: its rendezvous markers, and the trainer's own "
        "earlier save of the step it is saving again (as ckptd.torch does in the trainer)",
    ("ckptd.stages.persist", "_fresh_dir"): "a stale half-written save dir of the door",
    ("ckptd.stages.persist", "_write_one"): "a file of the save it is writing, written again",
    ("ckptd.stages.persist", "_remove_tree"): "the helper of the two above",
    ("ckptd.remote", "retreat_latest"): "the LATEST pointer object, not a step's bytes",
    ("ckptd.remote", "_swap"): "an unreadable LATEST pointer object, rewritten",
    ("ckptd.service.effects", "LatestPublisher.publish"): "<root>/.ckptd/latest.json",
    ("ckptd.service.recovery", "remove_stale_temps"): "ckptd's own temp files",
    ("ckptd.service.lease", "*"): "the root lease's own files (lease.json, claims, temps)",
    ("ckptd.daemon", "*"): "the daemon's own socket",
    ("ckptd.api", "bind_socket"): "a stale socket at the configured path",
    ("ckptd.doctor", "*"): "doctor's own probe files and objects",
    ("ckptd.demo", "*"): "the demo's own scratch directories",
    ("ckptd.restore", "*"): "restore's own staging and temp files in the target",
    ("ckptd.restore_pipe", "*"): "restore's own temp files",
    ("ckptd.torch._native", "*"): "the trainer's own saves, in the trainer's process",
    ("ckptd.torch._nodelocal", "*"): "the trainer's own saves, in the trainer's process",
}


def _deleting(call: ast.Call) -> str | None:
    f = call.func
    if isinstance(f, ast.Attribute):
        if f.attr in _DELETING_ATTRS:
            return f.attr
        if f.attr == "remove" and isinstance(f.value, ast.Name) and f.value.id == "os":
            return "os.remove"
    if isinstance(f, ast.Name) and f.id in _DELETING_NAMES:
        return f.id
    return None


def delete_calls() -> list[tuple[str, str, int, str]]:
    """(module, enclosing function's qualified name, line, what) of every deleting call."""
    found: list[tuple[str, str, int, str]] = []
    for path in sorted(CKPTD.rglob("*.py")):
        rel = path.relative_to(CKPTD.parent).with_suffix("")
        module = ".".join(p for p in rel.parts if p != "__init__")
        tree = ast.parse(path.read_text(), str(path))

        def walk(node: ast.AST, scope: list[str]) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    walk(child, [*scope, child.name])
                    continue
                if isinstance(child, ast.Call) and (what := _deleting(child)):
                    found.append((module, ".".join(scope), child.lineno, what))  # noqa: B023
                walk(child, scope)

        walk(tree, [])
    return found


def _allowed(module: str, scope: str) -> bool:
    if module in ALLOWED_MODULES or (module, "*") in ALLOWED_FUNCTIONS:
        return True
    # A nested helper counts as its enclosing function.
    parts = scope.split(".")
    return any((module, ".".join(parts[:i])) in ALLOWED_FUNCTIONS for i in range(1, len(parts) + 1))


def test_nothing_outside_the_executor_deletes() -> None:
    calls = delete_calls()
    assert any(m == "ckptd.retention.executor" for m, *_ in calls)  # the walk sees deletes
    stray = [f"{m}:{line} {scope or '<module>'}: {what}"
             for m, scope, line, what in calls if not _allowed(m, scope)]
    assert not stray, ("checkpoint bytes are deleted only by ckptd.retention.executor; add an "
                       "executor entry point, or (for ckptd's own temp/state files only) an "
                       "entry with its reason to ALLOWED_FUNCTIONS:\n" + "\n".join(stray))


def test_the_walk_catches_each_kind_of_delete() -> None:
    src = ("import os, shutil\n"
           "def f(p, backend, Path):\n"
           "    os.unlink(p); os.remove(p); os.rmdir(p); shutil.rmtree(p)\n"
           "    Path(p).unlink(); Path(p).rmdir(); backend.delete('k'); [].remove(1)\n")
    found = [_deleting(n) for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Call)]
    assert sorted(w for w in found if w) == sorted(
        ["unlink", "os.remove", "rmdir", "rmtree", "unlink", "rmdir", "delete"])
