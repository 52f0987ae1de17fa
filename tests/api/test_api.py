"""ckptd.api.server through a daemon in the test process, on its real socket: whatever a client
sends, malformed or hostile, gets a 4xx with {"error", "message"}, never a 500; JSON is strict
(no NaN or Infinity in); numbers out of range are refused at the door."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from support.ckpts import save_single
from support.fixtures import running_daemon
from support.wire import request

from ckptd.cli.main import main

POST = ("POST", "/v1/roots/r1/checkpoints")


def answer(d: Any, method: str, path: str, body: bytes = b"",
           headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    status, doc = request(d.socket, method, path, body, headers)
    assert status != 500, doc
    if status >= 400:
        assert set(doc) == {"error", "message"} and doc["message"], doc
    return status, doc


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One daemon for the module: requests here change nothing the others look at."""
    with running_daemon(tmp_path_factory.mktemp("api")) as daemon:
        save_single(daemon.roots["r1"], 3)
        daemon.wait_for("r1", 3)
        yield daemon


@pytest.mark.parametrize("body", [
    b'{"step": 1, "metrics": {"loss": NaN}}',
    b'{"step": 1, "metrics": {"loss": Infinity}}',
    b'{"step": 1, "metrics": {"loss": -Infinity}}',
    b'{"step": 1, "metrics": {"loss": 1e999}}',  # parses as infinity
    b'{"step": NaN}',
    b"{bad}",
    b'{"step": 1',
    b"\xff\xfe",
    b"[" * 100_000 + b"]" * 100_000,
])
def test_body_that_is_not_strict_json_is_400_bad_json(d: Any, body: bytes) -> None:
    status, doc = answer(d, *POST, body)
    assert (status, doc["error"]) == (400, "bad_json"), doc
    assert d.store.checkpoint("r1", 1) is None  # nothing was registered


@pytest.mark.parametrize("body", [
    {"step": -1}, {"step": 2**63}, {"step": 10**30}, {"step": "1"}, {"step": True},
    {"step": 1.5}, {}, {"step": 1, "extra": 1}, {"step": 1, "paths": "x"},
    {"step": 1, "paths": [""]}, {"step": 1, "paths": [1]}, {"step": 1, "metrics": [1]},
    {"step": 1, "metrics": {"loss": "low"}}, {"step": 1, "metrics": {"loss": True}},
])
def test_bad_registration_fields_are_400(d: Any, body: dict[str, Any]) -> None:
    status, doc = answer(d, *POST, json.dumps(body).encode())
    assert (status, doc["error"]) == (400, "bad_field"), doc


def test_a_json_body_that_is_not_an_object_is_400(d: Any) -> None:
    for body in (b"[1]", b"1", b'"step"', b"null"):
        status, doc = answer(d, *POST, body)
        assert status == 400, (body, doc)


def test_the_largest_step_is_taken(d: Any) -> None:
    status, doc = answer(d, *POST, json.dumps({"step": 2**63 - 1}).encode())
    assert status == 202 and doc["step"] == 2**63 - 1


@pytest.mark.parametrize("path", ["/etc/passwd", "../outside", ".ckptd/latest.json", "."])
def test_paths_outside_the_root_are_422(d: Any, path: str) -> None:
    body = json.dumps({"step": 1, "paths": [path]}).encode()
    status, doc = answer(d, *POST, body)
    assert (status, doc["error"]) == (422, "outside_root"), doc


def test_body_size_and_framing(d: Any) -> None:
    assert answer(d, *POST, headers={"Content-Length": str(1024 * 1024 + 1)})[0] == 413
    assert answer(d, *POST, headers={"Content-Length": "-5"})[0] == 400
    assert answer(d, *POST, headers={"Content-Length": "lots"})[0] == 400
    status, doc = answer(d, *POST, b"1\r\n{\r\n0\r\n\r\n", {"Transfer-Encoding": "chunked"})
    assert (status, doc["error"]) == (411, "length_required")


@pytest.mark.parametrize("path", [
    "/v1/roots/r1/checkpoints/abc", "/v1/roots/r1/checkpoints/-1",
    "/v1/roots/r1/checkpoints/1.5", "/v1/roots/r1/checkpoints/%C2%B2",  # "²" is a digit
    f"/v1/roots/r1/checkpoints/{2**63}", "/v1/roots/r1/checkpoints/" + "9" * 5000,
    "/v1/roots/r1/latest?tier=everywhere",
    "/v1/roots/r1/checkpoints/3/wait?until=forever",
    "/v1/roots/r1/checkpoints/3/wait?timeout=nan", "/v1/roots/r1/checkpoints/3/wait?timeout=inf",
    "/v1/roots/r1/checkpoints/3/wait?timeout=soon",
])
def test_bad_query_and_path_values_are_400(d: Any, path: str) -> None:
    assert answer(d, "GET", path)[0] == 400


@pytest.mark.parametrize("endpoint", ["hold", "lease"])
@pytest.mark.parametrize("query", ["", "?owner=", "?owner=" + "x" * 129, "?owner=a&ttl=nan",
                                   "?owner=a&ttl=-inf", "?owner=a&ttl=never"])
def test_bad_holds_are_400(d: Any, endpoint: str, query: str) -> None:
    assert answer(d, "PUT", f"/v1/roots/r1/checkpoints/3/{endpoint}{query}")[0] == 400


@pytest.mark.parametrize("endpoint", ["hold", "lease"])  # /lease: the deprecated name
def test_a_hold_keeps_the_step_in_use_until_released(d: Any, endpoint: str) -> None:
    path = f"/v1/roots/r1/checkpoints/3/{endpoint}?owner=api-{endpoint}&ttl=60"
    status, doc = answer(d, "PUT", path)
    assert (status, doc["step"], doc["owner"]) == (200, 3, f"api-{endpoint}")
    assert 3 in d.store.in_use("r1", 0.0)
    assert answer(d, "DELETE", path) == (200, {"root": "r1", "step": 3, "released": True})
    assert 3 not in d.store.in_use("r1", 0.0)


def test_the_hold_command(d: Any) -> None:
    sock = ["--socket", str(d.socket)]
    assert main(["hold", "r1", "3", "--owner", "cli", "--ttl", "60", *sock]) == 0
    assert 3 in d.store.in_use("r1", 0.0)
    assert main(["hold", "r1", "3", "--owner", "cli", "--release", *sock]) == 0
    assert 3 not in d.store.in_use("r1", 0.0)
    assert main(["hold", "r1", "99", "--owner", "cli", *sock]) == 1  # no such step
    assert main(["hold", "r1", "3", "--owner", "cli", "--ttl", "0", *sock]) == 2  # out of range


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/v1/roots/nope/checkpoints"), ("GET", "/v1/roots/nope/latest"),
    ("GET", "/v1/roots/r1/checkpoints/99"), ("PUT", "/v1/roots/r1/checkpoints/99/pin"),
    ("DELETE", "/v1/roots/r1/checkpoints/99/pin"), ("GET", "/v1/nothing"), ("GET", "/"),
    ("PUT", "/v1/roots/r1/checkpoints/99/hold?owner=a"),
    ("PUT", "/v1/roots/r1/checkpoints/99/lease?owner=a"),
])
def test_what_does_not_exist_is_404(d: Any, method: str, path: str) -> None:
    assert answer(d, method, path)[0] == 404


def test_a_wrong_method_is_405(d: Any) -> None:
    status, doc = answer(d, "DELETE", "/v1/health")
    assert (status, doc["error"]) == (405, "method_not_allowed")


def test_a_good_request_after_bad_ones_is_served(d: Any) -> None:
    answer(d, *POST, b'{"step": 1, "metrics": {"loss": NaN}}')
    status, doc = answer(d, *POST, json.dumps({"step": 4, "metrics": {"loss": 0.5}}).encode())
    assert status == 202 and doc == {"root": "r1", "step": 4, "accepted": True}
    status, doc = answer(d, "GET", "/v1/roots/r1/checkpoints/3/wait?timeout=1e9")
    assert (status, doc["error"]) == (400, "bad_field")  # out of range: refused, not clamped
    status, doc = answer(d, "GET", "/v1/roots/r1/checkpoints/3/wait?timeout=5")
    assert status == 200 and doc["step"] == 3
    assert answer(d, "GET", "/v1/health")[1]["status"] == "ok"


def test_a_body_that_never_comes_or_is_cut_short_is_4xx(d: Any) -> None:
    """A Content-Length and then nothing: 408 after the read timeout; a body cut short by
    the client closing its side: 400. Never a 500; the daemon answers the next request."""
    import socket

    for sent, want in ((b"", 408), (b'{"step"', 400)):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            s.connect(str(d.socket))
            s.sendall(b"POST /v1/roots/r1/checkpoints HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Length: 100\r\n\r\n" + sent)
            if sent:
                s.shutdown(socket.SHUT_WR)
            raw = b""
            while chunk := s.recv(65536):
                raw += chunk
        head, _, rest = raw.partition(b"\r\n\r\n")
        assert int(head.split()[1]) == want, raw
        assert json.loads(rest)["message"]
    assert answer(d, "GET", "/v1/health")[0] == 200
