"""A Hugging Face Trainer run as its users write one: a tiny GPT-2 built from a config (no hub
download), save_steps and save_total_limit, on the CPU. argv: OUTPUT_DIR MAX_STEPS
[--resume CHECKPOINT_DIR]. Prints the global step it ended at and a weights digest."""

from __future__ import annotations

import hashlib
import json
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 100, (16,), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}


def slow_disk() -> None:
    """CKPTD_TEST_SLOW_SAVE=1: every torch.save (the optimizer, scheduler, RNG states) takes a
    second, as on a slow disk, so a test can kill the run mid-save deterministically."""
    import os
    import time

    if os.environ.get("CKPTD_TEST_SLOW_SAVE") != "1":
        return
    real = torch.save

    def save(*args: object, **kwargs: object) -> None:
        time.sleep(1.0)
        real(*args, **kwargs)  # type: ignore[arg-type]

    torch.save = save  # type: ignore[assignment]


def main() -> None:
    slow_disk()
    out, max_steps = sys.argv[1], int(sys.argv[2])
    resume = sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--resume" else None
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100,
                                       n_positions=32))
    args = TrainingArguments(output_dir=out, max_steps=max_steps, save_steps=5,
                             save_total_limit=2, per_device_train_batch_size=4,
                             logging_steps=5, report_to=[], use_cpu=True, seed=0,
                             dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train(resume_from_checkpoint=resume)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    print(json.dumps({"global_step": trainer.state.global_step, "digest": digest}), flush=True)


if __name__ == "__main__":
    main()
