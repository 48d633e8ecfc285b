"""Add StagedPrecision to a plain Lightning project that uses Lightning's own DDPStrategy.

Nothing here comes from lightning-deepseek except the plugin: a small LightningModule of one's own, a
``DataLoader``, ``DDPStrategy``. The only change to an existing project is ``plugins=[StagedPrecision(...)]``
(and dropping ``precision=``). A callback reads ``last_step_skipped`` the way any other callback could.

    .venv/bin/python examples/precision_ddp.py        # 2 CPU processes, 120 steps
    .venv/bin/python examples/precision_ddp.py --accelerator cuda --devices 2

(or ``python ...`` in the activated venv).
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_deepseek import StagedPrecision
from lightning_deepseek.precision import Stage


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 10))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x).float(), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.trainer.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ReportSkips(pl.Callback):
    """Any callback can ask the plugin whether the optimizer step it just saw was skipped."""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.precision_plugin.last_step_skipped and trainer.is_global_zero:
            print(f"step {trainer.global_step - 1} skipped (loss scale now {trainer.precision_plugin.loss_scale:g})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=120)
    args = parser.parse_args()

    pl.seed_everything(0)
    x = torch.randn(4096, 32)
    y = (x[:, :10] * torch.linspace(1, 3, 10)).argmax(dim=1)
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)

    precision = StagedPrecision(
        schedule=[Stage("32-true", until=0.1, unit="fraction"),   # FP32 warm-up
                  Stage("16-mixed", until=0.8, unit="fraction"),  # FP16 + dynamic loss scaling
                  Stage("bf16-mixed")],                           # BF16 to the end
        hysteresis=2, fallback_skipped_steps=10, fallback_window=200,
    )
    trainer = pl.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=DDPStrategy(),
                         plugins=[precision], max_steps=args.max_steps, callbacks=[ReportSkips()],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(Classifier(), loader)
    if trainer.is_global_zero:
        print("stage changes:", precision.events())
        print("summary:", precision.summary())


if __name__ == "__main__":
    main()
