"""Feed-forward blocks from the plan a model declares: transformers' ``_tp_plan`` / ``config.base_model_tp_plan``.

HF models name their tensor-parallel layers themselves (``{"layers.*.mlp.gate_proj": "colwise", ...}``), which is
more reliable than any structural guess, so ``plan="auto"`` uses those entries for the layers under such a model
and structure detection (:mod:`lightning_deepseek.parallel.detection`) only for everything else.

Only the feed-forward entries are taken: our scheme keeps attention data-parallel. Within one module, the declared
``colwise`` linears (one, or two when gated, all ``d -> h``) and the one ``rowwise`` linear ``h -> d`` form a block;
attention's entries (``q/k/v`` colwise and ``o`` rowwise: three up-projections of different widths, or ``h == d``)
form none and are left out. Entries whose style is not ``colwise``/``rowwise`` (``packed_colwise`` fused expert
weights, ``moe_tp_experts``, ``embedding_rowwise``, ``colwise_gather_output`` heads) or that name a parameter
rather than a linear module are not feed-forward layers in our scheme and are skipped (routed experts belong to
expert parallelism). A ``*`` in a key matches one module name (a layer index), as in transformers.
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch.nn as nn

from lightning_deepseek.parallel.detection import FeedForwardBlock, linear_shape

_STYLES = ("colwise", "rowwise")


def declared_tp_plan(module: nn.Module) -> dict[str, str] | None:
    """The tensor-parallel plan ``module`` declares, keyed by module names relative to it (None: none declared)."""
    plan = getattr(module, "_tp_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan)
    config = getattr(module, "config", None)
    base_plan = getattr(config, "base_model_tp_plan", None)
    if not isinstance(base_plan, dict) or not base_plan or not hasattr(module, "base_model_prefix"):
        return None
    prefix = module.base_model_prefix
    base = f"{prefix}." if prefix and isinstance(getattr(module, prefix, None), nn.Module) else ""
    return {f"{base}{key}": style for key, style in base_plan.items()}


def declaring_modules(module: nn.Module) -> dict[str, tuple[nn.Module, dict[str, str]]]:
    """The outermost submodules of ``module`` (by name) that declare a plan, with their plans."""
    found: dict[str, tuple[nn.Module, dict[str, str]]] = {}
    for name, sub in module.named_modules():
        if any(outer == "" or name == outer or name.startswith(f"{outer}.") for outer in found):
            continue
        plan = declared_tp_plan(sub)
        if plan is not None:
            found[name] = (sub, plan)
    return found


def _pattern(key: str) -> re.Pattern[str]:
    return re.compile("\\.".join("[^.]+" if part == "*" else re.escape(part) for part in key.split(".")))


def declared_blocks(owner: nn.Module, plan: dict[str, str], prefix: str) -> list[FeedForwardBlock]:
    """The feed-forward blocks of ``plan`` (declared by ``owner``), named with ``prefix`` (see the module docstring)."""
    patterns = [(_pattern(key), style) for key, style in plan.items() if style in _STYLES]
    by_parent: dict[str, dict[str, list[tuple[str, nn.Module, tuple[int, int]]]]] = defaultdict(
        lambda: {"colwise": [], "rowwise": []})
    for name, sub in owner.named_modules():
        shape = linear_shape(sub)
        style = next((style for pattern, style in patterns if pattern.fullmatch(name)), None)
        if shape is None or style is None:
            continue
        parent = name.rpartition(".")[0]
        by_parent[parent][style].append((f"{prefix}{name}", sub, shape))
    blocks = []
    for layers in by_parent.values():
        ups, downs = layers["colwise"], layers["rowwise"]
        if not (1 <= len(ups) <= 2 and len(downs) == 1) or len({shape for _, _, shape in ups}) != 1:
            continue  # attention (q, k, v / o) or a partial entry: stays data-parallel
        dim, hidden = ups[0][2]
        if downs[0][2] != (hidden, dim) or dim == hidden:
            continue
        num_params = sum(p.numel() for _, m, _ in (*ups, *downs) for p in m.parameters())
        blocks.append(FeedForwardBlock(tuple(n for n, _, _ in ups), downs[0][0], dim, hidden, num_params,
                                       source=f"declared by {type(owner).__name__}"))
    return blocks
