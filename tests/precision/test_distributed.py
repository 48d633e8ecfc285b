"""StagedPrecision on 2 real gloo processes, with Lightning's DDPStrategy and with ``strategy="hybrid"``.

Every rank must take every decision (skip, back-off, fallback) together, also when only one rank overflowed.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_deepseek import StagedPrecision
from lightning_deepseek.models import GPT, GPTConfig
from lightning_deepseek.parallel import HybridParallelStrategy
from lightning_deepseek.precision.loss_scaler import DynamicLossScaler
from tests.helpers import run_distributed
from tests.precision.tiny import InjectInf, RecordSkips, TinyRegressor, make_trainer, regression_data


def _fit_ddp(rank: int, world_size: int, inject_steps: set[int]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyRegressor()
    plugin = StagedPrecision([("16-mixed", 8), ("32-true",)], init_scale=1024.0, hysteresis=1,
                             fallback_skipped_steps=3, fallback_window=10)
    record = RecordSkips()
    # The inf goes into rank 0's gradient after DDP has averaged it, so only rank 0 sees it: without the
    # all-reduced overflow flag rank 1 would step while rank 0 skips, and the replicas would diverge.
    trainer = make_trainer(plugin, max_steps=10, callbacks=[InjectInf(inject_steps, ranks={0}), record],
                           devices=world_size, strategy="ddp")
    trainer.fit(model, regression_data(num_samples=80, batch_size=4))
    return {
        "skipped": record.skipped, "scales": record.scales, "events": plugin.events(),
        "dtypes": [model.dtypes[s] for s in range(10)],
        "params": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
    }


def _overflow_on_rank0_only() -> tuple[bool, bool]:
    """Rank 0 alone has an inf gradient; returns (our scaler's verdict, torch GradScaler's verdict) on this rank."""
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([param], lr=0.1)
    grad = torch.ones(4)
    if torch.distributed.get_rank() == 0:
        grad[2] = float("inf")
    param.grad = grad.clone()
    ours = DynamicLossScaler(init_scale=2.0).unscale_(optimizer)
    param.grad = grad.clone()
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    torch_scaler.scale(torch.ones(()))  # GradScaler must see a scale() before unscale_()
    torch_scaler.unscale_(optimizer)
    found = torch_scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    return ours, bool(sum(v.item() for v in found.values()))


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    # One set of processes for all tests below: spawning and importing Lightning dominates their cost.
    verdicts = _overflow_on_rank0_only()
    return {"verdicts": verdicts, **_fit_ddp(rank, world_size, {2, 4, 6}), "hybrid": _fit_hybrid(rank, world_size),
            "fp8": _fit_fp8_ddp(rank, world_size)}


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


def _recurrence_data() -> DataLoader:
    tokens = torch.empty(64, 17, dtype=torch.long)  # a learnable affine recurrence from random starts
    tokens[:, 0] = torch.randint(0, 64, (64,), generator=torch.Generator().manual_seed(1))
    for t in range(16):
        tokens[:, t + 1] = (5 * tokens[:, t] + 3) % 64
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4, shuffle=False)


def _fit_fp8_ddp(rank: int, world_size: int) -> dict[str, Any]:
    """BF16 for 2 steps, then FP8 (emulated) under Lightning's DDP: the swap keeps DDP's parameters and hooks."""
    if importlib.util.find_spec("torchao") is None:
        return {}
    torch.manual_seed(0)
    model = TinyGPT()
    plugin = StagedPrecision([("bf16", 2), ("fp8",)])
    layers = {}

    class Layers(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            layers[trainer.global_step - 1] = type(pl_module.model.blocks[0].mlp.fc1).__name__

    trainer = make_trainer(plugin, max_steps=6, callbacks=[Layers()], devices=world_size, strategy="ddp")
    trainer.fit(model, _recurrence_data())
    return {"layers": [layers[s] for s in range(6)], "converted": plugin.float8_layers, "losses": model.losses,
            "params": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()}


def _fit_hybrid(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    data = _recurrence_data()
    model = TinyGPT()
    plugin = StagedPrecision([("32-true", 2), ("16-mixed", 6), ("bf16-mixed",)], init_scale=1024.0, hysteresis=1)
    inject, record = InjectInfIntoShard(step=3), RecordSkips()
    strategy = HybridParallelStrategy(tensor_parallel_size=2, min_shard_params=0)
    trainer = make_trainer(plugin, max_steps=8, callbacks=[inject, record], devices=world_size, strategy=strategy)
    trainer.fit(model, data)
    return {"sharded": inject.sharded, "skipped": record.skipped, "scales": record.scales, "events": plugin.events(),
            "dtypes": [model.dtypes[s] for s in range(8)], "losses": model.losses}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_worker, 2, timeout=150)


def test_found_inf_is_shared_by_all_ranks(ranks):
    """Rank 0 alone overflows (as after a rank-local hook): both ranks must skip. GradScaler decides per rank."""
    (ours0, theirs0), (ours1, theirs1) = ranks[0]["verdicts"], ranks[1]["verdicts"]
    assert ours0 and ours1
    assert theirs0 and not theirs1  # the divergence our all-reduce prevents


def test_overflow_on_one_rank_skips_and_falls_back_on_all_ranks_at_the_same_step(ranks):
    rank0, rank1 = ranks
    for result in (rank0, rank1):
        assert result["skipped"] == [2, 4, 6]
        assert result["events"] == [(7, "16-mixed -> bf16-mixed (fallback)"), (8, "bf16-mixed -> 32-true")]
        assert result["dtypes"] == [torch.float16] * 7 + [torch.bfloat16] + [torch.float32] * 2
    assert rank0["scales"] == rank1["scales"]
    assert rank0["params"] == rank1["params"]


def test_staged_precision_with_hybrid_strategy_skips_on_every_rank(ranks):
    rank0, rank1 = (r["hybrid"] for r in ranks)
    F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
    for result in (rank0, rank1):
        assert result["sharded"]  # the feed-forward gradients really are DTensor shards
        assert result["skipped"] == [3]  # the inf was in rank 0's shard only
        assert result["dtypes"] == [F32] * 2 + [F16] * 4 + [BF16] * 2
        assert result["events"] == [(2, "32-true -> 16-mixed"), (6, "16-mixed -> bf16-mixed")]
    assert rank0["scales"] == rank1["scales"] and rank0["scales"][3] == 512.0
    assert rank0["losses"][-1] < rank0["losses"][0] - 0.1  # it still trains


def test_fp8_stage_under_ddp_keeps_ranks_identical(ranks):
    rank0, rank1 = (r["fp8"] for r in ranks)
    if not rank0:
        pytest.skip("torchao is not installed (the fp8 extra)")
    for result in (rank0, rank1):
        assert result["layers"] == ["Linear"] * 2 + ["Float8Linear"] * 4
        assert result["converted"] == [f"model.blocks.0.{n}" for n in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")]
    assert rank0["params"] == rank1["params"]  # DDP still averaged every FP8 gradient
    assert rank0["losses"][-1] < rank0["losses"][0]
