"""The choice against recorded calibrations (no processes started): a candidate replaces plain DDP only when its
gain is beyond both ``tune.min_gain`` and the noise of the two measurements, and the table says why.

Each case is a recorded ``tune=auto`` calibration (benchmarks/autotune/REPORT.md covers the current runs): its rows'
tokens/s (best round) and timed step times (every round), and what the exhaustive grid of the same repetition
ranked first."""

import pytest

from lightning_deepseek.app.tune.choice import choose, noise
from lightning_deepseek.app.tune.configurations import Configuration
from lightning_deepseek.app.tune.table import Calibration, Row


def _row(name: str, tokens_per_s: float, steps: list[float]) -> Row:
    strategy, *rest = name.split("/")
    tp = int(rest.pop(0)[2:]) if strategy == "hybrid" else None
    ep = int(rest.pop(0)[2:]) if rest[0].startswith("ep") else None
    return Row(Configuration(strategy, tp, ep, rest[0]), "measured", tokens_per_s, step_seconds=tuple(steps))


def _choose(*rows: Row) -> tuple[str, str]:
    choice = choose(list(rows), [r.candidate for r in rows], min_gain=0.03, noise_margin=1.0, steps=2)
    return choice.candidate.name, choice.reason


def test_a_gain_within_the_noise_of_the_measurements_keeps_plain_ddp() -> None:
    # Loopback, the demo model, idle machine (07:33-07:38 UTC, rep 1): int8 measured 1.033x of plain DDP, just over
    # min_gain, and was chosen; the grid put it at 0.91x. Its steps (0.29-0.36 s) spread 11%, plain DDP's 6%.
    plain = _row("ddp/none", 13_002.0, [0.3541, 0.3405, 0.3119, 0.3156])
    int8 = _row("ddp/int8", 13_436.0, [0.3209, 0.2859, 0.3588])
    assert noise(plain, int8, steps=2) == pytest.approx(0.091, abs=0.002)
    name, reason = _choose(plain, int8)
    assert name == "ddp/none"
    assert reason.startswith("plain DDP: the fastest other, ddp/int8, measured 1.033x of it, within the margin (9.1%")
    # The former rule (min_gain alone) chose int8.
    assert choose([plain, int8], [plain.candidate, int8.candidate], min_gain=0.03).candidate.name == "ddp/int8"


def test_a_gain_beyond_the_noise_is_taken() -> None:
    # 1 Gbit testbed, moe-tiny (05:26-06:20 UTC, rep 0): hybrid tp2/ep1 ahead in both rounds; the grid's best
    # (1.29x of plain DDP).
    plain = _row("ddp/none", 21_958.0, [0.2581, 0.2533, 0.1819, 0.1888])
    hybrid = _row("hybrid/tp2/ep1/none", 25_760.0, [0.1628, 0.1491, 0.1758, 0.1756])
    name, reason = _choose(plain, hybrid, _row("hybrid/tp2/ep2/none", 22_028.0, [0.1759, 0.196]))
    assert name == "hybrid/tp2/ep1/none"
    assert reason.startswith("hybrid/tp2/ep1/none: 1.173x of plain DDP, beyond the margin (14.")
    # 10 Gbit testbed, the demo model (rep 0): int4 at 1.49x, the grid's best.
    plain = _row("ddp/none", 6_356.0, [1.2244, 1.6269, 1.3535, 1.2194])
    assert _choose(plain, _row("ddp/int4", 9_468.0, [1.0203, 0.7242, 0.767, 0.9403]))[0] == "ddp/int4"


def test_a_start_up_slowdown_in_plain_ddps_first_round_widens_the_margin() -> None:
    # 1 Gbit testbed, the demo model, loaded (the 3-round rep): plain DDP's first round 2x slower than its second;
    # int4 measured 1.105x of its best round and was chosen, while the grid put plain DDP first (int4 0.92x).
    plain = _row("ddp/none", 10_894.0, [1.2375, 1.7778, 0.7668, 0.7371])
    int4 = _row("ddp/int4", 12_038.0, [0.803, 0.7387, 0.6913, 0.6488])
    name, reason = _choose(plain, int4, _row("ddp/int8", 10_324.0, [0.7501, 0.8368]))
    assert name == "ddp/none" and "1.105x of it, within the margin (31." in reason


def test_without_a_spread_min_gain_decides_and_the_table_says_why() -> None:
    plain = _row("ddp/none", 1000.0, [0.5])  # one timed step each: no spread to estimate
    int8 = _row("ddp/int8", 1020.0, [0.49])
    slower = _row("ddp/int4", 900.0, [0.55])
    assert _choose(plain, int8)[1] == ("plain DDP: the fastest other, ddp/int8, measured 1.020x of it, within the "
                                       "margin (3.0%: min_gain 3%)")
    assert "ddp/int4, measured 0.900x of it, slower" in _choose(plain, slower)[1]
    name, reason = _choose(_row("ddp/none", 1000.0, [0.5, 0.5]), _row("ddp/int8", 1100.0, [0.45, 0.46]))
    assert name == "ddp/int8" and reason.startswith("ddp/int8: 1.100x of plain DDP, beyond the margin (3.0%: min_gain")
    # Plain DDP only the reference (the kept settings exclude it): the fastest allowed, whatever the margin.
    assert choose([plain, slower], [slower.candidate], 0.03, 1.0, 2).candidate.name == "ddp/int4"
    choice = choose([plain, int8], [plain.candidate, int8.candidate], 0.03, 1.0, 2)
    table = Calibration("auto", [plain, int8], choice.candidate, 3.0, min_gain=0.03, reason=choice.reason,
                        margin=choice.margin)
    assert table.table().splitlines()[-1] == f"why: {choice.reason}"
    assert table.summary()["tune_reason"] == choice.reason


def test_the_table_says_when_the_host_took_the_cpu_during_the_calibration(tmp_path) -> None:
    import json

    from lightning_deepseek.app.tune.steal import cpu_times, stolen_share

    plain, int8 = _row("ddp/none", 1000.0, [0.5, 0.5]), _row("ddp/int8", 1020.0, [0.49, 0.5])
    quiet = Calibration("auto", [plain, int8], plain.candidate, 3.0, reason="r", stolen=0.01)
    assert "hypervisor" not in quiet.table()
    busy = Calibration("auto", [plain, int8], plain.candidate, 3.0, reason="r", stolen=0.23)
    assert busy.table().splitlines()[-1].startswith("host: the hypervisor took 23% of this machine's CPU during the "
                                                    "calibration (steal)")
    busy.write(tmp_path)
    assert json.loads((tmp_path / "tune.json").read_text())["cpu_stolen_by_host"] == 0.23
    # /proc/stat's first line: user nice system idle iowait irq softirq steal (guest...): steal over all states
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 10 0 5 35 0 0\ncpu0 1 2 3\n")
    before = cpu_times(str(stat))
    stat.write_text("cpu  200 0 100 1500 20 0 10 170 0 0\n")
    after = cpu_times(str(stat))
    assert (before.steal, before.total) == (35, 1000) and stolen_share(before, after) == round(135 / 1000, 4)
    assert cpu_times(str(tmp_path / "missing")) == (before.__class__(0, 0))
    assert stolen_share(after, after) == 0.0
