"""``PlanCache``: what the plans of one search share, so that ``layout="auto"`` does not redo it per layout.

A plan (:func:`lightning_deepseek.planning.plan`) derives from the model alone its block kinds
(:mod:`.depth`), from the model and the tensor-parallel size the strategy's tensor-parallel plan (``decide_plan``:
block detection, the costliest part of the set-up), from the sizes the placement, and steps fake copies of the model.
Keyed by everything they are computed from, these are values: a cache hands the same value to every layout that
asks, and a plan made with a shared cache equals one made with a fresh cache (``tests/planning/test_cache.py``).

What is kept, by key:

- the block kinds of the model, and the block positions of each representative copy;
- the tensor-parallel plan per (copy, world size, ``tp``, ``min_shard_params``) and the placement per (sizes,
  policy, tokens);
- each fake step's measurement per (copy, layout, step shape, resolved placement); a ZeRO-1 optimizer-only step of
  the whole model (the most costly step of a representative plan) per layout *without* its activation
  checkpointing, which that step does not run (no forward);
- pipelined plans (:mod:`.pipeline`): the block kinds by name, the split per (``pp``, schedule), the action table
  per (``pp``, schedule, micro-batches), each stepped copy of a pipeline rank per (layout but its micro-batches
  and which V schedule, the kinds its stages keep; without FSDP2 and ZeRO-1 not its ``pp`` either), and each pipeline
  rank's groups.

Costs: the values above (small: names, sizes, counted bytes), no tensors; hits and misses are counted
(:attr:`PlanCache.hits`, :attr:`PlanCache.misses`) for the benchmark. Not shared across models, world sizes or
clusters by design: the keys hold them, but a search makes one cache for its one model and world.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")


class PlanCache:
    """A memo of the values the plans of one search share (see the module docstring)."""

    def __init__(self) -> None:
        self._values: dict[Hashable, Any] = {}
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable, compute: Callable[[], T]) -> T:
        """The value of ``key``, computed by ``compute`` the first time (an exception is raised, not kept)."""
        if key in self._values:
            self.hits += 1
            return self._values[key]
        self.misses += 1
        value = compute()
        self._values[key] = value
        return value

    def __len__(self) -> int:
        return len(self._values)
