"""Representative blocks of a pipeline rank: its stages planned from copies holding three or four blocks of each
kind per stage, as :mod:`.depth` plans a whole model.

The rank's *base* copy keeps, in each of its stages, ``BASE_BLOCKS`` blocks of each kind (the first ones, and the
stage's last block); per kind that a stage holds more of, a copy also keeps the next block of that kind in every
such stage. Both copies are split,
sharded and stepped by the strategy's own code (:mod:`.pipeline`) with the other blocks removed from the stage
modules after the split. Every per-micro-batch quantity of a stage (FLOPs, activations, the peaks above a forward's
and a backward's start, what the first backward keeps, its collectives' calls and bytes) is the base's plus the
stage's missing blocks times the stage's own difference between the copies; every quantity of the rank (model
states, the exchange after the schedule and its peak, the owned optimizer elements, the tensor-parallel layers) the
base's plus the missing blocks of all its stages times the difference per added block.

Exact: model states, FLOPs, bytes and calls per collective (a block's are the same wherever it sits); approximate:
the peaks (``tests/planning/test_depth.py`` bounds the error). A rank whose copies would step as many blocks as it
holds (few blocks per stage) is stepped whole. Copies of two ranks whose stages keep the same kinds (and hold the
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
        """Whether the copies together step fewer blocks than the rank holds (else it is stepped whole)."""
        return bool(self.extended) and len(self.base) + sum(
            len(self.with_one_more(kind)) for kind in self.extended) < len(self.names)

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


def extrapolate_rank(base: T, extras: dict[int, T], blocks: RankBlocks) -> T:
    """The whole rank's ``RankStep`` from the base copy's and, per extended kind, the copy with one more block of it
    in each stage that has more (see the module docstring)."""
    stages = tuple(_scaled(stage, {kind: extra.stages[j] for kind, extra in extras.items()},  # type: ignore[attr-defined]
                           {kind: blocks.missing(kind)[j] for kind in extras})
                   for j, stage in enumerate(base.stages))  # type: ignore[attr-defined]
    per_block = {}
    for kind in extras:
        missing = blocks.missing(kind)
        per_block[kind] = sum(missing) / sum(1 for m in missing if m)  # the copy adds one block per such stage
    return dataclasses.replace(_scaled(base, extras, per_block), stages=stages)  # type: ignore[type-var]


def _scaled(base: T, extras: dict[int, T], missing: dict[int, float]) -> T:
    """``base`` with every number and every collective list scaled: the base's value plus ``missing[kind]`` times
    the difference of ``extras[kind]``'s (fields the blocks do not change come out as the base's)."""
    changes = {}
    for field in dataclasses.fields(base):  # type: ignore[arg-type]
        value = getattr(base, field.name)
        others = {kind: getattr(extra, field.name) for kind, extra in extras.items()}
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            scaled = value + sum(missing[kind] * (other - value) for kind, other in others.items())
            changes[field.name] = round(scaled) if isinstance(value, int) else scaled
        elif isinstance(value, tuple) and field.name.endswith("calls"):
            changes[field.name] = scale_calls(value, others, missing)
    return dataclasses.replace(base, **changes)  # type: ignore[type-var]
