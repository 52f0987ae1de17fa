"""Reading the remote layout of a root: committed steps, their manifests, the LATEST pointer.

Owns the key names under `<url>/<root>/` and what counts as committed (a step with a
MANIFEST.json); writes nothing except LATEST, and never imports the store or a stage.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

from ckptd.backends.base import Backend, ObjectMeta
from ckptd.errors import CorruptData, ObjectNotFound
from ckptd.manifest import LATEST_NAME, MANIFEST_NAME, Manifest, parse_manifest, step_prefix

# Only the canonical spelling written by step_prefix: "step-007" is somebody else's object.
_STEP_DIR = re.compile(r"step-(0|[1-9][0-9]*)")


def manifest_key(root_name: str, step: int) -> str:
    return f"{step_prefix(root_name, step)}/{MANIFEST_NAME}"


def latest_key(root_name: str) -> str:
    return f"{root_name}/{LATEST_NAME}"


def list_steps(backend: Backend, root_name: str) -> list[int]:
    """Steps of `root_name` that are committed (have a MANIFEST.json), ascending.

    Objects of uncommitted steps, stray keys and non-canonical step names are ignored.
    """
    return sorted(set(_committed(backend.list(root_name), root_name)))


def _committed(metas: Iterable[ObjectMeta], root_name: str) -> Iterable[int]:
    for meta in metas:
        parts = meta.key.split("/")
        if len(parts) != 3 or parts[0] != root_name or parts[2] != MANIFEST_NAME:
            continue
        match = _STEP_DIR.fullmatch(parts[1])
        if match:
            yield int(match.group(1))


def read_manifest(backend: Backend, root_name: str, step: int) -> Manifest:
    """The committed manifest of one step: ObjectNotFound if the step is not committed,
    CorruptData if the document is malformed or describes another root or step."""
    key = manifest_key(root_name, step)
    where = f"{backend.url.rstrip('/')}/{key}"
    manifest = parse_manifest(backend.get_bytes(key), where)
    if manifest.root != root_name or manifest.step != step:
        raise CorruptData(
            f"{where}: describes root {manifest.root!r} step {manifest.step}, "
            f"not {root_name!r} step {step}"
        )
    return manifest


def read_latest(backend: Backend, root_name: str) -> int | None:
    """The step LATEST names, or None when there is no LATEST. CorruptData when malformed.

    LATEST is a hint written after a commit; the truth is `list_steps`.
    """
    key = latest_key(root_name)
    try:
        data = backend.get_bytes(key)
    except ObjectNotFound:
        return None
    try:
        step = json.loads(data)["step"]
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise CorruptData(f"{backend.url}/{key}: not a LATEST document ({exc})") from exc
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CorruptData(f"{backend.url}/{key}: bad step {step!r}")
    return step


def write_latest(backend: Backend, root_name: str, step: int | None) -> None:
    """Point LATEST at `step`, or remove it when `step` is None. Errors propagate."""
    if step is None:
        backend.delete(latest_key(root_name))
    else:
        backend.put(latest_key(root_name), json.dumps({"step": step}).encode() + b"\n")


def step_objects(backend: Backend, root_name: str, step: int) -> dict[str, ObjectMeta]:
    """Every object under one step's prefix, by key relative to the prefix (one LIST)."""
    prefix = step_prefix(root_name, step)
    cut = len(prefix) + 1
    return {m.key[cut:]: m for m in backend.list(prefix)}


def verify_step(backend: Backend, manifest: Manifest) -> list[str]:
    """Problems with the stored objects of `manifest`: missing ones and size mismatches.

    An empty list means every object is present with its manifest's `stored_size`. Uses one
    listing of the step's prefix rather than a HEAD per object.
    """
    present = step_objects(backend, manifest.root, manifest.step)
    problems: list[str] = []
    for f in manifest.files:
        meta = present.get(f.key)
        if meta is None:
            problems.append(f"missing object {f.key}")
        elif meta.size != f.stored_size:
            problems.append(
                f"object {f.key} has {meta.size} bytes, the manifest says {f.stored_size}"
            )
    return problems
