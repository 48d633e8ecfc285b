"""A tiny regression module and Trainer factory shared by the precision tests.

The module records, per optimizer step, the dtype a Linear layer computes in (what autocast really does inside the
model), the learning rate, and whether the plugin skipped the step. ``InjectInf`` puts an inf into one gradient
after backward (after the DDP reduction) on chosen steps and ranks.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset


class TinyRegressor(pl.LightningModule):
    def __init__(self, lr: float = 0.05, scheduler: bool = True) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.lr = lr
        self.use_scheduler = scheduler
        self.dtypes: dict[int, torch.dtype] = {}
        self.lrs: dict[int, float] = {}
        self.loss_multipliers: dict[int, float] = {}  # scaled loss seen by backward / loss: the loss scale used
        self._loss = 0.0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        hidden = self.net[0](x)
        self.dtypes[self.trainer.global_step] = hidden.dtype
        self.lrs[self.trainer.global_step] = self.trainer.optimizers[0].param_groups[0]["lr"]
        out = self.net[2](self.net[1](hidden))
        loss = torch.nn.functional.mse_loss(out.float(), y)
        self._loss = float(loss)
        return loss

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self.loss_multipliers[self.trainer.global_step] = round(float(loss) / self._loss)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        if not self.use_scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def regression_data(num_samples: int = 64, batch_size: int = 8, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, 8, generator=generator)
    y = x.sum(dim=1, keepdim=True).sin()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


class InjectInf(Callback):
    """Sets one gradient element to inf after backward on ``steps`` (optimizer steps) and ``ranks``."""

    def __init__(self, steps: set[int], ranks: set[int] | None = None) -> None:
        self.steps = steps
        self.ranks = ranks

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step in self.steps and (self.ranks is None or trainer.global_rank in self.ranks):
            pl_module.net[0].weight.grad[0, 0] = float("inf")


class RecordSkips(Callback):
    """Records the plugin's view of every optimizer step: skipped or not, loss scale, stage precision."""

    def __init__(self) -> None:
        self.skipped: list[int] = []
        self.scales: list[float] = []
        self.precisions: list[str] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        plugin = trainer.precision_plugin
        if plugin.last_step_skipped:
            self.skipped.append(trainer.global_step - 1)
        self.scales.append(plugin.loss_scale)
        self.precisions.append(plugin.precision)


def make_trainer(plugin: Any = None, max_steps: int = 8, callbacks: list[Callback] | None = None,
                 **kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=callbacks or [],
    )
    options.update(kwargs)
    if plugin is not None:
        options["plugins"] = [plugin]
    return pl.Trainer(**options)
