"""Tensor-parallel plan: which ``nn.Linear`` layers are sharded over the ``tp`` mesh dimension, and how.

``plan="auto"`` finds feed-forward blocks by structure, in any model: among the ``nn.Linear`` children of one
parent module (in registration order), one or two up-projections ``d -> h`` followed by a down-projection
``h -> d`` with ``h != d``. That covers GPT-style MLPs (``fc1``/``fc2``), ``nn.TransformerEncoderLayer`` /
``DecoderLayer`` (``linear1``/``linear2``) and gated SwiGLU MLPs (``gate``/``up``/``down``, or Llama's
``w1``/``w2``/``w3`` order), and it never pairs attention projections (``d -> d``, ``d -> 3d``). A block is
rejected when a sibling normalises over ``h`` (the hidden activations would be sharded under it). We chose
sibling structure over ``torch.fx`` tracing because tracing fails on data-dependent Python control flow that
ordinary models contain (shape checks in ``forward``) and needs no example input.

Limits: the heuristic assumes that what sits between the up- and down-projection is element-wise (activation,
gating product, dropout), which is the definition of a feed-forward block; a block whose hidden width equals
the model width (``h == d``) is not detected: name it in an explicit plan (``{"*.mlp.fc1": "colwise", ...}``).

Styles: up-projections are ``ColwiseParallel(input_layouts=Shard(0))`` (the batch-sharded input is all-gathered
over ``tp``), down-projections ``RowwiseParallel(output_layouts=Shard(0))`` (partial sums are reduce-scattered
back to each rank's own micro-batch). Every rank of a ``tp`` group must feed the same micro-batch shape.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

STYLES = ("colwise", "rowwise")
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())


@dataclass(frozen=True)
class PlanEntry:
    """One sharded ``nn.Linear``: its module name (relative to the root module) and its style."""

    name: str
    style: str
    num_params: int


@dataclass(frozen=True)
class FeedForwardBlock:
    """Up-projection(s) ``d -> h`` (one, or two when gated) and the down-projection ``h -> d`` of one block."""

    ups: tuple[str, ...]
    down: str
    dim: int
    hidden: int
    num_params: int


def _linear_children(parent: nn.Module, prefix: str) -> list[tuple[str, nn.Linear]]:
    return [(f"{prefix}{name}", child) for name, child in parent.named_children() if isinstance(child, nn.Linear)]


def _normalises_over(parent: nn.Module, width: int) -> bool:
    for child in parent.children():
        if isinstance(child, nn.LayerNorm) and child.normalized_shape[-1] == width:
            return True
        if isinstance(child, _NORMS) and not isinstance(child, nn.LayerNorm):
            shape = getattr(child, "normalized_shape", None) or (getattr(child, "num_features", None),)
            if shape and shape[-1] == width:
                return True
    return False


def find_feed_forward_blocks(module: nn.Module) -> list[FeedForwardBlock]:
    """All feed-forward blocks of ``module`` by sibling structure (see the module docstring)."""
    blocks: list[FeedForwardBlock] = []
    for parent_name, parent in module.named_modules():
        prefix = f"{parent_name}." if parent_name else ""
        linears = _linear_children(parent, prefix)
        shapes = {(m.in_features, m.out_features) for _, m in linears}
        for dim, hidden in sorted(shapes):
            if dim == hidden or (hidden, dim) not in shapes or _normalises_over(parent, hidden):
                continue
            ups = [(n, m) for n, m in linears if (m.in_features, m.out_features) == (dim, hidden)]
            downs = [(n, m) for n, m in linears if (m.in_features, m.out_features) == (hidden, dim)]
            per_block = len(ups) // len(downs)
            first_up_after_down = linears.index(ups[0]) > linears.index(downs[0])  # then (h, d) is the pair
            if first_up_after_down or per_block not in (1, 2) or per_block * len(downs) != len(ups):
                continue  # no consistent grouping: leave it to an explicit plan
            # One block (any order, e.g. Llama's w1, w2, w3), or several in registration order (flat ModuleLists).
            for i, (down_name, down) in enumerate(downs):
                group = ups[i * per_block:(i + 1) * per_block]
                num_params = sum(p.numel() for _, m in (*group, (down_name, down)) for p in m.parameters())
                blocks.append(FeedForwardBlock(tuple(n for n, _ in group), down_name, dim, hidden, num_params))
    return blocks


def auto_plan(module: nn.Module, tp_size: int, min_params: int) -> tuple[list[PlanEntry], list[FeedForwardBlock]]:
    """The plan that shards every detected block with at least ``min_params`` parameters whose hidden width
    divides by ``tp_size``; also returns the blocks skipped because their width does not divide."""
    entries: list[PlanEntry] = []
    indivisible: list[FeedForwardBlock] = []
    modules = dict(module.named_modules())
    for block in find_feed_forward_blocks(module):
        if block.num_params < min_params:
            continue
        if block.hidden % tp_size:
            indivisible.append(block)
            continue
        for name in block.ups:
            entries.append(PlanEntry(name, "colwise", _numel(modules[name])))
        entries.append(PlanEntry(block.down, "rowwise", _numel(modules[block.down])))
    return entries, indivisible


def why_auto_plan_is_empty(module: nn.Module, min_params: int) -> tuple[str, str]:
    """Why ``auto_plan`` sharded nothing in ``module`` (no block found, or all under ``min_params``), and the fix."""
    blocks = find_feed_forward_blocks(module)
    if not blocks:
        return (f"plan='auto' found no feed-forward block (nn.Linear d->h then h->d with h != d among one module's "
                f"children) in {type(module).__name__}",
                "Name the layers to shard in an explicit plan, e.g. plan={'*.mlp.fc1': 'colwise', "
                "'*.mlp.fc2': 'rowwise'}.")
    largest = max(blocks, key=lambda b: b.num_params)
    return (f"no feed-forward block reaches min_shard_params={min_params}: the largest "
            f"({', '.join((*largest.ups, largest.down))}) has {largest.num_params:,} parameters",
            f"Set min_shard_params={largest.num_params} (lds-train: strategy.min_shard_params={largest.num_params}) "
            "to shard it.")


def explicit_plan(module: nn.Module, patterns: dict[str, str], tp_size: int) -> list[PlanEntry]:
    """The plan of a user mapping ``{module-name pattern: "colwise" | "rowwise"}`` (``fnmatch`` patterns).

    Raises:
        ValueError: a pattern matches no module, a style is unknown, a matched module is not an ``nn.Linear``,
            or its sharded dimension does not divide by ``tp_size``.
    """
    entries: dict[str, PlanEntry] = {}
    names = [name for name, _ in module.named_modules() if name]
    modules = dict(module.named_modules())
    for pattern, style in patterns.items():
        if style not in STYLES:
            raise ValueError(f"plan[{pattern!r}]={style!r} is not a style: use one of {STYLES}.")
        matched = [name for name in names if fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            hint = ", ".join(n for n, m in modules.items() if isinstance(m, nn.Linear))[:300]
            raise ValueError(f"plan pattern {pattern!r} matches no module of {type(module).__name__}. "
                             f"Fix the pattern (fnmatch syntax, names relative to the LightningModule); "
                             f"its nn.Linear modules are: {hint}")
        for name in matched:
            linear = modules[name]
            if not isinstance(linear, nn.Linear):
                raise ValueError(f"plan pattern {pattern!r} matches {name!r}, a {type(linear).__name__}: only "
                                 "nn.Linear layers can be sharded. Narrow the pattern to the Linear layers.")
            width = linear.out_features if style == "colwise" else linear.in_features
            if width % tp_size:
                raise ValueError(f"plan: {name!r} ({style}) has {width} features, not divisible by "
                                 f"tensor_parallel_size={tp_size}. Choose a tensor_parallel_size that divides "
                                 f"{width} or leave this layer out of the plan.")
            entries[name] = PlanEntry(name, style, _numel(linear))
    return list(entries.values())


def apply_plan(module: nn.Module, entries: list[PlanEntry], tp_mesh: DeviceMesh) -> None:
    """Shard the planned layers of ``module`` in place over the 1-D ``tp_mesh``."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {
        "colwise": ColwiseParallel(input_layouts=Shard(0)),
        "rowwise": RowwiseParallel(output_layouts=Shard(0)),
    }
    if entries:
        parallelize_module(module, tp_mesh, {entry.name: styles[entry.style] for entry in entries})


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def format_plan_table(module: nn.Module, entries: list[PlanEntry], tp_size: int) -> str:
    """Markdown table of the plan (module, style, parameters, bytes per rank) and memory per rank vs DDP."""
    modules = dict(module.named_modules())
    rows = ["| module | style | parameters | bytes per rank |", "|---|---|---|---|"]
    sharded_full = sharded_local = 0
    for entry in entries:
        linear = modules[entry.name]
        local = _local_bytes(linear, entry.style, tp_size)
        full = sum(p.numel() * p.element_size() for p in linear.parameters())
        sharded_full, sharded_local = sharded_full + full, sharded_local + local
        rows.append(f"| {entry.name} | {entry.style} | {entry.num_params:,} | {local:,} |")
    total = sum(p.numel() * p.element_size() for p in module.parameters())
    per_rank = total - sharded_full + sharded_local
    rows.append("")
    rows.append(f"feed-forward parameter bytes per rank: {sharded_local:,} (DDP: {sharded_full:,}); "
                f"all parameter bytes per rank: {per_rank:,} (DDP: {total:,}, {per_rank / max(total, 1):.0%})")
    return "\n".join(rows)


def _local_bytes(linear: nn.Module, style: str, tp_size: int) -> int:
    """Bytes that one rank holds of ``linear`` under ``style``; a row-wise bias stays replicated."""
    total = 0
    for name, param in linear.named_parameters():
        sharded = not (style == "rowwise" and name == "bias")
        total += param.numel() * param.element_size() // (tp_size if sharded else 1)
    return total
