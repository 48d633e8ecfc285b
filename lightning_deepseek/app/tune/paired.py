"""Paired rounds of a long run's calibration (``tune.budget``): the leading others against plain DDP, again and again.

The two fastest others by what the short rounds measured (pruned ones included: a step or two ranks them) and plain
DDP are measured back to back, unpruned, alternately plain DDP last and first, until the verdict of each
(:func:`~lightning_deepseek.app.tune.choice.settle`, from the spread of the rounds' ratios) is in or the share of the
planned training's time (``tune.budget`` of ``tune.planned_steps`` or ``trainer.max_steps`` steps at plain DDP's
measured step time) is spent. A short run has no time left in its share and skips them. Cost: at most that share.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from lightning_deepseek.app.tune.choice import MIN_TAKE_ROUNDS, Choice, paired_choice, settle
from lightning_deepseek.app.tune.configurations import PLAIN_DDP, Configuration

if TYPE_CHECKING:
    from lightning_deepseek.app.tune.calibrate import Calibrator


def planned_batches(cfg: DictConfig) -> int | None:
    """The batches the run plans to train (``tune.planned_steps`` or ``trainer.max_steps``, times the gradient
    accumulation); ``None`` when neither says (an epoch- or time-bounded run)."""
    steps = cfg.tune.get("planned_steps") or cfg.trainer.get("max_steps")
    if not isinstance(steps, int) or steps < 1:
        return None
    return steps * int(cfg.trainer.get("accumulate_grad_batches", 1) or 1)


PAIRED_CONTENDERS = 2  # the fastest others put against plain DDP in paired rounds (a step or two ranks them)


@dataclass(frozen=True)
class Settled:
    """The paired rounds' outcome: the choice, and each other's ratios (plain DDP's mean step time over its, a
    round each)."""

    choice: Choice
    ratios: dict[str, tuple[float, ...]]


def paired_rounds(calibrator: Calibrator, measure: Callable[[list[str]], None], cfg: DictConfig,
            clock: Callable[[], float] = time.perf_counter) -> Settled | None:
    """Paired rounds of the leading others and plain DDP within ``tune.budget`` of the planned training, run by
    ``measure`` (module docstring); ``None`` when there is nothing to settle (plain DDP not eligible, no other
    measured) or the share left cannot pay for :data:`~lightning_deepseek.app.tune.choice.MIN_TAKE_ROUNDS` rounds
    (fewer could only drop others and keep plain DDP)."""
    tune = cfg.tune
    min_gain, take, drop = float(tune.min_gain), float(tune.get("paired_margin", 2.0)), float(tune.noise_margin)
    budget, planned = float(tune.get("budget", 0.0) or 0.0), planned_batches(cfg)
    plain, leaders = calibrator.results.get(PLAIN_DDP.name), calibrator.leaders(PAIRED_CONTENDERS)
    if (not budget or planned is None or plain is None or plain.state != "measured" or not plain.step_seconds
            or not leaders or calibrator.up_at is None or not calibrator.fits):
        return None
    allowed = budget * planned * statistics.median(plain.step_seconds)
    # a fit's average so far, until a round is timed
    round_seconds = (1 + len(leaders)) * (clock() - calibrator.up_at) / calibrator.fits
    if clock() - calibrator.up_at + MIN_TAKE_ROUNDS * round_seconds > allowed:
        return None
    ratios: dict[Configuration, list[float]] = {row.candidate: [] for row in leaders}
    open_, rounds = list(ratios), 0  # the others not yet decided
    calibrator.pruning = False
    try:
        while open_:
            began = clock()
            names = [c.name for c in open_] + [PLAIN_DDP.name]
            for name in names:
                calibrator.fit_means.pop(name, None)
            measure(names if rounds % 2 == 0 else names[::-1])  # plain DDP last, then first, ...
            rounds += 1
            if any(name not in calibrator.fit_means for name in names):  # one failed: the rounds before stand
                return None
            for candidate in open_:
                ratios[candidate].append(calibrator.fit_means[PLAIN_DDP.name] / calibrator.fit_means[candidate.name])
            open_ = [c for c in open_ if settle(ratios[c], min_gain, take, drop) is None]
            round_seconds = (clock() - began) * (1 + len(open_)) / len(names)
            if clock() - calibrator.up_at + round_seconds > allowed:
                break
    finally:
        calibrator.pruning = True
    choice = paired_choice(PLAIN_DDP, ratios, min_gain, take, drop)
    return Settled(choice, {c.name: tuple(round(r, 4) for r in v) for c, v in ratios.items()})
