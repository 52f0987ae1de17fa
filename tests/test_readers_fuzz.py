"""A bounded property test of the checkpoint readers: a real torch file, zip or legacy, with
bytes flipped, cut or replaced anywhere, is judged (valid or invalid with a reason) and never
raises, never hangs and never runs anything. A few hundred mutations a run."""

from __future__ import annotations

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
