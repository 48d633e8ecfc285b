"""One training loop for the expert-parallel parity runs of MoE models (transformers' families, torchtitan's and a
user's own layers): SGD with momentum over the given global batches, the balancing bias updated after every step
from the token counts. :func:`reference` runs one process on each global batch (= DDP's result); :func:`ep_run`
shards the routed experts ``ep=2`` under DDP on the calling rank's slice of each batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from lightning_deepseek.moe.balancing import LoadCounter, update_biases
from lightning_deepseek.moe.protocol import find_expert_layers
from lightning_deepseek.parallel.expert import apply_expert_parallel, is_expert_param, reduce_expert_gradients
from lightning_deepseek.parallel.expert_dispatch import apply_island_dispatch, build_island_dispatch
from lightning_deepseek.parallel.topology import parse_topology
from tests.parallel.common import full_state

RATE = 1e-2
Loss = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def train(model: nn.Module, wrapped: nn.Module, batches: list[torch.Tensor], loss: Loss,
          after_backward: Callable[[], None], reduce_counts: Callable[[torch.Tensor], torch.Tensor]) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    counter = LoadCounter(find_expert_layers(model))
    losses = []
    for tokens in batches:
        value = loss(wrapped, tokens)
        value.backward()
        after_backward()
        optimizer.step()
        optimizer.zero_grad()
        update_biases(counter.layers, reduce_counts(counter.take()), RATE)
        losses.append(value.item())
    return losses


def reference(model: nn.Module, batches: list[torch.Tensor], loss: Loss) -> tuple[list[float], dict[str, Any]]:
    model.train()
    return train(model, model, batches, loss, lambda: None, lambda c: c), full_state(model)


def ep_run(model: nn.Module, batches: list[torch.Tensor], loss: Loss, rank: int, world_size: int,
           islands: str | None = None) -> dict[str, Any]:
    """``model`` trained with its experts sharded ``ep=2`` (contiguous ranks), everything else under DDP; with
    ``islands`` (a topology, e.g. ``"0;1"``), dispatched per island."""
    model.train()
    mesh = DeviceMesh("cpu", torch.arange(world_size).view(world_size // 2, 2), mesh_dim_names=("edp", "ep"))
    layers = apply_expert_parallel(model, mesh)
    if islands is not None:
        apply_island_dispatch(layers, build_island_dispatch(parse_topology(islands), mesh.mesh.tolist()))
    ignored = [name for name, p in model.named_parameters() if is_expert_param(p)]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    ddp = DistributedDataParallel(model)
    micro = batches[0].size(0) // world_size
    local = [batch[rank * micro:(rank + 1) * micro] for batch in batches]

    def reduce_counts(counts: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(counts)
        return counts

    losses = train(model, ddp, local, loss, lambda: reduce_expert_gradients(model.parameters(), mesh), reduce_counts)
    total = torch.tensor(losses)
    dist.all_reduce(total)
    found = find_expert_layers(model)
    return {"losses": (total / world_size).tolist(), "state": full_state(model), "ignored": sorted(ignored),
            "layers": [(layer.name, layer.convention, layer.experts.num_experts) for layer in layers],
            "local_experts": [layer.experts.num_experts for layer in layers],
            "bias": [layer.bias.abs().sum().item() for layer in found if layer.bias is not None]}
