"""The MoE protocol: how lightning-deepseek finds a model's routed experts, their calling convention and bias.

An *experts module* holds the routed experts of one MoE layer:

- an int attribute ``num_experts``;
- parameters whose leading dimension is ``num_experts`` (e.g. ``gate_up_proj (E, 2h, d)``, ``down_proj (E, d, h)``;
  any such parameter is sharded by expert parallelism, others stay replicated);
- a ``forward`` in one of two calling conventions (:data:`CONVENTIONS`), routing done by the caller:

  ``"top_k"``: ``forward(hidden_states (T, d), top_k_index (T, k) int, top_k_weights (T, k)) -> (T, d)``, the sum
  over each token's ``k`` experts of their outputs times their weights (transformers 5.x's fused experts, every
  5.x release; :class:`~lightning_deepseek.models.moe.GroupedExperts`);

  ``"grouped"``: ``forward(rows (R, d) sorted by expert, num_tokens_per_expert (E,) int) -> (R, d)``, one
  unweighted output row per input row, the caller weighting and summing them (torchtitan's ``GroupedExperts``,
  called after its own router and token sorting; Megatron-style grouped GEMM experts).

Experts modules are found, in this order of precedence, by
1. the marker ``is_moe_experts = True`` (a class attribute, as on our ``GroupedExperts``, or set by
   :func:`register_experts` on a user's own module, which also records its convention);
2. what a transformers model declares in its config's ``base_model_ep_plan`` and ``base_model_tp_plan`` (relative to
   its base model), in the vocabulary of every 5.x release (:func:`declared_experts`); one named only by a
   tensor-parallel plan counts when it keeps the contract (others, as LongCat-Flash's, stay replicated);
3. torchtitan's ``GroupedExperts`` (any torchtitan module of that name already imported; convention ``"grouped"``).

The *balancing bias* of a layer (aux-loss-free balancing, added to the routing scores for the choice of experts
only) is a tensor of ``num_experts`` values named ``expert_bias`` (our router), ``expert_bias_E`` (torchtitan's MoE)
or ``e_score_correction_bias`` (transformers' DeepSeek-V3), under the nearest ancestor of the experts module that
holds one and no other MoE layer. A layer without one is still counted and logged by
:class:`~lightning_deepseek.moe.ExpertLoadBalancing`, but cannot be balanced.

The *router* of a layer, needed only by node-limited routing (:mod:`lightning_deepseek.moe.node_limited`), is the
module under the experts module's parent that has a method ``limit_groups(groups, max_groups)`` (our
:class:`~lightning_deepseek.models.moe.Router`) or the attributes ``num_group`` and ``topk_group`` (transformers'
DeepSeek-V3 group-limited router, which takes equal contiguous groups; ``n_group`` on its MoE block in 5.0).
torchtitan's router is not driven.

Not supported: experts as a list of separate expert modules (no stacked parameters), transformers MoE families whose
release declares no experts entry (Qwen2-MoE before 5.13: register its ``mlp.experts`` with
:func:`register_experts`), token dropping.
"""

from __future__ import annotations

import fnmatch
import inspect
import sys
from dataclasses import dataclass

import torch
from torch import nn

from lightning_deepseek.versions import require_if_loaded

BIAS_NAMES = ("expert_bias", "expert_bias_E", "e_score_correction_bias")
CONVENTIONS = {
    "top_k": "forward(hidden_states (T, d), top_k_index (T, k), top_k_weights (T, k)) -> (T, d), weighted sum per "
             "token (transformers 5.x, lightning_deepseek.models.moe)",
    "grouped": "forward(rows (R, d) sorted by expert, num_tokens_per_expert (E,)) -> (R, d), one row per row "
               "(torchtitan's GroupedExperts)",
}
# The style of the experts module's own entry: base_model_ep_plan from 5.19 ("ep_dispatch_experts"), from 5.3 to
# 5.22 ("moe_tp_experts"); base_model_tp_plan from 5.1 ("moe_tp_experts").
EXPERTS_STYLES = ("ep_dispatch_experts", "moe_tp_experts")
# transformers 5.0 gives the experts module a generic style and its stacked parameters their own entries.
CONTAINER_STYLES = ("gather", "local")
EXPERT_PARAM_STYLES = ("grouped_gemm", "local_colwise", "local_rowwise", "local_packed_rowwise")
PLAN_ATTRIBUTES = ("base_model_ep_plan", "base_model_tp_plan")
SEARCHED = (f"looked for modules marked `is_moe_experts` (lightning_deepseek.moe.register_experts), transformers' "
            f"{' / '.join(PLAN_ATTRIBUTES)} entries of style {' / '.join(EXPERTS_STYLES + CONTAINER_STYLES)} and "
            "torchtitan's GroupedExperts")


@dataclass(frozen=True)
class ExpertLayer:
    """One MoE layer as the protocol sees it.

    Args:
        name: the experts module's name relative to the searched root.
        experts: the experts module.
        num_experts: routed experts of the layer (all ranks together).
        bias: the balancing bias (a buffer or parameter of shape ``(num_experts,)``), or None.
        router: the router that can limit each token's experts to a few groups (see the module docstring), or None.
        convention: the experts' calling convention, a key of :data:`CONVENTIONS`.
    """

    name: str
    experts: nn.Module
    num_experts: int
    bias: torch.Tensor | None
    router: nn.Module | None = None
    convention: str = "top_k"


def register_experts(module: nn.Module, convention: str | None = None) -> nn.Module:
    """Mark a user's experts module (see the module docstring for the contract) so that it is found.

    Args:
        module: the experts module.
        convention: ``"top_k"`` or ``"grouped"`` (:data:`CONVENTIONS`); None: read from ``forward``'s positional
            parameters (three: ``"top_k"``, two: ``"grouped"``).
    """
    if convention is not None and convention not in CONVENTIONS:
        raise ValueError(f"register_experts(convention={convention!r}) is not a calling convention; use one of "
                         f"{tuple(CONVENTIONS)} ({_conventions_text()}).")
    convention = convention or convention_of(module, type(module).__name__)
    _check_contract(module, type(module).__name__)
    module.is_moe_experts = True
    module.moe_convention = convention
    return module


def num_global_experts(experts: nn.Module) -> int:
    """Routed experts of the layer over all ranks (``num_experts`` counts the local ones under EP)."""
    return getattr(experts, "num_global_experts", experts.num_experts)


def _conventions_text() -> str:
    return "; ".join(f"{name!r}: {text}" for name, text in CONVENTIONS.items())


def convention_of(module: nn.Module, name: str) -> str:
    """The calling convention of an experts module: its recorded ``moe_convention``, else read from ``forward``."""
    recorded = getattr(module, "moe_convention", None)
    if recorded is not None:
        return recorded
    params = inspect.signature(module.forward).parameters.values()
    kinds = [p.kind for p in params]
    positional = sum(k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) for k in kinds)
    if inspect.Parameter.VAR_POSITIONAL not in kinds and positional in (2, 3):
        return "top_k" if positional == 3 else "grouped"
    raise TypeError(f"MoE protocol: {name}.forward{inspect.signature(module.forward)} fits no calling convention "
                    f"of experts modules ({_conventions_text()}). Give it one of these forwards, or name its "
                    "convention: lightning_deepseek.moe.register_experts(module, convention=...).")


def _check_contract(module: nn.Module, name: str) -> None:
    num = getattr(module, "num_experts", None)
    if not isinstance(num, int) or num < 1:
        raise TypeError(f"MoE protocol: {name} has no positive int attribute `num_experts` (got {num!r}); set it "
                        "to the number of experts it holds.")
    num = num_global_experts(module)  # a DTensor shard's size() is the global one
    if not any(p.dim() >= 1 and p.size(0) == num for p in module.parameters(recurse=False)):
        raise TypeError(f"MoE protocol: {name} has no parameter whose leading dimension is num_experts={num}; "
                        "store the experts as stacked parameters (num_experts, ...).")


def declared_experts(plan: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """The keys of a transformers plan (``base_model_ep_plan`` or ``base_model_tp_plan``) that may name experts
    modules, each with the names that must be stacked parameters of the module for it to be one: none for the style
    ``ep_dispatch_experts`` or ``moe_tp_experts``; for (5.0) ``gather``/``local``, its own entries of an expert
    parameter style (``grouped_gemm``, ``local_colwise``, ...), which 5.0 also gives the linears of a dense block."""
    found = {}
    for key, style in plan.items():
        children = {k[len(key) + 1:]: s for k, s in plan.items() if k.startswith(f"{key}.")}
        params = tuple(name for name, s in children.items() if "." not in name and s in EXPERT_PARAM_STYLES)
        if style in EXPERTS_STYLES:
            found[key] = ()
        elif style in CONTAINER_STYLES and params:
            found[key] = params
    return found


def _declared_experts(root: nn.Module) -> dict[str, nn.Module]:
    """Experts modules declared by transformers models under ``root`` through their plans. A module named only by a
    tensor-parallel plan is taken when it keeps the contract (LongCat-Flash's, with zero-compute experts and no
    ``num_experts``, does not, and stays replicated as before); one named by an expert-parallel plan always is."""
    found: dict[str, nn.Module] = {}
    for prefix, module in root.named_modules():
        config = getattr(module, "config", None)
        plans = {attr: getattr(config, attr, None) for attr in PLAN_ATTRIBUTES}
        patterns = {(key, attr): params for attr, plan in plans.items() if isinstance(plan, dict)
                    for key, params in declared_experts(plan).items()}
        if not patterns:
            continue
        base_name = getattr(module, "base_model_prefix", "")
        base = getattr(module, base_name, None) if base_name else None
        base, base_prefix = (base, f"{base_name}.") if isinstance(base, nn.Module) else (module, "")
        for name, sub in base.named_modules():
            own = dict(sub.named_parameters(recurse=False))
            plans_naming = {attr for (key, attr), params in patterns.items()
                            if fnmatch.fnmatchcase(name, key) and all(p in own for p in params)}
            if "base_model_ep_plan" in plans_naming or (plans_naming and _keeps_contract(sub)):
                found[".".join(filter(None, (prefix, base_prefix + name)))] = sub
    return found


def _keeps_contract(module: nn.Module) -> bool:
    try:
        _check_contract(module, "")
    except TypeError:
        return False
    return True


def _torchtitan_classes() -> tuple[type, ...]:
    """torchtitan's ``GroupedExperts`` classes among the imported modules (a model built from them imported them)."""
    classes = {getattr(module, "GroupedExperts", None) for name, module in list(sys.modules.items())
               if name.startswith("torchtitan.") and module is not None}
    return tuple(cls for cls in classes if isinstance(cls, type) and issubclass(cls, nn.Module))


def find_expert_layers(root: nn.Module) -> list[ExpertLayer]:
    """Every MoE layer under ``root`` (module-name order), by the protocol above."""
    require_if_loaded("transformers", "transformers")  # its plans' vocabulary is read from 5.0 on
    modules = dict(root.named_modules())
    found: dict[str, tuple[nn.Module, str | None]] = {
        name: (m, None) for name, m in modules.items() if getattr(m, "is_moe_experts", False)}
    for name, module in _declared_experts(root).items():
        found.setdefault(name, (module, "top_k"))
    titan = _torchtitan_classes()
    for name, module in modules.items():
        if titan and isinstance(module, titan):
            found.setdefault(name, (module, "grouped"))
    layers = []
    for name in (n for n in modules if n in found):
        experts, convention = found[name]
        _check_contract(experts, name)
        num = num_global_experts(experts)
        parent = modules[name.rpartition(".")[0]]
        layers.append(ExpertLayer(name, experts, num, _find_bias(modules, name, num, found),
                                  _find_router(parent), getattr(experts, "moe_convention", None) or convention
                                  or convention_of(experts, name)))
    return layers


def _find_bias(modules: dict[str, nn.Module], name: str, num_experts: int, layers: dict[str, object]
               ) -> torch.Tensor | None:
    """The bias under the nearest ancestor of ``name`` that holds one and no other layer's experts."""
    parts = name.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        ancestor = ".".join(parts[:depth])
        prefix = f"{ancestor}." if ancestor else ""
        if any(other != name and other.startswith(prefix) for other in layers):
            return None
        for tensor_name, tensor in [*modules[ancestor].named_buffers(), *modules[ancestor].named_parameters()]:
            if tensor_name.rpartition(".")[2] in BIAS_NAMES and tensor.numel() == num_experts:
                return tensor
    return None


def groups_attribute(router: nn.Module) -> str | None:
    """The attribute holding transformers DeepSeek-V3's number of expert groups (``num_group``; ``n_group`` on its
    MoE block in 5.0), when ``router`` has it and ``topk_group``."""
    name = next((n for n in ("num_group", "n_group") if hasattr(router, n)), None)
    return name if name and hasattr(router, "topk_group") else None


def _find_router(parent: nn.Module) -> nn.Module | None:
    for module in parent.modules():
        if callable(getattr(module, "limit_groups", None)) or groups_attribute(module):
            return module
    return None
