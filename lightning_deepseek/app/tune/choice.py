"""The calibration's decision from its measured rows: the fastest configuration, unless plain DDP is within the margin.

Plain DDP stays unless the fastest other beats it by ``tune.min_gain`` and by ``tune.noise_margin`` standard errors
of their difference, estimated from the spread of the two configurations' own timed steps (:func:`noise`): a few
timed steps of two configurations a few percent apart cannot rank them by a 3% criterion. Every rank decides alike:
the step times are the slowest rank's (``calibrate._StepTimer``).

Paired rounds (:func:`settle`, a long run's ``tune.budget``): plain DDP and the leading others measured back to
back, again and again. Each round gives one ratio of plain DDP's mean step time over each other's, and the verdict
comes from the spread of those ratios between rounds, not from the steps within a round: a fit's speed moves
between fits more than its own steps' spread shows, so only repeated fits measure that noise. The verdict is looked
at after every round, so taking a configuration needs a wider margin (``tune.paired_margin``, 2 standard errors)
than the short choice's one look (``tune.noise_margin``, 1); dropping one needs only ``noise_margin`` short of
``min_gain``, so that a configuration within noise of plain DDP does not spend the run's whole share to keep plain
DDP. Checked against recorded calibrations in tests/app/tune/test_calibrate_choice.py; the runs behind the margins
are in benchmarks/autotune/REPORT.md.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_deepseek.app.tune.configurations import Configuration
from lightning_deepseek.app.tune.table import Row


@dataclass(frozen=True)
class Choice:
    """The configuration training uses, and why (the table's last line, the summary's ``tune_reason``).

    Args:
        candidate: the chosen configuration.
        reason: why it, and not plain DDP or the fastest other.
        margin: the gain over plain DDP the fastest other needed (``min_gain`` or the noise, the larger; 0 where
            plain DDP was not compared).
    """

    candidate: Configuration
    reason: str
    margin: float = 0.0


def noise(plain: Row, other: Row, steps: int) -> float:
    """The standard error of the relative difference between two rounds' mean step times, ``plain``'s and
    ``other``'s: each round's mean is of ``steps`` timed steps, each one's spread (the coefficient of variation) is
    estimated from all its timed steps, every round (a drift between rounds widens it). A candidate with fewer
    than two timed steps adds nothing."""
    def spread(row: Row) -> float:
        times = row.step_seconds
        return statistics.stdev(times) / statistics.fmean(times) if len(times) > 1 else 0.0

    return math.hypot(spread(plain), spread(other)) / math.sqrt(steps)


def choose(rows: list[Row], eligible: list[Configuration], min_gain: float, noise_margin: float = 0.0,
           steps: int = 1) -> Choice:
    """The fastest measured eligible candidate; plain DDP (when eligible) unless that one beats it by the margin:
    ``min_gain``, or ``noise_margin`` standard errors of their difference (:func:`noise`, ``steps`` timed steps a
    round), whichever is larger. Raises ``RuntimeError`` when no eligible candidate was measured."""
    measured = [r for r in rows if r.state == "measured" and r.candidate in eligible and r.tokens_per_s]
    if not measured:
        failed = "; ".join(f"{r.candidate.name}: {r.note}" for r in rows if r.state == "failed")
        raise RuntimeError(f"tune: no configuration could be measured ({failed}). Pass tune=none and check the "
                           "strategy and compression settings.")
    plain = next((r for r in measured if r.candidate.is_plain_ddp), None)
    others = sorted((r for r in measured if r is not plain), key=lambda r: -(r.tokens_per_s or 0.0))
    if plain is None:
        return Choice(others[0].candidate, "the fastest measured of the configurations the kept settings allow")
    if not others:
        return Choice(plain.candidate, "plain DDP: no other configuration was measured to the end")
    best = others[0]
    gain = (best.tokens_per_s or 0.0) / (plain.tokens_per_s or 1.0) - 1
    spread = noise_margin * noise(plain, best, steps)
    margin = max(min_gain, spread)
    why = (f"min_gain {min_gain:.0%}" if margin == min_gain else
           f"{noise_margin:g} standard error{'' if noise_margin == 1 else 's'} of the difference, from the spread of "
           f"their timed steps; min_gain "
           f"{min_gain:.0%}")
    if gain < margin:
        verdict = "slower" if gain < 0 else "within the margin"
        return Choice(plain.candidate, f"plain DDP: the fastest other, {best.candidate.name}, measured "
                      f"{1 + gain:.3f}x of it, {verdict} ({margin:.1%}: {why})", margin)
    return Choice(best.candidate, f"{best.candidate.name}: {1 + gain:.3f}x of plain DDP, beyond the margin "
                  f"({margin:.1%}: {why})", margin)


MIN_PAIRED_ROUNDS = 3  # the fewest paired rounds a verdict is drawn from (two give no usable spread)
MIN_TAKE_ROUNDS = 5  # the fewest a configuration is taken from: three rounds' spread is itself a guess


def paired_gain(ratios: Sequence[float]) -> tuple[float, float]:
    """The gain of the other over plain DDP from paired rounds (each plain DDP's mean step time over the other's),
    as a geometric mean minus 1, and the standard error of its logarithm from the rounds' spread (0 from one)."""
    logs = [math.log(r) for r in ratios]
    spread = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else 0.0
    return math.exp(statistics.fmean(logs)) - 1, spread


def settle(ratios: Sequence[float], min_gain: float, take: float, drop: float | None = None) -> bool | None:
    """The verdict of paired rounds: ``True`` when the other beats plain DDP by ``min_gain`` and by ``take``
    standard errors beyond it (from :data:`MIN_TAKE_ROUNDS` rounds on), ``False`` when it falls short of ``min_gain``
    by ``drop`` (default ``take``) standard errors (from :data:`MIN_PAIRED_ROUNDS` on), ``None`` while undecided."""
    if len(ratios) < MIN_PAIRED_ROUNDS:
        return None
    gain, error = paired_gain(ratios)
    distance = math.log1p(gain) - math.log1p(min_gain)
    if distance > take * error:
        return True if len(ratios) >= MIN_TAKE_ROUNDS else None
    if distance < -(take if drop is None else drop) * error:
        return False
    return None


def paired_choice(plain: Configuration, ratios: Mapping[Configuration, Sequence[float]], min_gain: float, take: float,
                  drop: float) -> Choice:
    """The choice after paired rounds of ``plain`` DDP and each other in ``ratios`` (its rounds' ratios): of the
    others :func:`settle` says beat plain DDP, the one with the largest gain; plain DDP when none does (each fell
    short, or the rounds ran out undecided)."""
    verdicts = {c: settle(r, min_gain, take, drop) for c, r in ratios.items()}
    lines = []
    for candidate, rounds in ratios.items():
        gain, error = paired_gain(rounds)
        why = {True: "beyond the margin", False: "short of the margin",
               None: "undecided when the budget (tune.budget) ran out"}[verdicts[candidate]]
        lines.append(f"{candidate.name} measured {1 + gain:.3f}x of plain DDP over {len(rounds)} paired rounds "
                     f"(standard error {error:.1%}): {why}")
    rule = (f"taken at min_gain {min_gain:.0%} and {take:g} standard error{'' if take == 1 else 's'} beyond it, "
            f"dropped at {drop:g} short of it")
    winners = [c for c, v in verdicts.items() if v]
    best = max(winners or ratios, key=lambda c: paired_gain(ratios[c])[0])  # the chosen, or the closest to it
    margin = math.expm1(math.log1p(min_gain) + take * paired_gain(ratios[best])[1])
    if winners:
        return Choice(best, f"{'; '.join(lines)} ({rule})", margin)
    return Choice(plain, f"plain DDP: {'; '.join(lines)} ({rule})", margin)
