"""The proof of the job's shared secret that every request between peer daemons carries: the
secret file read and checked (`read_secret`), a request's proof headers made (`sign`) and
checked (`Verifier`: the HMAC, the time window, each nonce once).

Owns the headers' names and formats, the canonical string the HMAC covers, and the names the
peer routes' paths carry (root, node, rank, step), which server and client share. Never reads a
request body and never decides what a proven node may do (the server does).
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import os
import re
import secrets
import stat
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from ckptd.clock import SYSTEM, Clock
from ckptd.errors import BadValue, ConfigError, HttpError

NODE = "X-Ckptd-Node"
TIME = "X-Ckptd-Time"
NONCE = "X-Ckptd-Nonce"
BODY = "X-Ckptd-Body-Sha256"
PROOF = "X-Ckptd-Proof"
HEADERS = (NODE, TIME, NONCE, BODY, PROOF)

MAX_SECRET = 4096

# What the peer routes' paths carry: /v1/peer/replicas/{root}/{node}/{rank}/{step}.
PREFIX = "/v1/peer"
ROOT_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
MAX_RANK = 2**16
MAX_STEP = 2**63
MAX_HEAD = 1024 * 1024  # a replica head's JSON
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()

NODE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_TIME_RE = re.compile(r"[0-9]{1,12}")
_NONCE_RE = re.compile(r"[0-9a-fA-F]{16,64}")
_SHA_RE = re.compile(r"[0-9a-fA-F]{64}")
_METHOD_RE = re.compile(r"[A-Z]{1,16}")
_PATH_RE = re.compile(r"/[\x21-\x7e]{0,8191}")


def read_secret(path: str | os.PathLike[str]) -> bytes:
    """The job's shared secret from the file at `path`, whitespace stripped. ConfigError,
    naming the path: missing, unreadable, a link or not a regular file, empty, over 4 KiB,
    or open to group or others (the file must be 0600 or stricter)."""
    where = f"memory.secret_file = {str(path)!r}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        why = "a symlink (point at the file itself)" if os.path.islink(path) else (
            exc.strerror or str(exc))
        raise ConfigError(f"{where}: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{where}: not a regular file")
        if st.st_mode & 0o077:
            raise ConfigError(f"{where}: readable or writable by group or others"
                              f" (mode {stat.S_IMODE(st.st_mode):04o}): chmod 600")
        data = os.read(fd, MAX_SECRET + 1)
    except OSError as exc:
        raise ConfigError(f"{where}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_SECRET:
        raise ConfigError(f"{where}: over {MAX_SECRET} bytes")
    secret = data.strip()
    if not secret:
        raise ConfigError(f"{where}: empty")
    return secret


def canonical(method: str, path: str, body_sha256: str, node: str, when: str,
              nonce: str) -> bytes:
    """The string the proof's HMAC covers: the request's parts joined by newlines."""
    return "\n".join((method, path, body_sha256, node, when, nonce)).encode()


def _mac(secret: bytes, message: bytes) -> str:
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def sign(secret: bytes, method: str, path: str, body_sha256: str, node: str, now: float,
         nonce: str | None = None) -> dict[str, str]:
    """The proof headers for one request of `node` at `now` (unix seconds). `path` is the
    request target as sent (with its query); `body_sha256` the hex sha256 the server checks
    (of the body, or of a replica's head). BadValue for a part that is not well formed."""
    nonce = secrets.token_hex(16) if nonce is None else nonce
    for value, pattern, what in ((method, _METHOD_RE, "method"), (path, _PATH_RE, "path"),
                                 (body_sha256, _SHA_RE, "body_sha256"), (node, NODE_RE, "node"),
                                 (nonce, _NONCE_RE, "nonce")):
        if not isinstance(value, str) or pattern.fullmatch(value) is None:
            raise BadValue(f"proof {what}: {str(value)[:80]!r} is not well formed")
    if not secret:
        raise BadValue("proof secret: empty")
    when = str(int(now))
    proof = _mac(secret, canonical(method, path, body_sha256, node, when, nonce))
    return {NODE: node, TIME: when, NONCE: nonce, BODY: body_sha256, PROOF: proof}


@dataclass(frozen=True)
class Proven:
    """What a valid proof vouches for: the sender's node id and the body hash it signed."""

    node: str
    body_sha256: str


class _Headers(Protocol):
    def items(self) -> Iterable[tuple[str, Any]]: ...


class Verifier:
    """Checks the proof of each request: well-formed headers, the HMAC (constant-time), a time
    within ±`window` s of the clock, a nonce not seen within its window. Nonces are remembered
    until their request's time leaves the window; past `max_nonces` remembered at once, new
    requests are refused (503) rather than a nonce forgotten early. Thread-safe."""

    def __init__(self, secret: bytes, clock: Clock = SYSTEM, window: float = 60.0,
                 max_nonces: int = 100_000, not_before: float | None = None) -> None:
        """`not_before`: refuse a proof whose time (whole seconds) is of a second before this
        one (the server's start: the nonces a daemon saw before it are not remembered, so
        their requests are refused by time instead)."""
        if not secret:
            raise BadValue("proof secret: empty")
        self._secret, self._clock = secret, clock
        self._window, self._max = float(window), max_nonces
        self._not_before = None if not_before is None else int(not_before)
        self._lock = threading.Lock()
        self._seen: dict[str, float] = {}  # nonce (lower case) -> when it may be forgotten
        self._expiry: list[tuple[float, str]] = []  # a heap over the same

    def check(self, method: str, path: str, headers: _Headers) -> Proven:
        """The proven sender of a request, else HttpError 401 (missing, malformed, wrong,
        stale or replayed) or 503 (too many nonces to remember)."""
        got = _proof_headers(headers)
        node, when, nonce, body = got[NODE], got[TIME], got[NONCE], got[BODY]
        for value, pattern, name in ((node, NODE_RE, NODE), (when, _TIME_RE, TIME),
                                     (nonce, _NONCE_RE, NONCE), (body, _SHA_RE, BODY),
                                     (got[PROOF], _SHA_RE, PROOF)):
            if pattern.fullmatch(value) is None:
                raise HttpError(401, "bad_proof", f"header {name} is malformed")
        now = self._clock.time()
        sent = int(when)
        if self._not_before is not None and sent < self._not_before:
            raise HttpError(401, "stale", f"{TIME} is before this daemon's start (a request"
                            " made before it started is not taken)")
        if abs(sent - now) > self._window:
            raise HttpError(401, "stale", f"{TIME} is {sent - now:+.0f} s from this daemon's"
                            f" clock, outside ±{self._window:g} s (are the clocks in sync?)")
        want = _mac(self._secret, canonical(method, path, body, node, when, nonce))
        if not hmac.compare_digest(want, got[PROOF].lower()):
            raise HttpError(401, "bad_proof", "the proof does not match (another secret, or"
                            " the request was changed on its way)")
        self._remember(nonce.lower(), sent + self._window, now)
        return Proven(node, body.lower())

    def _remember(self, nonce: str, until: float, now: float) -> None:
        with self._lock:
            while self._expiry and self._expiry[0][0] < now:
                _, old = heapq.heappop(self._expiry)
                self._seen.pop(old, None)
            if nonce in self._seen:
                raise HttpError(401, "replayed", "this request's nonce was used already")
            if len(self._seen) >= self._max:
                raise HttpError(503, "busy", "too many requests within the proof window;"
                                " try again shortly")
            self._seen[nonce] = until
            heapq.heappush(self._expiry, (until, nonce))

    def remembered(self) -> int:
        """How many nonces are remembered now."""
        with self._lock:
            return len(self._seen)


def _proof_headers(headers: _Headers) -> dict[str, str]:
    """The five proof headers, each present exactly once, as text."""
    wanted = {name.lower(): name for name in HEADERS}
    got: dict[str, str] = {}
    for key, value in headers.items():
        name = wanted.get(str(key).lower())
        if name is None:
            continue
        if name in got:
            raise HttpError(401, "bad_proof", f"header {name} appears twice")
        if not isinstance(value, str):
            raise HttpError(401, "bad_proof", f"header {name} is malformed")
        got[name] = value.strip()
    missing = [name for name in HEADERS if name not in got]
    if missing:
        raise HttpError(401, "no_proof", f"missing proof header(s): {', '.join(missing)}")
    return got
