"""PrecisionSchedule: parsing, validation at construction and at setup, and which stage runs which step."""

from __future__ import annotations

import pytest

from lightning_deepseek.precision.schedule import PrecisionSchedule, ScheduleError, Stage, default_schedule


def test_accepts_stages_mappings_tuples_and_aliases():
    schedule = PrecisionSchedule([Stage("32", 5), {"precision": 16, "until": 0.5, "unit": "fraction"}, ("bf16",)])
    assert [s.precision for s in schedule.stages] == ["32-true", "16-mixed", "bf16-mixed"]
    assert [s.unit for s in schedule.stages] == ["step", "fraction", "step"]
    named_like_the_groups = PrecisionSchedule([("fp32", 5), ("fp16", 9), ("bf16",)])  # lds-train's precision=...
    assert [s.precision for s in named_like_the_groups.stages] == ["32-true", "16-mixed", "bf16-mixed"]


def test_stage_at_follows_resolved_boundaries():
    schedule = PrecisionSchedule([("32-true", 3), ("16-mixed", 0.5, "fraction"), ("bf16-mixed", 2, "epoch"),
                                  ("32-true",)])
    assert schedule.resolve(total_steps=12, steps_per_epoch=4, max_epochs=None) == [3, 6, 8, None]
    assert schedule.describe() == "32-true [0,3) > 16-mixed [3,6) > bf16-mixed [6,8) > 32-true [8,end)"
    got = [schedule.stage_at(step, step // 4) for step in range(12)]
    assert got == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 3]


def test_default_schedule_is_fp32_fp16_bf16():
    schedule = PrecisionSchedule(default_schedule())
    schedule.resolve(total_steps=100, steps_per_epoch=10, max_epochs=None)
    assert [schedule.stage_at(s, 0) for s in (0, 9, 10, 79, 80, 99)] == [0, 0, 1, 1, 2, 2]
    assert [s.precision for s in schedule.stages] == ["32-true", "16-mixed", "bf16-mixed"]


@pytest.mark.parametrize(("stages", "match"), [
    ([("int4", 3), ("32-true",)], "unknown precision 'int4'"),
    ([("16-true",)], "unknown precision '16-true'"),
    ([("32-true", 10), ("16-mixed", 5), ("bf16-mixed",)], "not increasing"),
    ([("32-true", 10), ("16-mixed",), ("bf16-mixed",)], r"schedule\[1\].*has no `until`"),
    ([("32-true", 10)], "last stage and must not have `until`"),
    ([("32-true", 1.5, "fraction"), ("bf16-mixed",)], "must lie in"),
    ([("32-true", 2.5), ("bf16-mixed",)], "positive whole number"),
    ([("32-true", 2, "minutes"), ("bf16-mixed",)], "unit='minutes' is unknown"),
    ([], "non-empty list"),
    ("16-mixed", "non-empty list"),
])
def test_bad_schedules_are_rejected_at_construction(stages, match):
    with pytest.raises(ScheduleError, match=match):
        PrecisionSchedule(stages)


def test_boundary_beyond_max_steps_is_rejected_at_resolve():
    schedule = PrecisionSchedule([("32-true", 50), ("16-mixed",)])
    with pytest.raises(ScheduleError, match=r"beyond the run's 40 optimizer steps.*max_steps"):
        schedule.resolve(total_steps=40, steps_per_epoch=10, max_epochs=None)


def test_order_across_units_is_checked_at_resolve():
    schedule = PrecisionSchedule([("32-true", 2, "epoch"), ("16-mixed", 15), ("bf16-mixed",)])
    with pytest.raises(ScheduleError, match="not increasing"):
        schedule.resolve(total_steps=100, steps_per_epoch=10, max_epochs=None)


def test_epoch_boundary_beyond_max_epochs_is_rejected():
    schedule = PrecisionSchedule([("32-true", 4, "epoch"), ("16-mixed",)])
    with pytest.raises(ScheduleError, match="beyond max_epochs=3"):
        schedule.resolve(total_steps=30, steps_per_epoch=10, max_epochs=3)
