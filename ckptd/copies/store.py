"""The local copy store's layout and checks: where a step's compressed copy lives, reading its
manifest, listing copies, clearing a crash's staging, verifying a copy, and checking that the
originals may be replaced by it. Deletes nothing but stale staging; the retention executor
deletes originals and releases copies; the compress stage writes them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from ckptd import fileio, inputs
from ckptd.copies.decode import decode_object
from ckptd.errors import CorruptData, UnsafePath
from ckptd.fileio import HashSink
from ckptd.model import CKPTD_DIR
from ckptd.remote.manifest import MANIFEST_NAME, Manifest, StoredFile, parse_manifest

OBJECTS_DIR = "objects"


def objects_root(root_dir: Path) -> Path:
    """`<root>/.ckptd/objects`: the parent of every local compressed copy of a root."""
    return Path(root_dir) / CKPTD_DIR / OBJECTS_DIR


def objects_dir(root_dir: Path, step: int) -> Path:
    """`<root>/.ckptd/objects/step-<N>`: where the compressed copy of one step lives."""
    return objects_root(root_dir) / f"step-{step}"


def read_local_manifest(root_dir: Path, step: int) -> Manifest | None:
    """The manifest of step's local compressed copy, or None when there is no (committed) copy."""
    path = objects_dir(root_dir, step) / MANIFEST_NAME
    try:  # in the root, so outside input: bounded, never a link or a FIFO
        data = inputs.read_file(path, inputs.MANIFEST)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise CorruptData(f"{path}: cannot be read ({exc})") from None
    manifest = parse_manifest(data, str(path))
    if manifest.step != step:
        raise CorruptData(f"{path}: describes step {manifest.step}, not {step}")
    return manifest


def local_steps(root_dir: Path) -> list[int]:
    """Steps with a committed local compressed copy, ascending."""
    try:
        names = os.listdir(objects_root(root_dir))
    except FileNotFoundError:
        return []
    nums = [n.removeprefix("step-") for n in names if n.startswith("step-")]
    steps = [int(n) for n in nums if n.isdigit() and str(int(n)) == n]
    return sorted(s for s in steps if (objects_dir(root_dir, s) / MANIFEST_NAME).exists())


def remove_stale_staging(root_dir: Path) -> int:
    """Delete staging dirs a crash left in `<root>/.ckptd/objects` (call once at start-up, while
    no Stager of this root runs); returns how many went."""
    removed = 0
    try:
        entries = list(os.scandir(objects_root(root_dir)))
    except FileNotFoundError:
        return 0
    for e in entries:
        if not e.name.startswith(fileio.TEMP_PREFIX):
            continue
        with contextlib.suppress(OSError):  # best effort: start-up goes on regardless
            fileio.remove_tree(e.path)
        removed += 1
    return removed


def verify_copy(objects_dir: Path, manifest: Manifest) -> None:
    """Decode every object of a copy and check it against the manifest; CorruptData names the
    first bad file. Reads the copy once, dropping it from the page cache behind itself."""
    for f in manifest.files:
        src = fileio.safe_join(objects_dir, f.key)
        try:
            decode_object(src, f)
        except FileNotFoundError:
            raise CorruptData(f"{f.path}: stored object {src} is missing") from None


# --- replacing originals ---------------------------------------------------------------------


def check_replaceable(
    root_dir: Path,
    manifest: Manifest,
    original_paths: Sequence[str],
    *,
    verify: bool = True,
    rehash: bool = True,
) -> list[str]:
    """Check that a step's originals may be replaced by its local compressed copy; deletes
    nothing (the executor's `replace_originals` does, calling this first).

    With `verify`, the copy is decoded against its manifest and made durable; then every
    original still there is checked against the manifest: a regular file not reached through
    a symlink, its size, and with `rehash` its content (a re-save in place must not be
    deleted). Raises CorruptData or UnsafePath naming the file; returns the originals present.
    """
    root_dir = Path(root_dir)
    if verify:
        copy = objects_dir(root_dir, manifest.step)
        verify_copy(copy, manifest)
        _fsync_copy(copy, manifest)
    by_path = {f.path: f for f in manifest.files}
    present = []
    for rel in original_paths:
        fd = _original(root_dir, rel, by_path)
        if fd is None:
            continue
        try:
            _check_original(fd, by_path[rel], rehash)
        finally:
            os.close(fd)
        present.append(rel)
    return present


def _fsync_copy(copy: Path, manifest: Manifest) -> None:
    for f in manifest.files:
        fileio.fsync_file(copy / f.key)
    fileio.fsync_file(copy / MANIFEST_NAME)
    fileio.fsync_dir(copy)
    fileio.fsync_dir(copy.parent)


def _original(root_dir: Path, rel: str, by_path: Mapping[str, StoredFile]) -> int | None:
    """The original, opened beneath the root (`fileio.open_beneath`: no link followed on the
    way), if it is still there; UnsafePath for a link or anything not a regular file."""
    if rel not in by_path:
        raise UnsafePath(f"{rel} is not in the compressed copy: refusing to delete it")
    try:
        return fileio.open_beneath(root_dir, rel)
    except FileNotFoundError:
        return None
    except UnsafePath as exc:
        raise UnsafePath(f"{exc}: refusing to delete it") from None


def _check_original(fd: int, f: StoredFile, rehash: bool) -> None:
    size = os.fstat(fd).st_size
    if size != f.size:
        raise CorruptData(f"{f.path} has {size} bytes, its copy {f.size}: it changed after "
                          "compression; not deleting it")
    if rehash:
        hasher = HashSink()
        fileio.read_pass(f.path, [hasher], fd=fd)
        if hasher.digest != f.hash:
            raise CorruptData(f"{f.path} differs from its compressed copy (changed after "
                              "compression); not deleting it")
