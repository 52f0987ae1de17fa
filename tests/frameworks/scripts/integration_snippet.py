"""Run one code block of docs/INTEGRATIONS.md (the one after `<!-- snippet: NAME -->`) as a
user would, against the real framework: the names it leaves to the user (`model`,
`train_loader`, `args`, ...) are defined first, the paths and numbers of the docs replaced by
the test's. argv: NAME REPLACEMENTS_JSON (a list of [old, new], each old must occur). Prints
one JSON line: the global step, a weights digest, how many training steps this process ran,
and what the integration reported."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

DOC = Path(__file__).resolve().parents[3] / "docs" / "INTEGRATIONS.md"
SLOW = float(os.environ.get("CKPTD_TEST_STEP_SLEEP", "0"))  # seconds a step takes at least


def snippet(name: str, replacements: list[list[str]]) -> str:
    text = DOC.read_text()
    found = re.search(rf"<!-- snippet: {name} -->\n```python\n(.*?)```", text, re.S)
    assert found, f"no snippet {name!r} in {DOC}"
    code = found.group(1)
    for old, new in replacements:
        assert old in code, f"{old!r} is not in the {name} snippet"
        code = code.replace(old, new)
    return code


def digest(model: torch.nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                   for p in model.parameters())).hexdigest()


def counted(model: torch.nn.Module, steps: list[int]) -> torch.nn.Module:
    """Count (and with CKPTD_TEST_STEP_SLEEP slow down) every training forward pass: by its
    first leaf module, which every forward runs once (`training_step` may call a child)."""
    def hook(*_: Any) -> None:
        steps.append(1)
        time.sleep(SLOW)

    first = next(m for m in model.modules() if not any(m.children()))
    first.register_forward_hook(hook)
    return model


def lightning_names(steps: list[int]) -> dict[str, Any]:
    import lightning as L
    from lightning_train import Tiny, data

    L.seed_everything(0)
    return {"model": counted(Tiny(), steps), "train_loader": data()}


def lightning_result(g: dict[str, Any]) -> dict[str, Any]:
    from ckptd.integrations.lightning import CkptdCallback

    trainer = g["trainer"]
    (cb,) = [c for c in trainer.callbacks if isinstance(c, CkptdCallback)]
    return {"global_step": trainer.global_step, "digest": digest(g["model"]),
            "resumed_from": trainer.ckpt_path, "registered": sorted(cb.registered),
            "flushed": cb.flushed}


def hf_names(steps: list[int]) -> dict[str, Any]:
    from hf_train import Tokens
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100,
                                       n_positions=32))
    args = TrainingArguments(output_dir=os.environ["CKPTD_TEST_OUT"],
                             max_steps=int(os.environ["CKPTD_TEST_MAX_STEPS"]), save_steps=5,
                             per_device_train_batch_size=4, logging_steps=5, report_to=[],
                             use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    return {"model": counted(model, steps), "args": args, "train_dataset": Tokens()}


def hf_result(g: dict[str, Any]) -> dict[str, Any]:
    from ckptd.integrations.hf import CkptdTrainerCallback

    trainer = g["trainer"]
    (cb,) = [c for c in trainer.callback_handler.callbacks
             if isinstance(c, CkptdTrainerCallback)]
    return {"global_step": trainer.state.global_step, "digest": digest(g["model"]),
            "registered": sorted(cb.registered), "flushed": cb.flushed}


def dcp_names(steps: list[int]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ran: list[int] = []

    def train_step(step: int) -> None:
        g = torch.Generator().manual_seed(step)  # the batch of a step is the same in every run
        x = torch.randn(8, 16, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ran.append(step)

    return {"model": model, "optimizer": optimizer, "train_step": train_step, "ran": ran,
            "total_steps": int(os.environ["CKPTD_TEST_MAX_STEPS"])}


def dcp_result(g: dict[str, Any]) -> dict[str, Any]:
    ran = g["ran"]
    return {"global_step": ran[-1] if ran else None, "first_step": ran[0] if ran else None,
            "digest": digest(g["model"])}


def main() -> None:
    name, replacements = sys.argv[1], json.loads(sys.argv[2])
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    steps: list[int] = []
    names = {"lightning": lightning_names, "hf": hf_names, "dcp": dcp_names}[name](steps)
    g: dict[str, Any] = {"__name__": "__snippet__", **names}
    stopped = False
    try:
        exec(compile(snippet(name, replacements), f"INTEGRATIONS.md:{name}", "exec"), g)
    except SystemExit:  # Lightning stopping on SIGTERM
        stopped = True
    result = {"lightning": lightning_result, "hf": hf_result, "dcp": dcp_result}[name](g)
    print(json.dumps({**result, "steps_run": len(steps), "stopped": stopped}), flush=True)


if __name__ == "__main__":
    main()
