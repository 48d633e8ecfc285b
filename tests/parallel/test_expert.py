"""Expert parallelism against one process, on real gloo processes (one spawn per world size, several scenarios).

A plain DDP loop (no Lightning): the MoE GPT on one process on the global batch, against the same model with its
routed experts sharded ``ep=2`` (2 ranks), ``ep=2 x edp=2`` and ``ep=4`` (4 ranks), SGD with momentum, 20 steps,
the sequence-wise aux loss on and the aux-loss-free balancing bias updated after every step from the token counts
(summed over ranks under EP); losses, final weights and the first step's router gradients within 1e-5 relative. The
loop also runs the per-island dispatch (``test_expert_dispatch.py``). In the same 2-rank spawn: transformers'
Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 from tiny configs, found through their declared
``base_model_ep_plan`` (no adapter), ``ep=2`` against one process within 1e-4 over 10 SGD steps. The 4-rank runs
of this loop (``ep=2 x edp=2``, ``ep=4``) join the one 4-process spawn of ``test_expert_strategy.py``.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_deepseek.models import GPT, GPTConfig
from lightning_deepseek.moe.balancing import LoadCounter, update_biases
from lightning_deepseek.moe.node_limited import limit_routing
from lightning_deepseek.moe.protocol import find_expert_layers
from lightning_deepseek.parallel.dims import ParallelDims
from lightning_deepseek.parallel.expert import (
    apply_expert_parallel,
    is_expert_param,
    reduce_expert_gradients,
)
from lightning_deepseek.parallel.expert_dispatch import apply_island_dispatch, build_island_dispatch
from lightning_deepseek.parallel.topology import Topology
from tests.helpers import run_distributed
from tests.parallel.common import CONFIG, full_state, lm_loss, relative_error, token_data

STEPS, MICRO, TOL, RATE = 20, 2, 1e-5, 1e-2
MOE = dict(CONFIG, n_routed_experts=8, moe_top_k=2, n_shared_experts=1, moe_hidden=16, moe_aux_loss_coef=0.01)


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**MOE))


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _router_grads(model: torch.nn.Module) -> dict[str, list]:
    return {name: p.grad.tolist() for name, p in model.named_parameters() if "router" in name}


def reference(world_size: int, max_islands: int | None = None, groups: list[int] | None = None,
              steps: int = STEPS) -> tuple[list[float], dict[str, Any], dict]:
    """One process on the global batch (world size x micro-batch): losses, final weights, first router gradients.
    ``max_islands``: route as node-limited over the island of every expert, ``groups`` (default: two islands
    holding half of the experts each)."""
    data = token_data(steps * world_size * MICRO)
    model = _model()
    optimizer = _optimizer(model)
    counter = LoadCounter(find_expert_layers(model))
    if max_islands is not None:
        for layer in counter.layers:
            islands = groups or [e * 2 // layer.num_experts for e in range(layer.num_experts)]
            layer.router.limit_groups(islands, max_islands)
    losses, router_grads = [], {}
    for step in range(steps):
        batch = slice(step * world_size * MICRO, (step + 1) * world_size * MICRO)
        loss = lm_loss(model, data[batch])
        loss.backward()
        router_grads = router_grads or _router_grads(model)
        optimizer.step()
        optimizer.zero_grad()
        update_biases(counter.layers, counter.take(), RATE)
        losses.append(loss.item())
    return losses, full_state(model), router_grads


def expert_parallel_run(rank: int, world_size: int, ep_size: int, topology: Topology | None = None,
                        max_islands: int | None = None, steps: int = STEPS) -> dict[str, Any]:
    """The model with experts sharded over ``ep_size`` under DDP: global losses, full weights, bytes per rank.
    With ``topology``: the per-island dispatch over its islands, and node-limited routing to ``max_islands``."""
    data = token_data(steps * world_size * MICRO)
    model = _model()
    mesh = ParallelDims(world_size, ep=ep_size).build_mesh("cpu")["edp", "ep"]
    layers = apply_expert_parallel(model, mesh)
    if topology is not None:
        grid = mesh.mesh.tolist()
        if max_islands is not None:
            limit_routing(layers, topology, grid, max_islands)
        apply_island_dispatch(layers, build_island_dispatch(topology, grid))
    counter = LoadCounter(find_expert_layers(model))
    ignored = [name for name, p in model.named_parameters() if is_expert_param(p)]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    ddp = DistributedDataParallel(model)
    optimizer = _optimizer(model)
    losses, router_grads = [], {}
    for step in range(steps):
        start = (step * world_size + rank) * MICRO
        loss = lm_loss(ddp, data[start:start + MICRO])
        loss.backward()
        router_grads = router_grads or _router_grads(model)  # DDP's mean over the ranks
        reduce_expert_gradients(model.parameters(), mesh)
        optimizer.step()
        optimizer.zero_grad()
        counts = counter.take()
        dist.all_reduce(counts)  # one collective for all layers
        update_biases(counter.layers, counts, RATE)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    local = sum(p.to_local().numel() for p in model.parameters() if is_expert_param(p))
    return {"losses": losses, "state": full_state(model), "layers": [layer.name for layer in layers],
            "ignored": ignored, "local_expert_params": local,
            "local_experts": [layer.experts.num_experts for layer in layers],
            "bias": [layer.bias.tolist() for layer in counter.layers], "router_grads": router_grads}


def two_rank_scenarios(rank: int, world_size: int) -> dict[str, Any]:
    """Our model at ep=2 and, in the same spawn (process start dominates the cost), transformers' families."""
    gpt = expert_parallel_run(rank, world_size, 2)
    if importlib.util.find_spec("transformers") is None:
        return {"gpt": gpt, "hf": None}
    from tests.moe.hf_runs import all_families

    return {"gpt": gpt, "hf": all_families(rank, world_size)}


@pytest.fixture(scope="session")
def two_rank_spawn() -> dict[str, Any]:
    return run_distributed(two_rank_scenarios, 2, timeout=400)[0]


@pytest.fixture(scope="module")
def two_rank_result(two_rank_spawn: dict[str, Any]) -> dict[str, Any]:
    return two_rank_spawn["gpt"]


def _check(result: dict[str, Any], world_size: int, max_islands: int | None = None,
           groups: list[int] | None = None) -> None:
    ref_losses, ref_state, ref_router_grads = reference(world_size, max_islands, groups, len(result["losses"]))
    for step, (ours, ref) in enumerate(zip(result["losses"], ref_losses)):
        assert abs(ours - ref) <= TOL * abs(ref), f"step {step}: {ours} vs {ref}"
    assert relative_error(result["state"], ref_state) < TOL
    assert result["router_grads"].keys() == ref_router_grads.keys() and ref_router_grads
    grads = {name: np.array(grad) for name, grad in result["router_grads"].items()}
    assert relative_error(grads, {name: np.array(grad) for name, grad in ref_router_grads.items()}) < TOL
    assert any(abs(b) > 0 for bias in result["bias"] for b in bias)  # the balancing bias took part


def test_ep2_matches_one_process(two_rank_result: dict[str, Any]) -> None:
    _check(two_rank_result, 2)


def test_ep2_shards_every_moe_layer_and_keeps_it_out_of_ddp(two_rank_result: dict[str, Any]) -> None:
    assert two_rank_result["layers"] == ["blocks.0.mlp.experts", "blocks.1.mlp.experts"]
    assert two_rank_result["local_experts"] == [4, 4]
    assert sorted(two_rank_result["ignored"]) == sorted(
        f"blocks.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj"))
    full = sum(layer.experts.gate_up_proj.numel() + layer.experts.down_proj.numel()
               for layer in find_expert_layers(_model()))
    assert two_rank_result["local_expert_params"] * 2 == full


def test_expert_count_not_divisible_names_the_fix() -> None:
    layers = find_expert_layers(_model())
    with pytest.raises(ValueError, match=r"expert_parallel_size=3 does not divide the 8 experts of "
                                         r"blocks.0.mlp.experts. Choose one of \[1, 2\]"):
        ParallelDims(6, ep=3).check_experts(layers)


def test_ep_size_not_dividing_the_world_names_the_fix() -> None:
    with pytest.raises(ValueError, match=r"expert_parallel_size=4 does not divide the world size 6. "
                                         r"Choose one of \[1, 2, 3, 6\]"):
        ParallelDims(6, ep=4)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
def test_transformers_family_expert_parallel_matches_one_process(family: str, two_rank_spawn: dict[str, Any]
                                                                 ) -> None:
    pytest.importorskip("transformers")
    from tests.moe.hf_runs import HF_TOL
    from tests.moe.hf_runs import reference as hf_reference

    run = two_rank_spawn["hf"][family]
    ref_losses, ref_state = hf_reference(family, 2)
    assert run["local_experts"] and all(n == 2 for n in run["local_experts"])  # 4 experts, 2 per rank
    assert run["ignored"] == 2 * len(run["local_experts"])  # gate_up_proj and down_proj of every MoE layer
    for step, (ours, ref) in enumerate(zip(run["losses"], ref_losses)):
        assert abs(ours - ref) <= HF_TOL * abs(ref), f"{family} step {step}: {ours} vs {ref}"
    assert relative_error(run["state"], ref_state) < HF_TOL
    if family == "deepseek_v3":
        assert run["bias"] and run["bias"][0] > 0  # e_score_correction_bias was balanced
