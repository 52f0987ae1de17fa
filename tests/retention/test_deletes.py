"""Every delete of checkpoint bytes goes through the retention executor.

A walk over ckptd/'s syntax trees finds every call that deletes (os.unlink, os.remove,
os.rmdir, shutil.rmtree, fileio.remove_tree, Path.unlink/rmdir, a backend's delete, the
remote delete_step) or may delete by overwrite (os.rename/replace, shutil.move,
Path.rename/replace): each must sit in a function of the allow-list below, named precisely,
which says why it is not a checkpoint's bytes (and every entry must still hold one). A new
delete anywhere else fails here. Then the executor's entry points, each behind its nets, on
real files; and the re-save of a step held as a compressed copy, on a real daemon.
"""

from __future__ import annotations

import ast
import json
import os
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from support.ckpts import save_single
from support.nets import FixedNets
from support.wait import wait_until
from support.wire import cli

from ckptd.backends.local import LocalBackend
from ckptd.copies import store as copies
from ckptd.errors import CorruptData
from ckptd.model import Candidate, Local, Remote
from ckptd.remote import keys as remote
from ckptd.remote.manifest import Manifest
from ckptd.retention import executor, trash
from ckptd.retention.nets import SHARED
from ckptd.stages import compress
from ckptd.stages.upload import delete_step, upload_step
from ckptd.stages.validate import validate

CKPTD = Path(__file__).resolve().parents[2] / "ckptd"

# Attribute calls that delete whatever they are called on (a Path, a backend, os, shutil).
_DELETING_ATTRS = {"unlink", "rmdir", "rmtree", "removedirs", "delete", "remove_tree"}
# Plain names that are (or wrap) a delete.
_DELETING_NAMES = {"rmtree", "unlink", "rmdir", "remove_tree", "_remove_tree", "_unlink_quietly",
                   "delete_step"}
# Deletes by overwrite: a rename or replace onto a name that exists drops what was there
# (os.rename/replace/renames, shutil.move; Path.rename/replace, which take one argument:
# str.replace takes two and dataclasses.replace is called on its module).
_RENAMING_FUNCS = {("os", "rename"), ("os", "replace"), ("os", "renames"), ("shutil", "move")}
_RENAMING_METHODS = {"rename", "replace"}

# Every place allowed to delete or overwrite, named precisely (module, function; a nested
# helper counts as its enclosing function), with what it deletes: never a checkpoint's bytes
# outside the executor's entry points. No whole modules and no wildcards: a new delete in a
# module already listed fails here too.
ALLOWED_FUNCTIONS = {
    # The executor and its trash: the one place checkpoint bytes are deleted.
    ("ckptd.retention.executor", "_remove_remote"):
        "a remote step, through its DeleteStep, behind the nets read under the lock",
    ("ckptd.retention.executor", "_discard_early"):
        "an uncommitted step's objects its own save sent early, each still the one put",
    ("ckptd.retention.executor", "install_copy"):
        "renames a staged compressed copy in, after the superseded one went into the trash",
    ("ckptd.retention.trash", "purge"): "a trash entry, after its delete was recorded",
    ("ckptd.retention.trash", "restore"): "a trash entry whose names were put back",
    ("ckptd.retention.trash", "purge_trash"): "start-up recovery of the trash",
    ("ckptd.retention.trash", "remove_emptied_dirs"): "directories a trash move left empty",
    ("ckptd.retention.trash", "move_into_trash"): "its own trash entry, when nothing moved",
    ("ckptd.retention.trash", "_rename_unless_gone"): "a checkpoint's name moved into the trash",
    ("ckptd.retention.trash", "_put_names_back"): "a trashed name renamed back to a free place",
    # Storage primitives beneath the executor.
    ("ckptd.backends.localfiles", "put_file"): "its own temp file of a failed put",
    ("ckptd.backends.localfiles", "delete_file"): "the file:// delete primitive",
    ("ckptd.backends.localfiles", "_write_temp"): "its own temp file of a failed write",
    ("ckptd.backends.local", "LocalBackend._prune_empty_dirs"): "prefix dirs a delete emptied",
    ("ckptd.backends.localfiles", "_commit"): "the put primitive: temp renamed in",
    ("ckptd.backends.localfiles", "_replace_if"): "conditional put: temp renamed in",
    ("ckptd.backends.localfiles", "_unlink_quietly"): "the backend's own temp and lock files",
    ("ckptd.backends.localfiles", "_unlink_if_older"): "a crashed put's stale temp file",
    ("ckptd.backends.objstore", "ObstoreBackend.delete"): "the object-store delete primitive",
    ("ckptd.backends.wrappers", "RetryingBackend.delete"): "forwards to the wrapped backend",
    ("ckptd.backends.wrappers", "ThrottledBackend.delete"): "forwards to the wrapped backend",
    ("ckptd.backends.wrappers", "LimitedBackend.delete"): "forwards to the wrapped backend",
    ("ckptd.fileio.durable", "atomic_write_bytes"):
        "its own temp file, renamed over the file it writes",
    ("ckptd.fileio.paths", "remove_tree"): "the primitive the trash and the listed places call",
    ("ckptd.fileio.paths", "_open_dir_or_unlink"): "remove_tree's own step",
    # The remote-step delete protocol, handed only to the executor.
    ("ckptd.stages.upload", "delete_step"):
        "the remote-step delete protocol; only ever passed to the executor "
        "(execute_remote, replace_remote) as its DeleteStep",
    ("ckptd.copies.store", "remove_stale_staging"): "compress staging dirs a crash left",
    ("ckptd.stages.compress", "Stager.abort"): "this Stager's own staging dir",
    ("ckptd.stages.compress", "Stager._name_objects"): "its staged objects' temp names renamed",
    ("ckptd.stages.compress", "_ObjectSink.discard"): "a staged object's temp file",
    ("ckptd.stages.compress", "_install_new"):
        "a bare Stager's copy renamed in where none is (it never replaces one)",
    ("ckptd.stages.sending.ledger", "Ledger._open"): "the upload ledger's old-format file",
    ("ckptd.stages.multinode.parts", "_probe"): "the create-only probe object it just wrote",
    ("ckptd.arena_write", "commit"): "the save's own rendezvous markers (every native writer's)",
    ("ckptd.arena_write", "swap"):
        "renames the new save in, the earlier save of the step aside (the daemon's writer "
        "calls it inside executor.replace_save, behind its nets, which trashes that one)",
    ("ckptd.arena_write", "replace_here"):
        "the trainer's own earlier save of a step it saves again, in the trainer's process "
        "(ckptd.torch's fallback writer), as ckptd.torch does",
    ("ckptd.arena_write", "fresh_dir"):
        "a stale half-written save dir of the door, or of the trainer's own interrupted save",
    ("ckptd.arena_write", "_write_one"): "a file of the save it is writing, written again",
    ("ckptd.remote.keys", "retreat_latest"): "the LATEST pointer object, not a step's bytes",
    ("ckptd.fetch.holds", "sweep_stale"): "readers' hold objects no longer fresh, not a step's",
    ("ckptd.fetch.holds", "_Held.end"): "the reader's own hold object, at the end of its read",
    ("ckptd.remote.keys", "_swap"): "an unreadable LATEST pointer object, rewritten",
    ("ckptd.service.recovery", "remove_stale_temps"): "ckptd's own temp files",
    ("ckptd.service.lease_files", "retire_claims"): "the root lease's own claim files",
    ("ckptd.service.lease_files", "drop_claims_below"): "the root lease's own claim files",
    ("ckptd.daemon", "Daemon.stop"): "the daemon's own socket",
    ("ckptd.api.door", "bind_socket"): "a stale socket at the configured path",
    ("ckptd.cli.doctor", "_probe_dir"): "doctor's own probe file",
    ("ckptd.cli.doctor", "remote_check"): "doctor's own probe object",
    ("ckptd.demo", "_reset"): "the demo's own scratch directories, inside ./.demo only",
    ("ckptd.restore.files", "_restore_file"): "restore's own temp file, renamed into the target",
    ("ckptd.restore.files", "all_or_nothing"): "restore's own staging in the target",
    ("ckptd.fetch.pipe", "_attempt"): "restore's own temp file, renamed into the target",
    ("ckptd.torch._native", "save"): "the trainer's own failed save dir, in its process",
    ("ckptd.torch._nodelocal", "save"): "the trainer's own rendezvous probes",
    ("ckptd.torch._nodelocal", "_clear"): "what an interrupted save of the trainer left",
}


def _deleting(call: ast.Call) -> str | None:
    f = call.func
    if isinstance(f, ast.Attribute):
        if f.attr in _DELETING_ATTRS:
            return f.attr
        if f.attr == "remove" and isinstance(f.value, ast.Name) and f.value.id == "os":
            return "os.remove"
        if isinstance(f.value, ast.Name) and (f.value.id, f.attr) in _RENAMING_FUNCS:
            return f"{f.value.id}.{f.attr}"
        if (f.attr in _RENAMING_METHODS and len(call.args) == 1 and not call.keywords
                and not (isinstance(f.value, ast.Name) and f.value.id == "dataclasses")):
            return f"Path.{f.attr}"
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
    # A nested helper counts as its enclosing function.
    parts = scope.split(".")
    return any((module, ".".join(parts[:i])) in ALLOWED_FUNCTIONS for i in range(1, len(parts) + 1))


def test_nothing_outside_the_executor_deletes() -> None:
    calls = delete_calls()
    assert any(m == "ckptd.retention.trash" for m, *_ in calls)  # the walk sees deletes
    stray = [f"{m}:{line} {scope or '<module>'}: {what}"
             for m, scope, line, what in calls if not _allowed(m, scope)]
    assert not stray, ("checkpoint bytes are deleted only by ckptd.retention.executor; add an "
                       "executor entry point, or (for ckptd's own temp/state files only) an "
                       "entry with its reason to ALLOWED_FUNCTIONS:\n" + "\n".join(stray))


def test_every_allowed_place_still_deletes() -> None:
    """The allow-list names only places where the walk finds a delete: an entry left behind
    by a move or a removal would let a new delete there pass unseen."""
    calls = delete_calls()
    stale = [f"{m}:{f}" for m, f in ALLOWED_FUNCTIONS
             if not any(cm == m and (s == f or s.startswith(f + ".")) for cm, s, *_ in calls)]
    assert not stale, f"allow-list entries with no delete left: {stale}"


def test_the_walk_catches_each_kind_of_delete() -> None:
    src = ("import os, shutil, dataclasses\n"
           "def f(p, q, backend, Path, rec):\n"
           "    os.unlink(p); os.remove(p); os.rmdir(p); shutil.rmtree(p)\n"
           "    Path(p).unlink(); Path(p).rmdir(); backend.delete('k'); [].remove(1)\n"
           "    os.rename(p, q); os.replace(p, q, src_dir_fd=3); shutil.move(p, q)\n"
           "    Path(p).rename(q); Path(p).replace(q); os.renames(p, q)\n"
           "    'a'.replace('a', 'b'); dataclasses.replace(rec); rec.replace(step=1)\n")
    found = [_deleting(n) for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Call)]
    assert sorted(w for w in found if w) == sorted(
        ["unlink", "os.remove", "rmdir", "rmtree", "unlink", "rmdir", "delete",
         "os.rename", "os.replace", "shutil.move", "Path.rename", "Path.replace",
         "os.renames"])


def test_executor_delete_calls_are_its_only_callers_of_delete_step() -> None:
    """`delete_step` is the remote delete protocol: outside its module it is only ever handed
    to an executor entry point (which calls what it is given), never called."""
    for path in sorted(CKPTD.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                allowed = path.name in ("upload.py", "executor.py")
                assert node.func.id != "delete_step" or allowed, path


# --- the executor's entry points, behind their nets -------------------------------------------


def nets(**kw: Any) -> FixedNets:
    base: dict[str, Any] = {"latest_step": None, "best_step": None, "pinned": frozenset(),
                            "in_use": frozenset(), "committed": frozenset(),
                            "upload_configured": False}
    base.update(kw)
    return FixedNets(executor.Guards(**base))


def staged(root: Path, step: int, n: int = 64) -> tuple[Path, Manifest]:
    """A real torch checkpoint and its verified local compressed copy, as the daemon makes it."""
    path = save_single(root, step, n=n)
    rel = path.name
    cand = Candidate("single", step, rel, (rel,), complete=True)
    st = compress.Stager(root, "r", step, "single", "zstd", 3, 1, 0.03,
                         install=partial(executor.install_copy, root, step, nets=nets()))
    result = validate(root, cand, extra_sinks=st.sinks_for)
    assert result.valid, result
    return path, st.commit(result.files, result.metrics)


def copy_of(step: int, local: Local = Local.PRESENT) -> executor.Target:
    return executor.Target(step, f".ckptd/objects/step-{step}", (), local, Remote.UPLOADED, True)


def test_release_copy_nets(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    staged(root, 1)
    copy = copies.objects_dir(root, 1)
    # A reader holds the step: its copy stays, whether or not the originals are there.
    for local in (Local.PRESENT, Local.PRUNED):
        out = executor.release_copy(root, copy_of(1, local), nets(in_use=frozenset({1})))
        assert (out.action, out.reason) == ("refused", "in_use") and copy.is_dir()
    # The copy that is the checkpoint's local form is never released.
    out = executor.release_copy(root, copy_of(1, Local.COMPRESSED), nets())
    assert out.action == "refused" and out.reason.startswith("compressed:") and copy.is_dir()
    # With the originals gone it is the last local form: every prune net holds it.
    for kw, why in (({"latest_step": 1}, "latest"), ({"best_step": 1}, "best"),
                    ({"pinned": frozenset({1})}, "pinned"),
                    ({"upload_configured": True}, "not_uploaded")):
        out = executor.release_copy(root, copy_of(1, Local.PRUNED), nets(**kw))
        assert (out.action, out.reason) == ("refused", why) and copy.is_dir()
    # Beside its originals it is a spare: latest, best or pinned lose nothing by it.
    g = nets(latest_step=1, best_step=1, pinned=frozenset({1}), upload_configured=True)
    out = executor.release_copy(root, copy_of(1), g)
    assert out.action == "deleted" and out.bytes_freed > 0 and not copy.exists()
    assert os.listdir(trash.trash_dir_for(root)) == []
    assert (root / "model_step_1.pt").is_file()


def test_a_copy_another_owner_trashed_first_is_gone_not_failed(tmp_path: Path) -> None:
    """Two owners of one copy's delete: the copy release after an upload (the effects hook)
    and retention's prune of the step. The one that looked first finds, when it moves, the
    copy already in the trash through the other: its delete is done, not `prune_failed`."""
    root = tmp_path / "root"
    root.mkdir()
    staged(root, 1)
    real_root = root.resolve()
    trash_real = trash.own_trash(real_root)
    # The first owner has looked: the copy is there, and its move is planned.
    planned = trash.dir_move(real_root, ".ckptd/objects/step-1", [], trash_real)
    assert [name for name, _ in planned] == [".ckptd/objects/step-1"]
    # The other owner goes first, through the executor.
    out = executor.release_copy(root, copy_of(1), nets())
    assert out.action == "deleted" and out.bytes_freed > 0
    # Then the first one's move: nothing is left to move, which is a done delete.
    assert trash.move_into_trash(real_root, 1, planned, trash_real) is None
    assert os.listdir(trash.trash_dir_for(root)) == []
    assert not copies.objects_dir(root, 1).exists() and (root / "model_step_1.pt").is_file()


def test_every_delete_reads_its_nets_under_the_lock(tmp_path: Path) -> None:
    """Each entry point reads its guards itself, under the lock pins and holds take, and
    moves before letting go: a pin landing right after the reading waits for the delete."""
    root = tmp_path / "root"
    root.mkdir()
    staged(root, 1)
    lock = threading.RLock()
    seen: list[bool] = []

    def at_read() -> None:  # inside held(): the lock is this thread's; the copy still there
        seen.append(copies.objects_dir(root, 1).is_dir())
        assert lock._is_owned()  # type: ignore[attr-defined]

    held = FixedNets(nets().guards, lock=lock, on_read=at_read)
    out = executor.release_copy(root, copy_of(1), held)
    assert out.action == "deleted" and held.reads == 1 and seen == [True]
    assert not lock._is_owned()  # type: ignore[attr-defined]


def test_guards_are_built_only_where_the_store_is_read_under_the_lock() -> None:
    """Nobody builds guards by hand (once with latest, best and pins left empty): `Guards` is
    made in `views.guards_for` only, and that is called by `StoreNets.held` only, under the
    lock; the executor takes a `Nets`, never a `Guards`."""
    built: list[str] = []
    for path in sorted(CKPTD.rglob("*.py")):
        module = path.relative_to(CKPTD.parent).as_posix()

        def walk(node: ast.AST, scope: list[str]) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    walk(child, [*scope, child.name])
                    continue
                if isinstance(child, ast.Call):
                    f = child.func
                    name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                    if name in ("Guards", "guards_for"):
                        built.append(f"{module}:{'.'.join(scope)}: {name}")  # noqa: B023
                walk(child, scope)

        walk(ast.parse(path.read_text(), str(path)), [])
    assert sorted(built) == ["ckptd/retention/views.py:StoreNets.held: guards_for",
                             "ckptd/retention/views.py:guards_for: Guards"], built


def test_release_copy_refuses_anything_but_a_copy(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    path, _ = staged(root, 1)
    bad = executor.Target(1, path.name, (), Local.PRESENT, Remote.UPLOADED, True)
    out = executor.release_copy(root, bad, nets())
    assert out.action == "refused" and "not a compressed copy" in out.reason and path.is_file()


def test_replace_originals_nets(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    path, manifest = staged(root, 1)
    target = executor.Target(1, path.name, (path.name,), Local.PRESENT, Remote.NONE, False)
    checked: list[int] = []

    def check() -> None:
        checked.append(1)
        copies.check_replaceable(root, manifest, [path.name])

    for kw, why in (({"latest_step": 1}, "latest"), ({"in_use": frozenset({1})}, "in_use"),
                    ({"invalid": frozenset({1})}, "invalid"),
                    ({"shared": frozenset({1})}, SHARED)):
        out = executor.replace_originals(root, target, nets(**kw), check)
        assert (out.action, out.reason) == ("refused", why) and path.is_file()
    assert not checked  # a net refuses before anything is read
    # A changed original fails the check: kept.
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    out = executor.replace_originals(root, target, nets(), check)
    assert out.action == "failed" and "differs" in out.reason and path.is_file()
    path.write_bytes(data)
    # Pinned and best are compressed like the others (they stay restorable): a policy choice.
    g = nets(best_step=1, pinned=frozenset({1}), upload_configured=True)
    out = executor.replace_originals(root, target, g, check)
    assert out.action == "deleted" and out.bytes_freed == len(data) and not path.exists()
    assert os.listdir(trash.trash_dir_for(root)) == []
    assert copies.local_steps(root) == [1]


def test_replace_originals_cut_short_is_put_back_at_start(tmp_path: Path) -> None:
    """A crash while the originals move into the trash (journal "moving"): start-up's
    purge_trash puts them back beside the copy, and the next replace finishes the job."""
    root = tmp_path / "root"
    (root / "ck").mkdir(parents=True)
    for name in ("a.dat", "b.dat"):
        (root / "ck" / name).write_bytes(os.urandom(5000))
    cand = Candidate("registered", 7, "ck", ("ck/a.dat", "ck/b.dat"), complete=True)
    st = compress.Stager(root, "r", 7, "registered", "zstd", 3, 1, 0.03)
    result = validate(root, cand, extra_sinks=st.sinks_for)
    manifest = st.commit(result.files, result.metrics)
    saved = {n: (root / n).read_bytes() for n in cand.files}
    # What a crash after the first rename leaves: a "moving" entry holding a.dat only.
    entry = trash.trash_dir_for(root) / "step-7.cut"
    (entry / trash.DATA_NAME / "ck").mkdir(parents=True)
    os.rename(root / "ck" / "a.dat", entry / trash.DATA_NAME / "ck" / "a.dat")
    (entry / trash.JOURNAL_NAME).write_text(json.dumps(
        {"format": "ckptd-trash/1", "step": 7, "state": "moving",
         "names": ["ck/a.dat", "ck/b.dat"]}))
    assert trash.purge_trash(trash.trash_dir_for(root), root) == 0
    assert {n: (root / n).read_bytes() for n in cand.files} == saved
    target = executor.Target(7, "ck", cand.files, Local.PRESENT, Remote.NONE, False)
    out = executor.replace_originals(
        root, target, nets(), lambda: copies.check_replaceable(root, manifest, cand.files))
    assert out.action == "deleted" and not (root / "ck").exists()


def test_replace_remote_nets(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    _, manifest = staged(root, 1)
    backend = LocalBackend(tmp_path / "remote")
    upload_step(backend, "r", copies.objects_dir(root, 1), manifest)
    out = executor.replace_remote(backend, "r", 1, nets(in_use=frozenset({1})), delete_step)
    assert (out.action, out.reason) == ("refused", "in_use")
    assert remote.read_manifest(backend, "r", 1) == manifest
    out = executor.replace_remote(backend, "r", 1, nets(pinned=frozenset({1})), delete_step)
    assert out.action == "deleted" and not list(backend.list("r/"))


def test_install_copy_replaces_the_superseded_copy_through_the_trash(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    _, first = staged(root, 1, n=64)
    _, second = staged(root, 1, n=200)  # a re-save of the step
    assert first != second and copies.read_local_manifest(root, 1) == second
    assert os.listdir(copies.objects_root(root)) == ["step-1"]
    assert os.listdir(trash.trash_dir_for(root)) == []
    copies.verify_copy(copies.objects_dir(root, 1), second)


# --- the re-save of a step held as a compressed copy, on a real daemon -----------------------


@pytest.fixture
def thread_errors() -> Iterator[list[BaseException]]:
    """Exceptions that ended any thread while the test ran (watchdog's reader among them)."""
    got: list[BaseException] = []
    before = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None:
            got.append(args.exc_value)
        before(args)

    threading.excepthook = hook
    try:
        yield got
    finally:
        threading.excepthook = before


def inotify_readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ckptd-inotify"]


def test_resave_of_a_step_held_compressed(inproc_daemon: Any, tmp_path: Path,
                                          thread_errors: list[BaseException]) -> None:
    """The trainer saves a step again after ckptd replaced its originals by a compressed copy.
    The re-save's copy used to be swapped in with RENAME_EXCHANGE; the inotify reader of the
    time (watchdog's) lost track of both directories and died on the next delete with a
    KeyError naming `.ckptd/objects/step-N` (the daemon then heard no inotify events at all).
    ckptd's own reader leaves `.ckptd/` unwatched; the test keeps it honest."""
    d = inproc_daemon(roots=[{
        "name": "r1", "upload": {"url": f"file://{tmp_path / 'remote'}"},
        "retention": {"local": {"keep_last": 1, "keep_best": 0, "keep_within": "1h",
                                "compress_older": True, "min_free": "0"}},
    }])
    root, c = d.roots["r1"], d.client
    for step in (1, 2):
        save_single(root, step, n=256)
        assert d.wait_for("r1", step)["state"] == "valid"
        assert c.wait("r1", step, until="uploaded", timeout=60)

    def local_of() -> dict[int, tuple[str, str, int]]:
        return {x["step"]: (x["local"], x["remote"], x["bytes"]) for x in c.checkpoints("r1")}

    wait_until(lambda: local_of().get(1, ("",))[0] == "compressed", 30, "step 1 compressed",
               detail=lambda: d.log_text()[-3000:])
    old_bytes = local_of()[1][2]
    readers = inotify_readers()
    assert readers and all(t.is_alive() for t in readers)

    resaved = save_single(root, 1, n=300).read_bytes()
    wait_until(lambda: (lambda s: s[0] == "compressed" and s[1] == "uploaded"
                        and s[2] != old_bytes)(local_of()[1]), 60,
               "the re-save of step 1 validated, uploaded and compressed again",
               detail=lambda: d.log_text()[-4000:])
    save_single(root, 3, n=64)  # inotify events after the replacement are read too
    assert d.wait_for("r1", 3)["state"] == "valid"
    assert all(t.is_alive() for t in readers), "the inotify reader died"
    assert not thread_errors, thread_errors
    assert "KeyError" not in d.log_text() and "Traceback" not in d.log_text()
    # Step 2 may be on its way through the trash (compressed in place now that 3 is here).
    wait_until(lambda: os.listdir(trash.trash_dir_for(root)) == [], 30, "the trash empty")
    out = tmp_path / "restored"
    r = cli("restore", "r1", "1", "--to", str(out), config=d.config)
    assert r.returncode == 0, r.stderr
    assert (out / "model_step_1.pt").read_bytes() == resaved


def test_a_spare_copy_is_released_by_retention_and_never_under_a_reader(
        inproc_daemon: Any, tmp_path: Path) -> None:
    """compress_older kept step 1's copy after its upload; with compress_older turned off the
    plan releases it, but not while a reader holds the step (`copy:in_use`); once the reader is
    gone it is released through the executor (the originals stay)."""
    d = inproc_daemon(roots=[{
        "name": "r1", "upload": {"url": f"file://{tmp_path / 'remote'}"},
        "retention": {"local": {"keep_last": 2, "compress_older": True, "min_free": "0"}},
    }])
    root, c = d.roots["r1"], d.client
    save_single(root, 1, n=128)
    assert d.wait_for("r1", 1)["state"] == "valid"
    assert c.wait("r1", 1, until="uploaded", timeout=60)
    copy = copies.objects_dir(root, 1)
    assert copy.is_dir()  # kept: compress_older may still want it

    def plan_of_1() -> dict[str, Any]:
        r = cli("prune", "r1", "--dry-run", "--json", sock=d.socket)
        assert r.returncode == 0, r.stderr
        return next(i for i in json.loads(r.stdout)["plan"] if i["step"] == 1)

    with c.hold("r1", 1):  # held before the reload: retention runs at once after it
        d.config.write_text(d.config.read_text().replace("compress_older = true",
                                                         "compress_older = false"))
        assert d.reload() is True
        plan = plan_of_1()
        assert plan["copy"] == "keep" and "copy:in_use" in plan["reasons"], plan
        r = cli("prune", "r1", "--apply", "--json", sock=d.socket)
        assert r.returncode == 0, r.stderr
        assert copy.is_dir()  # (the executor's own net: test_release_copy_nets)
    # The reader gone, the plan releases the copy (`copy: delete`, `copy:released`; the golden
    # plan copies_released holds the words): retention's own run or this one, whichever first.
    r = cli("prune", "r1", "--apply", "--json", sock=d.socket)
    assert r.returncode == 0, r.stderr
    wait_until(lambda: not copy.exists(), 30, what="the spare copy released")
    assert (root / "model_step_1.pt").is_file()
    wait_until(lambda: os.listdir(trash.trash_dir_for(root)) == [], 30, what="trash purged")
    assert "copy" not in plan_of_1()


def test_recovery_releases_a_copy_the_store_dropped_through_the_executor(
        inproc_daemon: Any, tmp_path: Path) -> None:
    """A crash after `copy_dropped` committed but before the copy's files went: start-up
    releases it (executor.release_copy, through the trash)."""
    d = inproc_daemon(roots=[{"name": "r1", "upload": {"url": f"file://{tmp_path / 'remote'}"}}])
    root, c = d.roots["r1"], d.client
    save_single(root, 1, n=128)
    assert d.wait_for("r1", 1)["state"] == "valid"
    assert c.wait("r1", 1, until="uploaded", timeout=60)
    copy = copies.objects_dir(root, 1)
    wait_until(lambda: not copy.exists(), 30, "the copy released after the upload")
    d.stop()
    # What the crash left: the copy's files, which the store already counts as gone.
    st = compress.Stager(root, "r1", 1, "single", "zstd", 3, 1, 0.03)
    cand = Candidate("single", 1, "model_step_1.pt", ("model_step_1.pt",), complete=True)
    result = validate(root, cand, extra_sinks=st.sinks_for)
    st.commit(result.files, result.metrics)
    assert copy.is_dir()
    d.start()
    recovered = d.events("daemon_recovered")[-1]
    assert recovered["released_copies_removed"] == 1, recovered
    assert not copy.exists() and (root / "model_step_1.pt").is_file()
    assert os.listdir(trash.trash_dir_for(root)) == []


def test_a_trash_journal_that_is_no_regular_file_never_stalls_recovery(tmp_path: Path) -> None:
    """The trash lies in the root: a FIFO or a huge file at an entry's journal is read through
    the bounded reader (never waited on), so start-up recovery goes on."""
    root = tmp_path / "root"
    bin_dir = trash.trash_dir_for(root)
    for name, make in (("fifo", os.mkfifo), ("huge", lambda p: open(p, "wb").truncate(1 << 40))):
        entry = bin_dir / name
        entry.mkdir(parents=True)
        (entry / "victim.bin").write_bytes(b"x")
        make(entry / trash.JOURNAL_NAME)
    assert trash.purge_trash(bin_dir, root) == 2
    assert list(bin_dir.iterdir()) == []


def test_a_local_manifest_that_is_no_regular_file_is_refused_at_once(tmp_path: Path) -> None:
    root = tmp_path / "root"
    copy = copies.objects_dir(root, 3)
    copy.mkdir(parents=True)
    os.mkfifo(copy / "MANIFEST.json")
    with pytest.raises(CorruptData, match="MANIFEST.json"):
        copies.read_local_manifest(root, 3)
