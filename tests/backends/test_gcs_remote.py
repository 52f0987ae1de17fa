"""gs:// on a GCS-compatible server (fake-gcs-server): get, ranges, version tags, stat, list,
delete, missing objects, `ckptd restore` of a step a daemon uploaded, byte for byte, and what
ckptd makes of the writes the server refuses.

Reads only succeed: fake-gcs-server (1.54, and its main branch) serves no XML API write. The
fixture starts it with `-public-host 127.0.0.1:<port>`, so obstore's path-style requests do
reach its XML routes; but there a PUT of an object is its signed-URL upload, which answers
400 "invalid uploadType" unless the query carries `X-Goog-Algorithm` (and even then answers
JSON without the ETag header obstore needs and ignores `x-goog-if-generation-match`), and a
multipart start (`POST ?uploads`) gets the same 400. It also ignores If-Match on reads. So the
objects are put through its JSON upload API (for the restore: copied from the file:// remote
a real daemon wrote), and the write half of the contract is not tested on gs:// here
(docs/STORAGE.md says so).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from support.ckpts import save_single
from support.config import write_layout

from ckptd.backends import Backend, LocalBackend
from ckptd.backends.wrappers import RetryingBackend
from ckptd.errors import CorruptData, ObjectNotFound, PermanentError

if TYPE_CHECKING:
    from gcsserver import GCSServer

pytest_plugins = ["gcsserver"]  # fixtures: gcs_server, gs_url

MiB = 1024 * 1024


def payload(n: int, seed: int = 0) -> bytes:
    block = hashlib.sha256(f"{seed}".encode()).digest() * 2048  # 64 KiB
    return (block * (n // len(block) + 1))[:n]


def seed(server: GCSServer, url: str, objects: dict[str, bytes]) -> Backend:
    """Put `objects` under the URL's prefix and answer the ckptd backend for the URL."""
    bucket, _, prefix = url.removeprefix("gs://").partition("/")
    for key, data in objects.items():
        server.upload(bucket, f"{prefix}/{key}", data)
    return server.backend(url)


def test_gets_and_ranges(gcs_server: GCSServer, gs_url: str) -> None:
    big = payload(10 * MiB + 17, seed=1)  # over 8 MiB: fetched as ranged GETs
    backend = seed(gcs_server, gs_url, {"step-1/shard": big, "LATEST": b'{"step": 1}'})
    out = io.BytesIO()
    assert backend.get("step-1/shard", out) == len(big)
    assert out.getvalue() == big
    assert backend.get_bytes("LATEST") == b'{"step": 1}'
    data, tag = backend.get_versioned("LATEST")
    # GCS swaps on the generation: the version tag carries it beside the ETag.
    generation, _, etag = tag.partition("#")
    assert data == b'{"step": 1}' and generation.isdigit()
    assert etag == backend.stat("LATEST").etag
    assert bytes(backend.get_range("LATEST", 2, 6, etag=tag)) == b"step"
    with pytest.raises(PermanentError, match="version tag"):  # refused before any request
        backend.put("LATEST", b'{"step": 2}', if_match=etag)
    for start, end in ((0, 1), (MiB + 3, 2 * MiB + 5), (len(big) - 10, len(big))):
        assert bytes(backend.get_range("step-1/shard", start, end)) == big[start:end]
    for start, end in ((len(big) - 5, len(big) + 5), (len(big), len(big) + 1)):
        with pytest.raises(CorruptData, match="step-1/shard"):
            backend.get_range("step-1/shard", start, end)


def test_stat_gives_the_version_reads_are_pinned_to(gcs_server: GCSServer,
                                                    gs_url: str) -> None:
    """stat gives gs://'s version tag (`<generation>#<etag>`), another for a new generation.
    The server ignores If-Match on its reads, so what a pinned read of another version does
    is checked on S3, Azure and file:// (test_backend_ranges.py), not here."""
    big = payload(10 * MiB + 17, seed=1)
    backend = seed(gcs_server, gs_url, {"step-1/shard": big})
    meta = backend.stat("step-1/shard")
    assert meta.version and all(m.version for m in backend.list("step-1"))
    generation, _, etag = meta.version.partition("#")
    assert generation.isdigit() and etag == meta.etag
    assert bytes(backend.get_range("step-1/shard", 3, 9, etag=meta.version)) == big[3:9]
    out = io.BytesIO()
    assert backend.get("step-1/shard", out, etag=meta.version) == len(big)
    assert out.getvalue() == big
    seed(gcs_server, gs_url, {"step-1/shard": payload(len(big), seed=2)})  # a new generation
    assert backend.stat("step-1/shard").version != meta.version


def test_stat_list_delete(gcs_server: GCSServer, gs_url: str) -> None:
    keys = ("a/1", "a/2", "a/b/3", "ab/4", "c")
    backend = seed(gcs_server, gs_url, {k: k.encode() for k in keys})
    meta = backend.stat("a/b/3")
    assert (meta.key, meta.size) == ("a/b/3", 5) and meta.etag
    assert sorted(m.key for m in backend.list("a")) == ["a/1", "a/2", "a/b/3"]
    assert sorted(m.key for m in backend.list("")) == sorted(keys)
    assert {m.key: m.size for m in backend.list("a/b")} == {"a/b/3": 5}
    backend.delete("a/1")
    backend.delete("a/1")  # idempotent
    backend.delete("never/was")
    assert sorted(m.key for m in backend.list("a")) == ["a/2", "a/b/3"]


def test_missing_object(gcs_server: GCSServer, gs_url: str) -> None:
    backend = gcs_server.backend(gs_url)
    for read in (lambda: backend.get("nope/x", io.BytesIO()),
                 lambda: backend.get_bytes("nope/x"), lambda: backend.stat("nope/x"),
                 lambda: backend.get_range("nope/x", 0, 10)):
        with pytest.raises(ObjectNotFound, match="nope/x"):
            read()


def test_an_unusable_service_account_file_is_permanent(
        gcs_server: GCSServer, gs_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Building the store reads the file and sends nothing: retrying cannot help."""
    broken = tmp_path / "account.json"
    broken.write_text('{"client_email": ""}')
    monkeypatch.setenv("GOOGLE_SERVICE_ACCOUNT", str(broken))
    with pytest.raises(PermanentError, match="service account"):
        gcs_server.backend(gs_url)


def test_restore_from_gcs_brings_back_what_a_daemon_uploaded(
        inproc_daemon: Any, gcs_server: GCSServer, gs_url: str, tmp_path: Path,
        short_dir: Path) -> None:
    remote = tmp_path / "remote"
    d = inproc_daemon(roots=[{"name": "r1", "upload": {"url": f"file://{remote}"}}])
    original = save_single(d.roots["r1"], 7, n=256).read_bytes()
    assert d.client.wait("r1", 7, until="uploaded", timeout=60)
    d.stop()
    # The same objects, key for key, in the bucket; then a node whose remote is gs://.
    objects = {m.key: LocalBackend(remote).get_bytes(m.key) for m in LocalBackend(remote).list()}
    assert "r1/step-7/MANIFEST.json" in objects
    seed(gcs_server, gs_url, objects)
    node = write_layout(tmp_path / "node2", short_dir / "n2.sock", roots=[
        {"name": "r1", "upload": {"url": gs_url, "endpoint": gcs_server.endpoint}}])
    out = tmp_path / "restored"
    r = subprocess.run([sys.executable, "-m", "ckptd", "restore", "r1", "latest", "--to",
                        str(out), "--config", str(node.config)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert (out / "model_step_7.pt").read_bytes() == original  # byte for byte


def test_a_write_the_server_refuses_is_permanent_and_not_retried(
        gcs_server: GCSServer, gs_url: str) -> None:
    """Every XML API write obstore makes is refused by this server with a 400 (see the module
    docstring): a plain put, a create-only put, a generation swap and a multipart upload each
    leave as a PermanentError naming the key, sent once (no backoff), and nothing is stored."""
    bucket, _, prefix = gs_url.removeprefix("gs://").partition("/")
    # The refusal, as the server words it, on the public-host route obstore's requests take.
    status, body = gcs_server._request("PUT", f"/{bucket}/{prefix}/raw", b"x",
                                       "application/octet-stream")
    assert (status, b"invalid uploadType" in body) == (400, True), body[:300]
    seed(gcs_server, gs_url, {"LATEST": b'{"step": 1}'})
    sleeps: list[float] = []
    backend = RetryingBackend(gcs_server.backend(gs_url, part_size=5 * MiB), sleep=sleeps.append)
    _, tag = backend.get_versioned("LATEST")
    writes: dict[str, Callable[[], object]] = {
        "plain": lambda: backend.put("plain", b"1"),
        "create": lambda: backend.put("create", b"1", create_only=True),
        "LATEST": lambda: backend.put("LATEST", b'{"step": 2}', if_match=tag),
        "multi": lambda: backend.put("multi", io.BytesIO(payload(11 * MiB)), 11 * MiB),
    }
    for key, write in writes.items():
        try:
            write()
        except PermanentError as exc:
            assert re.fullmatch(rf"put {re.escape(gs_url)}/{key}: HTTP 400", str(exc)), exc
        else:
            pytest.fail(f"fake-gcs-server stored {key} through the XML API: it serves writes "
                        "now, so test them here instead of this refusal")
    assert sleeps == []
    assert {m.key for m in backend.list("")} == {"LATEST"}
    assert backend.get_bytes("LATEST") == b'{"step": 1}'


_CHILD = """
import io, sys
from ckptd.backends import make_backend
b = make_backend(sys.argv[1], endpoint=sys.argv[2])
assert b.get_bytes("x/one") == b"1"
b.get("x/one", io.BytesIO())
assert [m.key for m in b.list("x")] == ["x/one"]
b.stat("x/one")
print("done")
"""


def test_only_the_configured_endpoint_is_contacted(
        gcs_server: GCSServer, gs_url: str, tmp_path: Path) -> None:
    """With a service-account file that turns OAuth off, a client process connects to the
    server and to nothing else: no token endpoint, no metadata server (traced with strace)."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace not installed")
    seed(gcs_server, gs_url, {"x/one": b"1"})
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(_CHILD))
    trace = tmp_path / "trace.txt"
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(Path(__file__).parents[2]),
           "HOME": str(tmp_path), "GOOGLE_SERVICE_ACCOUNT": str(gcs_server.service_account)}
    cmd = [strace, "-f", "-qq", "-e", "trace=connect,sendto,sendmsg", "-o", str(trace),
           sys.executable, str(script), gs_url, gcs_server.endpoint]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    if done.returncode != 0 and "ptrace" in done.stderr:
        pytest.skip(f"strace cannot trace here: {done.stderr.strip()[:200]}")
    assert done.returncode == 0, done.stderr
    assert "done" in done.stdout
    text = trace.read_text()
    v4 = re.findall(r'sin_port=htons\((\d+)\), sin_addr=inet_addr\("([^"]+)"\)', text)
    v6 = re.findall(r'sin6_port=htons\((\d+)\).*?inet_pton\(AF_INET6, "([^"]+)"', text)
    assert {(addr, int(port)) for port, addr in v4 + v6} == {("127.0.0.1", gcs_server.port)}
