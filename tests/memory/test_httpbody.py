"""A request body read as it arrives: Content-Length or chunked framing, extensions and trailers
taken, and every malformed or cut-short framing a 400, never a hang or a traceback."""

from __future__ import annotations

import io

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.fuzzing import fuzz

from ckptd.errors import HttpError
from ckptd.memory.httpbody import MAX_LINE, Body, framing


def drain(body: Body, n: int = 7) -> bytes:
    out = b""
    while data := body.read(n):
        out += data
    return out


def test_a_length_framed_body() -> None:
    body = Body(io.BytesIO(b"hello world, and more"), 11)
    assert body.length == 11
    assert body.read_exact(5) == b"hello"
    assert drain(body) == b" world" and body.ended and body.read(5) == b""


def test_a_chunked_body_with_extensions_and_trailers() -> None:
    raw = b"5;ext=1\r\nhello\r\n1\r\n \r\nA\r\n0123456789\r\n0\r\nX-Trailer: y\r\n\r\nNEXT"
    stream = io.BytesIO(raw)
    body = Body(stream, None)
    assert body.length is None
    assert drain(body, 3) == b"hello 0123456789" and body.ended
    assert stream.read() == b"NEXT"  # the next request stays unread


@pytest.mark.parametrize("raw", [
    b"5\r\nhel",  # cut inside a chunk
    b"5\r\nhello",  # no CRLF after its data, nor a last chunk
    b"5\r\nhelloXX\r\n0\r\n\r\n",  # data longer than its size
    b"zz\r\nhello\r\n",  # not hex
    b"-5\r\nhello\r\n",
    b"\r\n",
    b"1" * 17 + b"\r\n",  # a size of more than 16 hex digits
    b"5" + b" " * MAX_LINE + b"\r\nhello\r\n",  # a size line over the cap
    b"0\r\n" + b"X: y\r\n" * 40 + b"\r\n",  # too many trailers
    b"0\r\nX: y\r\n",  # trailers never end
    b"",
])
def test_bad_chunked_framing_is_a_400(raw: bytes) -> None:
    with pytest.raises(HttpError) as info:
        drain(Body(io.BytesIO(raw), None))
    assert info.value.status == 400


def test_a_length_framed_body_cut_short_is_a_400() -> None:
    body = Body(io.BytesIO(b"abc"), 10)
    with pytest.raises(HttpError) as info:
        body.read_exact(10)
    assert info.value.status == 400 and info.value.code == "cut_short"


@pytest.mark.parametrize(("te", "length", "want"), [
    (None, "10", 10), (None, "0", 0), ("chunked", None, None), ("Chunked ", None, None),
])
def test_framing_from_headers(te: str | None, length: str | None, want: int | None) -> None:
    assert framing(te, length) == want


@pytest.mark.parametrize(("te", "length", "status"), [
    (None, None, 411), (None, "-1", 400), (None, "1e3", 400), (None, "9" * 20, 400),
    (None, "١٢", 400), ("gzip", None, 400), ("chunked", "10", 400), (None, "", 400),
])
def test_bad_framing_headers(te: str | None, length: str | None, status: int) -> None:
    with pytest.raises(HttpError) as info:
        framing(te, length)
    assert info.value.status == status


@fuzz()
@given(raw=st.binary(max_size=200) | st.lists(
    st.sampled_from([b"0", b"5", b"ff", b";x", b"\r\n", b"\n", b"hello", b"X: y"]),
    max_size=20).map(b"".join))
def test_any_bytes_as_a_chunked_body_end_or_are_a_400(raw: bytes) -> None:
    body = Body(io.BytesIO(raw), None)
    try:
        got = drain(body, 64)
    except HttpError as err:
        assert err.status == 400
    else:
        assert len(got) <= len(raw) and body.ended
