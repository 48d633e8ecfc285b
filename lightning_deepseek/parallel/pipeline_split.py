"""The stage split of a pipeline: which modules each pipeline stage owns, and the stage module built from it.

``plan_pipeline_split(model, pp_size, schedule)`` returns a frozen ``PipelineSplit`` (no process group needed; the
model may be on the meta device); ``build_stage_module(model, split, stage_index)`` copies the model and deletes every
module the stage does not own (torchtitan's way), so parameter names and ``state_dict`` keys stay those of the whole
model (``blocks.5.attn.qkv.weight`` on the stage that owns block 5); ``build_rank_module`` does it once for all stages
of one rank and gives each stage a view sharing those modules (what the strategy's LightningModule holds).

Supported models (found by structure, never by importing them):

- **our GPT** (``tok_emb``, ``pos_emb``, ``blocks``, ``ln_f``, ``head``), dense and MoE: the first stage embeds, every
  stage runs its blocks, the last applies ``ln_f`` and ``head``.
- **HF decoder LMs** laid out as ``model.embed_tokens / model.layers / model.norm / lm_head`` (Llama, Mistral, Qwen2
  and their kin): the stage runs the decoder layers itself with the rotary embedding (kept on every stage, it holds no
  parameters), the positions and the causal mask (SDPA's causal kernel, as HF's forward without padding: no mask
  tensor held per micro-batch in flight; an explicit mask for eager attention); HF's own ``forward`` is not reused.
- **a chain**: any other model whose top-level children run one after another, each on the previous one's output
  (``nn.Sequential``; a child that is an ``nn.ModuleList`` is expanded into its elements). Its stages begin
  at the declared ``split_points`` (names of chain elements), or, when it has a block list, are balanced over it.

How the stage's forward passes hidden states: the copy's class is swapped for a subclass whose ``forward`` is the
family's stage forward (the pattern activation checkpointing uses), and a block ``nn.ModuleList`` becomes an
``nn.ModuleDict`` keyed by the original indices. ``isinstance`` and names are kept.

Balance: the block list (:func:`.activation_checkpointing.find_transformer_blocks`) is cut into contiguous runs
minimising the largest stage cost, where cost = the stage's parameters outside embedding tables (a dense layer's
forward costs two FLOPs per parameter per token; a lookup costs none; attention's sequence-quadratic term and MoE's
sparsity are not counted: routed experts count whole, which balances their memory rather than their FLOPs). The
embedding joins the first stage, the final norm and head the last.

Virtual stages: ``1F1B`` has one stage per rank; ``Interleaved1F1B`` two per rank in loop order (stage s on rank
s mod P); ``ZBVZeroBubble`` and ``DualPipeV`` two per rank in V order (rank r holds stages r and 2P-1-r).

Costs: ``build_stage_module`` deep-copies the whole model before deleting what the stage does not own: free on the
meta device, a second whole model for a moment on a real one (build large models on meta).

Does not support: tied input and output embeddings (the two stages would share one parameter; untie them), blocks
that need more than the hidden states (a key/value cache, cross-attention inputs, HF attention masks with padding),
encoder-decoder models, more than two virtual stages per rank.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from lightning_deepseek.parallel.activation_checkpointing import find_transformer_blocks

SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")
_STAGES_PER_RANK = {"1F1B": 1, "Interleaved1F1B": 2, "ZBVZeroBubble": 2, "DualPipeV": 2}
_V_SHAPED = ("ZBVZeroBubble", "DualPipeV")

__all__ = ["SCHEDULES", "PipelineSplit", "StageSpec", "build_rank_module", "build_stage_module",
           "plan_pipeline_split", "stage_to_rank"]


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: its index, the pipeline rank that runs it, the modules it owns and their parameters."""

    index: int
    rank: int
    modules: tuple[str, ...]
    num_parameters: int


@dataclass(frozen=True)
class PipelineSplit:
    """The decided split of a model into pipeline stages (built by :func:`plan_pipeline_split`)."""

    family: str
    schedule: str
    pp_size: int
    stages: tuple[StageSpec, ...]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.pp_size

    def stage_indices(self, pp_rank: int) -> tuple[int, ...]:
        """The stages that pipeline rank ``pp_rank`` runs, in increasing order."""
        return tuple(stage.index for stage in self.stages if stage.rank == pp_rank)

    def table(self) -> str:
        """The split as a text table: stage, rank, modules (runs of blocks abbreviated), parameters."""
        rows = [("stage", "rank", "modules", "parameters")]
        rows += [(str(s.index), str(s.rank), _abbreviate(s.modules), f"{s.num_parameters:,}") for s in self.stages]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
        return "\n".join([f"pipeline split: {self.family}, {self.schedule}, pp={self.pp_size}", *lines])


def stage_to_rank(stage_index: int, pp_size: int, schedule: str) -> int:
    """The pipeline rank that runs ``stage_index`` under ``schedule`` (loop order, or V order for V schedules)."""
    if schedule in _V_SHAPED and stage_index >= pp_size:
        return 2 * pp_size - 1 - stage_index
    return stage_index % pp_size


def _abbreviate(names: Sequence[str]) -> str:
    """``blocks.0, blocks.1, blocks.2`` -> ``blocks.0-2``."""
    parts: list[str] = []
    run: list[tuple[str, int]] = []

    def flush() -> None:
        if run:
            prefix, first, last = run[0][0], run[0][1], run[-1][1]
            parts.append(f"{prefix}.{first}" if first == last else f"{prefix}.{first}-{last}")
            run.clear()

    for name in names:
        prefix, _, index = name.rpartition(".")
        if not (index.isdigit() and run and run[-1][0] == prefix and run[-1][1] + 1 == int(index)):
            flush()
        if index.isdigit():
            run.append((prefix, int(index)))
        else:
            parts.append(name)
    flush()
    return ", ".join(parts)


# --- families: which modules come before and after the blocks, and how a stage runs ------------------------------

def _is_gpt(model: nn.Module) -> bool:
    return all(hasattr(model, name) for name in ("tok_emb", "pos_emb", "blocks", "ln_f", "head"))


def _is_hf_decoder(model: nn.Module) -> bool:
    inner = getattr(model, "model", None)
    return inner is not None and all(hasattr(inner, n) for n in ("embed_tokens", "layers", "norm")) \
        and hasattr(model, "lm_head")


def _chain(model: nn.Module) -> list[str]:
    """The chain elements of a model run as a sequence: top-level children, ``nn.ModuleList``s expanded."""
    names = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            names += [f"{name}.{sub}" for sub, _ in child.named_children()]
        else:
            names.append(name)
    return names


def _family(model: nn.Module) -> tuple[str, list[str], list[str], list[str], bool]:
    """(family, modules before the blocks, the blocks, modules after the blocks, whether a block list was found);
    a chain without a block list gives all its elements as the units to split."""
    if _is_gpt(model):
        blocks = [f"blocks.{i}" for i in range(len(model.blocks))]
        return "gpt", ["tok_emb", "pos_emb", "drop"], blocks, ["ln_f", "head"], True
    if _is_hf_decoder(model):
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        if tied:
            raise ValueError(
                f"{type(model).__name__} ties its input and output embeddings (tie_word_embeddings=True): the first "
                "and last pipeline stages would share one parameter. Build the model with tie_word_embeddings=False.")
        blocks = [f"model.layers.{i}" for i in range(len(model.model.layers))]
        return "hf-decoder", ["model.embed_tokens"], blocks, ["model.norm", "lm_head"], True
    chain = _chain(model)
    found = set(find_transformer_blocks(model))
    blocks = [name for name in chain if name in found]
    if not blocks:
        return "chain", [], chain, [], False
    first, last = chain.index(blocks[0]), chain.index(blocks[-1])
    return "chain", chain[:first], chain[first:last + 1], chain[last + 1:], True


def _cost(module: nn.Module) -> int:
    embedded = {id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    return sum(p.numel() for p in module.parameters() if id(p) not in embedded)


def _balanced_cuts(costs: list[int], head_cost: int, tail_cost: int, num_stages: int) -> list[int]:
    """Start indices of ``num_stages`` contiguous, non-empty runs of ``costs`` minimising the largest run's cost
    (``head_cost`` joins the first run, ``tail_cost`` the last)."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][j]: least largest cost of splitting costs[:j] into s runs; cut[s][j]: where the last run starts.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for j in range(s, n - (num_stages - s) + 1):
            for i in range(s - 1, j):
                run = prefix[j] - prefix[i] + (head_cost if s == 1 else 0) + (tail_cost if s == num_stages else 0)
                value = max(best[s - 1][i], run)
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    starts, j = [], n
    for s in range(num_stages, 0, -1):
        j = cut[s][j]
        starts.append(j)
    return starts[::-1]


def _declared_cuts(blocks: list[str], split_points: Sequence[str], num_stages: int, family: str) -> list[int]:
    unknown = [name for name in split_points if name not in blocks]
    if unknown:
        raise ValueError(
            f"split_points={list(split_points)} names {unknown}, which are not {family} stage units of this model. "
            f"Name modules where a stage begins, from: {_abbreviate(blocks)}.")
    starts = sorted(blocks.index(name) for name in split_points)
    if len(starts) != num_stages - 1 or 0 in starts:
        raise ValueError(
            f"split_points={list(split_points)} gives {len(set(starts) - {0}) + 1} stages, but the schedule needs "
            f"{num_stages}: name {num_stages - 1} distinct modules (not the first, {blocks[0]!r}) where stages begin.")
    return [0, *starts]


def plan_pipeline_split(model: nn.Module, pp_size: int, schedule: str = "1F1B",
                        split_points: Sequence[str] | None = None) -> PipelineSplit:
    """Decide which modules each pipeline stage owns (no process group needed; ``model`` may be on meta).

    Args:
        model: the whole model (our GPT, an HF decoder LM, or a chain; see the module docstring).
        pp_size: the number of pipeline ranks.
        schedule: one of ``SCHEDULES``; it fixes the stages per rank and their order.
        split_points: names of the blocks (or chain elements) where a stage begins, instead of the balanced split;
            ``num_stages - 1`` names.

    Raises:
        ValueError: an unknown schedule, ``pp_size < 1``, more stages than blocks, a model with no block list and no
            ``split_points``, or ``split_points`` that name unknown modules or the wrong number of stages.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline_schedule={schedule!r} is not supported: use one of {SCHEDULES}.")
    if pp_size < 1:
        raise ValueError(f"pipeline_parallel_size={pp_size} must be at least 1.")
    num_stages = pp_size * _STAGES_PER_RANK[schedule]
    family, head, blocks, tail, has_blocks = _family(model)
    if not has_blocks and not split_points:
        raise ValueError(
            f"{type(model).__name__} has no transformer block list and no declared split: pass split_points=[...] "
            f"(the names of the modules where stages begin, from {_abbreviate(blocks)}), or give the model an "
            "nn.ModuleList of blocks.")
    if num_stages > len(blocks):
        raise ValueError(
            f"pipeline_parallel_size={pp_size} with pipeline_schedule={schedule!r} needs {num_stages} stages, but "
            f"{type(model).__name__} has {len(blocks)} blocks to split ({_abbreviate(blocks)}): lower "
            f"pipeline_parallel_size to at most {len(blocks) // _STAGES_PER_RANK[schedule]}"
            + (" or use '1F1B' (one stage per rank)." if _STAGES_PER_RANK[schedule] > 1 else "."))
    modules = dict(model.named_modules())
    if split_points:
        starts = _declared_cuts(blocks, split_points, num_stages, family)
    else:
        starts = _balanced_cuts([_cost(modules[b]) for b in blocks], sum(_cost(modules[n]) for n in head),
                                sum(_cost(modules[n]) for n in tail), num_stages)
    ends = [*starts[1:], len(blocks)]
    stages = []
    for index, (start, end) in enumerate(zip(starts, ends)):
        owned = (head if index == 0 else []) + blocks[start:end] + (tail if index == num_stages - 1 else [])
        params = sum(p.numel() for name in owned for p in modules[name].parameters())
        stages.append(StageSpec(index, stage_to_rank(index, pp_size, schedule), tuple(owned), params))
    return PipelineSplit(family, schedule, pp_size, tuple(stages))


# --- the stage module ----------------------------------------------------------------------------------------------

def _gpt_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    if self.tok_emb is not None:
        pos = torch.arange(x.size(1), device=x.device)
        x = self.drop(self.tok_emb(x) + self.pos_emb(pos))
    for block in self.blocks.values():
        x = block(x)
    if self.head is not None:
        x = self.head(self.ln_f(x))
    return x


def _hf_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    inner = self.model
    if inner.embed_tokens is not None:
        x = inner.embed_tokens(x)
    batch, length = x.size(0), x.size(1) * getattr(self, "pipeline_sequence_shards", 1)  # a sequence shard's stage
    position_ids = torch.arange(length, device=x.device).unsqueeze(0).expand(batch, -1)
    mask = None  # SDPA: its causal kernel; eager attention: the explicit mask
    if getattr(inner.config, "_attn_implementation", "eager") != "sdpa":
        mask = torch.full((length, length), torch.finfo(x.dtype).min, device=x.device, dtype=x.dtype).triu(1)[
            None, None].expand(batch, 1, length, length)
    rotary = getattr(inner, "rotary_emb", None)
    position_embeddings = rotary(x, position_ids) if rotary is not None else None
    for layer in inner.layers.values():
        out = layer(x, attention_mask=mask, position_ids=position_ids, position_embeddings=position_embeddings)
        x = out[0] if isinstance(out, tuple) else out  # a tuple in transformers 4, a tensor in 5
    if self.lm_head is not None:
        x = self.lm_head(inner.norm(x))
    return x


def _chain_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    for name in self._pipeline_chain:
        x = self.get_submodule(name)(x)
    return x


_FORWARDS: dict[str, Callable[..., torch.Tensor]] = {"gpt": _gpt_forward, "hf-decoder": _hf_forward,
                                                     "chain": _chain_forward}
_stage_classes: dict[tuple[type, str], type] = {}


def _stage_class(cls: type, family: str) -> type:
    key = (cls, family)
    if key not in _stage_classes:
        _stage_classes[key] = type(cls.__name__, (cls,), {"forward": _FORWARDS[family],
                                                          "__module__": cls.__module__})
    return _stage_classes[key]


def _delete(root: nn.Module, name: str) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    if isinstance(parent, nn.ModuleDict):
        del parent[child]
    else:
        setattr(parent, child, None)


def build_stage_module(model: nn.Module, split: PipelineSplit, stage_index: int) -> nn.Module:
    """A copy of ``model`` holding only the modules stage ``stage_index`` owns, whose forward maps the stage's
    input (token ids on the first stage, hidden states on the others) to its output (hidden states; logits on the
    last). Names and ``state_dict`` keys are the whole model's; ``model`` is not changed.

    Args:
        model: the whole model the split was planned on (any device, meta included).
        split: the split from :func:`plan_pipeline_split`.
        stage_index: which stage to build.
    """
    return _build(model, split, split.stages[stage_index].modules)


def build_rank_module(model: nn.Module, split: PipelineSplit, pp_rank: int) -> tuple[nn.Module, list[nn.Module]]:
    """One copy of ``model`` holding the modules of every stage pipeline rank ``pp_rank`` runs (what its optimizer
    steps and its checkpoint saves, under the whole model's names), and one module per stage, in
    ``split.stage_indices(pp_rank)`` order, made of the same submodule objects (what each ``PipelineStage`` runs:
    no parameter is copied). With one stage per rank the two are the same module."""
    indices = split.stage_indices(pp_rank)
    rank_module = _build(model, split, [name for i in indices for name in split.stages[i].modules])
    if len(indices) == 1:
        return rank_module, [rank_module]
    return rank_module, [_view(rank_module, [n for j in indices if j != i for n in split.stages[j].modules],
                               split.stages[i].modules) for i in indices]


def _view(root: nn.Module, drop: Sequence[str], keep: Sequence[str]) -> nn.Module:
    """A shallow copy of ``root`` without the modules ``drop`` (the containers on their paths are copied, every
    other submodule is shared); a chain runs the modules ``keep``. A copied container has its own hooks: FSDP2's
    ``fully_shard`` of one stage registers its forward and backward hooks on that stage's root alone (shared
    hooks would run every stage's FSDP2 state in each stage's forward: gathers of another stage's parameters)."""
    def shallow(module: nn.Module) -> nn.Module:
        clone = copy.copy(module)
        clone.__dict__["_modules"] = dict(module._modules)
        for name, value in module.__dict__.items():  # parameters and buffers stay shared, hooks are copied
            if "hooks" in name and isinstance(value, dict):
                clone.__dict__[name] = copy.copy(value)
        return clone

    view, copied = shallow(root), {}
    for name in drop:
        parent, path = view, ""
        for part in name.split(".")[:-1]:
            path = f"{path}.{part}"
            if path not in copied:
                copied[path] = parent._modules[part] = shallow(parent._modules[part])
            parent = copied[path]
        leaf = name.rpartition(".")[2]
        if isinstance(parent, nn.ModuleDict):
            del parent._modules[leaf]
        else:
            parent._modules[leaf] = None
    if "_pipeline_chain" in root.__dict__:
        view._pipeline_chain = list(keep)
    return view


def _build(model: nn.Module, split: PipelineSplit, owned_names: Sequence[str]) -> nn.Module:
    stage = copy.deepcopy(model)
    owned = set(owned_names)
    all_owned = [name for spec in split.stages for name in spec.modules]
    for container in {name.rpartition(".")[0] for name in all_owned}:
        holder = stage.get_submodule(container) if container else stage
        if isinstance(holder, nn.ModuleList):  # keep the original indices as keys
            parent_name, _, attr = container.rpartition(".")
            parent = stage.get_submodule(parent_name) if parent_name else stage
            setattr(parent, attr, nn.ModuleDict(dict(holder.named_children())))
    for name in all_owned:
        if name not in owned:
            _delete(stage, name)
    if split.family == "chain":
        stage._pipeline_chain = list(owned_names)
    stage.__class__ = _stage_class(type(stage), split.family)
    return stage
