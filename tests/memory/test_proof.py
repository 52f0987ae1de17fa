"""The peers' shared-secret proof: the secret file's checks, a signed request verified, and every
way a request can fail it (a header missing or malformed, another secret, a time outside the
window either way, a nonce replayed), with the nonce memory bounded and pruned."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.fuzzing import fuzz

from ckptd.errors import BadValue, ConfigError, HttpError
from ckptd.memory import proof
from ckptd.memory.proof import HEADERS, Proven, Verifier, read_secret, sign

SECRET = b"s3cret-of-the-job"
BODY = hashlib.sha256(b"body").hexdigest()
T0 = 1_800_000_000.0


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


def signed(path: str = "/v1/peer/health", node: str = "node-1", now: float = T0,
           secret: bytes = SECRET, nonce: str | None = None) -> dict[str, str]:
    return sign(secret, "GET", path, BODY, node, now, nonce)


def refused(v: Verifier, headers: dict[str, str], path: str = "/v1/peer/health",
            method: str = "GET") -> HttpError:
    with pytest.raises(HttpError) as info:
        v.check(method, path, headers)
    return info.value


# -- the secret file -----------------------------------------------------------------------


def write_secret(tmp_path: Path, data: bytes, mode: int = 0o600) -> Path:
    p = tmp_path / "secret"
    p.write_bytes(data)
    p.chmod(mode)
    return p


def test_a_secret_file_is_read_and_stripped(tmp_path: Path) -> None:
    assert read_secret(write_secret(tmp_path, b"  abc\n")) == b"abc"


@pytest.mark.parametrize(("data", "mode", "says"), [
    (b"abc", 0o640, "chmod 600"),
    (b"abc", 0o604, "chmod 600"),
    (b"abc", 0o620, "chmod 600"),
    (b" \n\t", 0o600, "empty"),
    (b"", 0o600, "empty"),
    (b"x" * 4097, 0o600, "over 4096"),
])
def test_a_bad_secret_file_is_a_config_error_naming_it(tmp_path: Path, data: bytes,
                                                       mode: int, says: str) -> None:
    p = write_secret(tmp_path, data, mode)
    with pytest.raises(ConfigError, match=says) as info:
        read_secret(p)
    assert str(p) in str(info.value)


def test_a_missing_or_linked_or_unreadable_secret_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="secret"):
        read_secret(tmp_path / "nothing")
    real = write_secret(tmp_path, b"abc")
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(ConfigError, match="symlink"):
        read_secret(link)
    with pytest.raises(ConfigError, match="regular"):
        read_secret(tmp_path)
    if os.geteuid() != 0:
        real.chmod(0o000)
        with pytest.raises(ConfigError, match=str(real)):
            read_secret(real)
    assert read_secret(write_secret(tmp_path, b"x" * 4096)) == b"x" * 4096


# -- signing and checking ------------------------------------------------------------------


def test_a_signed_request_is_proven() -> None:
    v = Verifier(SECRET, Clock())
    headers = signed(path="/v1/peer/replicas/r/node-1?x=1")
    assert set(headers) == set(HEADERS)
    got = v.check("GET", "/v1/peer/replicas/r/node-1?x=1", headers)
    assert got == Proven("node-1", BODY)
    lower = {k.lower(): val for k, val in signed().items()}  # header names in any case
    assert v.check("GET", "/v1/peer/health", lower).node == "node-1"


@pytest.mark.parametrize("name", HEADERS)
def test_each_missing_header_is_a_401(name: str) -> None:
    headers = signed()
    del headers[name]
    err = refused(Verifier(SECRET, Clock()), headers)
    assert err.status == 401 and err.code == "no_proof" and name in err.message


@pytest.mark.parametrize(("name", "value"), [
    (proof.NODE, ""), (proof.NODE, "-lead"), (proof.NODE, "a" * 65), (proof.NODE, "a/b"),
    (proof.NODE, "nöde"), (proof.TIME, "-5"), (proof.TIME, "1.5"), (proof.TIME, "1e9"),
    (proof.TIME, "9" * 13), (proof.TIME, ""), (proof.NONCE, "abc"), (proof.NONCE, "g" * 32),
    (proof.NONCE, "a" * 65), (proof.BODY, "0" * 63), (proof.BODY, "z" * 64),
    (proof.PROOF, "0" * 63), (proof.PROOF, "not hex"),
])
def test_each_malformed_header_is_a_401(name: str, value: str) -> None:
    headers = signed()
    headers[name] = value
    err = refused(Verifier(SECRET, Clock()), headers)
    assert err.status == 401 and err.code == "bad_proof", err.message


def test_a_duplicated_header_is_a_401() -> None:
    headers = signed()
    headers["x-ckptd-node"] = headers[proof.NODE]
    assert refused(Verifier(SECRET, Clock()), headers).code == "bad_proof"


def test_another_secret_or_a_changed_request_fails_the_proof() -> None:
    v = Verifier(SECRET, Clock())
    assert refused(v, signed(secret=b"another")).code == "bad_proof"
    assert refused(v, signed(), path="/v1/peer/healthz").code == "bad_proof"
    assert refused(v, signed(), method="PUT").code == "bad_proof"
    for name, value in ((proof.NODE, "node-2"), (proof.BODY, "0" * 64),
                        (proof.TIME, str(int(T0) + 1)), (proof.NONCE, "0" * 32)):
        headers = signed()
        headers[name] = value
        assert refused(v, headers).code == "bad_proof", name


@pytest.mark.parametrize("offset", [-61.0, 61.0, -3600.0, 10**6])
def test_a_time_outside_the_window_either_way_is_stale(offset: float) -> None:
    v = Verifier(SECRET, Clock(), window=60.0)
    err = refused(v, signed(now=T0 + offset))
    assert err.status == 401 and err.code == "stale"


@pytest.mark.parametrize("offset", [-59.0, 59.0])
def test_a_time_inside_the_window_is_taken(offset: float) -> None:
    assert Verifier(SECRET, Clock(), window=60.0).check("GET", "/v1/peer/health",
                                                        signed(now=T0 + offset))


def test_a_replayed_nonce_is_refused_until_its_time_has_left_the_window() -> None:
    clock = Clock()
    v = Verifier(SECRET, clock, window=60.0)
    headers = signed()
    v.check("GET", "/v1/peer/health", headers)
    err = refused(v, headers)
    assert err.status == 401 and err.code == "replayed"
    upper = dict(headers, **{proof.NONCE: headers[proof.NONCE].upper()})
    assert refused(v, upper).code == "bad_proof"  # the proof covers the nonce as sent
    clock.now += 59
    assert refused(v, headers).code == "replayed"
    clock.now += 2
    assert refused(v, headers).code == "stale"  # never taken again once out of the window


def test_the_nonce_memory_is_bounded_and_pruned() -> None:
    clock = Clock()
    v = Verifier(SECRET, clock, window=60.0, max_nonces=3)
    for _ in range(3):
        v.check("GET", "/v1/peer/health", signed())
    err = refused(v, signed())
    assert err.status == 503 and err.code == "busy"  # refused, not a nonce forgotten early
    assert v.remembered() == 3
    clock.now += 61
    v.check("GET", "/v1/peer/health", signed(now=clock.now))
    assert v.remembered() == 1  # the three expired are pruned


def test_a_bad_proof_never_fills_the_nonce_memory() -> None:
    v = Verifier(SECRET, Clock(), max_nonces=2)
    for _ in range(10):
        refused(v, signed(secret=b"wrong"))
    assert v.remembered() == 0


def test_sign_refuses_malformed_parts() -> None:
    for kwargs in ({"node": "-x"}, {"path": "no-slash"}, {"nonce": "xyz"},
                   {"path": "/a b"}, {"path": "/a\nb"}):
        with pytest.raises(BadValue):
            signed(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(BadValue):
        Verifier(b"")


header_text = st.one_of(st.text(max_size=80), st.from_regex(r"[0-9a-f]{1,70}", fullmatch=True),
                        st.integers(min_value=-10**20, max_value=10**20).map(str))


@fuzz()
@given(values=st.dictionaries(st.sampled_from([*HEADERS, "x-ckptd-proof", "Other"]),
                              header_text, max_size=7),
       keep=st.sets(st.sampled_from(HEADERS)))
def test_any_header_values_are_a_proof_or_an_http_error(values: dict[str, str],
                                                        keep: set[str]) -> None:
    headers = {k: v for k, v in signed().items() if k in keep}
    headers.update(values)
    try:
        got = Verifier(SECRET, Clock()).check("GET", "/v1/peer/health", headers)
    except HttpError as err:
        assert err.status in (401, 503)
    else:
        assert got.node == headers[proof.NODE]
