"""GradientCompression dropped into a plain Lightning project that uses Lightning's own DDPStrategy, on CPU.

Nothing else from lightning-deepseek is used: an ordinary LightningModule, an ordinary DataLoader, and one extra
callback. Run it (2 CPU processes, about a minute)::

    .venv/bin/python examples/compression_ddp_cpu.py [--bits 4]   # or `python ...` in the activated venv

It trains the same small classifier twice, with fp32 DDP and with compressed DDP, and prints both final losses and
the compression telemetry.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_deepseek import GradientCompression


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                                       torch.nn.GELU(), torch.nn.Linear(256, 10))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def data() -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=gen)
    y = (x[:, :10] @ torch.randn(10, 10, generator=gen)).argmax(dim=1)  # a learnable labelling
    return DataLoader(TensorDataset(x, y), batch_size=64)


def fit(callbacks: list[pl.Callback]) -> float:
    torch.manual_seed(0)
    trainer = pl.Trainer(strategy=DDPStrategy(), accelerator="cpu", devices=2, max_epochs=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, callbacks=callbacks)
    trainer.fit(Classifier(), data())
    return float(trainer.callback_metrics["train_loss"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bits", type=int, default=8, choices=[8, 4])
    args = parser.parse_args()
    torch.set_num_threads(1)
    baseline = fit([])
    compression = GradientCompression(bits=args.bits, block_size=128, warmup_steps=5, min_bucket_numel=1024)
    compressed = fit([compression])
    if compression.hook_state is not None and compression.hook_state.rank == 0:
        print(f"final train loss: fp32 DDP {baseline:.4f}, int{args.bits} DDP {compressed:.4f} "
              f"({compressed / baseline - 1:+.2%})")
        print("compression summary:", compression.summary())


if __name__ == "__main__":
    main()
