"""A native checkpoint's meta.json is outside input to a load, from the bucket as from a root:
read through the bounded strict reader, and every value the load acts on (format, step, world
size, the listed files' paths, sizes, components and ranks) checked before the first tensor is
touched. A refused one is CorruptData naming the object, and the model and the optimizer are
bit for bit what they were before the load. The fuzz test mutates real meta.json documents
written by ckptd.torch.save."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from support.published import publish

import ckptd.torch as ckpt
from ckptd.backends import LocalBackend
from ckptd.errors import BadInput, CkptdError, CorruptData, NotFound
from ckptd.remote.manifest import step_prefix
from ckptd.torch import _meta

STEP = 3


def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    return model, opt


def bits(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[tuple[str, bytes]]:
    """Every byte of the model's and the optimizer's state, to compare bit for bit."""
    out = [(k, _raw(v)) for k, v in model.state_dict().items()]
    for i, state in sorted(opt.state_dict()["state"].items()):
        out += [(f"opt.{i}.{k}", _raw(v)) for k, v in sorted(state.items())]
    return out


def _raw(v: Any) -> bytes:
    if torch.is_tensor(v):
        return bytes(v.detach().cpu().reshape(-1).contiguous().numpy().tobytes())
    return repr(v).encode()


class Published:
    """Step 3 of root "r" saved by ckptd.torch.save and committed to a file:// remote with
    codec none, so one test can put another meta.json in its place (and in the manifest)."""

    def __init__(self, tmp: Path) -> None:
        self.root, self.remote = tmp / "r", tmp / "remote"
        self.model, self.opt = trained(0)
        ckpt.save(self.root, STEP, model=self.model, optimizer=self.opt, extra={"n": 1},
                  metrics={"loss": 0.5}, register=False)
        publish(self.root, "r", STEP, LocalBackend(str(self.remote)), codec="none")
        self.url = f"file://{self.remote}"
        self.step_dir = self.remote / step_prefix("r", STEP)
        self.original = (self.root / f"step-{STEP}" / "meta.json").read_bytes()

    def doc(self) -> dict[str, Any]:
        return json.loads(self.original)  # type: ignore[no-any-return]

    def put_meta(self, data: bytes) -> None:
        """meta.json's object replaced by `data`, the manifest saying so (size, hash)."""
        manifest_path = self.step_dir / "MANIFEST.json"
        manifest = json.loads(manifest_path.read_bytes())
        entry = next(f for f in manifest["files"] if f["path"].endswith("meta.json"))
        assert entry["codec"] == "none"
        (self.step_dir / entry["key"]).write_bytes(data)
        entry.update(size=len(data), stored_size=len(data),
                     hash=xxhash.xxh3_128(data).hexdigest())
        manifest_path.write_bytes(json.dumps(manifest).encode())

    def load_remote(self, tmp: Path) -> tuple[int, dict[str, Any], Any, Any, list[Any]]:
        model, opt = trained(1)
        before = bits(model, opt)
        try:
            step, meta = ckpt.load(tmp / "node" / "r", model=model, optimizer=opt,
                                   source="remote", remote=self.url)
        except CkptdError:
            assert bits(model, opt) == before, "a refused load changed the model or optimizer"
            raise
        return step, meta, model, opt, before


@pytest.fixture
def pub(tmp_path: Path) -> Published:
    return Published(tmp_path)


def _set(doc: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    target: Any = doc
    for key in path[:-1]:
        target = target[key]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return doc


class _Deleted:
    """The marker for "this key is left out"; its repr is stable, so test ids are the same in
    every process (pytest-xdist compares them)."""

    def __repr__(self) -> str:
        return "<deleted>"


_DELETE = _Deleted()
# (where in meta.json, the value put there): every one is refused before a tensor is read.
HOSTILE = [
    (("step",), None), (("step",), -1), (("step",), 1.5), (("step",), "3"), (("step",), True),
    (("step",), 4), (("step",), 2**63 - 1), (("step",), _DELETE), (("format",), _DELETE),
    (("format",), "ckptd-other/1"), (("format",), 1), (("world_size",), 0),
    (("world_size",), "1"), (("world_size",), 2**40), (("files",), None),
    (("files",), {"model.pt": 1}), (("files", 0), "model.pt"),
    (("files", 0, "path"), "../model.pt"), (("files", 0, "path"), "/etc/passwd"),
    (("files", 0, "path"), "meta.json"), (("files", 0, "path"), ""),
    (("files", 0, "path"), "a/./b"), (("files", 0, "path"), 7),
    (("files", 0, "size"), -1), (("files", 0, "size"), "10"), (("files", 0, "size"), None),
    (("files", 0, "size"), 12345), (("files", 0, "size"), 2**62),
    (("files", 0, "component"), None), (("files", 0, "component"), ["model"]),
    (("files", 0, "component"), "optimizer"), (("files", 0, "path"), "elsewhere.pt"),
    (("metrics",), []), (("metrics", "loss"), "low"), (("metrics", "loss"), None),
    (("config",), "x"), (("created",), 5), (("save_id",), {}), (("nodes",), 0),
]


def _optim_entry(doc: dict[str, Any]) -> int:
    return next(i for i, f in enumerate(doc["files"]) if f["path"] == "optim.rank0.pt")


@pytest.mark.parametrize("where,value", HOSTILE,
                         ids=[f"{'.'.join(map(str, w))}={v!r}"[:60] for w, v in HOSTILE])
def test_a_hostile_remote_meta_json_is_refused_before_a_tensor(tmp_path: Path, pub: Published,
                                                               where: tuple[Any, ...],
                                                               value: Any) -> None:
    model_entry = next(i for i, f in enumerate(pub.doc()["files"]) if f["path"] == "model.pt")
    where = tuple(model_entry if w == 0 and i == 1 else w for i, w in enumerate(where))
    pub.put_meta(json.dumps(_set(pub.doc(), where, value)).encode())
    with pytest.raises(CorruptData, match=r"meta\.json"):
        pub.load_remote(tmp_path)


@pytest.mark.parametrize("change", ["rank", "optim-rank", "duplicate", "unlisted-in-manifest"])
def test_listed_ranks_and_files_must_agree(tmp_path: Path, pub: Published, change: str) -> None:
    doc = pub.doc()
    i = _optim_entry(doc)
    if change == "rank":
        doc["files"][i]["rank"] = 1  # world_size is 1
    elif change == "optim-rank":
        doc["world_size"], doc["files"][i]["rank"] = 2, 1  # optim.rank0.pt said to be rank 1's
    elif change == "duplicate":
        doc["files"].append(dict(doc["files"][i]))
    else:  # a file the manifest does not hold
        doc["world_size"] = 2
        doc["files"].append({"path": "optim.rank1.pt", "component": "optimizer", "rank": 1,
                             "size": 10})
    pub.put_meta(json.dumps(doc).encode())
    with pytest.raises(CorruptData, match=r"meta\.json|optim\.rank"):
        pub.load_remote(tmp_path)


@pytest.mark.parametrize("data", [
    b'{"config": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # deep nesting
    b'{"step": 3, "pad": "' + b"x" * (2 << 20) + b'"}',  # over the 1 MiB cap
    b'{"step": NaN}', b"\xff\xfe{}", b"not json", b"", b"[]",
    b'{"step": 3, "step": 3}',  # a duplicate key
    b'{"step": ' + b"9" * 5000 + b"}",  # a number that is slow to convert
], ids=["deep", "huge", "nan", "utf16", "text", "empty", "list", "dupkey", "digits"])
def test_a_remote_meta_json_that_is_not_strict_json_is_refused(tmp_path: Path, pub: Published,
                                                               data: bytes) -> None:
    pub.put_meta(data)
    with pytest.raises(CorruptData, match=r"meta\.json"):
        pub.load_remote(tmp_path)


def test_the_good_remote_meta_json_still_loads(tmp_path: Path, pub: Published) -> None:
    step, meta, model, opt, _ = pub.load_remote(tmp_path)
    assert step == STEP and meta["extra"] == {"n": 1} and meta["metrics"] == {"loss": 0.5}
    assert bits(model, opt) == bits(pub.model, pub.opt)


# -- the same checks on a root's own disk ----------------------------------------------------


def _load_local(target: Path, step: int | None = None) -> None:
    model, opt = trained(1)
    before = bits(model, opt)
    try:
        if step is None:
            ckpt.load(target, model=model, optimizer=opt, source="local", client=_NoDaemon())
        else:
            ckpt.load(target, step, model=model, optimizer=opt, source="local",
                      client=_NoDaemon())
    finally:
        assert bits(model, opt) == before, "a refused load changed the model or optimizer"


class _NoDaemon:
    """A client whose daemon says the root has no latest (so the loader scans the root)."""

    strict = False

    def latest(self, *_a: Any, **_k: Any) -> None:
        return None

    def hold(self, *_a: Any, **_k: Any) -> Any:
        import contextlib

        return contextlib.nullcontext()


@pytest.mark.parametrize("where,value", [(("step",), None), (("step",), 4),
                                         (("files", 0, "size"), "1"), (("world_size",), -2),
                                         (("files", 0, "component"), 3)])
def test_a_hostile_local_meta_json_is_refused_before_a_tensor(tmp_path: Path,
                                                              where: tuple[Any, ...],
                                                              value: Any) -> None:
    model, opt = trained(0)
    step_dir = ckpt.save(tmp_path / "r", STEP, model=model, optimizer=opt, register=False)
    doc = json.loads((step_dir / "meta.json").read_text())
    (step_dir / "meta.json").write_text(json.dumps(_set(doc, where, value)))
    with pytest.raises(CorruptData, match=r"step-3/meta\.json"):
        _load_local(step_dir)  # the step's directory itself
    with pytest.raises(NotFound):  # by number: not a complete checkpoint
        _load_local(tmp_path / "r", STEP)


def test_a_local_file_not_at_its_listed_size_is_refused_before_a_tensor(tmp_path: Path) -> None:
    model, opt = trained(0)
    step_dir = ckpt.save(tmp_path / "r", STEP, model=model, optimizer=opt, register=False)
    with open(step_dir / "optim.rank0.pt", "ab") as f:
        f.write(b"\0" * 16)  # the model loads first; the optimizer's file is the bad one
    with pytest.raises(CorruptData, match=r"optim\.rank0\.pt: \d+ bytes, meta\.json lists"):
        _load_local(step_dir)


def test_a_missing_component_is_refused_before_any_object_is_filled(tmp_path: Path) -> None:
    model, _ = trained(0)
    step_dir = ckpt.save(tmp_path / "r", STEP, model=model, register=False)  # no optimizer
    with pytest.raises(NotFound, match="no optimizer state"):
        _load_local(step_dir)


# -- fuzz: mutations of real meta.json documents ---------------------------------------------


_VALUES: list[Any] = [None, True, False, 0, -1, 1, 3, 2**31, 2**63 - 1, -(2**63) + 1, 0.5,
                      -0.0, 1e308, "", "3", "model.pt", "../x", "/x", "meta.json", [], {},
                      [1], {"a": 1}, "optimizer", "model", "ckptd-native/1", "x" * 300]


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _mutate(rng: random.Random, original: bytes) -> bytes:
    doc = json.loads(original)
    for _ in range(rng.randint(1, 3)):
        op = rng.random()
        paths = _paths(doc)
        if op < 0.6 and paths:
            _set(doc, rng.choice(paths), rng.choice(_VALUES))
        elif op < 0.75 and paths:
            path = rng.choice(paths)
            if len(path) > 1 or isinstance(doc, dict):
                try:
                    _set(doc, path, _DELETE)
                except (KeyError, IndexError, TypeError):
                    pass
        elif op < 0.85 and isinstance(doc.get("files"), list) and doc["files"]:
            copied = rng.choice(doc["files"])
            doc["files"].append(dict(copied) if isinstance(copied, dict) else {})
            doc["files"][-1]["path"] = rng.choice(["optim.rank1.pt", "rng.rank0.pt", "x.pt"])
        else:
            doc[rng.choice(["step", "config", "metrics", "x"])] = rng.choice(_VALUES)
    data = json.dumps(doc).encode()
    if rng.random() < 0.15:  # byte-level: a cut, a flipped byte
        cut = rng.randrange(len(data))
        data = data[:cut] if rng.random() < 0.5 else \
            data[:cut] + bytes([data[cut] ^ (1 << rng.randrange(8))]) + data[cut + 1:]
    return data


def test_fuzz_meta_json_parse(tmp_path: Path) -> None:
    """Mutations of a real meta.json: each is a Meta whose values hold what a load needs, or
    BadInput; never another exception."""
    model, opt = trained(0)
    step_dir = ckpt.save(tmp_path / "r", STEP, model=model, optimizer=opt, extra={"n": 1},
                         register=False)
    original = (step_dir / "meta.json").read_bytes()
    rng = random.Random(20261206)
    refused = 0
    for _ in range(3000):
        data = _mutate(rng, original)
        try:
            meta = _meta.parse(data, "meta.json", STEP)
        except BadInput:
            refused += 1
            continue
        assert meta.step == STEP and 1 <= meta.world_size <= _meta.MAX_WORLD
        for path, size in meta.files.items():
            assert isinstance(path, str) and ".." not in path.split("/")
            assert not path.startswith("/") and isinstance(size, int) and size >= 0
        assert isinstance(meta.doc.get("metrics", {}), dict)
    assert refused > 1500  # most mutations touch a value a load acts on


def test_fuzz_remote_meta_json(tmp_path: Path, pub: Published) -> None:
    """End to end from the bucket: a mutated meta.json either loads the saved state whole,
    or is refused with CorruptData (NotFound where a listed component is left out) and the
    model and optimizer untouched."""
    rng = random.Random(6122026)
    saved = bits(pub.model, pub.opt)
    outcomes = {"loaded": 0, "refused": 0}
    for i in range(40):
        pub.put_meta(_mutate(rng, pub.original))
        try:
            _step, _meta_doc, model, opt, _ = pub.load_remote(tmp_path / str(i))
        except (CorruptData, NotFound):
            outcomes["refused"] += 1
            continue
        assert bits(model, opt) == saved
        outcomes["loaded"] += 1
    assert outcomes["refused"] > 20, outcomes
