"""A Lightning run as its users write one: ModelCheckpoint every few steps with
save_last="link" and a monitored metric, on the CPU. argv: DIR MAX_STEPS [--resume CKPT].
Prints the global step it ended at and a weights digest."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def data() -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                                       batch_size=16)


def main() -> None:
    out, max_steps = sys.argv[1], int(sys.argv[2])
    resume = sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--resume" else None
    if os.environ.get("CKPTD_TEST_SLOW_SAVE") == "1":  # a slow disk: kill mid-save in tests
        real = torch.save

        def slow(obj: object, f: object, *a: object, **k: object) -> None:
            open(os.environ["CKPTD_TEST_MARK"], "w").close()  # the save has begun
            time.sleep(2.0)
            real(obj, f, *a, **k)  # type: ignore[arg-type]

        torch.save = slow  # type: ignore[assignment]
    L.seed_everything(0)
    ckpt = ModelCheckpoint(dirpath=out, every_n_train_steps=5, save_top_k=-1,
                           monitor="train_loss", save_last="link",
                           filename="{epoch}-{step}")
    trainer = L.Trainer(max_steps=max_steps, callbacks=[ckpt], accelerator="cpu",
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    model = Tiny()
    trainer.fit(model, data(), ckpt_path=resume)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    print(json.dumps({"global_step": trainer.global_step, "digest": digest}), flush=True)


if __name__ == "__main__":
    main()
