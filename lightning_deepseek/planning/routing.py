"""Uniform routing: the MoE layers' data-dependent steps replaced, for a planned step only, by their shapes under
an even split of tokens over experts.

A step on fake tensors has shapes but no values, and two steps of an MoE layer take their shapes from values: the
per-expert row counts (``bincount``, ``tolist``) of the all-to-all dispatch
(:class:`lightning_deepseek.parallel.expert.ExpertParallel`) and the experts' own grouped matrix products. Inside
:func:`uniform_routing` the planner assumes each of the ``T x k`` (token, expert) pairs of a rank goes to the experts
in equal shares (the assumption of :func:`lightning_deepseek.parallel.expert.all_to_all_bytes` too): the dispatch
sends ``T x k / ep`` rows to each rank of the ``ep`` group through the same ``all_to_all_single_autograd`` call
(forward and backward), and each local expert multiplies ``T x k / E`` rows by its own weights (a batched product
of the same FLOPs and activation sizes as the grouped one). The router, attention and everything else run as
written. Both replacements are undone on leaving the context; nothing outside a planned step sees them.

Supported experts: transformers' fused layout (``gate_up_proj`` ``(E, 2h, d)``, ``down_proj`` ``(E, d, h)``: Mixtral,
Qwen2/3-MoE, DeepSeek-V3, ...) and this package's ``GroupedExperts`` (the same layout), of the ``"top_k"``
convention. Not supported: other expert layouts (a ``NotImplementedError`` names the class), the per-island
dispatch (planned as the flat one), uneven routing (real runs send what their router decides; the error against
a measured run is reported in ``benchmarks/planning/REPORT.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd  # the strategy's own call
from torch.distributed.fsdp import FSDPModule

from lightning_deepseek.moe.protocol import ExpertLayer
from lightning_deepseek.parallel.expert import ExpertParallel

FUSED_PARAMS = ("gate_up_proj", "down_proj")


def _even(rows: int, parts: int) -> list[int]:
    return [rows // parts + (1 if i < rows % parts else 0) for i in range(parts)]


def uniform_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    """The experts' forward with ``T x k`` pairs dealt evenly to the ``num_experts`` local experts."""
    num_tokens, top_k = top_k_index.shape
    if not all(hasattr(self, name) for name in FUSED_PARAMS) or getattr(self, "is_transposed", False):
        raise NotImplementedError(f"planning {type(self).__name__}: only the fused expert layout "
                                  f"{FUSED_PARAMS} with (E, 2h, d) and (E, d, h) weights is supported.")
    gate_up, down = self.gate_up_proj, self.down_proj
    num_experts = gate_up.size(0)
    pairs = num_tokens * top_k
    per_expert = -(-pairs // num_experts)
    rows = hidden_states.repeat_interleave(top_k, dim=0)
    rows = F.pad(rows, (0, 0, 0, per_expert * num_experts - pairs)).view(num_experts, per_expert, -1)
    gate, up = torch.bmm(rows, gate_up.transpose(1, 2)).chunk(2, dim=-1)
    act = getattr(self, "act_fn", F.silu)
    out = torch.bmm(act(gate) * up, down.transpose(1, 2)).reshape(num_experts * per_expert, -1)[:pairs]
    out = out.view(num_tokens, top_k, -1) * top_k_weights[..., None].to(out.dtype)
    return out.sum(dim=1).to(hidden_states.dtype)


def uniform_dispatch(self: ExpertParallel, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor, compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                     ) -> torch.Tensor:
    """``ExpertParallel._dispatch`` with every rank of the ``ep`` group sending ``T x k / ep`` rows to each."""
    num_tokens, top_k = top_k_index.shape
    size, num_local = dist.get_world_size(self._ep_group), self.num_experts
    counts = torch.zeros(size * num_local, dtype=torch.int64, device=top_k_index.device)
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=self._ep_group)  # the count exchange, as in the real one
    splits = _even(num_tokens * top_k, size)
    rows = all_to_all_single_autograd(hidden_states.repeat_interleave(top_k, dim=0), splits, splits,
                                      self._ep_group)
    received = rows.size(0)
    local_index = torch.repeat_interleave(torch.arange(num_local, device=rows.device),
                                          torch.tensor(_even(received, num_local), device=rows.device),
                                          output_size=received)
    out = all_to_all_single_autograd(compute(rows, local_index), splits, splits, self._ep_group)
    out = out.view(num_tokens, top_k, -1)
    return (out * top_k_weights[..., None].to(out.dtype)).sum(dim=1).to(hidden_states.dtype)


@contextmanager
def uniform_routing(layers: list[ExpertLayer]) -> Iterator[None]:
    """Inside: the experts of ``layers`` and the expert-parallel dispatch route evenly (see the module docstring)."""
    classes = {}
    for layer in layers:
        # The experts' own class, under the classes expert parallelism and FSDP2 swap in
        base = next(c for c in type(layer.experts).__mro__ if not issubclass(c, (ExpertParallel, FSDPModule)))
        if layer.convention != "top_k":
            raise NotImplementedError(f"planning {layer.name}: only the 'top_k' experts convention is supported, "
                                      f"not {layer.convention!r}.")
        classes[base] = base.__dict__["forward"]
    saved_dispatch = ExpertParallel._dispatch
    try:
        ExpertParallel._dispatch = uniform_dispatch
        for cls in classes:
            cls.forward = uniform_experts_forward
        yield
    finally:
        ExpertParallel._dispatch = saved_dispatch
        for cls, forward in classes.items():
            cls.forward = forward
