"""HybridParallelStrategy in a plain Lightning project: a ``torch.nn.TransformerEncoder`` language model that knows
nothing about parallelism; the automatic plan shards each layer's ``linear1``/``linear2`` over ``tp``.

Run: ``.venv/bin/python examples/hybrid_transformer.py`` (2 CPU processes, tp=2, about a minute).
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_deepseek import HybridParallelStrategy

VOCAB, SEQ, WIDTH = 64, 32, 64


class TinyTransformerLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, nhead=4, dim_feedforward=4 * WIDTH, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.head(self.encoder(self.embed(x), mask=self.mask, is_causal=True))
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main() -> None:
    pl.seed_everything(0)
    starts = torch.randint(0, VOCAB, (512, 1))
    tokens = (starts + 3 * torch.arange(SEQ + 1)) % VOCAB  # a learnable pattern
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)
    strategy = HybridParallelStrategy(tensor_parallel_size=2, min_shard_params=0)  # tiny model: shard anyway
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=30, gradient_clip_val=1.0,
                         logger=False, enable_checkpointing=False)
    trainer.fit(TinyTransformerLM(), data)


if __name__ == "__main__":
    main()
