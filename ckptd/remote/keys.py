"""Reading a root's remote keys: committed steps, their manifests, the LATEST pointer.

Owns the key names under `<url>/<root>/` and what counts as committed in the bucket (a step
with a MANIFEST.json); writes nothing except LATEST (compare-and-swap, or create-only where it is
absent; removed only where it cannot be read or no committed step is left), and never imports
the store or a stage.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping

from ckptd import inputs
from ckptd.backends.base import Backend, ObjectMeta
from ckptd.errors import (
    BadInput,
    CorruptData,
    ObjectExists,
    ObjectNotFound,
    PreconditionFailed,
    StorageError,
    TransientError,
)
from ckptd.lifecycle import answers
from ckptd.log import get_logger
from ckptd.remote.manifest import LATEST_NAME, MANIFEST_NAME, Manifest, parse_manifest, step_prefix

# Only the canonical spelling written by step_prefix: "step-007" is somebody else's object.
_STEP_DIR = re.compile(r"step-(0|[1-9][0-9]*)")
# Compare-and-swap rounds on LATEST before giving up: each lost round means another writer
# moved it, so a handful covers every node of a job committing at once.
LATEST_TRIES = 8


def manifest_key(root_name: str, step: int) -> str:
    return f"{step_prefix(root_name, step)}/{MANIFEST_NAME}"


def latest_key(root_name: str) -> str:
    return f"{root_name}/{LATEST_NAME}"


def peers_prefix(root_name: str) -> str:
    """Where the daemons of a root say how to reach them (`ckptd.memory.directory`)."""
    return f"{root_name}/_peers/"


def peer_key(root_name: str, node: str) -> str:
    """One node's entry under `peers_prefix`."""
    return f"{peers_prefix(root_name)}{node}.json"


def manifest_exists(backend: Backend, root_name: str, step: int) -> bool:
    """Whether the bucket holds `step` committed: its MANIFEST.json exists (one HEAD; not
    read). What the store records of it is `lifecycle.answers.is_committed`."""
    try:
        backend.stat(manifest_key(root_name, step))
    except ObjectNotFound:
        return False
    return True


def listed_committed(objects: Mapping[str, ObjectMeta]) -> bool:
    """Whether a listing of one step's prefix (`step_objects`) is of a committed step."""
    return MANIFEST_NAME in objects


def list_steps(backend: Backend, root_name: str) -> list[int]:
    """Steps of `root_name` that are committed (have a MANIFEST.json), ascending.

    Objects of uncommitted steps, stray keys and non-canonical step names are ignored.
    """
    return sorted(committed_manifests(backend, root_name))


def committed_manifests(backend: Backend, root_name: str) -> dict[int, ObjectMeta]:
    """The MANIFEST.json of each committed step of `root_name`, by step (one LIST)."""
    return dict(_committed(backend.list(root_name), root_name))


def _committed(metas: Iterable[ObjectMeta], root_name: str) -> Iterable[tuple[int, ObjectMeta]]:
    for meta in metas:
        parts = meta.key.split("/")
        if len(parts) != 3 or parts[0] != root_name or parts[2] != MANIFEST_NAME:
            continue
        match = _STEP_DIR.fullmatch(parts[1])
        if match:
            yield int(match.group(1)), meta


def read_manifest(backend: Backend, root_name: str, step: int) -> Manifest:
    """The committed manifest of one step: ObjectNotFound if the step is not committed,
    CorruptData if the document is malformed or describes another root or step (BadInput
    when it is over `inputs.MANIFEST`'s cap: refused before its body is read)."""
    key = manifest_key(root_name, step)
    where = f"{backend.url.rstrip('/')}/{key}"
    manifest = parse_manifest(backend.get_bytes(key, inputs.MANIFEST.cap), where)
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
        data = backend.get_bytes(key, inputs.LATEST.cap)
    except ObjectNotFound:
        return None
    return _parse_latest(data, f"{backend.url}/{key}")


def _parse_latest(data: bytes, where: str) -> int:
    doc = inputs.loads(data, where)
    if not isinstance(doc, dict) or "step" not in doc:
        raise CorruptData(f"{where}: not a LATEST document")
    return inputs.check_int(doc["step"], f"{where}: step")


# The version `_read_pointer` gives a LATEST it cannot read at all (over its cap): no version
# to swap against, so `_swap` deletes it and creates LATEST anew.
_UNREADABLE = "\x00unreadable"


def _read_pointer(backend: Backend, root_name: str) -> tuple[int | None, str | None]:
    """LATEST's step (None when absent or damaged) and version (None only when absent;
    `_UNREADABLE` when it is over its cap)."""
    key = latest_key(root_name)
    try:
        data, version = backend.get_versioned(key, inputs.LATEST.cap)
    except ObjectNotFound:
        return None, None
    except BadInput as exc:
        get_logger().warning("bad_remote_item", root=root_name, key=key, error=str(exc))
        return None, _UNREADABLE
    try:
        return _parse_latest(data, f"{backend.url}/{key}"), version
    except CorruptData:
        return None, version  # damaged: replaced like any other version


def _swap(backend: Backend, root_name: str, step: int, version: str | None) -> None:
    """Write LATEST = step if it is still `version` (create-only when it was absent; an
    unreadable one is deleted first, then created: LATEST is a hint, `list_steps` the truth)."""
    body = json.dumps({"step": step}).encode() + b"\n"
    if version == _UNREADABLE:
        backend.delete(latest_key(root_name))
        version = None
    if version is None:
        backend.put(latest_key(root_name), body, create_only=True)
    else:
        backend.put(latest_key(root_name), body, if_match=version)


def advance_latest(backend: Backend, root_name: str, step: int) -> bool:
    """Best effort: move LATEST forward to `step` unless it names `step` or a later one.

    Compare-and-swap: read LATEST with its version, put conditionally on that version (or
    create-only), and on losing to another writer read again, `LATEST_TRIES` rounds at most.
    True when LATEST names `step` afterwards. Never raises: failures log
    `latest_update_failed`, a later step already there logs `latest_kept`.
    """
    log = get_logger(root=root_name, step=step)
    try:
        for _ in range(LATEST_TRIES):
            current, version = _read_pointer(backend, root_name)
            if current is not None and current >= step:
                if current > step:
                    log.info("latest_kept", latest=current)
                return current == step
            try:
                _swap(backend, root_name, step, version)
                return True
            except (PreconditionFailed, ObjectExists):
                continue  # another writer moved it in between: look again
        raise TransientError(f"LATEST kept changing for {LATEST_TRIES} rounds")
    except (StorageError, CorruptData) as exc:
        log.warning("latest_update_failed", key=latest_key(root_name), error=str(exc))
        return False


def retreat_latest(backend: Backend, root_name: str, deleted: int) -> None:
    """After step `deleted` is removed: if LATEST names it (or is damaged), point it at the
    highest remaining committed step, or remove it when none is left. Errors propagate.

    Conditional like `advance_latest`. The removal cannot be (obstore has no conditional
    delete), so a step committed meanwhile is looked for afterwards and LATEST advanced to it.
    """
    for _ in range(LATEST_TRIES):
        current, version = _read_pointer(backend, root_name)
        if version is None or (current is not None and current != deleted):
            return
        remaining = answers.newest(s for s in list_steps(backend, root_name) if s != deleted)
        if remaining is None:
            backend.delete(latest_key(root_name))
            later = answers.newest(s for s in list_steps(backend, root_name) if s != deleted)
            if later is not None:
                advance_latest(backend, root_name, later)
            return
        try:
            _swap(backend, root_name, remaining, version)
            return
        except (PreconditionFailed, ObjectExists):
            continue
    raise TransientError(f"LATEST of {root_name!r} kept changing for {LATEST_TRIES} rounds")


def step_objects(backend: Backend, root_name: str, step: int) -> dict[str, ObjectMeta]:
    """Every object under one step's prefix, by key relative to the prefix (one LIST)."""
    prefix = step_prefix(root_name, step)
    cut = len(prefix) + 1
    return {m.key[cut:]: m for m in backend.list(prefix)}

