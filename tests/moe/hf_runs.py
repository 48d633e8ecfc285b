"""transformers MoE families under expert parallelism: 10 SGD steps of each family from ``hf_families``, on one
process on the global batch (= DDP's result) and expert-sharded ``ep=2`` under DDP, with bias balancing where the
family has a bias (DeepSeek-V3's ``e_score_correction_bias``); the loop is :mod:`tests.moe.ep_runs`. The tests are in
tests/parallel/test_expert.py, which `make test-oldest` also runs on the oldest supported versions."""

from __future__ import annotations

from typing import Any

import torch

from tests.moe import ep_runs
from tests.moe.hf_families import FAMILIES, build, hf_loss

STEPS, MICRO, SEQ, HF_TOL = 10, 2, 16, 1e-4


def _batches(world_size: int) -> list[torch.Tensor]:
    tokens = torch.randint(0, 64, (STEPS * world_size * MICRO, SEQ), generator=torch.Generator().manual_seed(3))
    return list(tokens.split(world_size * MICRO))


def reference(family: str, world_size: int) -> tuple[list[float], dict[str, Any]]:
    return ep_runs.reference(build(family), _batches(world_size), hf_loss)


def ep_run(family: str, rank: int, world_size: int) -> dict[str, Any]:
    run = ep_runs.ep_run(build(family), _batches(world_size), hf_loss, rank, world_size)
    return {**run, "ignored": len(run["ignored"])}


def all_families(rank: int, world_size: int) -> dict[str, Any]:
    return {family: ep_run(family, rank, world_size) for family in FAMILIES}
