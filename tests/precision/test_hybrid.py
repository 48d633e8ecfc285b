"""StagedPrecision under ``strategy="hybrid"`` (HybridParallelStrategy): DTensor feed-forward shards, 2 processes."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_deepseek import StagedPrecision
from lightning_deepseek.models import GPT, GPTConfig
from lightning_deepseek.parallel import HybridParallelStrategy
from tests.helpers import run_distributed
from tests.precision.tiny import RecordSkips, make_trainer


class TinyGPT(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))
        self.dtypes: dict[int, torch.dtype] = {}
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        self.dtypes[self.trainer.global_step] = logits.dtype
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class InjectInfIntoShard(pl.Callback):
    """After backward on ``step``, rank 0 alone writes inf into its shard of the first tensor-parallel gradient."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.sharded = False

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        grads = [p.grad for p in pl_module.parameters() if isinstance(p.grad, DTensor)]
        self.sharded = bool(grads)
        if trainer.global_step == self.step and trainer.global_rank == 0:
            grads[0].to_local()[0, 0] = float("inf")


def _fit_hybrid(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    tokens = torch.empty(64, 17, dtype=torch.long)  # a learnable affine recurrence from random starts
    tokens[:, 0] = torch.randint(0, 64, (64,), generator=torch.Generator().manual_seed(1))
    for t in range(16):
        tokens[:, t + 1] = (5 * tokens[:, t] + 3) % 64
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4, shuffle=False)
    model = TinyGPT()
    plugin = StagedPrecision([("32-true", 2), ("16-mixed", 6), ("bf16-mixed",)], init_scale=1024.0, hysteresis=1)
    inject, record = InjectInfIntoShard(step=3), RecordSkips()
    strategy = HybridParallelStrategy(tensor_parallel_size=2, min_shard_params=0)
    trainer = make_trainer(plugin, max_steps=8, callbacks=[inject, record], devices=world_size, strategy=strategy)
    trainer.fit(model, data)
    return {"sharded": inject.sharded, "skipped": record.skipped, "scales": record.scales, "events": plugin.events(),
            "dtypes": [model.dtypes[s] for s in range(8)], "losses": model.losses}


def test_staged_precision_with_hybrid_strategy_skips_on_every_rank():
    rank0, rank1 = run_distributed(_fit_hybrid, 2, timeout=150)
    F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
    for result in (rank0, rank1):
        assert result["sharded"]  # the feed-forward gradients really are DTensor shards
        assert result["skipped"] == [3]  # the inf was in rank 0's shard only
        assert result["dtypes"] == [F32] * 2 + [F16] * 4 + [BF16] * 2
        assert result["events"] == [(2, "32-true -> 16-mixed"), (6, "16-mixed -> bf16-mixed")]
    assert rank0["scales"] == rank1["scales"] and rank0["scales"][3] == 512.0
    assert rank0["losses"][-1] < rank0["losses"][0] - 0.1  # it still trains
