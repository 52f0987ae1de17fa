"""The compress stage on real checkpoints: staged inside the real validation pass, committed,
verified, restored byte for byte; corruption, symlinks, kill -9 and a full disk."""

from __future__ import annotations

import filecmp
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import layout_writers as w
import numpy as np
import pytest
from support.compress import list_temps, odd_files, stage, stager
from support.layouts_real import CASES, detect
from support.nets import no_nets
from support.wait import wait_until
from writers import flip_byte, member_data_offset, truncate

from ckptd import fileio
from ckptd.copies.store import (
    check_replaceable,
    local_steps,
    objects_dir,
    objects_root,
    read_local_manifest,
    remove_stale_staging,
    verify_copy,
)
from ckptd.errors import CkptdError, CorruptData, DiskFull, UnsafePath
from ckptd.model import Candidate, Local, Remote
from ckptd.remote.manifest import MANIFEST_NAME, Manifest, parse_manifest
from ckptd.restore.files import restore_from_dir
from ckptd.retention import executor, trash
from ckptd.stages.compress import Stager
from ckptd.stages.validate import validate

CODECS = ["none", "zstd", "zstd-bytegroup", "auto"]
HERE = Path(__file__).resolve().parent


NO_NETS = no_nets()


def replace_originals(root: Path, manifest: Manifest, paths: list[str],
                      anchor: str | None = None) -> list[str]:
    """Compress-in-place as the retention service does it: the executor deletes, after
    `check_replaceable`; a failed check raises its error here, as it did before."""
    errors: list[Exception] = []

    def check() -> None:
        try:
            check_replaceable(root, manifest, paths)
        except Exception as exc:
            errors.append(exc)
            raise

    present = [p for p in paths if (root / p).exists() or (root / p).is_symlink()]
    target = executor.Target(manifest.step, anchor or "", tuple(paths), Local.PRESENT,
                             Remote.NONE, False)
    out = executor.replace_originals(root, target, NO_NETS, check)
    if errors:
        raise errors[0]
    assert out.action == "deleted", out
    return present


def assert_restored(root: Path, to: Path, manifest: Manifest) -> None:
    for f in manifest.files:
        assert filecmp.cmp(root / f.path, to / f.path, shallow=False), f.path
    assert not list_temps(to)


def staging_dirs(root: Path) -> list[str]:
    if not objects_root(root).exists():
        return []
    return [n for n in os.listdir(objects_root(root)) if n.startswith(fileio.TEMP_PREFIX)]


# --- every layout, every codec -------------------------------------------------------------

_WRITTEN: dict[str, Path] = {}


@pytest.fixture(scope="module")
def layouts_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("layouts")


def layout_root(name: str, base: Path, tmp_path: Path) -> tuple[Path, Candidate]:
    """A fresh copy of one layout's checkpoint (each is written once per module)."""
    if name not in _WRITTEN:
        writer, kwargs, *_ = CASES[name]
        (base / name).mkdir()
        writer(base / name, **kwargs)
        _WRITTEN[name] = base / name
    root = tmp_path / "root"
    shutil.copytree(_WRITTEN[name], root)
    world = CASES[name][2]
    cands = [c for c in detect(root, world) if c.complete]
    assert len(cands) == 1, cands
    return root, cands[0]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_every_layout(name: str, codec: str, layouts_dir: Path, tmp_path: Path) -> None:
    root, cand = layout_root(name, layouts_dir, tmp_path)
    manifest = stage(root, cand, codec)
    assert {f.path for f in manifest.files} == set(cand.files) | set(cand.expected_sizes)
    assert (manifest.root, manifest.step, manifest.layout) == ("r", cand.step, cand.layout)
    assert read_local_manifest(root, cand.step) == manifest
    assert staging_dirs(root) == []
    restored = restore_from_dir(objects_dir(root, cand.step), manifest, tmp_path / "out")
    assert sorted(restored) == sorted(tmp_path / "out" / f.path for f in manifest.files)
    assert_restored(root, tmp_path / "out", manifest)


@pytest.mark.parametrize("codec,threads", [(c, 1) for c in CODECS] + [("zstd-bytegroup", 3)])
def test_round_trip_odd_sizes(codec: str, threads: int, tmp_path: Path) -> None:
    root = tmp_path / "root"
    cand = odd_files(root)
    manifest = stage(root, cand, codec, threads)
    if codec != "auto":
        assert {f.codec for f in manifest.files} == {codec}
    verify_copy(objects_dir(root, 3), manifest)
    restore_from_dir(objects_dir(root, 3), manifest, tmp_path / "out")
    assert_restored(root, tmp_path / "out", manifest)


def test_auto_names_each_object_by_the_codec_it_chose(tmp_path: Path) -> None:
    root = tmp_path / "root"
    manifest = stage(root, odd_files(root), "auto")
    by = {f.path: f for f in manifest.files}
    assert by["odd/random.dat"].codec == "none" and by["odd/random.dat"].key == "odd/random.dat"
    assert by["odd/multi_block.dat"].codec == "zstd-bytegroup"
    assert by["odd/multi_block.dat"].stored_size < by["odd/multi_block.dat"].size
    for f in manifest.files:
        assert (objects_dir(root, 3) / f.key).stat().st_size == f.stored_size
    on_disk = sorted(p.relative_to(objects_dir(root, 3)).as_posix()
                     for p in objects_dir(root, 3).rglob("*") if p.is_file())
    assert on_disk == sorted([MANIFEST_NAME, *(f.key for f in manifest.files)])
    assert parse_manifest((objects_dir(root, 3) / MANIFEST_NAME).read_bytes()) == manifest


def test_stock_zstd_decompresses_zstd_objects(tmp_path: Path) -> None:
    zstd = shutil.which("zstd")
    if zstd is None:
        pytest.skip("the zstd command is not installed")
    root = tmp_path / "root"
    manifest = stage(root, odd_files(root), "zstd")
    f = next(f for f in manifest.files if f.path == "odd/multi_block.dat")
    out = subprocess.run([zstd, "-dc", str(objects_dir(root, 3) / f.key)], capture_output=True,
                         check=True).stdout
    assert out == (root / f.path).read_bytes()


# --- corruption --------------------------------------------------------------------------


def test_flipped_block_is_named_at_restore_and_no_half_file_is_left(tmp_path: Path) -> None:
    root = tmp_path / "root"
    manifest = stage(root, odd_files(root), "zstd-bytegroup")
    f = next(f for f in manifest.files if f.path == "odd/multi_block.dat")
    flip_byte(objects_dir(root, 3) / f.key, f.stored_size * 2 // 3)
    with pytest.raises(CorruptData, match=r"odd/multi_block\.dat: .*block [12]"):
        restore_from_dir(objects_dir(root, 3), manifest, tmp_path / "out")
    assert not (tmp_path / "out" / f.path).exists()
    assert list_temps(tmp_path / "out") == []


@pytest.mark.parametrize("codec", CODECS)
def test_verify_copy_catches_a_flipped_byte(codec: str, tmp_path: Path) -> None:
    root = tmp_path / "root"
    manifest = stage(root, odd_files(root), codec)
    verify_copy(objects_dir(root, 3), manifest)
    f = next(f for f in manifest.files if f.path == "odd/f32_plus3.dat")
    flip_byte(objects_dir(root, 3) / f.key, f.stored_size // 2)
    with pytest.raises(CorruptData, match=r"odd/f32_plus3\.dat"):
        verify_copy(objects_dir(root, 3), manifest)


def test_raw_object_corruption_is_a_hash_mismatch(tmp_path: Path) -> None:
    root = tmp_path / "root"
    manifest = stage(root, odd_files(root), "none")
    f = next(f for f in manifest.files if f.path == "odd/random.dat")
    flip_byte(objects_dir(root, 3) / f.key, 12345)
    with pytest.raises(CorruptData, match=r"odd/random\.dat: content hash mismatch"):
        restore_from_dir(objects_dir(root, 3), manifest, tmp_path / "out")
    assert not (tmp_path / "out" / f.path).exists() and list_temps(tmp_path / "out") == []


def test_truncated_and_missing_objects(tmp_path: Path) -> None:
    root = tmp_path / "root"
    manifest = stage(root, odd_files(root), "zstd")
    f = next(f for f in manifest.files if f.path == "odd/zeros.dat")
    truncate(objects_dir(root, 3) / f.key, f.stored_size - 1)
    with pytest.raises(CorruptData, match=r"odd/zeros\.dat: stored object .* has \d+ bytes"):
        verify_copy(objects_dir(root, 3), manifest)
    (objects_dir(root, 3) / f.key).unlink()
    with pytest.raises(CorruptData, match="missing"):
        verify_copy(objects_dir(root, 3), manifest)


# --- staging, commit, abort ----------------------------------------------------------------


def test_invalid_checkpoint_is_aborted_and_leaves_nothing(tmp_path: Path) -> None:
    root = tmp_path / "root"
    w.write_native(root, 5)
    [cand] = detect(root)
    model = root / "step-5" / "model.pt"
    offset, _ = member_data_offset(model, "data/0")
    flip_byte(model, offset + 3)
    st = stager(root, cand, "zstd")
    result = validate(root, cand, extra_sinks=st.sinks_for)
    assert not result.valid and result.reason == "crc_mismatch"
    assert staging_dirs(root) != []  # the pass had started writing
    st.abort()
    assert staging_dirs(root) == [] and local_steps(root) == []
    assert read_local_manifest(root, 5) is None


def test_rerun_replaces_an_existing_copy(tmp_path: Path) -> None:
    root = tmp_path / "root"
    cand = odd_files(root)
    first = stage(root, cand, "none")
    second = stage(root, cand, "zstd")
    assert read_local_manifest(root, 3) == second != first
    assert os.listdir(objects_root(root)) == ["step-3"]
    assert not (objects_dir(root, 3) / "odd" / "random.dat").exists()  # old objects are gone
    assert os.listdir(trash.trash_dir_for(root)) == []  # through the trash, and purged
    restore_from_dir(objects_dir(root, 3), second, tmp_path / "out")
    assert_restored(root, tmp_path / "out", second)


def test_colliding_object_names_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "c").mkdir(parents=True)
    # With `auto`, compressible `a` is stored as `a.zst`, and random `a.zst` raw, as `a.zst`.
    (root / "c" / "a").write_bytes(b"a" * 1000)
    (root / "c" / "a.zst").write_bytes(np.random.default_rng(0).bytes(1000))
    cand = Candidate("registered", 1, "c", ("c/a", "c/a.zst"), complete=True)
    st = stager(root, cand, "auto")
    result = validate(root, cand, extra_sinks=st.sinks_for)
    with pytest.raises(CkptdError, match="collide"):
        st.commit(result.files, result.metrics)
    assert staging_dirs(root) == [] and local_steps(root) == []


def test_commit_without_staged_objects_is_an_error(tmp_path: Path) -> None:
    root = tmp_path / "root"
    cand = odd_files(root)
    result = validate(root, cand)
    st = stager(root, cand)
    with pytest.raises(CkptdError, match="no compressed object staged"):
        st.commit(result.files, result.metrics)


def test_bad_codec_options_fail_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown codec"):
        Stager(tmp_path, "r", 1, "single", "lz4", 3, 1, 0.03)
    with pytest.raises(ValueError, match="threads"):
        Stager(tmp_path, "r", 1, "single", "zstd", 3, 0, 0.03)


def test_remove_stale_staging_keeps_committed_copies(tmp_path: Path) -> None:
    root = tmp_path / "root"
    cand = odd_files(root)
    stage(root, cand, "zstd")
    left = stager(root, cand)
    validate(root, cand, extra_sinks=left.sinks_for)  # never committed nor aborted
    assert len(staging_dirs(root)) == 1
    assert remove_stale_staging(root) == 1
    assert os.listdir(objects_root(root)) == ["step-3"] and local_steps(root) == [3]
    assert remove_stale_staging(tmp_path / "nothing-here") == 0


def test_release_copy_goes_all_at_once(tmp_path: Path) -> None:
    root = tmp_path / "root"
    cand = odd_files(root)
    stage(root, cand, "zstd")
    target = executor.Target(3, ".ckptd/objects/step-3", (), Local.PRESENT, Remote.NONE, True)
    out = executor.release_copy(root, target, NO_NETS)
    assert out.action == "deleted" and out.bytes_freed > 0
    assert local_steps(root) == [] and staging_dirs(root) == []
    assert os.listdir(trash.trash_dir_for(root)) == []
    assert executor.release_copy(root, target, NO_NETS).reason == "already gone"
    assert all((root / rel).exists() for rel in cand.files)


def test_a_bare_stager_never_replaces_an_existing_copy(tmp_path: Path) -> None:
    root = tmp_path / "root"
    cand = odd_files(root)
    first = stage(root, cand, "none")
    bare = Stager(root, "r", cand.step, cand.layout, "zstd", 3, 1, 0.03)
    result = validate(root, cand, extra_sinks=bare.sinks_for)
    with pytest.raises(CkptdError, match="only the retention executor replaces"):
        bare.commit(result.files, result.metrics)
    assert read_local_manifest(root, 3) == first and staging_dirs(root) == []


def test_copies_do_not_stay_in_the_page_cache(tmp_path: Path) -> None:
    if shutil.which("fincore") is None:
        pytest.skip("fincore (util-linux) is not installed")
    root = tmp_path / "root"
    (root / "c").mkdir(parents=True)
    (root / "c" / "big.dat").write_bytes(np.random.default_rng(0).bytes(64 << 20))
    cand = Candidate("registered", 1, "c", ("c/big.dat",), complete=True)
    manifest = stage(root, cand, "none")
    restore_from_dir(objects_dir(root, 1), manifest, tmp_path / "out")
    for path in (objects_dir(root, 1) / "c" / "big.dat", tmp_path / "out" / "c" / "big.dat"):
        out = subprocess.run(["fincore", "-b", "-n", "-o", "RES", str(path)], check=True,
                             capture_output=True, text=True).stdout
        assert int(out.split()[0]) < (64 << 20) // 10, (path, out)


# --- replacing originals -------------------------------------------------------------------


def test_replace_originals_deletes_after_verification_and_restore_brings_them_back(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    w.write_native(root, 5)
    (root / "unrelated.txt").write_text("keep me")
    [cand] = detect(root)
    saved = tmp_path / "saved"
    shutil.copytree(root / "step-5", saved)
    manifest = stage(root, cand, "auto")
    gone = replace_originals(root, manifest, list(cand.files), anchor=cand.path)
    assert sorted(gone) == sorted(cand.files)
    assert not (root / "step-5").exists() and (root / "unrelated.txt").exists()
    restore_from_dir(objects_dir(root, 5), manifest, root)
    assert not filecmp.dircmp(saved, root / "step-5").diff_files
    assert sorted(os.listdir(saved)) == sorted(os.listdir(root / "step-5"))
    # A re-run after a crash halfway finds the originals back (or gone): it simply finishes.
    replace_originals(root, manifest, list(cand.files), anchor=cand.path)
    assert replace_originals(root, manifest, list(cand.files), anchor=cand.path) == []


def test_replace_originals_without_anchor_keeps_the_surrounding_directory(tmp_path: Path) -> None:
    root = tmp_path / "root"
    w.write_split(root / "run1", 5)
    [cand] = detect(root)
    manifest = stage(root, cand, "zstd")
    replace_originals(root, manifest, list(cand.files))
    assert (root / "run1").is_dir() and os.listdir(root / "run1") == []


def test_replace_originals_keeps_everything_when_the_copy_is_corrupt(tmp_path: Path) -> None:
    root = tmp_path / "root"
    cand = odd_files(root)
    manifest = stage(root, cand, "zstd-bytegroup")
    f = next(f for f in manifest.files if f.path == "odd/multi_block.dat")
    flip_byte(objects_dir(root, 3) / f.key, f.stored_size // 2)
    with pytest.raises(CorruptData, match=r"odd/multi_block\.dat"):
        replace_originals(root, manifest, list(cand.files), anchor="odd")
    assert all((root / rel).exists() for rel in cand.files)


def test_replace_originals_refuses_an_original_changed_since(tmp_path: Path) -> None:
    root = tmp_path / "root"
    cand = odd_files(root)
    manifest = stage(root, cand, "zstd")
    flip_byte(root / "odd" / "random.dat", 10)  # same size, other content: a re-save
    with pytest.raises(CorruptData, match=r"odd/random\.dat differs"):
        replace_originals(root, manifest, list(cand.files), anchor="odd")
    assert all((root / rel).exists() for rel in cand.files)


def test_replace_originals_never_goes_through_a_symlink(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "real").mkdir(parents=True)
    outside.mkdir()
    (root / "real" / "a.dat").write_bytes(b"a" * 5000)
    cand = Candidate("registered", 1, "real", ("real/a.dat",), complete=True)
    manifest = stage(root, cand, "zstd")
    # The original swapped for a link to a file outside the root with the same bytes.
    shutil.move(root / "real" / "a.dat", outside / "a.dat")
    (root / "real" / "a.dat").symlink_to(outside / "a.dat")
    with pytest.raises(UnsafePath):
        replace_originals(root, manifest, ["real/a.dat"])
    assert (outside / "a.dat").read_bytes() == b"a" * 5000
    # A directory on the way swapped for a link, even one inside the root: still refused.
    (root / "real" / "a.dat").unlink()
    (root / "real").rename(root / "moved")
    shutil.move(outside / "a.dat", root / "moved" / "a.dat")
    (root / "real").symlink_to(root / "moved")
    with pytest.raises(UnsafePath, match="symlink"):
        replace_originals(root, manifest, ["real/a.dat"])
    with pytest.raises(UnsafePath, match="not in the compressed copy"):
        replace_originals(root, manifest, ["moved/a.dat"])
    assert (root / "moved" / "a.dat").exists()


# --- crashes and a full disk ---------------------------------------------------------------

_CHILD = """
import sys, time
from pathlib import Path
from ckptd.model import Candidate
from ckptd.stages.compress import Stager
from ckptd.stages.validate import validate

root, marker = Path(sys.argv[1]), Path(sys.argv[2])

class Stall:
    # Signals after the first chunk, then stalls: the kill lands in the middle of the pass.
    def update(self, offset, view):
        if offset:
            marker.write_text("mid")
            time.sleep(60)
    def finish(self, total):
        pass

cand = Candidate("registered", 1, "c", ("c/big.dat",), complete=True)
st = Stager(root, "r", 1, "registered", "zstd-bytegroup", 3, 1, 0.03)
validate(root, cand, extra_sinks=lambda rel: [*st.sinks_for(rel), Stall()])
"""


def test_kill_9_mid_compression_leaves_the_original_and_a_removable_staging_dir(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    (root / "c").mkdir(parents=True)
    data = np.random.default_rng(0).standard_normal(12 << 20 >> 2, np.float32).tobytes()
    (root / "c" / "big.dat").write_bytes(data)
    marker = tmp_path / "marker"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(root), str(marker)])
    try:
        wait_until(lambda: marker.exists() or child.poll() is not None, 30,
                   "the child past its first chunk (or gone)", interval=0.02)
        assert marker.exists(), "the child never got past its first chunk"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert (root / "c" / "big.dat").read_bytes() == data
    [staging] = staging_dirs(root)
    partial = [p for p in (objects_root(root) / staging).rglob("*") if p.is_file()]
    assert partial and partial[0].name.startswith(fileio.TEMP_PREFIX)
    assert partial[0].stat().st_size > 0
    assert local_steps(root) == []
    assert remove_stale_staging(root) == 1
    cand = Candidate("registered", 1, "c", ("c/big.dat",), complete=True)
    manifest = stage(root, cand, "zstd-bytegroup")  # the stage, run again
    restore_from_dir(objects_dir(root, 1), manifest, tmp_path / "out")
    assert (tmp_path / "out" / "c" / "big.dat").read_bytes() == data


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (needs root and permission to mount)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs for ENOSPC ({done.stderr.strip()})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_enospc_while_compressing_is_diskfull_and_keeps_the_original(small_fs: Path) -> None:
    root = small_fs / "root"
    (root / "c").mkdir(parents=True)
    data = np.random.default_rng(0).bytes(3 << 20)  # incompressible: the copy cannot fit
    (root / "c" / "rand.dat").write_bytes(data)
    cand = Candidate("registered", 1, "c", ("c/rand.dat",), complete=True)
    st = stager(root, cand, "zstd")
    with pytest.raises(DiskFull, match="no space left .*original files are untouched"):
        validate(root, cand, extra_sinks=st.sinks_for)
    st.abort()
    assert staging_dirs(root) == [] and local_steps(root) == []
    assert (root / "c" / "rand.dat").read_bytes() == data
    # Once space is freed, the stage succeeds.
    (root / "c" / "rand.dat").write_bytes(data[: 1 << 20])
    manifest = stage(root, cand, "zstd")
    assert read_local_manifest(root, 1) == manifest


def test_enospc_while_restoring_is_diskfull_without_a_half_file(
    small_fs: Path, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    (root / "c").mkdir(parents=True)
    (root / "c" / "zeros.dat").write_bytes(bytes(8 << 20))  # tiny compressed, too big restored
    cand = Candidate("registered", 1, "c", ("c/zeros.dat",), complete=True)
    manifest = stage(root, cand, "zstd")
    with pytest.raises(DiskFull):
        restore_from_dir(objects_dir(root, 1), manifest, small_fs / "out")
    assert list(small_fs.rglob("*.dat")) == [] and list_temps(small_fs) == []


_RSS_CHILD = """
import resource, sys
from pathlib import Path
from ckptd.model import Candidate
from ckptd.restore.files import restore_from_dir
from ckptd.stages.compress import Stager
from ckptd.copies.store import objects_dir
from ckptd.stages.validate import validate

root = Path(sys.argv[1])

def round_trip(rel, step):
    cand = Candidate("registered", step, rel, (rel,), complete=True)
    st = Stager(root, "r", step, "registered", "zstd-bytegroup", 3, 2, 0.03)
    res = validate(root, cand, extra_sinks=st.sinks_for)
    m = st.commit(res.files, res.metrics)
    restore_from_dir(objects_dir(root, step), m, root / "out")

round_trip("small.dat", 1)  # imports, pools and buffers at their working size
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
round_trip("big.dat", 2)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def write_floats(path: Path, size: int) -> None:
    chunk = np.random.default_rng(0).standard_normal(1 << 20, np.float32).tobytes()
    with open(path, "wb") as f:
        for _ in range(size // len(chunk)):
            f.write(chunk)


def test_memory_stays_bounded_whatever_the_file_size(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    write_floats(root / "small.dat", 16 << 20)
    write_floats(root / "big.dat", 128 << 20)
    out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(root)], check=True,
                         capture_output=True, text=True).stdout
    grew = int(out.strip())
    assert grew < 16 << 20, f"peak RSS grew by {grew >> 20} MiB for a 128 MiB file"
    assert filecmp.cmp(root / "big.dat", root / "out" / "big.dat", shallow=False)
