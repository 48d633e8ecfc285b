"""A long run's paired rounds (``tune.budget``, no processes started): plain DDP and the two leading others
measured back to back until each other's ratio to plain DDP is beyond the noise of the rounds themselves, or the
run's share of time is spent.

The rounds are walked as :func:`~lightning_deepseek.app.tune.paired.paired_rounds` runs them, with each fit's mean step
time given and a clock advancing one second a fit."""

import pytest
from hydra import compose, initialize_config_dir

from lightning_deepseek.app.run import CONFIG_DIR
from lightning_deepseek.app.tune import configurations
from lightning_deepseek.app.tune.calibrate import Calibrator
from lightning_deepseek.app.tune.choice import paired_gain, settle
from lightning_deepseek.app.tune.paired import Settled, paired_rounds, planned_batches
from lightning_deepseek.app.tune.table import Calibration, Row

# Recorded on the 10 Gbit testbed, moe-tiny: hybrid tp2/ep1 against plain DDP in each of 5 repetitions of a grid of
# 4 rounds x 8 steps (benchmarks/autotune/REPORT.md): 1.10x by the median, but no order the repetitions agree on.
TESTBED_MOE = [1.14, 1.10, 1.08, 0.96, 0.90]


def test_the_verdict_comes_from_the_rounds_spread() -> None:
    assert settle([1.10, 1.12, 1.09, 1.11, 1.10], min_gain=0.03, take=1.0) is True
    # Recorded on loopback: ddp/int8 taken after three rounds agreeing closely (1.065x, standard error 1.0%) where the
    # grid right after measured it 0.99x of plain DDP: taking now needs five rounds; dropping still three.
    assert settle([1.0812, 1.0694, 1.0454], min_gain=0.03, take=2.0, drop=1.0) is None
    assert settle([1.10, 1.12, 1.09, 1.11], min_gain=0.03, take=1.0) is None
    assert settle([0.98, 1.00, 1.01], min_gain=0.03, take=1.0) is False
    assert settle([1.10, 1.12], min_gain=0.03, take=0.0) is None  # too few rounds to see the noise
    gain, error = paired_gain(TESTBED_MOE)
    assert gain == pytest.approx(0.032, abs=0.001) and error == pytest.approx(0.044, abs=0.001)
    assert settle(TESTBED_MOE, min_gain=0.03, take=1.0) is None
    assert settle(TESTBED_MOE, min_gain=0.03, take=0.0) is True  # min_gain alone: the mean decides
    # Recorded on loopback, the demo model: ddp/int4 against plain DDP, taken at 1 standard error after 8 rounds; the
    # grid right after put it at 0.99x of plain DDP. The default paired margin (2, for a verdict looked at every round)
    # would have gone on measuring.
    rounds = [0.9628, 1.0178, 1.3015, 1.079, 1.0489, 0.9382, 1.0533, 1.3508]
    assert settle(rounds, min_gain=0.03, take=1.0) is True
    assert settle(rounds, min_gain=0.03, take=2.0) is None
    # Recorded on loopback with 2 both ways: ddp/int4's first three rounds, after which it stayed undecided for 89
    # rounds (1.011x of plain DDP at the end) and spent the whole 4% share. Dropped at 1 standard error short of
    # min_gain (the default, tune.noise_margin), it ends there; taking it still needs 2 beyond.
    first = [0.9057, 0.711, 1.0172]
    assert settle(first, min_gain=0.03, take=2.0) is None
    assert settle(first, min_gain=0.03, take=2.0, drop=1.0) is False


def _calibrator(*overrides: str) -> Calibrator:
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["model=tiny", "trainer.devices=2", "tune=quick", *overrides])
    order = configurations(cfg, forced=[])
    calibrator = Calibrator(cfg, None, None, order, order)
    ddp, int8, int4, hybrid = (next(c for c in order if c.name == n)
                               for n in ("ddp/none", "ddp/int8", "ddp/int4", "hybrid/tp2/none"))
    calibrator.results = {"ddp/none": Row(ddp, "measured", 1000.0, step_seconds=(0.1, 0.1, 0.1, 0.1)),
                          "ddp/int8": Row(int8, "measured", 950.0, step_seconds=(0.105, 0.106)),
                          "ddp/int4": Row(int4, "pruned", 900.0, step_seconds=(0.111,)),
                          "hybrid/tp2/none": Row(hybrid, "pruned", 980.0, step_seconds=(0.102,))}
    calibrator.up_at, calibrator.fits = 0.0, 10  # ten fits in ten seconds so far
    return calibrator


def _walk(calibrator: Calibrator, **seconds: list[float]) -> tuple[list[list[str]], Settled | None]:
    """Run ``paired_rounds`` with plain DDP's fits at 0.1 s a step and ``hybrid``'s and ``int8``'s at the given ones."""
    clock, fits = [10.0], []
    times = {"hybrid/tp2/none": iter(seconds.get("hybrid", [])), "ddp/int8": iter(seconds.get("int8", []))}

    def measure(names: list[str]) -> None:
        fits.append(names)
        assert not calibrator.pruning  # every one is measured to the end
        for name in names:
            clock[0] += 1.0
            calibrator.fit_means[name] = 0.1 if name == "ddp/none" else next(times[name])

    settled = paired_rounds(calibrator, measure, calibrator.cfg, clock=lambda: clock[0])
    assert calibrator.pruning
    return fits, settled


def test_the_leader_ahead_beyond_the_noise_is_taken_and_a_slower_one_dropped() -> None:
    calibrator = _calibrator("tune.planned_steps=10000")  # 4% of 10,000 steps of 0.1 s: 40 s
    assert planned_batches(calibrator.cfg) == 10000
    fits, settled = _walk(calibrator, hybrid=[0.091, 0.090, 0.092, 0.091, 0.090], int8=[0.11, 0.112, 0.109])
    # The two leaders: the pruned hybrid (980 tokens/s before it stopped) and int8; plain DDP last, then first. int8
    # is dropped after three rounds, hybrid taken after five.
    assert fits == [["hybrid/tp2/none", "ddp/int8", "ddp/none"], ["ddp/none", "ddp/int8", "hybrid/tp2/none"],
                    ["hybrid/tp2/none", "ddp/int8", "ddp/none"], ["ddp/none", "hybrid/tp2/none"],
                    ["hybrid/tp2/none", "ddp/none"]]
    assert settled.choice.candidate.name == "hybrid/tp2/none"
    assert settled.choice.reason.startswith("hybrid/tp2/none measured 1.101x of plain DDP over 5 paired rounds")
    assert "; ddp/int8 measured 0.906x of plain DDP over 3 paired rounds (standard error 0.8%): short of the " \
           "margin (taken at min_gain 3% and 2 standard errors beyond it, dropped at 1 short of it)" in \
           settled.choice.reason
    table = Calibration("quick", list(calibrator.results.values()), settled.choice.candidate, 30.0,
                        reason=settled.choice.reason, paired=settled.ratios)
    assert "paired rounds (tune.budget): plain DDP's step time over hybrid/tp2/none's, each round back to back: " \
           "1.099 1.111 1.087 1.099 1.111" in table.table()


def test_a_near_tie_runs_until_the_share_is_spent_and_keeps_plain_ddp() -> None:
    calibrator = _calibrator("tune.planned_steps=10000")
    noisy = [0.1 / r for r in (1.14, 0.90, 1.10, 0.96, 1.08)] * 4  # the testbed MoE's ratios, alternating
    fits, settled = _walk(calibrator, hybrid=noisy, int8=[0.11, 0.112, 0.109])
    # 10 s spent; three rounds of 3 fits (int8 then drops out), then rounds of 2 fits until the next would pass 40 s.
    assert [len(f) for f in fits] == [3, 3, 3] + [2] * 10 and 10 + 9 + 20 <= 40
    assert fits[3] == ["ddp/none", "hybrid/tp2/none"]  # round 4: plain DDP first
    assert settled.choice.candidate.name == "ddp/none"
    assert settled.choice.reason.startswith("plain DDP: hybrid/tp2/none measured 1.034x of plain DDP over 13 "
                                            "paired rounds (standard error 2.7%): undecided when the budget")


def test_leaders_that_are_not_faster_are_dropped_as_soon_as_the_rounds_say_so() -> None:
    fits, settled = _walk(_calibrator("tune.planned_steps=10000"), hybrid=[0.101, 0.1, 0.102],
                          int8=[0.11, 0.112, 0.109])
    assert len(fits) == 3 and settled.choice.candidate.name == "ddp/none"
    assert settled.choice.reason.startswith("plain DDP: hybrid/tp2/none measured 0.990x")


@pytest.mark.parametrize("overrides", [
    [],  # the default 500 steps: 4% is 2 s, less than three rounds
    ["tune.planned_steps=10000", "tune.budget=0"],
    ["tune.planned_steps=10000", "trainer.max_steps=-1"],  # planned_steps given: max_steps does not matter
])
def test_a_short_run_or_no_budget_runs_no_paired_round(overrides: list[str]) -> None:
    fits, settled = _walk(_calibrator(*overrides), hybrid=[0.05] * 5, int8=[0.2] * 3)
    if "trainer.max_steps=-1" in overrides:
        assert len(fits) == 5  # planned_steps stands in for an unbounded max_steps
    else:
        assert fits == [] and settled is None
    calibrator = _calibrator("trainer.max_steps=-1")  # an epoch-bounded run without planned_steps
    assert planned_batches(calibrator.cfg) is None and _walk(calibrator)[1] is None
