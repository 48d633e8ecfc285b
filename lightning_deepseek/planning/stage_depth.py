"""Representative blocks of a pipeline rank: its stages planned from copies holding three or four blocks of each
kind per stage, as :mod:`.depth` plans a whole model.

The rank's *base* copy keeps, in each of its stages, ``BASE_BLOCKS`` blocks of each kind (the first ones, and the
stage's last block); per kind that a stage holds more of, a copy also keeps the next block of that kind in every
such stage. Both copies are split,
sharded and stepped by the strategy's own code (:mod:`.pipeline`) with the other blocks removed from the stage
modules after the split. Every per-micro-batch quantity of a stage (FLOPs, activations, the peaks above a forward's
and a backward's start, what the first backward keeps, its collectives' calls and bytes) is the base's plus the
stage's missing blocks times one block's difference, read on a stage of the first rank holding more of that kind
(one extra copy per kind and layout: a block adds the same wherever it sits); every quantity of the rank (model
states, the exchange after the schedule and its peak, the owned optimizer elements, the tensor-parallel layers) the
base's plus the missing blocks of all its stages times the difference per added block.

Exact: model states, FLOPs, bytes and calls per collective (a block's are the same wherever it sits); approximate:
the peaks (``tests/planning/test_depth.py`` bounds the error). A rank whose stages hold no more than the base
keeps is stepped whole. Copies of two ranks whose stages keep the same kinds (and hold the
embedding or the head alike) are the same measurement: :func:`copy_shape` is its key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from lightning_deepseek.planning.depth import BASE_BLOCKS, scale_calls

T = TypeVar("T")


@dataclass(frozen=True)
class RankBlocks:
    """The blocks of each stage of one pipeline rank, as ``(name, kind)`` in order, and whether the stage holds
    the embedding (the first stage) or the head (the last)."""

    stages: tuple[tuple[tuple[str, int], ...], ...]
    ends: tuple[tuple[bool, bool], ...]

    @staticmethod
    def _kept(stage: tuple[tuple[str, int], ...], extra: int | None) -> list[str]:
        """The first blocks of each kind, the stage's last block among them (the strategy hooks the stage's ends:
        sequence parallelism slices before its first block and gathers after its last)."""
        last = stage[-1][0] if stage else None
        kept: set[str] = set()
        for kind in {k for _, k in stage}:
            names = [name for name, k in stage if k == kind]
            if last in names:
                names = [*names[:BASE_BLOCKS - 1], last, *names[BASE_BLOCKS - 1:-1]]
            kept.update(names[:BASE_BLOCKS + (kind == extra)])
        return [name for name, _ in stage if name in kept]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for stage in self.stages for name, _ in stage)

    @property
    def base(self) -> tuple[str, ...]:
        """The base copy's blocks: ``BASE_BLOCKS`` of each kind in each stage."""
        return tuple(name for stage in self.stages for name in self._kept(stage, None))

    def with_one_more(self, kind: int) -> tuple[str, ...]:
        """The base copy's blocks and, in each stage with more blocks of ``kind``, the next one."""
        return tuple(name for stage in self.stages for name in self._kept(stage, kind))

    def missing(self, kind: int) -> tuple[int, ...]:
        """Per stage, its blocks of ``kind`` that the base copy lacks."""
        return tuple(max(sum(k == kind for _, k in stage) - BASE_BLOCKS, 0) for stage in self.stages)

    @property
    def extended(self) -> list[int]:
        """The kinds some stage holds more of than the base copy keeps."""
        return sorted({kind for stage in self.stages for _, kind in stage if any(self.missing(kind))})

    @property
    def worth_it(self) -> bool:
        """Whether the base copy holds fewer blocks than the rank (else it is stepped whole)."""
        return len(self.base) < len(self.names)

    def first_extended(self, kind: int) -> int:
        """The position among the rank's stages of the first one holding more blocks of ``kind`` than the base."""
        return next(j for j, m in enumerate(self.missing(kind)) if m)

    def copy_shape(self, keep: Sequence[str]) -> tuple:
        """What decides a copy's measurement: per stage, its ends and the kinds of the blocks it keeps."""
        kept = set(keep)
        return tuple((ends, tuple(kind for name, kind in stage if name in kept))
                     for ends, stage in zip(self.ends, self.stages))


def rank_blocks(split: Any, pp_rank: int, kinds: dict[str, int]) -> RankBlocks:
    """The :class:`RankBlocks` of ``pp_rank`` under ``split`` (a ``PipelineSplit``); ``kinds``: each block's kind by
    name (:func:`.depth.layer_kinds` over ``find_transformer_blocks``)."""
    indices = split.stage_indices(pp_rank)
    return RankBlocks(tuple(tuple((name, kinds[name]) for name in split.stages[i].modules if name in kinds)
                            for i in indices),
                      tuple((i == 0, i == split.num_stages - 1) for i in indices))


@dataclass(frozen=True)
class BlockDelta:
    """What one more block of a kind adds, from a reference rank's copies: ``base`` and ``extra`` (one more block
    of the kind in each of ``num_extended`` stages), the stage-level difference read at stage position ``stage``."""

    base: Any
    extra: Any
    stage: int
    num_extended: int


def block_delta(base: Any, extra: Any, blocks: RankBlocks, kind: int) -> BlockDelta:
    """The :class:`BlockDelta` of ``kind`` from the copies of the rank whose blocks are ``blocks``."""
    return BlockDelta(base, extra, blocks.first_extended(kind), sum(1 for m in blocks.missing(kind) if m))


def extrapolate_rank(base: T, blocks: RankBlocks, deltas: dict[int, BlockDelta]) -> T:
    """The whole rank's ``RankStep`` from its base copy's and each extended kind's :class:`BlockDelta` (every
    block of a kind adds the same, wherever it sits; see the module docstring)."""
    deltas = {kind: _on_groups_of(base, d) for kind, d in deltas.items()}
    stages = tuple(_scaled(stage, [(blocks.missing(kind)[j], d.extra.stages[d.stage], d.base.stages[d.stage])
                                   for kind, d in deltas.items()])
                   for j, stage in enumerate(base.stages))  # type: ignore[attr-defined]
    terms = [(sum(blocks.missing(kind)) / d.num_extended, d.extra, d.base) for kind, d in deltas.items()]
    return dataclasses.replace(_scaled(base, terms), stages=stages)  # type: ignore[type-var]


def _on_groups_of(rank: Any, delta: BlockDelta) -> BlockDelta:
    """``delta`` with its calls on ``rank``'s process groups (another pipeline rank's ``dp``, ``tp``... groups are
    other groups of the same mesh dimensions)."""
    by_dim = {info.dim: name for name, info in rank.groups.items()}
    names = {name: by_dim.get(info.dim, name) for name, info in delta.base.groups.items()}
    if all(old == new for old, new in names.items()):
        return delta
    return dataclasses.replace(delta, base=renamed_groups(delta.base, names),
                               extra=renamed_groups(delta.extra, names))


def renamed_groups(step: T, names: dict[str, str]) -> T:
    """``step`` (a ``RankStep`` or ``StageStep``) with the group of every collective call renamed by ``names``
    (old name to new; a name not in it is kept), its stages' calls too."""
    changes: dict[str, Any] = {
        f.name: tuple(dataclasses.replace(c, group=names.get(c.group, c.group)) for c in getattr(step, f.name))
        for f in dataclasses.fields(step) if f.name.endswith("calls")}  # type: ignore[arg-type]
    if hasattr(step, "stages"):
        changes["stages"] = tuple(renamed_groups(stage, names) for stage in step.stages)
    return dataclasses.replace(step, **changes)  # type: ignore[type-var]


def _scaled(base: T, terms: list[tuple[float, Any, Any]]) -> T:
    """``base`` with every number and every collective list scaled: the base's value plus, per term
    ``(weight, plus, minus)``, ``weight`` times the difference of ``plus``'s and ``minus``'s (fields the blocks do
    not change come out as the base's)."""
    changes = {}
    for field in dataclasses.fields(base):  # type: ignore[arg-type]
        value = getattr(base, field.name)
        pairs = [(weight, getattr(plus, field.name), getattr(minus, field.name)) for weight, plus, minus in terms]
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            scaled = value + sum(weight * (plus - minus) for weight, plus, minus in pairs)
            changes[field.name] = round(scaled) if isinstance(value, int) else scaled
        elif isinstance(value, tuple) and field.name.endswith("calls"):
            changes[field.name] = scale_calls(value, pairs)
    return dataclasses.replace(base, **changes)  # type: ignore[type-var]
