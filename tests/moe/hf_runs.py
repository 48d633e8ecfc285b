"""transformers MoE families under expert parallelism: 10 SGD steps of each family from ``hf_families``, on one
process on the global batch (= DDP's result) and expert-sharded ``ep=2`` under DDP, with bias balancing where the
family has a bias (DeepSeek-V3's ``e_score_correction_bias``). The tests are in tests/parallel/test_expert.py."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_deepseek.moe.balancing import LoadCounter, update_biases
from lightning_deepseek.moe.protocol import find_expert_layers
from lightning_deepseek.parallel.expert import (
    ExpertParallelDims,
    apply_expert_parallel,
    build_expert_mesh,
    is_expert_param,
    reduce_expert_gradients,
)
from tests.moe.hf_families import FAMILIES, build, hf_loss
from tests.parallel.common import full_state

STEPS, MICRO, SEQ, HF_TOL, RATE = 10, 2, 16, 1e-4, 1e-2


def _tokens(world_size: int) -> torch.Tensor:
    return torch.randint(0, 64, (STEPS * world_size * MICRO, SEQ), generator=torch.Generator().manual_seed(3))


def _train(model: torch.nn.Module, wrapped: torch.nn.Module, batches: list[torch.Tensor],
           after_backward: Any, reduce_counts: Any) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    counter = LoadCounter(find_expert_layers(model))
    losses = []
    for tokens in batches:
        loss = hf_loss(wrapped, tokens)
        loss.backward()
        after_backward()
        optimizer.step()
        optimizer.zero_grad()
        update_biases(counter.layers, reduce_counts(counter.take()), RATE)
        losses.append(loss.item())
    return losses


def reference(family: str, world_size: int) -> tuple[list[float], dict[str, Any]]:
    model = build(family).train()
    tokens = _tokens(world_size).split(world_size * MICRO)
    return _train(model, model, list(tokens), lambda: None, lambda c: c), full_state(model)


def ep_run(family: str, rank: int, world_size: int) -> dict[str, Any]:
    model = build(family).train()
    mesh = build_expert_mesh("cpu", ExpertParallelDims(world_size, 2))
    layers = apply_expert_parallel(model, mesh)
    ignored = [name for name, p in model.named_parameters() if is_expert_param(p)]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    ddp = DistributedDataParallel(model)
    batches = [t[rank * MICRO:(rank + 1) * MICRO] for t in _tokens(world_size).split(world_size * MICRO)]

    def reduce_counts(counts: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(counts)
        return counts

    losses = _train(model, ddp, batches, lambda: reduce_expert_gradients(model.parameters(), mesh), reduce_counts)
    total = torch.tensor(losses)
    dist.all_reduce(total)
    return {"losses": (total / world_size).tolist(), "state": full_state(model), "ignored": len(ignored),
            "local_experts": [layer.experts.num_experts for layer in layers],
            "bias": [layer.bias.abs().sum().item() for layer in find_expert_layers(model) if layer.bias is not None]}


def all_families(rank: int, world_size: int) -> dict[str, Any]:
    return {family: ep_run(family, rank, world_size) for family in FAMILIES}
