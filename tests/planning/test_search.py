"""``search``'s ``time_limit`` (:func:`lightning_deepseek.planning.search.search`): after it, no layout is planned;
every candidate is still accounted for (planned, refused, pruned by a bound, or listed as unplanned), in one process
and side by side."""

from __future__ import annotations

import itertools
import types

import pytest

from lightning_deepseek.planning import PlanLayout
from lightning_deepseek.planning import search as search_module
from lightning_deepseek.planning.search import SearchResult, search
from tests.planning.test_cache import FAST, LAYOUTS
from tests.planning.test_depth import DENSE, STEP


def _accounted(result: SearchResult) -> list[PlanLayout]:
    return [*(r.layout for r in result.fitting + result.not_fitting), *(lay for lay, _ in result.rejected),
            *(lay for lay, _ in result.pruned), *result.unplanned]


def test_no_layout_is_planned_after_the_time_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clock that moves one second per reading: the layouts read before the limit are planned, the rest not."""
    ticks = itertools.count()
    monkeypatch.setattr(search_module, "time", types.SimpleNamespace(monotonic=lambda: next(ticks)))
    layouts = [*LAYOUTS, PlanLayout(tp=3)]  # tp=3: refused by the strategy when planned
    result = search(DENSE, 4, FAST, STEP, layouts, time_limit=2.5)  # readings 1 and 2 plan, 3 on do not
    assert len(result.fitting + result.not_fitting) == 2 and not result.rejected
    assert sorted(_accounted(result), key=layouts.index) == layouts
    assert len(result.unplanned) == len(layouts) - 2 - len(result.pruned) > 0


def test_side_by_side_ends_at_the_time_limit() -> None:
    result = search(DENSE, 4, FAST, STEP, LAYOUTS, workers=2, time_limit=1e-9)
    assert not result.fitting and not result.not_fitting and set(result.unplanned) == set(LAYOUTS)


def test_time_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="time_limit=0 must be a positive number of seconds"):
        search(DENSE, 4, FAST, STEP, LAYOUTS, time_limit=0)
