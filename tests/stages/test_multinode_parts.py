"""The multi-node upload stage (ckptd.stages.multinode.parts) against a real file:// store: the
probe refuses a store that ignores create-only writes; two nodes' shares commit once, by the
coordinator, with both parts; a re-run sends nothing; a node whose part is not in the commit
is told so; `restore --node` picks a node's files and the record. docs/MULTINODE.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ckptd.backends.local import LocalBackend
from ckptd.cluster import commit as cc
from ckptd.errors import BadPart, PermanentError, TransientError
from ckptd.remote.keys import read_manifest
from ckptd.remote.manifest import Manifest, StoredFile, for_node
from ckptd.stages.multinode import parts, records


class IgnoresCreateOnly:
    """A store (a gateway, say) that drops the conditional header: every put overwrites."""

    def __init__(self, inner: LocalBackend) -> None:
        self.inner = inner
        self.url = inner.url + "#ignores-create-only"
        self.part_size = inner.part_size

    def put(self, key: str, src: Any, size: int | None = None, *,
            create_only: bool = False, if_match: str | None = None) -> Any:
        return self.inner.put(key, src, size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _share(tmp: Path, node: str, files: dict[str, bytes], mtime: float,
           record: cc.CommitRecord | None = None) -> tuple[Path, Manifest, parts.Share]:
    """One node's local compressed copy (codec none: the object is the file) and its share."""
    objects = tmp / node / "objects"
    stored = []
    for path, data in files.items():
        (objects / path).parent.mkdir(parents=True, exist_ok=True)
        (objects / path).write_bytes(data)
        import xxhash

        stored.append(StoredFile(path, len(data), xxhash.xxh3_128_hexdigest(data), "xxh3-128",
                                 "none", len(data), path))
    manifest = Manifest("job", 7, "dcp", tuple(stored))
    share = parts.Share(node=node, commit_timeout=60.0, record=record,
                        mtimes={p: mtime for p in files})
    return objects, manifest, share


def test_the_probe_refuses_a_store_that_ignores_create_only(tmp_path: Path) -> None:
    good = LocalBackend(tmp_path / "good")
    parts.require_create_only(good, "job")
    bad = IgnoresCreateOnly(LocalBackend(tmp_path / "bad"))
    with pytest.raises(PermanentError, match="ignores conditional writes"):
        parts.require_create_only(bad, "job")  # type: ignore[arg-type]
    assert not list((tmp_path / "good").rglob("_probe/*"))  # the probe key is removed


def test_two_shares_commit_once_with_both_parts(tmp_path: Path) -> None:
    store = LocalBackend(tmp_path / "remote")
    t = 1_700_000_000.0
    record = cc.CommitRecord("step-7/.metadata", t + 2, {"step-7/__0_0.distcp": 4,
                                                   "step-7/__1_0.distcp": 4})
    c_dir, c_man, c_share = _share(tmp_path, "n0", {"step-7/.metadata": b"meta",
                                                    "step-7/__0_0.distcp": b"zero"}, t + 1,
                                   record)
    o_dir, o_man, o_share = _share(tmp_path, "n1", {"step-7/__1_0.distcp": b"one!"}, t)
    with pytest.raises(parts.NotCommitted) as waiting:
        parts.upload_share(store, "job", c_dir, c_man, c_share, now=t + 10)
    assert waiting.value.missing_nodes == []  # n1 is not known yet: no part, no commit
    assert "__1_0.distcp in no part" in str(waiting.value)
    with pytest.raises(parts.NotCommitted):  # not the coordinator, before the timeout
        parts.upload_share(store, "job", o_dir, o_man, o_share, now=t + 11)
    done = parts.upload_share(store, "job", c_dir, c_man, c_share, now=t + 12)
    assert done.uploaded_objects == 0 and done.skipped_objects == 2  # a re-run sends nothing
    commit = read_manifest(store, "job", 7)
    assert {(n, r) for n, _a, r in commit.nodes} == {("n0", "step-7/.metadata"), ("n1", "")}
    assert sorted(f.path for f in commit.files) == [
        "step-7/.metadata", "step-7/__0_0.distcp", "step-7/__1_0.distcp"]
    parts.upload_share(store, "job", o_dir, o_man, o_share, now=t + 13)  # finds the commit
    mine = for_node(commit, "n1")
    assert sorted(f.path for f in mine.files) == ["step-7/.metadata", "step-7/__1_0.distcp"]
    assert for_node(commit, "*") == commit
    with pytest.raises(ValueError, match="not 'n9'"):
        for_node(commit, "n9")

    # A re-save on n1 after the commit: its new part is not in the commit, and it says so.
    r_dir, r_man, r_share = _share(tmp_path / "again", "n1", {"step-7/__1_0.distcp": b"ONE!"},
                                   t + 600)
    with pytest.raises(PermanentError, match="committed without this node's files"):
        parts.upload_share(store, "job", r_dir, r_man, r_share, now=t + 700)


def _status_doc(uncommitted: list[dict[str, Any]]) -> dict[str, Any]:
    """A `status` document of one multi-node root, as the daemon answers it."""
    return {"version": "x", "status": "ok", "uptime_s": 1, "in_flight": [], "roots": [
        {"name": "job", "latest": None, "best": None, "counts": {}, "queue": 0,
         "disk_free_bytes": None, "last_error": None, "uncommitted": uncommitted}]}


def test_status_counts_the_nodes_it_cannot_name() -> None:
    """Before any commit, a node that wrote no part is known to no one: `status` still says
    how many of the root's nodes it cannot name."""
    from ckptd.cli.render import render_status
    from ckptd.service.commits import Waiting

    waiting = Waiting()
    plan = cc.Plan("n0", (), covered=False, missing_nodes=())
    waiting.wait("job", 4, parts.NotCommitted(4, plan, {"n0": "uploaded", "n1": "uploaded"}))
    assert waiting.uncommitted("job", 3) == [
        {"step": 4, "missing_nodes": [], "unseen_nodes": 1}]
    assert "job: step 4 waits for its commit: parts missing from 1 node not seen yet" in (
        render_status(_status_doc(waiting.uncommitted("job", 3))))
    plan = cc.Plan("n0", (), covered=False, missing_nodes=("n2",))
    waiting.wait("job", 5, parts.NotCommitted(5, plan, {"n0": "uploaded", "n1": "uploaded",
                                                        "n2": "missing"}))
    assert waiting.uncommitted("job", 3)[1] == {"step": 5, "missing_nodes": ["n2"],
                                                "unseen_nodes": 0}
    assert waiting.uncommitted("other", 3) == []
    # n2, learned of from step 5, has no part of step 4 either
    text = render_status(_status_doc(waiting.uncommitted("job", 3)))
    assert "job: step 4 waits for its commit: parts missing from n2" in text
    assert "job: step 5 waits for its commit: parts missing from n2" in text


def test_a_share_that_grew_sends_only_its_new_files(tmp_path: Path) -> None:
    """The coordinator's shard settles before `.metadata` comes: its first part (no record)
    holds the shard; the part with the record reuses that object instead of sending it again,
    and `restore --node` still finds every file of the node."""
    store = LocalBackend(tmp_path / "remote")
    t = 1_700_000_000.0
    shard = {"step-7/__0_0.distcp": b"zero" * 100}
    o_dir, o_man, o_share = _share(tmp_path, "n0", shard, t)
    with pytest.raises(parts.NotCommitted):
        parts.upload_share(store, "job", o_dir, o_man, o_share, now=t + 5)
    (first,) = parts.read_parts(store, "job", 7)
    record = cc.CommitRecord("step-7/.metadata", t, {"step-7/__0_0.distcp": 400})
    c_dir, c_man, c_share = _share(tmp_path, "n0", {**shard, "step-7/.metadata": b"meta"}, t,
                                   record)
    done = parts.upload_share(store, "job", c_dir, c_man, c_share, now=t + 6)
    assert (done.sent_bytes, done.skipped_objects) == (4, 1)
    commit = read_manifest(store, "job", 7)
    keys = {f.path: f.key for f in commit.files}
    assert keys["step-7/__0_0.distcp"] == f"n0.{first.attempt}/step-7/__0_0.distcp"
    assert [a for n, a, _r in commit.nodes] != [first.attempt]  # committed under the second
    assert sorted(f.path for f in for_node(commit, "n0").files) == [
        "step-7/.metadata", "step-7/__0_0.distcp"]
    for bad in ("n1.x/step-7/a", "n0/step-7/a", "n0.x.y/a"):  # keys of another node, or none
        doc = cc.Part("n0", "b", "dcp", (cc.PartFile("step-7/a", 1, t, "h", "x", "none", 1,
                                                     bad),)).to_bytes()
        with pytest.raises(BadPart):
            cc.parse_part(doc, "p")



@pytest.mark.parametrize("paths", [("step-7/a", "step-7/a"), ("step-7/a", "step-7/a/b")])
def test_a_part_naming_a_path_twice_or_as_a_directory_is_bad(paths: tuple[str, str]) -> None:
    """A part's files must be placeable all or nothing, as a manifest's are."""
    files = tuple(cc.PartFile(p, 1, 1.0, "h", "x", "none", 1, f"n0.a{i}/{p}")
                  for i, p in enumerate(paths))
    with pytest.raises(BadPart, match="named twice|directory of"):
        cc.parse_part(cc.Part("n0", "b", "dcp", files).to_bytes(), "p")


# -- the ranked layout's record --------------------------------------------------------------


def _ranked_share(root: Path, meta: bytes | None, ranks: tuple[int, ...] = (0,)) -> Manifest:
    """The coordinator's (or, without meta, another node's) validated files of a ranked save,
    written under `root/run/` by torch.save, as the manifest of its share."""
    import torch
    import xxhash

    d = root / "run"
    d.mkdir(parents=True, exist_ok=True)
    names = [f"optim_5_rank{r}.pt" for r in ranks]
    for name in names:
        torch.save({"state": {0: torch.ones(3)}}, d / name)
    if meta is not None:
        torch.save({"w": torch.zeros(2)}, d / "model_5.pt")
        (d / "meta_5.json").write_bytes(meta)
        names += ["model_5.pt", "meta_5.json"]
    stored = []
    for name in sorted(names):
        data = (d / name).read_bytes()
        stored.append(StoredFile(f"run/{name}", len(data), xxhash.xxh3_128_hexdigest(data),
                                 "xxh3-128", "none", len(data), f"run/{name}"))
    return Manifest("job", 5, "ranked", tuple(stored))


def _mtimes(manifest: Manifest) -> dict[str, float]:
    return {f.path: 1_700_000_000.0 + i for i, f in enumerate(manifest.files)}


def test_ranked_record_expects_every_rank_of_the_meta(tmp_path: Path) -> None:
    manifest = _ranked_share(tmp_path, b'{"step": 5, "world_size": 3}')
    mtimes = _mtimes(manifest)
    record = records.ranked_record(tmp_path, manifest, mtimes)
    assert record is not None
    assert (record.path, record.mtime, record.after) == (
        "run/meta_5.json", mtimes["run/meta_5.json"], cc.SPREAD_S)
    assert record.expected == {"run/model_5.pt": 0, "run/meta_5.json": 0,
                               **{f"run/optim_5_rank{r}.pt": 0 for r in range(3)}}
    wider = records.ranked_record(tmp_path, manifest, mtimes, world_size=4)  # the root's wins
    assert wider is not None and "run/optim_5_rank3.pt" in wider.expected
    other = _ranked_share(tmp_path / "n1", None, ranks=(1, 2))  # no meta: no record
    assert records.ranked_record(tmp_path / "n1", other, _mtimes(other)) is None


@pytest.mark.parametrize("meta", [b'{"step": 5}', b'{"world_size": 0}', b'{"world_size": true}',
                                  b'{"world_size": "3"}', b'{"world_size": 1048577}'])
def test_ranked_record_without_a_world_size(meta: bytes, tmp_path: Path) -> None:
    """No usable count in the meta: the root's `world_size`, else the shards are unknown."""
    manifest = _ranked_share(tmp_path, meta)
    record = records.ranked_record(tmp_path, manifest, _mtimes(manifest), world_size=2)
    assert record is not None
    assert sorted(p for p in record.expected if "optim" in p) == [
        "run/optim_5_rank0.pt", "run/optim_5_rank1.pt"]
    with pytest.raises(PermanentError, match="records no world_size and the root sets none"):
        records.ranked_record(tmp_path, manifest, _mtimes(manifest))


@pytest.mark.parametrize(("meta", "why"), [(b"{", "not valid JSON"),
                                           (b"\xff\xfe", "not valid JSON"),
                                           (b"[" * 100_000, "not valid JSON"),
                                           (b"[3]", "not a JSON object")])
def test_ranked_record_bad_meta_is_permanent(meta: bytes, why: str, tmp_path: Path) -> None:
    manifest = _ranked_share(tmp_path, meta)
    with pytest.raises(PermanentError, match=why):
        records.ranked_record(tmp_path, manifest, _mtimes(manifest), world_size=2)


def test_ranked_record_refuses_a_huge_meta_unread(tmp_path: Path) -> None:
    pad = b'{"world_size": 1, "pad": "' + b"x" * (1 << 20) + b'"}'
    manifest = _ranked_share(tmp_path, pad)
    (tmp_path / "run" / "meta_5.json").unlink()  # never opened: the size alone refuses it
    with pytest.raises(PermanentError, match="more than the 1048576"):
        records.ranked_record(tmp_path, manifest, _mtimes(manifest))


@pytest.mark.parametrize("now", [b'{"world_size": 4}', b'{"world_size": 3} '])
def test_ranked_record_changed_since_validation(now: bytes, tmp_path: Path) -> None:
    """Other bytes (same size or not) than the validated ones: rescanned, never recorded."""
    manifest = _ranked_share(tmp_path, b'{"world_size": 3}')
    (tmp_path / "run" / "meta_5.json").write_bytes(now)
    with pytest.raises(TransientError, match="changed since it was validated"):
        records.ranked_record(tmp_path, manifest, _mtimes(manifest))


def test_a_share_rewritten_since_validation_is_rescanned_not_sent(tmp_path: Path) -> None:
    """The mtimes that tie a part to its save attempt are read with the same stat pass that
    checks the files are still the validated ones: a re-save that rewrote them since (a new
    mtime) defers the upload, instead of naming the re-save's attempt for the old bytes."""
    import os

    from ckptd.config import RootConfig
    from ckptd.lifecycle.table import Stage
    from ckptd.model import CheckpointRecord, Local, Remote, State
    from ckptd.service.jobs import Changed
    from ckptd.service.uploads import validated_mtimes
    from ckptd.store import Job
    from ckptd.watch.scanner import file_fingerprint

    root = tmp_path / "root"
    (root / "step-7").mkdir(parents=True)
    shard = root / "step-7" / "__1_0.distcp"
    shard.write_bytes(b"one!" * 10)
    files = ("step-7/__1_0.distcp",)
    rec = CheckpointRecord(1, "job", 7, "dcp", "step-7", State.VALID, Local.COMPRESSED,
                           Remote.NONE, 40, 40, {}, "", "", False, 0.0, 0.0,
                           file_fingerprint(root, files))
    job = Job(rec, Stage.UPLOAD, files, {}, {}, "", "")
    _dir, manifest, _share_ = _share(tmp_path, "n1", {files[0]: b"one!" * 10}, 0.0)
    cfg = RootConfig(name="job", path=root)
    mtimes = validated_mtimes(cfg, job, manifest)
    assert mtimes == {files[0]: shard.stat().st_mtime_ns / 1e9}
    shard.write_bytes(b"TWO!" * 10)  # the re-save: the same size, new bytes, a new mtime
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 1_000_000))
    changed = validated_mtimes(cfg, job, manifest)
    assert isinstance(changed, Changed) and "changed since they were validated" in changed.why
    shard.unlink()
    assert isinstance(validated_mtimes(cfg, job, manifest), Changed)
