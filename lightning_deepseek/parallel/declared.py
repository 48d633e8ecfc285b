"""Feed-forward blocks from the plan a model declares: transformers' ``_tp_plan`` / ``config.base_model_tp_plan``.

HF models name their tensor-parallel layers themselves (``{"layers.*.mlp.gate_proj": "colwise", ...}``), which is
more reliable than any structural guess, so ``plan="auto"`` uses those entries for the layers under such a model
and structure detection (:mod:`lightning_deepseek.parallel.detection`) only for everything else.

Without a pipeline only the feed-forward entries are taken: each rank there feeds its own micro-batch, so attention
stays data-parallel. Within one module, the declared up-projections (one, or two when gated, all ``d -> h``) and the
one down-projection ``h -> d`` form a block; attention's entries (``q/k/v`` and ``o``: three up-projections of
different widths, or ``h == d``) form none. Under a pipeline the ranks of a ``tp`` group read the same batch
(Megatron's layout, :mod:`.pipeline_stage_parallel`), and attention's entries are taken too
(:func:`declared_attention`): its heads split over ``tp``, which transformers' attention modules support as written
(they infer the head count from the projection's width). A ``*`` in a key matches one module name (a layer index),
as in transformers.

The styles read, across transformers 5.x (every release's style registry and model configs were read):

- up-projection, output sharded: ``colwise`` (every release), ``local_colwise`` (5.0);
- down-projection, input sharded: ``rowwise`` (every release), ``local_rowwise`` (5.0).

Everything else is skipped, as not a feed-forward layer of our scheme: gathered or replicated outputs and inputs
(``colwise_rep``, ``rowwise_rep`` in 5.0; ``colwise_gather_output``, ``rowwise_split_input`` from 5.1), fused
weights (``packed_colwise``, ``packed_rowwise``, ``local_packed_rowwise``), attention heads (``unit_colwise``,
``unit_rowwise``, ``mla_kv_a_proj``), embeddings (``embedding_rowwise``/``_colwise``), routed experts and their
routers (``moe_tp_experts``, ``grouped_gemm``, ``ep_router``, ``gather``, ``local``: expert parallelism's, read by
:mod:`lightning_deepseek.moe.protocol`), and the rest (``replicated_with_grad_allreduce``, ``all_reduce``,
``sequence_parallel``, ``replicate``, ``local_params``, ``moe_identity_expert``, ``megamoe_*``). So are entries
that name a parameter rather than a linear module.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import torch.nn as nn

from lightning_deepseek.parallel.detection import FeedForwardBlock, linear_shape
from lightning_deepseek.versions import require_if_loaded

UP_STYLES = ("colwise", "local_colwise")
DOWN_STYLES = ("rowwise", "local_rowwise")


def feed_forward_role(style: str) -> str | None:
    """``"up"`` or ``"down"`` for a declared style that shards a feed-forward projection our way, else None."""
    return "up" if style in UP_STYLES else "down" if style in DOWN_STYLES else None


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
    require_if_loaded("transformers", "transformers")  # its plans' vocabulary is read from 5.0 on
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


_Layer = tuple[str, nn.Module, tuple[int, int]]


def _declared_by_parent(owner: nn.Module, plan: dict[str, str], prefix: str) -> dict[str, dict[str, list[_Layer]]]:
    """The declared up- and down-projections of ``plan`` grouped by their parent module's name (relative to ``owner``),
    each as (name with ``prefix``, module, (in, out) features)."""
    patterns = [(_pattern(key), feed_forward_role(style)) for key, style in plan.items() if feed_forward_role(style)]
    by_parent: dict[str, dict[str, list[_Layer]]] = defaultdict(lambda: {"up": [], "down": []})
    for name, sub in owner.named_modules():
        shape = linear_shape(sub)
        role = next((role for pattern, role in patterns if pattern.fullmatch(name)), None)
        if shape is not None and role is not None:
            by_parent[name.rpartition(".")[0]][role].append((f"{prefix}{name}", sub, shape))
    return by_parent


def declared_blocks(owner: nn.Module, plan: dict[str, str], prefix: str) -> list[FeedForwardBlock]:
    """The feed-forward blocks of ``plan`` (declared by ``owner``), named with ``prefix`` (see the module docstring)."""
    blocks = []
    for layers in _declared_by_parent(owner, plan, prefix).values():
        ups, downs = layers["up"], layers["down"]
        if not (1 <= len(ups) <= 2 and len(downs) == 1) or len({shape for _, _, shape in ups}) != 1:
            continue  # attention (q, k, v / o) or a partial entry: stays data-parallel
        dim, hidden = ups[0][2]
        if downs[0][2] != (hidden, dim) or dim == hidden:
            continue
        num_params = sum(p.numel() for _, m, _ in (*ups, *downs) for p in m.parameters())
        blocks.append(FeedForwardBlock(tuple(n for n, _, _ in ups), downs[0][0], dim, hidden, num_params,
                                       source=f"declared by {type(owner).__name__}"))
    return blocks


@dataclass(frozen=True)
class AttentionHeads:
    """The declared projections of one attention module: ``ups`` (query, key, value; column-wise, each rank computing
    ``heads / tp`` query and ``kv_heads / tp`` key/value heads) and ``down`` (the output projection, row-wise)."""

    ups: tuple[str, ...]
    down: str
    heads: int
    kv_heads: int
    num_params: int
    source: str


def declared_attention(owner: nn.Module, plan: dict[str, str], prefix: str) -> list[AttentionHeads]:
    """The attention modules of ``plan`` (declared by ``owner``): three column-wise projections and one row-wise
    one under a module with an integer ``head_dim`` (transformers' attention classes), the query's width that of the
    output projection's input, and no other parameter but vectors of ``head_dim`` (a norm over each head, Qwen3's
    ``q_norm``: its gradient is then summed over ``tp``,
    :func:`~lightning_deepseek.parallel.pipeline_stage_parallel.tensor_parallel_partial_params`). Named with ``prefix``.
    """
    modules = dict(owner.named_modules())
    found = []
    for parent, layers in _declared_by_parent(owner, plan, prefix).items():
        ups, downs = layers["up"], layers["down"]
        head_dim = getattr(modules.get(parent), "head_dim", None)
        if len(ups) != 3 or len(downs) != 1 or not isinstance(head_dim, int) or head_dim < 1:
            continue
        width = downs[0][2][0]
        if width != max(out for _, _, (_, out) in ups) or any(out % head_dim for _, _, (_, out) in ups):
            continue
        projections = {n[len(prefix):] for n, _, _ in (*ups, *downs)}
        others = [p for n, p in modules[parent].named_parameters(prefix=parent)
                  if n.rpartition(".")[0] not in projections]
        if any(p.dim() != 1 or p.numel() != head_dim for p in others):
            continue  # per-head state (e.g. attention sinks) would need sharding too: stays replicated
        num_params = sum(p.numel() for _, m, _ in (*ups, *downs) for p in m.parameters())
        found.append(AttentionHeads(tuple(n for n, _, _ in ups), downs[0][0], width // head_dim,
                                    min(out for _, _, (_, out) in ups) // head_dim, num_params,
                                    f"declared by {type(owner).__name__}"))
    return found
