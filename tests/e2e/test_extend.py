"""A new layout, a new object store, a new codec name and a new retention rule are each one
registration (docs/DESIGN.md, "How to extend"): registered here in-process, the config accepts
them, detection finds the layout, `make_backend` opens the store, `make_encoder` builds the
codec's encoder, the planner keeps what the rule keeps with its reason, and no list elsewhere in
ckptd/ had to learn their names."""

from __future__ import annotations

import ast
import io
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from ckptd import backends, codec, layouts, model
from ckptd.backends import LocalBackend, backend_for_upload
from ckptd.codec import Encoder, encoder
from ckptd.config import LocalRetention, RemoteRetention, load_config
from ckptd.config import fields as config_fields
from ckptd.errors import ConfigError
from ckptd.layouts import common
from ckptd.model import Candidate, FileInfo, Local, Remote, RootOptions, Snapshot, State, Tier
from ckptd.retention import planner, rules
from ckptd.stages.multinode import records

CKPTD = Path(__file__).resolve().parents[2] / "ckptd"
NOW = 10_000.0


class DoneMarkerLayout:
    """`run-<N>/` complete once it holds `DONE`: a framework ckptd does not know."""

    name = "donemarker"

    def wants_content(self, rel: str) -> bool:
        return False

    def candidates(self, snap: Snapshot, opts: RootOptions, now: float,
                   claimed: frozenset[str]) -> list[Candidate]:
        out = []
        for d in sorted(snap.dirs):
            if "/" in d or not d.startswith("run-") or not d[4:].isdigit():
                continue
            files = [f for f in snap.files if f.startswith(d + "/") and f not in claimed]
            done = f"{d}/DONE" in snap.files
            out.append(common.make(self.name, int(d[4:]), d, files,
                                   ["" if done else "DONE"]))
        return out


class MemStore(LocalBackend):
    """An object store of its own scheme (`mem://bucket/prefix`), kept in a directory."""

    md5_etags = False


@pytest.fixture
def registries(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The registries as they were, after the test."""
    monkeypatch.setattr(layouts, "_BY_NAME", dict(layouts._BY_NAME))
    monkeypatch.setattr(layouts, "_AUTO", dict(layouts._AUTO))
    monkeypatch.setattr(backends, "_OPENERS", dict(backends._OPENERS))
    schemes = dict(config_fields.STORAGE_SCHEMES)
    monkeypatch.setattr(codec, "_REGISTERED", dict(codec._REGISTERED))
    monkeypatch.setattr(encoder, "SUFFIXES", dict(encoder.SUFFIXES))
    monkeypatch.setattr(codec, "SUFFIXES", encoder.SUFFIXES)
    codecs = list(model.CODECS)
    keep_rules = dict(rules.RULES)
    yield
    model.CODECS[:] = codecs
    rules.RULES.clear()
    rules.RULES.update(keep_rules)
    config_fields.STORAGE_SCHEMES.clear()
    config_fields.STORAGE_SCHEMES.update(schemes)
    layouts._field_readers.cache_clear()


def _config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "ckptd.toml"
    path.write_text(f'[[roots]]\nname = "r"\npath = "root"\n{body}')
    return path


def _snapshot(*rels: str) -> Snapshot:
    files = {rel: FileInfo(rel, 10, NOW - 100, NOW - 100, False) for rel in rels}
    dirs = {rel.rsplit("/", 1)[0] for rel in rels if "/" in rel}
    return Snapshot(files=files, dirs=frozenset(dirs), contents={}, registrations={})


def test_a_new_layout_is_one_registration(tmp_path: Path, registries: None) -> None:
    with pytest.raises(ConfigError, match='must be one of: auto, native.*got "donemarker"'):
        load_config(_config(tmp_path, 'layout = "donemarker"\n'))
    layouts.register(DoneMarkerLayout(), 105)  # after `single`, before native dirs without meta

    root = load_config(_config(tmp_path, 'layout = "donemarker"\n')).root("r")
    assert root.layout == "donemarker"
    assert layouts.names()[-1] == "donemarker"
    assert isinstance(layouts.get("donemarker"), DoneMarkerLayout)
    snap = _snapshot("run-7/weights.bin", "run-7/DONE", "run-8/weights.bin")
    for layout in ("donemarker", "auto"):
        found = layouts.detect(snap, root.options, NOW, layout)
        assert [(c.layout, c.step, c.complete) for c in found] == [
            ("donemarker", 7, True), ("donemarker", 8, False)]
    assert records.reader_for("donemarker") is None  # no multi-node commit record: refused
    with pytest.raises(ValueError, match="already"):
        layouts.register(DoneMarkerLayout(), 106)


def test_a_new_object_store_is_one_registration(tmp_path: Path, registries: None) -> None:
    url = "mem://bucket/ckpts"
    with pytest.raises(ConfigError, match='is not a supported URL: use s3://bucket/prefix'):
        load_config(_config(tmp_path, f'[roots.upload]\nurl = "{url}"\n'))
    opened: list[str] = []

    def open_mem(url: str, **options: Any) -> MemStore:
        opened.append(url)
        return MemStore(tmp_path / "mem" / url.removeprefix("mem://"),
                        part_size=options["part_size"])

    backends.register("mem", open_mem, "mem://bucket/prefix")
    with pytest.raises(ConfigError, match="use s3://bucket/prefix, .*, mem://bucket/prefix"):
        load_config(_config(tmp_path, '[roots.upload]\nurl = "nope://x"\n'))
    root = load_config(_config(tmp_path, f'[roots.upload]\nurl = "{url}/"\n')).root("r")
    assert root.upload.url == url
    backend = backend_for_upload(root.upload)  # with the standard wrappers
    assert opened == [url] and backend.url.startswith("file://")
    assert backend.md5_etags is False  # asked of the backend, through its wrappers
    backend.put("a/b", b"payload")
    out = io.BytesIO()
    backend.get("a/b", out)
    assert out.getvalue() == b"payload"


def test_a_new_codec_name_is_one_registration(tmp_path: Path, registries: None) -> None:
    with pytest.raises(ConfigError, match='must be one of: auto, zstd, zstd-bytegroup, none, '
                                          'got "raw"'):
        load_config(_config(tmp_path, '[roots.compress]\ncodec = "raw"\n'))
    with pytest.raises(ValueError, match="unknown codec 'raw'"):
        codec.make_encoder("raw", io.BytesIO())
    made: list[dict[str, Any]] = []

    def make_raw(out: Any, **settings: Any) -> Encoder:
        made.append(settings)
        return Encoder("raw", out)  # the bytes as they are

    codec.register("raw", make_raw, ".raw")
    root = load_config(_config(tmp_path, '[roots.compress]\ncodec = "raw"\nlevel = 5\n')).root("r")
    assert root.compress.codec == "raw"
    with pytest.raises(ConfigError, match="must be one of: auto, zstd, zstd-bytegroup, none, raw"):
        load_config(_config(tmp_path, '[roots.compress]\ncodec = "gzip"\n'))
    out = io.BytesIO()
    enc = codec.make_encoder(root.compress.codec, out, level=root.compress.level)
    enc.update(0, memoryview(b"payload"))
    enc.finish(7)
    assert out.getvalue() == b"payload" and (enc.codec, enc.suffix) == ("raw", ".raw")
    assert codec.codec_suffix("raw") == ".raw" and made[0]["level"] == 5
    with pytest.raises(ValueError, match="already"):
        codec.register("raw", make_raw, ".raw")


class FirstsRetention(RemoteRetention):
    """`[roots.retention.remote]` with one setting more: keep the N oldest copies."""

    keep_first: config_fields.Count = 0


def test_a_new_retention_rule_is_one_registration(registries: None) -> None:
    def view(step: int) -> planner.CheckpointView:
        return planner.CheckpointView(step, State.VALID, Local.PRUNED, Remote.UPLOADED,
                                      completed=NOW - 100 + step, bytes=1)

    @rules.keep_rule("keep_first")
    def keep_first(valid: Sequence[rules.Kept], tier: Tier, n: int,
                   ctx: rules.Context) -> list[rules.Kept]:
        return sorted(valid, key=lambda v: v.step)[:n]

    remote = FirstsRetention(keep_last=1, keep_best=0, keep_every=20, keep_within="",
                             keep_first=2)
    disk = planner.Disk(free_bytes=100, total_bytes=100, min_free_bytes=0)
    p = planner.plan([view(s) for s in (10, 20, 30, 40)], LocalRetention(), remote, disk, NOW)
    assert {i.step: (i.remote, i.reasons) for i in p.items} == {
        10: (planner.Action.KEEP, ("remote:keep_first=2",)),
        20: (planner.Action.KEEP, ("remote:keep_every=20", "remote:keep_first=2")),
        30: (planner.Action.DELETE, ("remote:not_kept",)),
        40: (planner.Action.KEEP, ("remote:latest", "remote:keep_last=1", "remote:keep_every=20")),
    }
    # Off (0) keeps nothing; a tier whose table lacks the setting is not asked.
    p = planner.plan([view(s) for s in (10, 30)], LocalRetention(),
                     remote.model_copy(update={"keep_first": 0}), disk, NOW)
    assert [i.remote for i in p.items] == [planner.Action.DELETE, planner.Action.KEEP]
    with pytest.raises(ValueError, match="already"):
        rules.keep_rule("keep_first")(keep_first)


def test_every_keep_setting_has_its_rule_and_every_rule_its_setting() -> None:
    settings = {name for model in (LocalRetention, RemoteRetention)
                for name in model.model_fields if name.startswith("keep_")}
    assert settings == set(rules.RULES)


def _string_lists(path: Path) -> Iterator[tuple[int, set[str]]]:
    """The strings of each tuple, list, set, dict's keys and `Literal[...]` in a module."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        elts: list[ast.expr | None] = []
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            elts = list(node.elts)
        elif isinstance(node, ast.Dict):
            elts = list(node.keys)
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple):
            elts = list(node.slice.elts)
        yield getattr(node, "lineno", 0), {
            e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}


def test_no_list_of_layout_or_codec_names_or_md5_schemes_outside_the_registries() -> None:
    """Names derive from the registries: a list of several layouts' or codecs' names, or a
    check of which schemes' etags are MD5s, anywhere else would be a place a new one must be
    added. The codec names' one list is `ckptd.model.CODECS`; `codec/encoder.py` maps each
    built-in codec to its suffix."""
    names = set(layouts.names())
    codec_lists = {Path("model.py"), Path("codec/encoder.py")}
    found = []
    for path in sorted(CKPTD.rglob("*.py")):
        for line, strings in _string_lists(path):
            if len(strings & names) >= 3 or (
                    len(strings & set(model.CODECS)) >= 3
                    and path.relative_to(CKPTD) not in codec_lists):
                found.append(f"{path.relative_to(CKPTD)}:{line}")
        if "stages" in path.parts and '"s3' in path.read_text():
            found.append(f"{path.relative_to(CKPTD)}: a scheme check")
    assert found == []
