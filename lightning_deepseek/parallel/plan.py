"""The tensor-parallel plan: which linear layers are sharded over the ``tp`` mesh dimension, and how; a frozen value.

Where it comes from (each entry records its source, printed in the plan table):

- ``plan="auto"``: for a model that declares its own tensor-parallel plan (HF transformers' ``_tp_plan`` /
  ``config.base_model_tp_plan``: Llama, Mistral, Qwen, Mixtral, DeepSeek-V3, ...), that plan's feed-forward entries
  (:mod:`lightning_deepseek.parallel.declared`), and under a pipeline its attention entries too
  (``add_attention_heads``: the ranks of a ``tp`` group there read the same batch); for everything else (our GPT,
  torch's ``TransformerEncoderLayer``, GPT-2, BERT, ViT, a user's own model), feed-forward blocks found by structure
  (:mod:`lightning_deepseek.parallel.detection`). Blocks under ``min_shard_params`` stay replicated, as do blocks
  whose hidden width does not divide by ``tp`` (warned);
- an explicit mapping ``{module-name pattern: "colwise" | "rowwise"}`` (``fnmatch``, names relative to the
  LightningModule; ``*`` also matches dots).

Layers are ``nn.Linear`` or transformers' ``Conv1D``; how they are sharded is :mod:`lightning_deepseek.parallel.styles`.

Printed at setup: the plan table (the memory per rank follows once the optimizers exist: :mod:`.memory`).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch.nn as nn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_deepseek.parallel.declared import declared_attention, declared_blocks, declaring_modules
from lightning_deepseek.parallel.detection import FeedForwardBlock, find_feed_forward_blocks, linear_shape
from lightning_deepseek.parallel.dims import ParallelDims

STYLES = ("colwise", "rowwise")

__all__ = ["STYLES", "FeedForwardBlock", "Plan", "PlanEntry", "add_attention_heads", "auto_plan", "decide_plan",
           "explicit_plan",
           "find_feed_forward_blocks", "format_plan_table", "plan_blocks", "why_auto_plan_is_empty"]


@dataclass(frozen=True)
class PlanEntry:
    """One sharded linear layer: its module name (relative to the root module), its style, where it came from
    (``"structure"``, ``"declared by <HF class>"`` or ``"explicit"``) and whether it is an attention projection whose
    heads the plan splits (``add_attention_heads``)."""

    name: str
    style: str
    num_params: int
    source: str = "structure"
    heads: bool = False


@dataclass(frozen=True)
class Plan:
    """The sharded layers, decided once at setup. Empty: ``reason`` says why (and ``warn`` whether the user should
    be told: they did not ask for an unsharded run)."""

    entries: tuple[PlanEntry, ...] = ()
    reason: str = ""
    warn: bool = False

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    @property
    def styles(self) -> dict[str, str]:
        return {e.name: e.style for e in self.entries}

    @property
    def sources(self) -> list[str]:
        return sorted({e.source for e in self.entries})


def plan_blocks(module: nn.Module) -> list[FeedForwardBlock]:
    """The feed-forward blocks of ``module``: declared ones under models that declare a plan with feed-forward
    entries, structural ones everywhere else."""
    declared: list[FeedForwardBlock] = []
    covered: list[str] = []
    for name, (owner, plan) in declaring_modules(module).items():
        blocks = declared_blocks(owner, plan, f"{name}." if name else "")
        if blocks:
            declared += blocks
            covered.append(name)

    def outside(block: FeedForwardBlock) -> bool:
        return not any(c == "" or block.down.startswith(f"{c}.") for c in covered)

    return declared + [b for b in find_feed_forward_blocks(module) if outside(b)]


def auto_plan(module: nn.Module, tp_size: int, min_params: int) -> tuple[list[PlanEntry], list[FeedForwardBlock]]:
    """The plan that shards every block of ``plan_blocks`` with at least ``min_params`` parameters whose hidden
    width divides by ``tp_size``; also returns the blocks skipped because their width does not divide."""
    entries: list[PlanEntry] = []
    indivisible: list[FeedForwardBlock] = []
    modules = dict(module.named_modules())
    for block in plan_blocks(module):
        if block.num_params < min_params:
            continue
        if block.hidden % tp_size:
            indivisible.append(block)
            continue
        for name in block.ups:
            entries.append(PlanEntry(name, "colwise", _numel(modules[name]), block.source))
        entries.append(PlanEntry(block.down, "rowwise", _numel(modules[block.down]), block.source))
    return entries, indivisible


def add_attention_heads(module: nn.Module, plan: Plan, tp_size: int, min_params: int) -> Plan:
    """``plan`` (an automatic one) with the attention modules ``module``'s declared plans name (query, key and value
    column-wise, the output projection row-wise: their heads split over ``tp``), each with at least ``min_params``
    parameters; in the modules' order. For layouts whose ``tp`` ranks read the same batch (under a pipeline). Attention
    whose head or key/value-head count ``tp_size`` does not divide stays replicated (warned)."""
    modules = dict(module.named_modules())
    added: list[PlanEntry] = []
    for name, (owner, declared) in declaring_modules(module).items():
        for heads in declared_attention(owner, declared, f"{name}." if name else ""):
            if heads.num_params < min_params:
                continue
            if heads.heads % tp_size or heads.kv_heads % tp_size:
                rank_zero_warn(f"HybridParallelStrategy: {heads.down.rpartition('.')[0]} keeps its attention "
                               f"replicated: tensor_parallel_size={tp_size} does not divide its {heads.heads} heads "
                               f"and {heads.kv_heads} key/value heads.")
                continue
            source = f"{heads.source} (attention heads)"
            added += [PlanEntry(n, "colwise", _numel(modules[n]), source, heads=True) for n in heads.ups]
            added.append(PlanEntry(heads.down, "rowwise", _numel(modules[heads.down]), source, heads=True))
    if not added:
        return plan
    order = {name: index for index, name in enumerate(modules)}
    return Plan(tuple(sorted((*plan.entries, *added), key=lambda e: order[e.name])))


def _linear_names(module: nn.Module) -> str:
    return ", ".join(n for n, m in module.named_modules() if linear_shape(m) is not None)[:300]


def why_auto_plan_is_empty(module: nn.Module, min_params: int) -> tuple[str, str]:
    """Why ``auto_plan`` sharded nothing in ``module`` (no block found, or all under ``min_params``), and the fix."""
    blocks = plan_blocks(module)
    if not blocks:
        declaring = sorted({type(owner).__name__ for owner, _ in declaring_modules(module).values()})
        declared = (f"; {', '.join(declaring)} declares a tensor-parallel plan, but none of its entries is a "
                    "feed-forward linear pair (fused expert weights are expert parallelism's)" if declaring else "")
        return (f"plan='auto' found no feed-forward block (a linear d->h then h->d with h != d among one module's "
                f"children, or declared by the model) in {type(module).__name__}{declared}",
                "Name the layers to shard in an explicit plan, {module-name pattern: 'colwise' for an up-projection, "
                f"'rowwise' for its down-projection}}; the linear layers of {type(module).__name__} are: "
                f"{_linear_names(module) or 'none'}.")
    largest = max(blocks, key=lambda b: b.num_params)
    return (f"no feed-forward block reaches min_shard_params={min_params}: the largest "
            f"({', '.join((*largest.ups, largest.down))}) has {largest.num_params:,} parameters",
            f"Set min_shard_params={largest.num_params} (lds-train: strategy.min_shard_params={largest.num_params}) "
            "to shard it.")


def explicit_plan(module: nn.Module, patterns: dict[str, str], tp_size: int) -> list[PlanEntry]:
    """The plan of a user mapping ``{module-name pattern: "colwise" | "rowwise"}`` (``fnmatch`` patterns).

    Raises:
        ValueError: a pattern matches no module, a style is unknown, a matched module is not a linear layer
            (``nn.Linear`` or transformers' ``Conv1D``), or its sharded dimension does not divide by ``tp_size``.
    """
    entries: dict[str, PlanEntry] = {}
    modules = dict(module.named_modules())
    names = [name for name in modules if name]
    for pattern, style in patterns.items():
        if style not in STYLES:
            raise ValueError(f"plan[{pattern!r}]={style!r} is not a style: use one of {STYLES}.")
        matched = [name for name in names if fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            raise ValueError(f"plan pattern {pattern!r} matches no module of {type(module).__name__}. "
                             f"Fix the pattern (fnmatch syntax, names relative to the LightningModule); "
                             f"its linear layers are: {_linear_names(module)}")
        for name in matched:
            shape = linear_shape(modules[name])
            if shape is None:
                raise ValueError(f"plan pattern {pattern!r} matches {name!r}, a {type(modules[name]).__name__}: "
                                 "only nn.Linear (and transformers' Conv1D) layers can be sharded. Narrow the "
                                 "pattern to the linear layers.")
            width = shape[1] if style == "colwise" else shape[0]
            if width % tp_size:
                raise ValueError(f"plan: {name!r} ({style}) has {width} features, not divisible by "
                                 f"tensor_parallel_size={tp_size}. Choose a tensor_parallel_size that divides "
                                 f"{width} or leave this layer out of the plan.")
            entries[name] = PlanEntry(name, style, _numel(modules[name]), "explicit")
    return list(entries.values())


def decide_plan(module: nn.Module, plan: str | dict[str, str], world_size: int, tp_size: int, tp_is_auto: bool,
                min_params: int) -> Plan:
    """The plan of ``module`` for ``HybridParallelStrategy``'s settings; an empty one says why, and whether to warn
    (one process, ``tensor_parallel_size='per_node'`` resolving to 1, or no block found or large enough).

    Raises:
        ValueError: an explicit plan is invalid (see ``explicit_plan``), or ``tp_size`` divides none of the widths.
    """
    processes = f"over {world_size} processes" if world_size > 1 else "on one process"
    plain_ddp = f"nothing is sharded and this trains as plain DDP {processes}"
    if world_size == 1:
        return Plan(reason=f"one process (Trainer devices=1, num_nodes=1): there is no tp group, so {plain_ddp}. "
                    "Run on 2 or more devices (lds-train: trainer.devices=2) to shard the feed-forward layers.",
                    warn=True)
    if tp_size == 1:
        if not tp_is_auto:
            return Plan(reason=f"tensor_parallel_size=1: {plain_ddp}.")
        divisors = [d for d in range(2, world_size + 1) if world_size % d == 0]
        return Plan(reason=f"tensor_parallel_size='per_node' is the number of processes per node, 1 here, so "
                    f"{plain_ddp}. "
                    f"Set tensor_parallel_size to one of {divisors}, or run more devices per node.", warn=True)
    if plan != "auto":
        entries = explicit_plan(module, plan, tp_size)
        return Plan(tuple(entries)) if entries else Plan(reason=f"the plan is empty ({plan}): {plain_ddp}.")
    entries, indivisible = auto_plan(module, tp_size, min_params)
    if indivisible and not entries:
        widths = sorted({b.hidden for b in indivisible})
        raise ValueError(f"tensor_parallel_size={tp_size} divides none of the feed-forward widths {widths}. "
                         f"Choose a tensor_parallel_size that divides them, or pass an explicit plan.")
    for block in indivisible:
        rank_zero_warn(f"HybridParallelStrategy: {block.down} keeps replicated: its width {block.hidden} is "
                       f"not divisible by tensor_parallel_size={tp_size}.")
    if entries:
        return Plan(tuple(entries))
    cause, fix = why_auto_plan_is_empty(module, min_params)
    return Plan(reason=f"{cause}, so {plain_ddp}. {fix}", warn=True)


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def format_plan_table(module: nn.Module, plan: Plan, tp_size: int) -> str:
    """Markdown table of the plan (module, style, source, parameters, bytes per rank) and memory per rank vs DDP."""
    modules = dict(module.named_modules())
    rows = ["| module | style | source | parameters | bytes per rank |", "|---|---|---|---|---|"]
    sharded_full = sharded_local = 0
    for entry in plan:
        linear = modules[entry.name]
        local = _local_bytes(linear, entry.style, tp_size)
        full = sum(p.numel() * p.element_size() for p in linear.parameters())
        sharded_full, sharded_local = sharded_full + full, sharded_local + local
        rows.append(f"| {entry.name} | {entry.style} | {entry.source} | {entry.num_params:,} | {local:,} |")
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


def log_plan(module: nn.Module, plan: Plan, dims: ParallelDims) -> None:
    """Print the plan table at setup (rank 0); warn where an empty plan says to."""
    if not plan and plan.warn:
        rank_zero_warn(f"HybridParallelStrategy: {plan.reason}")
    table = format_plan_table(module, plan, dims.tp) if plan else f"empty plan: {plan.reason}"
    rank_zero_info(f"HybridParallelStrategy plan (tp={dims.tp}, dp={dims.dp}):\n{table}")
