"""What the bounded property tests share: hypothesis settings (`CKPTD_FUZZ_EXAMPLES` for more
cases), a time bound on each parse, JSON strategies with hostile literals, and a document with
one node replaced by raw text. Holds no tests."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from ckptd.model import Reason

EXAMPLES = int(os.environ.get("CKPTD_FUZZ_EXAMPLES", "200"))


BOUND_S = 5.0  # any one parse, on the shared CI cores


REASONS = {r.value for r in Reason} | {""}


def fuzz(n: int = EXAMPLES) -> Callable[[Any], Any]:
    return settings(max_examples=n, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])


@contextmanager
def bounded(what: str) -> Iterator[None]:
    started = time.monotonic()
    yield
    took = time.monotonic() - started
    assert took < BOUND_S, f"{what} took {took:.1f} s"


def ends_within(fn: Callable[[], Any], what: str) -> Any:
    """`fn()`'s result or the exception it raised, failing if it has not ended in BOUND_S (a
    spin is left to a daemon thread instead of hanging the suite)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(BOUND_S)
    assert out, f"{what} still running after {BOUND_S} s"
    return out[0]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=4),
    max_leaves=12)


# Literal JSON text that a lenient parser takes and a strict one must refuse (or bound).
hostile_literals = st.sampled_from([
    "NaN", "-Infinity", "Infinity", "1e999", "-1e999", "9" * 400, "-" + "9" * 4000,
    "1" + "0" * 19, str(2**63), str(-(2**63)), str(2**63 - 1), "0." + "1" * 100,
    "1" * 5000 + ".5", "[" * 100 + "]" * 100, "[" * 100_000, '{"a":' * 70 + "1" + "}" * 70,
    '{"a": 1, "a": 2}', '"\\ud800"', '"' + "x" * 10_000 + '"', "[1,]", "{}", "[]",
    "true", "null", "-0", "1E400", "0e-400",
])


def _splice(source: Any, path: list[int], literal: str) -> bytes:
    """`source` serialised with the node reached by `path` replaced by `literal` (raw text)."""
    marker = "\x00SPLICE\x00"
    doc = _replace(source, path, marker)
    return json.dumps(doc).replace(json.dumps(marker), literal).encode()


def _replace(doc: Any, path: list[int], value: Any) -> Any:
    if not path or not isinstance(doc, dict | list) or not doc:
        return value
    keys = list(doc) if isinstance(doc, dict) else list(range(len(doc)))
    key = keys[path[0] % len(keys)]
    out = dict(doc) if isinstance(doc, dict) else list(doc)
    out[key] = _replace(doc[key], path[1:], value)  # type: ignore[index]
    return out
