"""The MoE protocol: how lightning-deepseek finds a model's routed experts and its balancing bias.

An *experts module* holds the routed experts of one MoE layer in the layout of transformers 5.x's fused experts:

- an int attribute ``num_experts``;
- parameters whose leading dimension is ``num_experts`` (e.g. ``gate_up_proj (E, 2h, d)``, ``down_proj (E, d, h)``;
  any such parameter is sharded by expert parallelism, others stay replicated);
- ``forward(hidden_states (T, d), top_k_index (T, k) int, top_k_weights (T, k)) -> (T, d)``, which sums, for every
  token, its ``k`` experts' outputs times their weights. Routing happens before the call, in the caller.

Experts modules are found, in this order of precedence, by
1. the marker ``is_moe_experts = True`` (a class attribute, as on :class:`~lightning_deepseek.models.moe
   .GroupedExperts`, or set by :func:`register_experts` on a user's own module);
2. what a transformers model declares: the patterns of its config's ``base_model_ep_plan`` whose style is
   ``"ep_dispatch_experts"`` (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, ... in transformers >= 5), relative to
   its base model.

The *balancing bias* of a layer (aux-loss-free balancing, added to the routing scores for the choice of experts
only) is a tensor named ``expert_bias`` (our router) or ``e_score_correction_bias`` (transformers' DeepSeek-V3)
anywhere under the experts module's parent. A layer without one is still counted and logged by
:class:`~lightning_deepseek.moe.ExpertLoadBalancing`, but cannot be balanced.

The *router* of a layer, needed only by node-limited routing (:mod:`lightning_deepseek.moe.node_limited`), is the
module under the experts module's parent that has a method ``limit_groups(groups, max_groups)`` (our
:class:`~lightning_deepseek.models.moe.Router`) or the attributes ``num_group`` and ``topk_group`` (transformers'
DeepSeek-V3 group-limited router, which takes equal contiguous groups).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch
from torch import nn

BIAS_NAMES = ("expert_bias", "e_score_correction_bias")
EP_PLAN_STYLE = "ep_dispatch_experts"


@dataclass(frozen=True)
class ExpertLayer:
    """One MoE layer as the protocol sees it.

    Args:
        name: the experts module's name relative to the searched root.
        experts: the experts module.
        num_experts: routed experts of the layer (all ranks together).
        bias: the balancing bias (a buffer or parameter of shape ``(num_experts,)``), or None.
        router: the router that can limit each token's experts to a few groups (see the module docstring), or None.
    """

    name: str
    experts: nn.Module
    num_experts: int
    bias: torch.Tensor | None
    router: nn.Module | None = None


def register_experts(module: nn.Module) -> nn.Module:
    """Mark a user's experts module (see the module docstring for the contract) so that it is found."""
    _check_contract(module, type(module).__name__)
    module.is_moe_experts = True
    return module


def num_global_experts(experts: nn.Module) -> int:
    """Routed experts of the layer over all ranks (``num_experts`` counts the local ones under EP)."""
    return getattr(experts, "num_global_experts", experts.num_experts)


def _check_contract(module: nn.Module, name: str) -> None:
    num = getattr(module, "num_experts", None)
    if not isinstance(num, int) or num < 1:
        raise TypeError(f"MoE protocol: {name} has no positive int attribute `num_experts` (got {num!r}); set it "
                        "to the number of experts it holds.")
    num = num_global_experts(module)  # a DTensor shard's size() is the global one
    if not any(p.dim() >= 1 and p.size(0) == num for p in module.parameters(recurse=False)):
        raise TypeError(f"MoE protocol: {name} has no parameter whose leading dimension is num_experts={num}; "
                        "store the experts as stacked parameters (num_experts, ...).")


def _declared_experts(root: nn.Module) -> dict[str, nn.Module]:
    """Experts modules declared by transformers models under ``root`` through ``base_model_ep_plan``."""
    found: dict[str, nn.Module] = {}
    for prefix, module in root.named_modules():
        plan = getattr(getattr(module, "config", None), "base_model_ep_plan", None)
        if not isinstance(plan, dict) or not isinstance(module, nn.Module):
            continue
        patterns = [p for p, style in plan.items() if style == EP_PLAN_STYLE]
        base_name = getattr(module, "base_model_prefix", "")
        base = getattr(module, base_name, None) if base_name else None
        base, base_prefix = (base, f"{base_name}.") if isinstance(base, nn.Module) else (module, "")
        for name, sub in base.named_modules():
            if any(fnmatch.fnmatchcase(name, p) for p in patterns):
                found[".".join(filter(None, (prefix, base_prefix + name)))] = sub
    return found


def find_expert_layers(root: nn.Module) -> list[ExpertLayer]:
    """Every MoE layer under ``root`` (module-name order), by the protocol above."""
    found = {name: m for name, m in root.named_modules() if getattr(m, "is_moe_experts", False)}
    for name, module in _declared_experts(root).items():
        found.setdefault(name, module)
    modules = dict(root.named_modules())
    layers = []
    for name in (n for n in modules if n in found):
        experts = found[name]
        _check_contract(experts, name)
        parent = modules[name.rpartition(".")[0]]
        layers.append(ExpertLayer(name, experts, num_global_experts(experts), _find_bias(parent),
                                  _find_router(parent)))
    return layers


def _find_bias(parent: nn.Module) -> torch.Tensor | None:
    for name, tensor in [*parent.named_buffers(), *parent.named_parameters()]:
        if name.rpartition(".")[2] in BIAS_NAMES:
            return tensor
    return None


def _find_router(parent: nn.Module) -> nn.Module | None:
    for module in parent.modules():
        if callable(getattr(module, "limit_groups", None)) or (hasattr(module, "num_group")
                                                               and hasattr(module, "topk_group")):
            return module
    return None
