"""The example GPT as a LightningModule that records each training step's wall time, for the step-time benchmarks
(``zero/step_time.py``, ``hybrid/bench_placement.py``, ``autotune/bench_cost_model.py``). Imported inside their
worker processes: it loads torch and Lightning."""

from __future__ import annotations

import time

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from lightning_deepseek.models import GPT, GPTConfig


class TimedGPT(pl.LightningModule):
    """``GPT(config)`` trained on (input, target) token batches with cross-entropy by ``optimizer(lr=lr)``;
    ``step_times`` holds the seconds of each training step (batch start to batch end, optimizer step included)."""

    def __init__(self, config: GPTConfig, optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW,
                 lr: float = 1e-3) -> None:
        super().__init__()
        self.model = GPT(config)
        self.optimizer, self.lr = optimizer, lr
        self.step_times: list[float] = []
        self._start = 0.0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

    def on_train_batch_start(self, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.step_times.append(time.perf_counter() - self._start)

    def configure_optimizers(self):
        return self.optimizer(self.parameters(), lr=self.lr)
