"""A reader's hold on a remote step while it is read: through the daemon where it answers, else
a hold object in the bucket that the daemon's remote retention honours while it is fresh, on
file:// and a real S3 server (SeaweedFS). Stale and hostile hold objects hold nothing for long
and cost a bounded listing; a step deleted under a read that holds nothing fails it with
NotFound naming the object."""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.ckpts import save_single
from support.passthrough import PassThrough
from support.published import publish
from support.uploads import s3_backend, upload_cfg, wait_remote
from support.wait import wait_until

from ckptd.backends import Backend, LocalBackend
from ckptd.backends.base import ObjectMeta, Source
from ckptd.config import load_config, parse_config
from ckptd.errors import NotFound, PermanentError
from ckptd.fetch import holds
from ckptd.fetch.openfile import RemoteFile
from ckptd.fetch.source import read_remote_manifest
from ckptd.fetch.step import RemoteStep
from ckptd.remote.keys import manifest_exists
from ckptd.restore.files import restore
from ckptd.stages.upload import delete_step

pytest_plugins = ["s3server"]  # fixtures: s3_server, s3_url

KEEP_ONE = {"remote": {"keep_last": 1, "keep_best": 0, "keep_every": 0, "keep_within": ""}}


class ReadOnly(PassThrough):
    """A backend whose credentials may read but not write (a put is refused, as S3 refuses it
    with 403): every read passes through."""

    def put(self, key: str, src: Source, size: int | None = None, *,
            create_only: bool = False, if_match: str | None = None) -> ObjectMeta:
        raise PermanentError(f"{self.url}/{key}: access denied (read-only credentials)")

    def delete(self, key: str) -> None:
        raise PermanentError(f"{self.url}/{key}: access denied (read-only credentials)")


@pytest.fixture
def no_daemon(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No daemon answers at the client's default socket: a reader holds through the bucket."""
    monkeypatch.setenv("CKPTD_SOCKET", str(tmp_path / "nobody.sock"))


def s3_env(monkeypatch: pytest.MonkeyPatch, s3: Any) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret_key)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    monkeypatch.setenv("AWS_REGION", s3.region)


@pytest.fixture(params=["file", "s3"])
def remote(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
           ) -> tuple[str, Backend, dict[str, Any]]:
    """(url, a backend on it, the daemon's upload table) on a directory or on SeaweedFS."""
    if request.param == "file":
        url = f"file://{tmp_path / 'remote'}"
        return url, LocalBackend(str(tmp_path / "remote")), upload_cfg(url)
    s3 = request.getfixturevalue("s3_server")
    url = request.getfixturevalue("s3_url")
    s3_env(monkeypatch, s3)
    return url, s3_backend(s3, url), upload_cfg(url, s3)


def published(tmp_path: Path, backend: Backend, steps: tuple[int, ...] = (3,)) -> None:
    root = tmp_path / "r"
    root.mkdir(exist_ok=True)
    for step in steps:
        save_single(root, step)
        publish(root, "r", step, backend)


def _ignore(_n: int) -> None:
    return None


def listed(backend: Backend, prefix: str) -> list[str]:
    return sorted(m.key for m in backend.list(prefix))


# --- the hold object ------------------------------------------------------------------------


def test_a_reader_without_a_daemon_holds_its_step_in_the_bucket(
        tmp_path: Path, remote: Any, no_daemon: None) -> None:
    url, backend, _ = remote
    published(tmp_path, backend)
    with RemoteStep.open("r", 3, remote=url) as step:
        assert step.hold is not None and step.hold.how == "bucket"
        (key,) = listed(backend, "r/_holds")
        assert key == holds.hold_key("r", 3, step.hold.owner)
        doc = json.loads(backend.get_bytes(key))
        assert doc["step"] == 3 and doc["owner"] == step.hold.owner
        assert holds.read_holds(backend, "r", time.time()).steps == {3}
        # what lists the remote prefix sees the same steps as before
        assert [s for s in (3,) if manifest_exists(backend, "r", s)] == [3]
        from ckptd.remote.keys import list_steps
        assert list_steps(backend, "r") == [3]
    assert listed(backend, "r/_holds") == []  # released with the read


def test_ckptd_open_holds_until_the_file_is_closed(tmp_path: Path, no_daemon: None) -> None:
    backend = LocalBackend(str(tmp_path / "remote"))
    published(tmp_path, backend)
    import ckptd

    opener: Any = ckptd.open  # resolved on first use
    with opener("r", 3, "model_step_3.pt", remote=f"file://{tmp_path / 'remote'}") as f:
        assert f.read(2) == b"PK"
        assert holds.read_holds(backend, "r", time.time()).steps == {3}
    assert listed(backend, "r/_holds") == []


def test_a_hold_object_is_renewed_while_the_read_lasts(tmp_path: Path, no_daemon: None) -> None:
    backend = LocalBackend(str(tmp_path / "remote"))
    with holds.ReaderHold(backend, "r", 3, renew_s=0.05) as hold:
        path = tmp_path / "remote" / hold.key
        old = time.time() - 2 * holds.HOLD_TTL_S
        os.utime(path, (old, old))  # as if the read had gone on for ten minutes
        wait_until(lambda: path.stat().st_mtime > old, 10, "the hold object rewritten")
        path.unlink()  # swept by a retention run that judged it stale meanwhile
        wait_until(path.exists, 10, "the hold object written again")
        assert holds.read_holds(backend, "r", time.time()).steps == {3}
    assert not path.exists()


def test_a_read_that_cannot_hold_goes_on_and_a_deleted_step_is_not_found(
        tmp_path: Path, remote: Any, no_daemon: None) -> None:
    _url, backend, _ = remote
    published(tmp_path, backend)
    ro = ReadOnly(backend)
    hold = holds.ReaderHold(ro, "r", 3)
    assert hold.how == "none"  # read-only credentials: no hold, and no error
    step = RemoteStep(ro, "r", 3, read_remote_manifest(ro, "r", 3), hold=hold)
    with step, RemoteFile(step, "model_step_3.pt") as f:  # its block index read already
        delete_step(backend, "r", 3)  # remote retention, with nothing to stop it
        with pytest.raises(NotFound) as err:
            f.read()
    key = step.manifest.files[0].key
    assert f"r/step-3/{key}" in str(err.value) and "missing" in str(err.value)


def test_stale_future_and_hostile_hold_objects_hold_nothing_for_long(tmp_path: Path) -> None:
    backend = LocalBackend(str(tmp_path / "remote"))
    now = time.time()
    held = tmp_path / "remote" / "r" / "_holds"
    held.mkdir(parents=True)
    # garbage and a ttl of years in the body: the body is never read, the store's clock decides
    (held / "step-5.a.json").write_bytes(b"\xff{not json")
    (held / "step-6.b.json").write_text(json.dumps({"step": 6, "ttl_s": 10**12}))
    (held / "step-7.c.json").write_text("{}")
    os.utime(held / "step-7.c.json", (now + 100 * holds.HOLD_TTL_S,) * 2)  # far ahead
    (held / "step-8.d.json").write_text("{}")
    os.utime(held / "step-8.d.json", (now - 2 * holds.HOLD_TTL_S,) * 2)  # expired
    (held / "notes.txt").write_text("not a hold")
    (held / "step-007.e.json").write_text("{}")  # not the canonical step name
    got = holds.read_holds(backend, "r", now)
    assert got.steps == {5, 6} and not got.over_cap
    assert sorted(got.stale) == ["r/_holds/step-7.c.json", "r/_holds/step-8.d.json"]
    later = holds.read_holds(backend, "r", now + holds.HOLD_TTL_S + 1)
    assert later.steps == frozenset()  # the huge ttl did not stretch it
    assert holds.sweep_stale(backend, "r", later.stale + ("r/step-5/MANIFEST.json",)) == 4
    assert sorted(p.name for p in held.iterdir()) == ["notes.txt", "step-007.e.json"]


def test_thousands_of_hold_objects_cost_a_bounded_listing(tmp_path: Path) -> None:
    backend = LocalBackend(str(tmp_path / "remote"))
    held = tmp_path / "remote" / "r" / "_holds"
    held.mkdir(parents=True)
    for i in range(holds.MAX_HOLD_OBJECTS + 500):
        (held / f"step-{i}.x.json").write_text("{}")
    t0, c0 = time.monotonic(), time.process_time()
    got = holds.read_holds(backend, "r", time.time())
    assert got.over_cap and got.held(10**9)  # past the cap, every step counts as held
    assert len(got.steps) <= holds.MAX_HOLD_OBJECTS
    assert time.process_time() - c0 < 5 and time.monotonic() - t0 < 10


# --- the daemon's remote retention ----------------------------------------------------------


def _keep_one(inproc_daemon: Any, upload: dict[str, Any]) -> Any:
    return inproc_daemon(roots=[{"name": "r1", "upload": upload, "retention": KEEP_ONE}])


def _saved(d: Any, step: int) -> None:
    save_single(d.roots["r1"], step)
    assert d.client.wait("r1", step, until="uploaded", timeout=60)
    wait_remote(d.client, "r1", step)


def _prune(d: Any) -> None:
    d.client.request_json("POST", "/v1/roots/r1/prune", timeout=120)


def _newer_steps_arrive(d: Any, steps: tuple[int, ...]) -> None:
    for step in steps:
        _saved(d, step)
    _prune(d)


def test_the_daemon_keeps_a_step_a_reader_holds_through_it(inproc_daemon: Any,
                                                           tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'remote'}"
    d = _keep_one(inproc_daemon, upload_cfg(url))
    backend = LocalBackend(str(tmp_path / "remote"))
    _saved(d, 1)
    step = RemoteStep.open("r1", 1, config=d.config)
    try:
        _newer_steps_arrive(d, (2, 3))
        assert not manifest_exists(backend, "r1", 2)  # retention ran and deleted what it could
        assert manifest_exists(backend, "r1", 1)
        assert step.hold is not None and step.hold.how == "daemon"
        assert listed(backend, "r1/_holds") == []  # the daemon holds it: nothing in the bucket
        sink = io.BytesIO()
        step.reader(step.files()[0].path).read(None, lambda _at, v: _ignore(sink.write(v)))
        assert sink.getvalue()[:2] == b"PK"
    finally:
        step.close()
    _prune(d)
    assert not manifest_exists(backend, "r1", 1)


def test_the_daemon_keeps_a_step_held_in_the_bucket(inproc_daemon: Any, remote: Any,
                                                    no_daemon: None) -> None:
    url, backend, upload = remote
    d = _keep_one(inproc_daemon, upload)
    _saved(d, 1)
    with RemoteStep.open("r1", 1, remote=url) as step:
        _newer_steps_arrive(d, (2, 3))
        assert not manifest_exists(backend, "r1", 2)
        assert manifest_exists(backend, "r1", 1)
        assert step.hold is not None and step.hold.how == "bucket"
        sink = io.BytesIO()
        step.reader(step.files()[0].path).read(None, lambda _at, v: _ignore(sink.write(v)))
        assert sink.getvalue()[:2] == b"PK"
    _prune(d)
    wait_until(lambda: not manifest_exists(backend, "r1", 1), 30, "step 1 deleted once released")


def test_an_expired_hold_object_does_not_keep_a_step(inproc_daemon: Any, tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'remote'}"
    d = _keep_one(inproc_daemon, upload_cfg(url))
    backend = LocalBackend(str(tmp_path / "remote"))
    _saved(d, 1)
    left = tmp_path / "remote" / "r1" / "_holds" / "step-1.crashed-reader.json"
    left.parent.mkdir()
    left.write_text("{}")  # a reader that died without releasing it, long ago
    old = time.time() - 2 * holds.HOLD_TTL_S
    os.utime(left, (old, old))
    _newer_steps_arrive(d, (2,))
    wait_until(lambda: not manifest_exists(backend, "r1", 1), 30, "step 1 deleted")
    assert not left.exists()  # swept: it held nothing


# --- every way in holds the step while it reads ---------------------------------------------


def test_ckptd_restore_holds_the_step_while_it_restores(tmp_path: Path, remote: Any) -> None:
    url, backend, upload = remote
    published(tmp_path, backend)
    cfg = parse_config({"daemon": {"state_dir": str(tmp_path / "state"),
                                   "socket": str(tmp_path / "nobody.sock")},
                        "roots": [{"name": "r", "path": str(tmp_path / "elsewhere"),
                                   "upload": upload}]}, tmp_path)
    seen: list[list[str]] = []
    step, paths = restore(cfg, "r", 3, tmp_path / "out",
                          progress=lambda _done, _total: seen.append(listed(backend, "r/_holds")))
    assert step == 3 and [p.name for p in paths] == ["model_step_3.pt"]
    assert seen and all(len(keys) == 1 and "/step-3." in keys[0] for keys in seen)
    assert listed(backend, "r/_holds") == []


def test_the_dcp_reader_holds_the_step_until_its_last_read(tmp_path: Path, no_daemon: None
                                                           ) -> None:
    import torch.distributed.checkpoint as dcp
    from support.dcp_state import ROOT, blank_like, same, saved, state

    from ckptd.dcp import StorageReader

    backend = LocalBackend(str(tmp_path / "remote"))
    saved(tmp_path, backend, 3)
    reader = StorageReader(ROOT, step=3, remote=f"file://{tmp_path / 'remote'}")
    reader.read_metadata()  # what dcp.load asks first: the step is open and held from here
    assert holds.read_holds(backend, ROOT, time.time()).steps == {3}
    dest = blank_like(state(3))
    dcp.load(dest, storage_reader=reader, no_dist=True)  # type: ignore[attr-defined]
    assert same(dest, state(3))
    assert listed(backend, f"{ROOT}/_holds") == []  # released after its read_data


def test_a_remote_torch_load_holds_the_step_while_it_fills(tmp_path: Path,
                                                           no_daemon: None) -> None:
    import torch

    import ckptd.torch as ckpt

    backend = LocalBackend(str(tmp_path / "remote"))
    root = tmp_path / "r"
    ckpt.save(root, 3, model=torch.nn.Linear(8, 4), register=False)
    publish(root, "r", 3, backend)
    seen: list[list[str]] = []

    class Watched(torch.nn.Linear):
        def load_state_dict(self, *args: Any, **kw: Any) -> Any:
            seen.append(listed(backend, "r/_holds"))
            return super().load_state_dict(*args, **kw)

    step, _ = ckpt.load(tmp_path / "fresh" / "r", model=Watched(8, 4), source="remote",
                        remote=f"file://{tmp_path / 'remote'}")
    assert step == 3 and len(seen) == 1 and len(seen[0]) == 1 and "/step-3." in seen[0][0]
    assert listed(backend, "r/_holds") == []


# --- the hold objects' names and times as input ---------------------------------------------

names = st.one_of(
    st.text(max_size=80),
    st.builds(lambda s, o, x: f"step-{s}.{o}{x}", st.integers(-5, 2**64),
              st.text(max_size=70) | st.from_regex(r"[A-Za-z0-9_.-]{1,66}", fullmatch=True),
              st.sampled_from([".json", ".json.tmp", "", ".JSON"])))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(names)
def test_fuzz_a_hold_key_parses_only_as_written(name: str) -> None:
    got = holds.parse_hold_key("r", f"r/_holds/{name}")
    if got is not None:
        step, owner = got
        assert 0 <= step < 2**63
        assert holds.hold_key("r", step, owner) == f"r/_holds/{name}"


class Listing:
    """A bucket that only lists (all `read_holds` asks of one)."""

    def __init__(self, metas: list[ObjectMeta]) -> None:
        self.metas = metas

    def list(self, prefix: str = "") -> Iterator[ObjectMeta]:
        return iter(m for m in self.metas if m.key.startswith(prefix + "/"))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(names, st.floats(allow_nan=True, allow_infinity=True)), max_size=30))
def test_fuzz_any_listing_of_holds_is_read_within_its_rule(objs: list[tuple[str, float]]) -> None:
    now = 1.8e9
    metas = [ObjectMeta(f"r/_holds/{n}", 2, t) for n, t in objs]
    got = holds.read_holds(Listing(metas), "r", now)  # type: ignore[arg-type]
    fresh = {p[0] for m in metas if (p := holds.parse_hold_key("r", m.key))
             and abs(m.mtime - now) <= holds.HOLD_TTL_S}
    assert got.steps == fresh and not got.over_cap
    assert all(holds.parse_hold_key("r", k) is not None for k in got.stale)


def test_a_local_restore_holds_its_step_through_the_daemon(inproc_daemon: Any,
                                                           tmp_path: Path) -> None:
    """The daemon releases a compressed copy once its upload is done; a restore reading that
    copy holds the step through the daemon, so the release waits for the read."""
    from support.compress import stage
    from support.layouts_real import detect

    d = _keep_one(inproc_daemon, upload_cfg(f"file://{tmp_path / 'remote'}"))
    _saved(d, 1)
    root = d.roots["r1"]
    [cand] = [c for c in detect(root) if c.step == 1]
    stage(root, cand, "zstd")  # a copy the daemon would release, as it does after an upload
    held: list[bool] = []
    step, paths = restore(load_config(d.config), "r1", 1, tmp_path / "out",
                          progress=lambda _d, _t: held.append(1 in d.store.in_use("r1",
                                                                                  time.time())))
    assert step == 1 and [p.name for p in paths] == ["model_step_1.pt"]
    assert held and all(held)
    assert 1 not in d.store.in_use("r1", time.time())
