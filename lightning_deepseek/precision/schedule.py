"""``Stage`` and ``PrecisionSchedule``: which compute precision runs at which point of training.

A schedule is a list of stages; each names a precision (``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``, ``"fp8"``)
and where it ends, in optimizer steps (``unit="step"``), epochs (``unit="epoch"``) or as a fraction of the total
number of optimizer steps (``unit="fraction"``). The last stage has no end. Steps are attempted optimizer steps
(``trainer.global_step``, which counts steps skipped on overflow too), so a boundary never moves with the number of
overflows.

Construction validates what it can alone (known precisions, units, strictly increasing boundaries within a
unit); ``resolve`` checks the rest against the trainer (every boundary inside the run, order across units).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "fp8-mixed")
# "fp8-mixed": FP8 GEMMs in the converted nn.Linear layers (precision/float8.py), BF16 autocast for the rest.
AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {
    "32-true": None, "16-mixed": torch.float16, "bf16-mixed": torch.bfloat16, "fp8-mixed": torch.bfloat16,
}
# Lightning's short forms, and the names of lds-train's precision group options.
_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "fp32": "32-true", "fp16": "16-mixed",
            "fp8": "fp8-mixed"}
UNITS = ("step", "epoch", "fraction")


class ScheduleError(ValueError):
    """A precision schedule is malformed; the message names the stage, the bad value and the fix."""


def normalize_precision(value: Any, where: str) -> str:
    """Lightning's precision string for ``value`` (aliases ``32``/``fp32``, ``16``/``fp16``, ``bf16`` accepted)."""
    name = _ALIASES.get(str(value), str(value))
    if name not in PRECISIONS:
        raise ScheduleError(f"{where}: unknown precision {value!r}. Use one of {list(PRECISIONS)} "
                            "(true half precision such as '16-true' is not supported: master weights stay FP32).")
    return name


@dataclass(frozen=True)
class Stage:
    """One stage of a precision schedule.

    Args:
        precision: ``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"`` or ``"fp8"`` (``"fp8-mixed"``; needs torchao).
        until: where the stage ends (exclusive); ``None`` for the last stage.
        unit: ``"step"`` (optimizer steps), ``"epoch"`` or ``"fraction"`` (of the run's optimizer steps).
    """

    precision: str
    until: float | None = None
    unit: str = "step"

    def label(self) -> str:
        if self.until is None:
            return f"{self.precision} to the end"
        return f"{self.precision} until {self.unit} {self.until:g}"


def _as_stage(item: Any, index: int) -> Stage:
    where = f"schedule[{index}]"
    if isinstance(item, Stage):
        fields = {"precision": item.precision, "until": item.until, "unit": item.unit}
    elif isinstance(item, Mapping):
        unknown = set(item) - {"precision", "until", "unit"}
        if unknown or "precision" not in item:
            raise ScheduleError(f"{where}={dict(item)!r}: a stage is a mapping with keys `precision` (required), "
                                f"`until` and `unit`; got unknown keys {sorted(unknown)}.")
        fields = {"unit": "step", "until": None, **item}
    elif isinstance(item, Sequence) and not isinstance(item, str) and 1 <= len(item) <= 3:
        fields = dict(zip(("precision", "until", "unit"), item))
        fields.setdefault("until", None)
        fields.setdefault("unit", "step")
    else:
        raise ScheduleError(f"{where}={item!r} is not a stage. Use Stage('16-mixed', until=0.8, unit='fraction'), "
                            "a mapping {precision: 16-mixed, until: 0.8, unit: fraction} or a tuple.")
    precision = normalize_precision(fields["precision"], where)
    unit, until = fields["unit"], fields["until"]
    if unit not in UNITS:
        raise ScheduleError(f"{where}.unit={unit!r} is unknown. Use one of {list(UNITS)}.")
    if until is not None:
        if isinstance(until, bool) or not isinstance(until, (int, float)) or not math.isfinite(until):
            raise ScheduleError(f"{where}.until={until!r} must be a number (or null for the last stage).")
        if unit == "fraction" and not 0 < until <= 1:
            raise ScheduleError(f"{where}.until={until} with unit='fraction' must lie in (0, 1], e.g. 0.8.")
        if unit != "fraction" and (until != int(until) or until < 1):
            raise ScheduleError(f"{where}.until={until} with unit={unit!r} must be a positive whole number.")
    return Stage(precision, None if until is None else (float(until) if unit == "fraction" else int(until)), unit)


def default_schedule() -> list[Stage]:
    """FP32 for the first 10% of steps, FP16 until 80%, BF16 for the last 20% (the seed document's order)."""
    return [Stage("32-true", 0.1, "fraction"), Stage("16-mixed", 0.8, "fraction"), Stage("bf16-mixed")]


class PrecisionSchedule:
    """An ordered, validated list of stages.

    Args:
        stages: ``Stage`` objects, mappings or ``(precision, until, unit)`` tuples; all but the last need ``until``.
    """

    def __init__(self, stages: Sequence[Any]) -> None:
        if isinstance(stages, (str, Mapping)) or not isinstance(stages, Sequence) or not stages:
            raise ScheduleError(f"schedule={stages!r} must be a non-empty list of stages, e.g. "
                                "[('32-true', 100), ('16-mixed', 0.8, 'fraction'), ('bf16-mixed',)].")
        self.stages = [_as_stage(item, i) for i, item in enumerate(stages)]
        for i, stage in enumerate(self.stages[:-1]):
            if stage.until is None:
                raise ScheduleError(f"schedule[{i}] ({stage.precision}) has no `until` but is not the last stage. "
                                    "Give every stage but the last an end.")
        if self.stages[-1].until is not None:
            raise ScheduleError(f"schedule[{len(self.stages) - 1}] is the last stage and must not have `until` "
                                f"(got {self.stages[-1].until}); it runs to the end of training.")
        last: dict[str, tuple[int, float]] = {}
        for i, stage in enumerate(self.stages[:-1]):
            if stage.unit in last and stage.until <= last[stage.unit][1]:
                j, previous = last[stage.unit]
                raise ScheduleError(f"schedule is not increasing: schedule[{i}].until={stage.until:g} {stage.unit} "
                                    f"is not after schedule[{j}].until={previous:g}. Order stages by their end.")
            last[stage.unit] = (i, stage.until)
        self.end_steps: list[int | None] = [None] * len(self.stages)

    def __len__(self) -> int:
        return len(self.stages)

    def __repr__(self) -> str:
        return "[" + ", ".join(stage.label() for stage in self.stages) + "]"

    def describe(self) -> str:
        """The stages with their optimizer-step ranges once resolved, e.g. ``32-true [0,50) > 16-mixed [50,400)``."""
        if self.end_steps[0] is None and len(self.stages) > 1:
            return repr(self)
        starts = [0, *self.end_steps[:-1]]
        return " > ".join(f"{stage.precision} [{start},{'end' if end is None else end})"
                          for stage, start, end in zip(self.stages, starts, self.end_steps))

    def resolve(self, total_steps: int, steps_per_epoch: int, max_epochs: int | None) -> list[int | None]:
        """Convert every boundary to an optimizer step and check it against the run.

        Args:
            total_steps: optimizer steps of the whole run (``max_steps``, or Lightning's estimate).
            steps_per_epoch: optimizer steps per epoch.
            max_epochs: the run's epoch limit, if any.
        """
        ends: list[int | None] = []
        for i, stage in enumerate(self.stages[:-1]):
            if stage.unit == "fraction":
                end = round(stage.until * total_steps)
            elif stage.unit == "epoch":
                if max_epochs is not None and max_epochs >= 0 and stage.until > max_epochs:
                    raise ScheduleError(f"schedule[{i}].until={stage.until} epochs is beyond max_epochs={max_epochs}. "
                                        "Lower it or raise trainer.max_epochs.")
                end = int(stage.until) * steps_per_epoch
            else:
                end = int(stage.until)
            if end > total_steps:
                raise ScheduleError(f"schedule[{i}].until={stage.until:g} {stage.unit} ends at optimizer step {end}, "
                                    f"beyond the run's {total_steps} optimizer steps (max_steps, or max_epochs x "
                                    "steps per epoch). Lower it, or raise trainer.max_steps / max_epochs.")
            if ends and end < ends[-1]:
                raise ScheduleError(f"schedule is not increasing: schedule[{i}] ({stage.label()}) ends at step {end}, "
                                    f"before schedule[{i - 1}] ends at step {ends[-1]}. Order stages by their end.")
            ends.append(end)
        self.end_steps = [*ends, None]
        return self.end_steps

    def stage_at(self, step: int, epoch: int) -> int:
        """Index of the stage that runs optimizer step ``step`` in epoch ``epoch`` (first stage not yet ended)."""
        for i, stage in enumerate(self.stages[:-1]):
            ended = epoch >= stage.until if stage.unit == "epoch" else step >= self._end_step(i)
            if not ended:
                return i
        return len(self.stages) - 1

    def _end_step(self, index: int) -> int:
        end = self.end_steps[index]
        if end is None:
            stage = self.stages[index]
            if stage.unit == "fraction":
                raise ScheduleError(f"schedule[{index}] uses unit='fraction' but the run's length is unknown; "
                                    "the plugin must be set up by a Trainer with max_steps or max_epochs.")
            return int(stage.until)
        return end
