"""``Stage("fp8")`` with the tensor-parallel plan: two real gloo processes, one spawn for every assertion.

- the sharded feed-forward layers are converted too (``Float8Linear`` over DTensor shards, the plan's hooks kept);
- exactness per layer, for each torchao recipe: a column- then row-wise sharded MLP in emulated FP8 gives the
  unsharded FP8 MLP's output and gradients within 1e-6 relative (FP32 operands: the scales are amaxes that DTensor
  reduces over the mesh, so every shard is quantized as the whole tensor is);
- training: emulated FP8 at ``tp=2`` against emulated FP8 at ``tp=1`` (DDP over the same 2 processes, same seed):
  every loss within 1e-3 relative (BF16 autocast around the FP8 GEMMs sums the row-wise partial outputs in
  another order, and FP8 rounding amplifies that: measured 2e-4 after 6 steps);
- resume mid-FP8 at ``tp=2`` continues in FP8 with the uninterrupted run's losses (1e-6).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_deepseek import HybridParallelStrategy, StagedPrecision
from lightning_deepseek.parallel.styles import apply_tensor_parallel
from lightning_deepseek.precision.float8 import RECIPES, Float8Training, is_float8
from tests.helpers import run_distributed
from tests.parallel.common import TinyLM, loader, make_trainer, token_data

pytest.importorskip("torchao")

STEPS, MICRO, RESUME_AT = 6, 2, 3  # an epoch is RESUME_AT steps: Lightning resumes exactly at an epoch end


def _mlp_exactness(rank: int, recipe: str) -> dict[str, float]:
    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    sharded = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    sharded.load_state_dict(whole.state_dict())
    apply_tensor_parallel(sharded, {"0": "colwise", "2": "rowwise"}, init_device_mesh("cpu", (2,)))
    x = torch.randn(8, 32)
    results = []
    for model, inputs in ((whole, x), (sharded, x.chunk(2)[rank])):  # the plan's input is batch-sharded
        Float8Training(recipe).convert(model, "cpu")
        y = model(inputs)
        y.pow(2).sum().backward()
        grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
        results.append((y.detach(), grads))
    (y_whole, g_whole), (y_sharded, g_sharded) = results
    return {
        "converted": all(is_float8(sharded[i]) and isinstance(sharded[i].weight, DTensor) for i in (0, 2)),
        "output": float((y_whole.chunk(2)[rank] - y_sharded).norm() / y_whole.chunk(2)[rank].norm()),
        "grads": max(float((a - b).norm() / a.norm()) for a, b in zip(g_whole, g_sharded)),
    }


class _Layers(pl.Callback):
    """The class of the first feed-forward up-projection and whether its weight is a DTensor, per step (after the
    forward: the stage of a step is entered inside its optimizer step)."""

    def __init__(self) -> None:
        self.layers: dict[int, str] = {}

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        fc1 = pl_module.model.blocks[0].mlp.fc1
        self.layers[trainer.global_step] = type(fc1).__name__ + ("/DTensor" if isinstance(fc1.weight, DTensor) else "")


def _fit(world_size: int, tp: int, ckpt: Path | None = None, resume: Path | None = None) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    module, layers = TinyLM(), _Layers()
    plugin = StagedPrecision([("bf16", 1), ("fp8",)])
    strategy = HybridParallelStrategy(tensor_parallel_size=tp, min_shard_params=0)
    trainer = make_trainer(world_size, strategy, max_steps=STEPS, plugins=[plugin], callbacks=[layers],
                           max_epochs=-1)
    dataset = token_data(RESUME_AT * world_size * MICRO)

    class Save(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:  # where ModelCheckpoint saves
            if ckpt is not None and trainer.global_step == RESUME_AT:
                trainer.save_checkpoint(ckpt)

    trainer.callbacks.append(Save())
    trainer.fit(module, loader(dataset, MICRO), ckpt_path=resume)
    return {"losses": module.losses, "layers": layers.layers, "converted": plugin.float8_layers,
            "events": plugin.events()}


def _scenarios(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    ckpt = Path(tmp) / "fp8_tp2.ckpt"
    return {"mlp": {recipe: _mlp_exactness(rank, recipe) for recipe in RECIPES}, "tp1": _fit(world_size, 1),
            "tp2": _fit(world_size, 2, ckpt=ckpt), "resumed": _fit(world_size, 2, resume=ckpt)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_scenarios, 2, str(tmp_path_factory.mktemp("fp8_tp")), timeout=300)


def test_sharded_layers_in_fp8_match_the_unsharded_ones(two_ranks: list[dict[str, Any]]) -> None:
    for rank in two_ranks:
        assert rank["mlp"].keys() == set(RECIPES)
        for mlp in rank["mlp"].values():
            assert mlp["converted"]
            assert mlp["output"] <= 1e-6 and mlp["grads"] <= 1e-6


def test_fp8_at_tp2_trains_as_fp8_at_tp1(two_ranks: list[dict[str, Any]]) -> None:
    for rank in two_ranks:
        tp1, tp2 = rank["tp1"], rank["tp2"]
        assert tp2["converted"] == tp1["converted"] and "model.blocks.0.mlp.fc1" in tp2["converted"]
        assert [tp2["layers"][s] for s in range(STEPS)] == ["Linear/DTensor"] + ["Float8Linear/DTensor"] * 5
        assert len(tp2["losses"]) == len(tp1["losses"]) == STEPS
        for got, want in zip(tp2["losses"], tp1["losses"]):
            assert abs(got - want) <= 1e-3 * abs(want)
        assert tp2["losses"] != tp1["losses"]  # two layouts really ran


def test_resume_mid_fp8_at_tp2_continues_in_fp8(two_ranks: list[dict[str, Any]]) -> None:
    for rank in two_ranks:
        first, resumed = rank["tp2"], rank["resumed"]
        assert [resumed["layers"][s] for s in range(RESUME_AT, STEPS)] == ["Float8Linear/DTensor"] * 3
        assert resumed["events"] == first["events"] == [(1, "bf16-mixed -> fp8-mixed")]
        assert len(resumed["losses"]) == STEPS - RESUME_AT
        for got, want in zip(resumed["losses"], first["losses"][RESUME_AT:]):
            assert abs(got - want) <= 1e-6 * abs(want)
