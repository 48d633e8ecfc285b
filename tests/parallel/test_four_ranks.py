"""Four real gloo processes (``dp=2 x tp=2``), one spawn, checked scenario by scenario:

- parity with one process on the global batch (20 optimizer steps, fp32, 1e-5 relative);
- gradient accumulation (2 micro-batches) plus norm clipping: still the reference, and the data-parallel
  reductions run once per optimizer step, not per micro-batch (counted by a DDP comm hook and the strategy);
- a permuted mesh (declared two-node topology, ``placement="dp_intra_node"``): ``tp`` groups ``{0, 2}``,
  ``{1, 3}``; data shards follow the mesh coordinate, so the parity still holds.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_deepseek import HybridParallelStrategy
from lightning_deepseek.parallel import Cluster
from tests.helpers import run_distributed
from tests.parallel.common import TinyLM, full_state, loader, make_trainer, reference_run, token_data
from tests.parallel.test_two_ranks import MICRO, STEPS, check_parity, fit_parity


class _CountReductions(pl.Callback):
    """Counts DDP bucket reductions (through a comm hook) and tensor-parallel gradient reductions."""

    def __init__(self) -> None:
        self.buckets = 0
        self.tp_reductions = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy

        def hook(group, bucket):  # unannotated: DDP checks annotations, which postponed evaluation turns into str
            self.buckets += 1
            return default_hooks.allreduce_hook(group, bucket)

        strategy.ddp_module.register_comm_hook(strategy.data_parallel_group, hook)
        reduce = strategy.reduce_tensor_parallel_gradients

        def counted(optimizer: Any) -> None:
            self.tp_reductions += 1
            reduce(optimizer)

        strategy.reduce_tensor_parallel_gradients = counted


def _accumulate_and_clip(world_size: int, steps: int, clip: float) -> dict[str, Any]:
    dataset = token_data(steps * 2 * world_size * MICRO)
    pl.seed_everything(0, verbose=False)
    module, counter = TinyLM(), _CountReductions()
    strategy = HybridParallelStrategy(tensor_parallel_size=2, min_shard_params=0)
    trainer = make_trainer(world_size, strategy, max_steps=steps, accumulate_grad_batches=2,
                           gradient_clip_val=clip, callbacks=[counter])
    trainer.fit(module, loader(dataset, MICRO))
    losses: list[Any] = [None] * world_size
    dist.all_gather_object(losses, module.losses)
    state = full_state(module)
    return {"losses": losses, "state": state if dist.get_rank() == 0 else None,
            "buckets": counter.buckets, "tp_reductions": counter.tp_reductions}


def _four_rank_scenarios(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "dp2xtp2": fit_parity(world_size, tp=2, steps=STEPS),
        "accumulate_clip": _accumulate_and_clip(world_size, steps=5, clip=0.5),
        "permuted": fit_parity(world_size, tp=2, steps=5, placement="dp_intra_node",
                               cluster=Cluster(topology="0,1;2,3")),
    }


@pytest.fixture(scope="module")
def four_ranks() -> dict[str, Any]:
    return run_distributed(_four_rank_scenarios, 4, timeout=280)[0]


def test_dp2_tp2_matches_single_process(four_ranks: dict[str, Any]) -> None:
    assert four_ranks["dp2xtp2"]["mesh"] == [[0, 1], [2, 3]]
    assert "model.blocks.1.mlp.fc2" in four_ranks["dp2xtp2"]["plan"]
    check_parity(four_ranks["dp2xtp2"], world_size=4, steps=STEPS)


def test_accumulation_with_clipping_matches_and_reduces_once_per_step(four_ranks: dict[str, Any]) -> None:
    result = four_ranks["accumulate_clip"]
    check_parity(result, world_size=4, steps=5, accumulate=2, clip=0.5)
    assert result["buckets"] == 5  # one bucket (tiny model) per optimizer step, none on the no_sync micro-batch
    assert result["tp_reductions"] == 5
    # Clipping was active: without it the same run ends elsewhere.
    dataset = token_data(5 * 2 * 4 * MICRO)
    _, clipped = reference_run(5, 4 * MICRO, dataset, clip=0.5, accumulate=2)
    _, unclipped = reference_run(5, 4 * MICRO, dataset, accumulate=2)
    assert any(abs(clipped[k] - unclipped[k]).max() > 1e-4 for k in clipped)


def test_permuted_mesh_keeps_parity(four_ranks: dict[str, Any]) -> None:
    assert four_ranks["permuted"]["mesh"] == [[0, 2], [1, 3]]
    check_parity(four_ranks["permuted"], world_size=4, steps=5)
