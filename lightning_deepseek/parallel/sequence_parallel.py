"""Sequence parallelism inside tensor-parallel pipeline stages (``sequence_parallel=True`` with
``pipeline_parallel_size`` and ``tensor_parallel_size``): Megatron's and torchtitan's layout, on the Megatron-style
stages of :mod:`.pipeline_stage_parallel`.

Between the sharded layers of a block the hidden states are split along the sequence over ``tp``: the norms, the
residual additions and what activation checkpointing keeps of each block (its input) hold ``1 / tp`` of the tokens.

- The first stage's first block takes this rank's slice of the embedded sequence (no communication) and the last
  stage's last block all-gathers its output back for the final norm and the head. In between, each ``tp`` rank sends
  and receives its sequence shard at the stage boundaries (plain tensors: ``1 / tp`` of the point-to-point bytes and
  of torch's receive buffers); a later stage counts positions over the whole sequence (``pipeline_sequence_shards``
  on its stage module, read by the HF stage forward).
- The first tensor input of each module holding column-wise layers (the attention, the feed-forward block) is
  all-gathered once, in a forward pre-hook; the row-wise layers reduce-scatter their partial sums to sequence shards,
  in place of the all-reduce (the same bytes).
- The parameters of the blocks outside the plan (the norms) receive each rank's share of their gradient: summed
  over ``tp`` with those of :func:`.pipeline_stage_parallel.tensor_parallel_partial_params`.

torch's ``SequenceParallel`` style makes each norm's parameters replicated DTensors instead; a plain module on a
local slice works for any norm class, and the one flat all-reduce per step replaces DTensor's reduction per norm.

Requires: every block of the split holds an attention whose heads the plan splits (declared by the model,
:func:`.plan.add_attention_heads`), since a replicated attention would see only a slice of the sequence; a sequence
length divisible by ``tp``. Costs per micro-batch: one all-gather of the last stage's blocks' output over ``tp`` in
the forward (and its gradient's reduce in the backward); otherwise the collectives of the tensor-parallel layers, split
differently (an all-gather before and a reduce-scatter after each sharded module, not one all-reduce after it). In the
backward each column-wise layer all-reduces its own input gradient (torch's ``ColwiseParallel`` from a plain input: the
query, key and value three times), where one reduce-scatter per module would do; feeding them one shared replicated
DTensor does that, but gave wrong outputs with transformers' SDPA attention in Qwen3 (eager and Llama were right), so
it is not done.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_deepseek.parallel.pipeline_split import PipelineSplit
from lightning_deepseek.parallel.plan import Plan

__all__ = ["apply_sequence_parallel", "check_sequence_parallel", "sequence_local_params"]

SEQUENCE_DIM = 1


def _blocks(split: PipelineSplit, stage_index: int) -> list[str]:
    """The blocks (elements of the list the split cut) stage ``stage_index`` owns, in order."""
    return [name for name in split.stages[stage_index].modules if name.rpartition(".")[2].isdigit()]


def check_sequence_parallel(plan: Plan, split: PipelineSplit, prefix: str, tp_size: int) -> None:
    """Raise unless every block of ``split`` holds an attention whose heads ``plan`` splits (``prefix``: the model's
    attribute in the LightningModule, which the plan's names carry)."""
    heads = [e.name for e in plan if e.heads]
    for index in range(split.num_stages):
        for block in _blocks(split, index):
            name = f"{prefix}.{block}" if prefix else block
            if not any(h.startswith(f"{name}.") for h in heads):
                raise ValueError(
                    f"sequence_parallel=True with tensor_parallel_size={tp_size}: block {name!r} holds no attention "
                    "whose heads the tensor-parallel plan splits, and a replicated attention would see a slice of "
                    "the sequence. Sequence parallelism needs a model that declares its attention projections "
                    "(transformers' Llama, Mistral, Qwen...); set sequence_parallel=False.")


def _slice(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    if x.size(SEQUENCE_DIM) % mesh.size():
        raise ValueError(f"sequence_parallel=True: the sequence length {x.size(SEQUENCE_DIM)} does not divide by "
                         f"tensor_parallel_size={mesh.size()}. Give sequences a multiple of {mesh.size()} tokens, "
                         "or set sequence_parallel=False.")
    full = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return full.redistribute(mesh, [Shard(SEQUENCE_DIM)]).to_local()


def _gather(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    sharded = DTensor.from_local(x, mesh, [Shard(SEQUENCE_DIM)], run_check=False)
    return sharded.redistribute(mesh, [Replicate()]).to_local()


def _on_first_input(fn: Any) -> Any:
    """A forward pre-hook (``with_kwargs``) applying ``fn`` to the module's first tensor input: its first positional
    argument, else ``hidden_states`` (transformers' keyword)."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (fn(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
    return hook


def _on_output(fn: Any) -> Any:
    """A forward hook applying ``fn`` to the module's output (a tensor, or the first element of a tuple)."""
    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        return (fn(output[0]), *output[1:]) if isinstance(output, tuple) else fn(output)
    return hook


def apply_sequence_parallel(module: nn.Module, plan: Plan, split: PipelineSplit, stage_indices: Sequence[int],
                            stages: Sequence[nn.Module], prefix: str, tp_mesh: DeviceMesh) -> None:
    """Register the hooks of the module docstring on this rank's stages (``stage_indices``, their stage modules
    ``stages``) in ``module`` (the LightningModule after the split and ``apply_stage_tensor_parallel(...,
    sequence_parallel=True)``)."""
    held = dict(module.named_modules())
    gathered = {e.name.rpartition(".")[0] for e in plan if e.style == "colwise"}
    for name in sorted(n for n in gathered if n in held):
        held[name].register_forward_pre_hook(_on_first_input(lambda x: _gather(x, tp_mesh)), with_kwargs=True)
    for index, stage in zip(stage_indices, stages):
        blocks = [f"{prefix}.{b}" if prefix else b for b in _blocks(split, index)]
        if index == 0:
            held[blocks[0]].register_forward_pre_hook(_on_first_input(lambda x: _slice(x, tp_mesh)),
                                                      with_kwargs=True)
        else:  # its input is the previous stage's sequence shard: positions count the whole sequence
            stage.pipeline_sequence_shards = tp_mesh.size()
        if index == split.num_stages - 1:
            held[blocks[-1]].register_forward_hook(_on_output(lambda x: _gather(x, tp_mesh)))


def sequence_local_params(module: nn.Module, plan: Plan, split: PipelineSplit, stage_indices: Sequence[int],
                          prefix: str) -> list[nn.Parameter]:
    """The trainable parameters of this rank's blocks outside the plan's layers (norms): each ``tp`` rank computes
    their gradient over its slice of the sequence."""
    blocks = [f"{prefix}.{b}" if prefix else b for i in stage_indices for b in _blocks(split, i)]
    planned = set(plan.names)
    return [p for name, p in module.named_parameters()
            if p.requires_grad and name.rpartition(".")[0] not in planned
            and any(name.startswith(f"{block}.") for block in blocks)]
