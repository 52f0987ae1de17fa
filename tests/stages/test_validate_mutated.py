"""A bounded property test of the checkpoint readers: a real torch file, zip or legacy, with
bytes flipped, cut or replaced anywhere, is judged (valid or invalid with a reason) and never
raises, never hangs and never runs anything. A few hundred mutations a run."""

from __future__ import annotations

import collections
import io
import os
import time
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptd.model import Candidate, Reason
from ckptd.stages.validate import validate

REASONS = {r.value for r in Reason}


def _torch_bytes(legacy: bool) -> bytes:
    buf = io.BytesIO()
    torch.save({"w": torch.arange(32, dtype=torch.float32), "step": 3,
                "nested": {"b": torch.ones(2, 3, dtype=torch.bfloat16)}}, buf,
               _use_new_zipfile_serialization=not legacy)
    return buf.getvalue()


SAMPLES = {False: _torch_bytes(False), True: _torch_bytes(True)}

mutations = st.lists(st.tuples(st.sampled_from(["flip", "cut", "put"]),
                               st.floats(0, 1, allow_nan=False), st.binary(min_size=1,
                                                                           max_size=8)),
                     min_size=1, max_size=4)


def _mutate(data: bytes, plan: list[tuple[str, float, bytes]]) -> bytes:
    out = bytearray(data)
    for kind, where, blob in plan:
        if not out:
            break
        at = min(len(out) - 1, int(where * len(out)))
        if kind == "flip":
            out[at] ^= blob[0] or 1
        elif kind == "cut":
            del out[at:]
        else:
            out[at:at + len(blob)] = blob
    return bytes(out)


@settings(max_examples=int(os.environ.get("CKPTD_FUZZ_EXAMPLES", "200")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(legacy=st.booleans(), plan=mutations, deep=st.booleans())
def test_a_mutated_torch_file_is_judged_never_raises(tmp_path: Path, legacy: bool,
                                                     plan: list[tuple[str, float, bytes]],
                                                     deep: bool) -> None:
    name = "model_step_3.pt"
    (tmp_path / name).write_bytes(_mutate(SAMPLES[legacy], plan))
    t0 = time.monotonic()
    result = validate(tmp_path, Candidate("single", 3, name, (name,), True), deep=deep)
    assert time.monotonic() - t0 < 10
    assert result.valid or result.reason in REASONS, result
    assert not (tmp_path / "ran").exists()


class _View:
    """Pickles as torch's tensor rebuild over a small storage with any sizes, strides and
    offset: what a hostile pickle may claim of a tensor."""

    def __init__(self, storage: torch.Tensor, offset: int, size: tuple[int, ...],
                 stride: tuple[int, ...]) -> None:
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride

    def __reduce__(self) -> tuple[object, ...]:
        typed = torch.storage.TypedStorage(wrap_storage=self.storage.untyped_storage(),
                                           dtype=self.storage.dtype, _internal=True)
        return (torch._utils._rebuild_tensor_v2,
                (typed, self.offset, self.size, self.stride, False, collections.OrderedDict()))


claimed_views = st.lists(st.tuples(
    st.integers(0, 40),
    st.lists(st.sampled_from([0, 1, 2, 3, 7, 1000, 10**6, 2**31, 2**40, 2**62]), min_size=1,
             max_size=4),
    st.lists(st.sampled_from([0, 1, 2, 5, 64, 2**20, 2**40]), min_size=4, max_size=4)),
    min_size=1, max_size=6)


@settings(max_examples=int(os.environ.get("CKPTD_FUZZ_DEEP_EXAMPLES", "12")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(views=claimed_views, nan=st.booleans())
def test_deep_validation_of_claimed_views_is_judged_in_bounded_time(
        tmp_path: Path, views: list[tuple[int, list[int], list[int]]], nan: bool) -> None:
    """A torch file whose tensors claim any sizes, strides and offsets over small storages (2^62
    elements, stride 0, beyond the data): judged by the deep check within seconds, bounded by
    the file, not by the element counts claimed."""
    storage = torch.zeros(64)
    if nan:
        storage[63] = float("nan")
    state = {f"t{i}": _View(storage, off, tuple(size), tuple(stride[: len(size)]))
             for i, (off, size, stride) in enumerate(views)}
    name = "model_step_3.pt"
    torch.save(state, tmp_path / name)
    t0 = time.monotonic()
    result = validate(tmp_path, Candidate("single", 3, name, (name,), True), deep=True)
    assert time.monotonic() - t0 < 30
    assert result.valid or result.reason in REASONS, result
