"""A request body read off an HTTP/1.1 connection as it arrives, framed by Content-Length or
chunked transfer coding, in bounded pieces: a chunk-size line, a trailer and the trailers'
count all have a cap, and every read waits at most the socket's timeout.

Owns only the framing. Never decides how much of a body may be kept (the caller counts what it
takes) and never answers the request: its errors are HttpError 400 (malformed, cut short) and
408 (a sender that stalls), which the server turns into its answer.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Protocol

from ckptd.errors import HttpError

MAX_LINE = 1024  # a chunk-size line (with its extensions) or a trailer line
MAX_TRAILERS = 32
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")


class Reader(Protocol):
    def read(self, n: int, /) -> bytes: ...

    def readline(self, n: int, /) -> bytes: ...


def framing(te: str | None, length: str | None) -> int | None:
    """The body's length from its headers (None: chunked); HttpError 400/411 otherwise."""
    if te is not None:
        if te.strip().lower() != "chunked":
            raise HttpError(400, "bad_request", f"Transfer-Encoding {te[:40]!r} is not chunked")
        if length is not None:
            raise HttpError(400, "bad_request", "both Transfer-Encoding and Content-Length")
        return None
    if length is None:
        raise HttpError(411, "length_required", "send Content-Length or a chunked body")
    if not length.strip().isdigit() or not length.strip().isascii() or len(length) > 19:
        raise HttpError(400, "bad_request", f"Content-Length {length[:40]!r} is not a number")
    return int(length)


class Body:
    """The body of one request on `rfile`: `length` bytes, or chunked when `length` is None."""

    def __init__(self, rfile: Reader, length: int | None) -> None:
        self._rfile = rfile
        self._chunked = length is None
        self._left = 0 if length is None else length  # in this chunk, or in the whole body
        self._started = False
        self._ended = length == 0
        self.received = 0

    @property
    def length(self) -> int | None:
        """The whole body's length when known up front."""
        return None if self._chunked else self._left + self.received

    def read(self, n: int) -> bytes:
        """Up to `n` bytes of the body (fewer only at a chunk's end); b"" once it is over."""
        if self._ended:
            return b""
        if self._chunked and self._left == 0:
            self._next_chunk()
            if self._ended:
                return b""
        data = self._read(min(n, self._left))
        if not data:
            raise HttpError(400, "cut_short", f"the request body ended after {self.received}"
                            " bytes, before its framing said")
        self._left -= len(data)
        self.received += len(data)
        if not self._chunked and self._left == 0:
            self._ended = True
        return data

    def read_exact(self, n: int) -> bytes:
        """Exactly `n` bytes of the body; HttpError 400 when it ends first."""
        parts: list[bytes] = []
        got = 0
        while got < n:
            data = self.read(n - got)
            if not data:
                raise HttpError(400, "cut_short", f"the request body ended after"
                                f" {self.received} bytes, within its first {n}")
            parts.append(data)
            got += len(data)
        return b"".join(parts)

    @property
    def ended(self) -> bool:
        return self._ended

    def _next_chunk(self) -> None:
        if self._started:
            if self._line() != b"":
                raise HttpError(400, "bad_chunk", "a chunk's data is not followed by CRLF")
        self._started = True
        line = self._line().split(b";", 1)[0].strip()
        if _HEX.fullmatch(line) is None:
            raise HttpError(400, "bad_chunk", f"bad chunk size {line[:40]!r}")
        self._left = int(line, 16)
        if self._left == 0:
            for _ in range(MAX_TRAILERS + 1):
                if self._line() == b"":
                    self._ended = True
                    return
            raise HttpError(400, "bad_chunk", f"more than {MAX_TRAILERS} trailer lines")

    def _line(self) -> bytes:
        raw = self._io(lambda: self._rfile.readline(MAX_LINE + 1))
        if not raw.endswith(b"\n"):
            if len(raw) > MAX_LINE:
                raise HttpError(400, "bad_chunk", f"a chunk line over {MAX_LINE} bytes")
            raise HttpError(400, "cut_short", f"the request body ended after {self.received}"
                            " bytes, inside its chunked framing")
        return raw.rstrip(b"\r\n")

    def _read(self, n: int) -> bytes:
        return self._io(lambda: self._rfile.read(n))

    def _io(self, call: Callable[[], bytes]) -> bytes:
        try:
            return call()
        except TimeoutError:
            raise HttpError(408, "request_timeout", f"the request body stalled after"
                            f" {self.received} bytes") from None
        except OSError as exc:
            raise HttpError(400, "cut_short", f"the request body could not be read after"
                            f" {self.received} bytes: {exc.strerror or exc}") from None
