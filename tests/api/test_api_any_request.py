"""A bounded property test of the socket API: whatever method, path, query and body a client
sends, the daemon answers with a JSON error or a success, never a 500, and keeps answering.
One real daemon in this process, a real socket; a few hundred generated requests."""

from __future__ import annotations

import json
import os
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import Harness, raw
from writers import save_torch

ROUTES = ["/v1/health", "/v1/status", "/v1/flush", "/metrics", "/v1/roots/{r}/checkpoints",
          "/v1/roots/{r}/checkpoints/{s}", "/v1/roots/{r}/latest",
          "/v1/roots/{r}/checkpoints/{s}/pin", "/v1/roots/{r}/checkpoints/{s}/hold",
          "/v1/roots/{r}/checkpoints/{s}/lease", "/v1/roots/{r}/checkpoints/{s}/wait",
          "/v1/roots/{r}/prune", "/{r}", "/v1/{r}/{s}"]

text = st.text(max_size=40)
numberish = st.one_of(st.integers(-2**70, 2**70).map(str), st.floats().map(repr),
                      st.sampled_from(["nan", "inf", "-0", "1e999", "\u0661\u0662", "0x10",
                                       " 1", "1 ", "9223372036854775807",
                                       "9223372036854775808"]), text)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**80, 2**80) | st.floats() | text,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(text, inner, max_size=5),
    max_leaves=20)
bodies = st.one_of(
    st.just(b""),
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"step": json_values}, optional={
        "paths": st.lists(text | json_values, max_size=4), "metrics": json_values,
    }).map(lambda v: json.dumps(v).encode()),
)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    import shutil
    import tempfile

    sock_dir = Path(tempfile.mkdtemp(prefix="ckd-", dir="/tmp"))
    h = Harness(tmp_path_factory.mktemp("fuzz"), sock_dir)
    save_torch(h.root / "model_step_1.pt")
    h.daemon.start()
    try:
        assert h.client.wait("r", 1, until="valid", timeout=30)
        yield h
    finally:
        h.daemon.stop(grace=5)
        shutil.rmtree(sock_dir, ignore_errors=True)


# CI runs a few hundred; CKPTD_FUZZ_EXAMPLES=5000 for a longer hunt by hand.
@settings(max_examples=int(os.environ.get("CKPTD_FUZZ_EXAMPLES", "300")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
       route=st.sampled_from(ROUTES), root=st.sampled_from(["r", "nope"]) | text,
       step=numberish,
       query=st.dictionaries(st.sampled_from(["tier", "until", "timeout", "ttl", "owner", "x"]),
                             numberish, max_size=3),
       body=bodies)
def test_any_request_gets_an_answer_never_a_500(daemon: Harness, method: str, route: str,
                                                 root: str, step: str, query: dict[str, str],
                                                 body: bytes) -> None:
    path = route.format(r=urllib.parse.quote(root, safe=""), s=urllib.parse.quote(step, safe=""))
    if "wait" in path:
        query = {**query, "timeout": "0"}  # a valid wait would otherwise hold the test
    target = path + ("?" + urllib.parse.urlencode(query) if query else "")
    status, payload = raw(daemon.daemon.config.daemon.socket, method, target, body,
                          decode=False)
    assert status < 500 or status == 503, (status, payload[:300])
    if status >= 400:
        doc: Any = strict(payload)
        assert set(doc) == {"error", "message"}
    elif payload[:1] in (b"{", b"["):
        strict(payload)  # JSON out is strict: no NaN or Infinity anywhere


def strict(payload: bytes) -> Any:
    def refuse(name: str) -> Any:
        raise AssertionError(f"non-standard JSON constant {name} in {payload[:200]!r}")

    return json.loads(payload, parse_constant=refuse)


def test_the_daemon_is_whole_after_the_fuzz(daemon: Harness) -> None:
    assert daemon.client.health()["status"] == "ok"  # type: ignore[index]
    assert daemon.client.latest("r")["step"] == 1  # type: ignore[index]
