"""transformers MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 from tiny configs): found through their
declared ``base_model_ep_plan``, expert-sharded ``ep=2`` on 2 real gloo processes under DDP, and trained 10 SGD
steps: losses and final weights within 1e-4 relative of one process on the global batch (= DDP's result).
DeepSeek-V3's router bias ``e_score_correction_bias`` is found and balanced as ours is.
"""

from __future__ import annotations

from typing import Any

import pytest
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
from tests.helpers import run_distributed
from tests.moe.hf_families import FAMILIES, build, hf_loss
from tests.parallel.common import full_state, relative_error

pytest.importorskip("transformers")

STEPS, MICRO, SEQ, TOL, RATE = 10, 2, 16, 1e-4, 1e-2


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


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    return run_distributed(all_families, 2, timeout=400)[0]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_family_expert_parallel_matches_ddp(family: str, result: dict[str, Any]) -> None:
    run = result[family]
    ref_losses, ref_state = reference(family, 2)
    assert run["local_experts"] and all(n == 2 for n in run["local_experts"])  # 4 experts, 2 per rank
    assert run["ignored"] == 2 * len(run["local_experts"])  # gate_up_proj and down_proj of every MoE layer
    for step, (ours, ref) in enumerate(zip(run["losses"], ref_losses)):
        assert abs(ours - ref) <= TOL * abs(ref), f"{family} step {step}: {ours} vs {ref}"
    assert relative_error(run["state"], ref_state) < TOL
    if family == "deepseek_v3":
        assert run["bias"] and run["bias"][0] > 0  # e_score_correction_bias was balanced
