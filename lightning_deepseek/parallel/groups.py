"""Process groups and device meshes that later fits in the same processes reuse instead of creating again.

Why: torch keeps every ``new_group`` (and every ``DeviceMesh``'s groups) until the default process group is
destroyed, and an idle gloo group still costs its process time: a 2-process DDP loop ran 20.3 ms per step with no
extra group and 31.9 ms with 400 (benchmarks/autotune/probe_groups.py). Every fit of ``HybridParallelStrategy``
builds a mesh, every ``GradientCompression`` a second communicator, the cost model's setup several more; a
calibration or a benchmark fits dozens of times in the same processes, so later candidates ran slower than earlier
ones. torch has no such cache (``init_device_mesh`` and ``new_group`` always create).

A cached entry holds the default process group it was made under and is used only while that is still the default
group (the same object on every rank after the same calls), so a destroyed and re-initialised world starts afresh
and every rank takes the same branch (``new_group`` is collective over the world).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")
_CACHE: dict[Hashable, object] = {}
_OWNER: list[object] = [None]  # the default process group the cached entries were made under


def reused(key: Hashable, make: Callable[[], T]) -> T:
    """The value made by ``make`` for ``key`` under the current default process group, made once (collective where
    ``make`` is: every rank must ask for the same keys in the same order)."""
    world = dist.group.WORLD if dist.is_initialized() else None
    if world is None:
        return make()
    if _OWNER[0] is not world:  # a new world: every entry belongs to the old one
        _CACHE.clear()
        _OWNER[0] = world
    if key not in _CACHE:
        _CACHE[key] = make()
    return _CACHE[key]  # type: ignore[return-value]
