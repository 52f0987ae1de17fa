"""ckptd.torch.load from the remote: a native step saved by ckptd.torch.save, compressed and
committed as the daemon does it, streamed back into fresh objects with no staging disk;
`source="auto"` falls back to the remote on a node that has nothing; errors name the object."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support.published import publish
from support.torch_state import same, trained

import ckptd.torch as ckpt
from ckptd.backends import LocalBackend
from ckptd.errors import CorruptData, NotFound
from ckptd.remote.manifest import step_prefix


def big_model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 16))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    return model, opt


@pytest.fixture
def published(tmp_path: Path) -> tuple[Path, str, Any, Any]:
    """Step 3 of root "r" (a model of 8 MB and its Adam state) at a file:// remote."""
    root = tmp_path / "r"
    model, opt = big_model(0)
    ckpt.save(root, 3, model=model, optimizer=opt, extra={"note": "x"}, register=False)
    backend = LocalBackend(str(tmp_path / "remote"))
    publish(root, "r", 3, backend)
    return root, f"file://{tmp_path / 'remote'}", model, opt


def test_remote_load_equals_the_saved_state(tmp_path: Path, published: Any) -> None:
    _root, url, model, opt = published
    fresh, fresh_opt = big_model(1)
    step, meta = ckpt.load(tmp_path / "elsewhere" / "r", model=fresh, optimizer=fresh_opt,
                           source="remote", remote=url)
    assert step == 3 and meta["extra"] == {"note": "x"}
    assert meta["path"].startswith(url)
    assert same(fresh.state_dict(), model.state_dict())
    assert same(fresh_opt.state_dict(), opt.state_dict())
    assert not (tmp_path / "elsewhere").exists()  # nothing staged on disk


def test_auto_reads_the_remote_when_the_node_has_nothing(tmp_path: Path,
                                                         published: Any) -> None:
    _root, url, model, _opt = published
    fresh = big_model(2)[0]
    step, _ = ckpt.load(tmp_path / "fresh-node" / "r", step=3, model=fresh, remote=url)
    assert step == 3 and same(fresh.state_dict(), model.state_dict())


def test_local_never_reads_the_remote(tmp_path: Path, published: Any) -> None:
    _root, url, _model, _opt = published
    with pytest.raises(NotFound):
        ckpt.load(tmp_path / "fresh-node" / "r", step=3, model=big_model(2)[0],
                  source="local", remote=url)


def test_a_corrupt_object_is_an_error_naming_it(tmp_path: Path, published: Any) -> None:
    _root, url, _model, _opt = published
    obj = next((tmp_path / "remote" / step_prefix("r", 3)).rglob("model.pt*"))
    raw = bytearray(obj.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    obj.write_bytes(raw)
    with pytest.raises(CorruptData, match=obj.name.replace(".", r"\.")):
        ckpt.load(tmp_path / "x" / "r", model=big_model(2)[0], source="remote", remote=url)


def test_an_unknown_step_and_a_bad_source(tmp_path: Path, published: Any) -> None:
    _root, url, _model, _opt = published
    with pytest.raises(NotFound, match="step 9"):
        ckpt.load(tmp_path / "x" / "r", step=9, model=big_model(2)[0], source="remote",
                  remote=url)
    with pytest.raises(ValueError, match="source"):
        ckpt.load(tmp_path / "x" / "r", source="bucket")


def test_importing_the_training_side_stays_light() -> None:
    """The backends, obstore and pydantic load only when a load reads the bucket."""
    code = ("import sys, ckptd, ckptd.torch, ckptd.dcp; "
            "print(sorted(m for m in ('obstore', 'pydantic', 'structlog', 'ckptd.backends') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]", out
    _ = trained


def test_ckptd_open_reads_a_file_of_the_step(tmp_path: Path, published: Any) -> None:
    """By its path in the step or in the root; seekable; the bytes are the original's."""
    import ckptd

    root, url, _model, _opt = published
    want = (root / "step-3" / "model.pt").read_bytes()
    for name in ("model.pt", "step-3/model.pt"):
        with ckptd.open("r", 3, name, remote=url) as f:
            assert f.read() == want
            f.seek(len(want) // 3)
            assert f.read(1000) == want[len(want) // 3 : len(want) // 3 + 1000]
            f.seek(-10, 2)
            assert f.read() == want[-10:]
    with pytest.raises(NotFound, match="no file"):
        ckptd.open("r", 3, "nothing.pt", remote=url)
