"""Which step to restore and from where: the root's local compressed copies, latest.json, and
the remote's committed manifests. Decides only; writes nothing (restore.files writes).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ckptd import inputs
from ckptd.backends import Backend, backend_for_upload
from ckptd.copies.store import local_steps
from ckptd.errors import CorruptData, NotFound, ObjectNotFound, PermanentError
from ckptd.lifecycle import answers
from ckptd.log import get_logger
from ckptd.model import CKPTD_DIR
from ckptd.remote import keys as remote
from ckptd.remote.keys import manifest_exists
from ckptd.remote.manifest import Manifest

if TYPE_CHECKING:
    from ckptd.config import RootConfig

StepArg = int | Literal["latest"]
Where = Literal["local", "remote"]


def read_remote_manifest(backend: Backend, root_name: str, step: int) -> Manifest:
    """The committed manifest of a remote step; NotFound when the step has none."""
    try:
        return remote.read_manifest(backend, root_name, step)
    except ObjectNotFound:
        raise NotFound(f"step {step} of {root_name!r} is not at {backend.url} "
                       f"(no {remote.manifest_key(root_name, step)})") from None


def list_remote_steps(backend: Backend, root_name: str) -> list[int]:
    """Steps of `root_name` that have a MANIFEST.json under the backend, ascending."""
    return remote.list_steps(backend, root_name)


def remote_backend(root: RootConfig) -> Backend | None:
    """The root's upload backend, with retries and its bandwidth cap; None if it uploads nowhere."""
    up = root.upload
    if not up.enabled:
        return None
    return backend_for_upload(up)


def resolve_step(
    root_dir: Path, root_name: str, step: StepArg, backend: Backend | None
) -> tuple[int, Where]:
    """Which step to restore and from where.

    An explicit step: its local compressed copy, else the remote. "latest": the step named by
    `<root>/.ckptd/latest.json` if a copy of it exists (local first), else the highest step
    with any copy (local preferred on a tie). NotFound says what was looked at, and says so
    when the step is still on disk as its original files (nothing to restore).
    """
    local = set(local_steps(root_dir))
    if step != "latest":
        if step in local:
            return step, "local"
        if backend is not None and manifest_exists(backend, root_name, step):
            return step, "remote"
        raise NotFound(_nothing_for(root_dir, root_name, step, backend))
    named = _latest_named(root_dir)
    if named is not None and named[0] in local:
        return named[0], "local"
    remote = set(list_remote_steps(backend, root_name)) if backend is not None else set()
    if named is not None and named[0] in remote and _readable(backend, root_name, named[0]):
        return named[0], "remote"
    top = newest_copy(local, remote, backend, root_name)
    if named is not None and (top is None or named[0] > top) and _on_disk(named):
        raise NotFound(_present(root_name, named))
    if top is None:
        raise NotFound(_nothing_for(root_dir, root_name, "latest", backend))
    return top, "local" if top in local else "remote"


def newest_copy(local: set[int], remote: set[int], backend: Backend | None,
                root_name: str) -> int | None:
    """`answers.newest` of the steps with a copy: local preferred on a tie; a remote step
    counts only when its manifest can be read (a bad one is skipped, logged as
    `bad_remote_item`, and the next lower step tried), so one bad step never hides the
    others."""
    return answers.newest(local | remote, lambda n: n in local or (
        backend is not None and _readable(backend, root_name, n)))


def _readable(backend: Backend | None, root_name: str, step: int) -> bool:
    """Whether the remote step's MANIFEST.json can be read (a bad one is logged)."""
    if backend is None:
        return False
    try:
        remote.read_manifest(backend, root_name, step)
    except ObjectNotFound:
        return False
    except (CorruptData, PermanentError) as exc:
        get_logger().warning("bad_remote_item", root=root_name,
                             key=remote.manifest_key(root_name, step), error=str(exc))
        return False
    return True


def _latest_named(root_dir: Path) -> tuple[int, Path | None] | None:
    """(step, path) from latest.json, or None when it is missing or unreadable (read with
    `inputs.LATEST_JSON`'s bounds: a FIFO or a symlink there is unreadable)."""
    try:
        doc = inputs.read_json(Path(root_dir) / CKPTD_DIR / "latest.json", inputs.LATEST_JSON)
        step, path = doc["step"], doc.get("path")
    except (OSError, CorruptData, TypeError, KeyError, AttributeError):
        return None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return None
    return step, Path(root_dir, path) if isinstance(path, str) and path else None


def _on_disk(named: tuple[int, Path | None]) -> bool:
    return named[1] is not None and named[1].exists()


def _present(root_name: str, named: tuple[int, Path | None]) -> str:
    return (f"step {named[0]} of {root_name!r} is present locally at {named[1]} (its original "
            "files); nothing to restore")


def _nothing_for(root_dir: Path, root_name: str, step: StepArg, backend: Backend | None) -> str:
    named = _latest_named(root_dir)
    if named is not None and named[0] == step and _on_disk(named):
        return _present(root_name, named)
    where = f"no local copy under {Path(root_dir) / CKPTD_DIR / 'objects'}"
    where += f", nothing at {backend.url}" if backend is not None else " and no upload.url"
    what = "no step" if step == "latest" else f"no copy of step {step}"
    return f"{what} of {root_name!r} to restore: {where}"
