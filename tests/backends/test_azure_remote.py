"""az:// and abfs:// end to end on a real Azure Blob endpoint (Azurite): the daemon uploads a
checkpoint, a fresh node sees it, `ckptd restore` brings it back byte for byte; the URL forms,
credentials from the environment, and the errors a user meets first.

The contract itself runs on Azurite in test_backends.py and test_backend_ranges.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from support.ckpts import save_single
from support.config import write_layout
from support.wait import wait_until

from ckptd.backends import backend_for_upload, make_backend
from ckptd.config import load_config
from ckptd.errors import ObjectNotFound, PermanentError

if TYPE_CHECKING:
    from azurite import Azurite

pytest_plugins = ["azurite"]  # fixtures: azurite, az_url


def az_upload(url: str, server: Azurite) -> dict[str, Any]:
    """A root's [upload] table for Azurite: account, key and the endpoint, as a user writes."""
    return {"url": url, "endpoint": server.endpoint, "access_key_id": server.account,
            "secret_access_key": server.key}


def test_daemon_uploads_to_azure_and_restore_brings_it_back(
        inproc_daemon: Any, azurite: Azurite, az_url: str, tmp_path: Path) -> None:
    d = inproc_daemon(roots=[{"name": "r1", "upload": az_upload(az_url, azurite)}])
    root = d.roots["r1"]
    original = save_single(root, 7, n=256).read_bytes()
    assert d.client.wait("r1", 7, until="uploaded", timeout=60)
    remote = azurite.backend(az_url)
    keys = {m.key for m in remote.list("r1")}
    assert {"r1/LATEST", "r1/step-7/MANIFEST.json"} <= keys
    assert json.loads(remote.get_bytes("r1/LATEST"))["step"] == 7
    d.stop()
    # A fresh node: same config, empty disk and state dir.
    shutil.rmtree(d.state_dir)
    shutil.rmtree(root)
    root.mkdir()
    d.start()
    ls = wait_until(lambda: d.client.checkpoints("r1") or [], 30, "r1 listing its remote steps")
    assert [(x["step"], x["local"], x["remote"]) for x in ls] == [(7, "pruned", "uploaded")]
    d.stop()
    out = tmp_path / "restored"
    r = subprocess.run([sys.executable, "-m", "ckptd", "restore", "r1", "latest", "--to",
                        str(out), "--config", str(d.config)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert (out / "model_step_7.pt").read_bytes() == original  # byte for byte


def test_abfs_url_with_the_account_in_it(
        azurite: Azurite, az_url: str, tmp_path: Path, short_dir: Path) -> None:
    """`abfs://container@account.dfs.core.windows.net/prefix`, from a config file as the
    daemon and `ckptd restore` read it, reaches the same objects as `az://container/prefix`;
    an access_key_id naming another account is refused."""
    container = az_url.removeprefix("az://").split("/", 1)[0]
    abfs = f"abfs://{container}@{azurite.account}.dfs.core.windows.net/ckpt"
    layout = write_layout(tmp_path, short_dir / "s.sock",
                          roots=[{"name": "r1", "upload": az_upload(abfs, azurite)}])
    (root,) = load_config(layout.config).roots
    assert root.upload.url == abfs
    backend = backend_for_upload(root.upload)
    backend.put("a/b", b"via abfs")
    assert azurite.backend(az_url).get_bytes("a/b") == b"via abfs"
    assert [m.key for m in backend.list("a")] == ["a/b"]
    with pytest.raises(PermanentError, match="must agree"):
        azurite.backend(abfs, access_key_id="another")


def test_credentials_and_endpoint_from_the_environment(
        azurite: Azurite, az_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing in the config: the standard AZURE_STORAGE_* variables, plain http allowed
    because the endpoint they name says http://."""
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", azurite.account)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", azurite.key)
    monkeypatch.setenv("AZURE_STORAGE_ENDPOINT", azurite.endpoint)
    backend = make_backend(az_url, request_retries=0)
    backend.put("env", b"from the environment")
    assert backend.get_bytes("env") == b"from the environment"


def test_wrong_key_is_permanent_and_names_the_credentials(
        azurite: Azurite, az_url: str) -> None:
    backend = azurite.backend(az_url, secret_access_key="d3Jvbmcga2V5")
    with pytest.raises(PermanentError, match="access denied") as info:
        backend.put("x", b"1")
    assert "d3Jvbmcga2V5" not in str(info.value)


def test_missing_container_is_permanent_not_not_found(azurite: Azurite) -> None:
    backend = azurite.backend(azurite.url("no-such-container", "p"))
    for op in (lambda: backend.put("x", b"1"), lambda: list(backend.list("")),
               lambda: backend.get_bytes("x"), lambda: backend.delete("x")):
        with pytest.raises(PermanentError, match="does not exist") as info:
            op()
        assert not isinstance(info.value, ObjectNotFound)


_CHILD = """
import io, os, sys
from ckptd.backends import make_backend
url, endpoint, account, key = sys.argv[1:5]
b = make_backend(url, endpoint=endpoint, access_key_id=account, secret_access_key=key,
                 part_size=5 * 1024 * 1024)
b.put("x/one", b"1")
b.put("x/big", io.BytesIO(os.urandom(6 * 1024 * 1024)))
assert b.get_bytes("x/one") == b"1"
b.get("x/big", io.BytesIO())
b.stat("x/one")
assert sorted(m.key for m in b.list("x")) == ["x/big", "x/one"]
b.delete("x/one")
print("done")
"""


def test_only_the_configured_endpoint_is_contacted(
        azurite: Azurite, az_url: str, tmp_path: Path) -> None:
    """With the account and key configured, a client process connects to Azurite and to
    nothing else: no instance metadata service, no DNS (traced with strace)."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace not installed")
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(_CHILD))
    trace = tmp_path / "trace.txt"
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(Path(__file__).parents[2]),
           "HOME": str(tmp_path)}
    cmd = [strace, "-f", "-qq", "-e", "trace=connect,sendto,sendmsg", "-o", str(trace),
           sys.executable, str(script), az_url, azurite.endpoint, azurite.account, azurite.key]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    if done.returncode != 0 and "ptrace" in done.stderr:
        pytest.skip(f"strace cannot trace here: {done.stderr.strip()[:200]}")
    assert done.returncode == 0, done.stderr
    assert "done" in done.stdout
    text = trace.read_text()
    v4 = re.findall(r'sin_port=htons\((\d+)\), sin_addr=inet_addr\("([^"]+)"\)', text)
    v6 = re.findall(r'sin6_port=htons\((\d+)\).*?inet_pton\(AF_INET6, "([^"]+)"', text)
    assert {(addr, int(port)) for port, addr in v4 + v6} == {("127.0.0.1", azurite.port)}
