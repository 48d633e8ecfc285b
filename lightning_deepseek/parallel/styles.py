"""Applying a plan: torch's ``ColwiseParallel`` / ``RowwiseParallel``, extended to transformers' ``Conv1D``.

Up-projections are ``ColwiseParallel(input_layouts=Shard(0))`` (the batch-sharded input is all-gathered over
``tp``), down-projections ``RowwiseParallel(output_layouts=Shard(0))`` (partial sums are reduce-scattered back to
each rank's own micro-batch). torch's styles accept only ``nn.Linear`` and ``nn.Embedding``; GPT-2 and every model
built on transformers' ``Conv1D`` (``y = x @ W + b`` with ``W`` stored ``(in, out)``, the transpose of a Linear's)
would be left out. The two subclasses here shard a ``Conv1D`` along the same logical dimensions, on the transposed
weight (column-wise: ``W`` on dim 1 and the bias; row-wise: ``W`` on dim 0, the bias replicated), and reuse torch's
input/output redistribution unchanged; ``Conv1D.forward`` (``addmm`` and ``view``) runs on DTensors as written.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_deepseek.parallel.detection import is_conv1d
from lightning_deepseek.parallel.expert import is_expert_param
from lightning_deepseek.parallel.gradients import reduce_shard_gradients


def _shard_conv1d(weight: Placement, bias: Placement, src_data_rank: int | None):
    def partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, placement in (("weight", weight), ("bias", bias)):
            param = getattr(module, param_name, None)
            if param is not None:
                sharded = distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank)
                module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    return partition


class Conv1DColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` that also shards a transformers ``Conv1D`` (its weight on dim 1, its bias on dim 0)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        return distribute_module(
            module, device_mesh, _shard_conv1d(Shard(1), Shard(0), self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class Conv1DRowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` that also shards a transformers ``Conv1D`` (its weight on dim 0, its bias replicated)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh, _shard_conv1d(Shard(0), Replicate(), self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


def apply_tensor_parallel(module: nn.Module, styles: dict[str, str], tp_mesh: DeviceMesh) -> None:
    """Shard the layers named in ``styles`` (``{module name: "colwise" | "rowwise"}``) in place over ``tp_mesh``."""
    if not styles:
        return
    make = {
        "colwise": lambda: Conv1DColwiseParallel(input_layouts=Shard(0)),
        "rowwise": lambda: Conv1DRowwiseParallel(output_layouts=Shard(0)),
    }
    parallelize_module(module, tp_mesh, {name: make[style]() for name, style in styles.items()})


def reduce_tensor_parallel_gradients(params: Iterable[torch.Tensor], mesh: DeviceMesh) -> None:
    """Sum the tensor-parallel shards' gradients among ``params`` over ``mesh``'s ``dp`` groups and divide by the
    world size (``mesh`` is the strategy's ``dp x tp`` mesh): the reduction DDP does not do for the shards it
    ignores, once per optimizer step."""
    grads = [p.grad.to_local() for p in params
             if isinstance(p, DTensor) and not is_expert_param(p) and p.grad is not None]
    reduce_shard_gradients(grads, mesh.get_group("dp") if grads and mesh["dp"].size() > 1 else None, mesh.size())
