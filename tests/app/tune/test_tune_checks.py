"""``tune``: candidates, forced settings, the choice rule and every bad input (no processes started)."""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from lightning_deepseek.app.errors import user_errors_exit
from lightning_deepseek.app.run import CONFIG_DIR, RunFolder
from lightning_deepseek.app.training import prepare_training
from lightning_deepseek.app.tune import (
    PLAIN_DDP,
    Configuration,
    check_tune,
    check_tune_option,
    choose,
    configurations,
    forced_settings,
)
from lightning_deepseek.app.tune.checks import nothing_to_choose
from lightning_deepseek.app.tune.table import Calibration, Row


def _cfg(*overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("train", overrides=["model=tiny", "trainer.devices=2", *overrides])


def test_candidates_start_with_plain_ddp() -> None:
    found = configurations(_cfg("tune=quick"), forced=[])
    assert found[0] == PLAIN_DDP
    assert [c.name for c in found] == ["ddp/none", "ddp/int8", "ddp/int4", "hybrid/tp2/none", "hybrid/tp2/int8",
                                       "hybrid/tp2/int4"]
    four = configurations(_cfg("tune=grid", "trainer.devices=4", "allow_oversubscribe=true"), forced=[])
    assert {"hybrid/tp2/int8/bucket1", "hybrid/tp4/none", "ddp/int4/bucket100"} <= {c.name for c in four}
    moe = configurations(_cfg("tune=quick", "model=moe-tiny"), forced=[], experts=8)
    assert {"hybrid/tp1/ep2/none", "hybrid/tp2/ep1/none", "hybrid/tp2/ep2/none"} <= {c.name for c in moe}
    assert "hybrid/tp1/ep1/none" not in {c.name for c in moe}


def test_forced_settings_come_from_the_command_line_and_tune_keep() -> None:
    cfg = _cfg("tune=quick", "tune.keep=[bucket_cap_mb]")
    forced = forced_settings(cfg, ["compression=int8", "strategy.tensor_parallel_size=2", "model=tiny"])
    assert forced == ["tensor_parallel_size", "compression", "bucket_cap_mb"]
    found = configurations(_cfg("tune=quick", "compression=int8"), forced=["compression"])
    assert [c.name for c in found] == ["ddp/int8", "hybrid/tp2/int8"]


def test_hybrid_candidates_are_placed_by_the_runs_own_micro_batch() -> None:
    # Without it a fixed tp size places by 2048 tokens (placement.py's default): on the 1 Gbit testbed the wide-FFN
    # model's tp=2 then ran inside a node at 437 ms a step instead of across nodes at 238 ms (benchmarks/autotune).
    found = configurations(_cfg("tune=quick", "model=wide-ffn", "data.batch_size=2"), forced=[])
    assert {c.micro_batch_tokens for c in found if c.strategy == "hybrid"} == {2 * 16}
    assert all(c.micro_batch_tokens is None for c in found if c.strategy == "ddp")
    assert "strategy.micro_batch_tokens=32" in found[-1].overrides() and found[-1].name == "hybrid/tp2/int4"
    block = configurations(_cfg("tune=quick", "data.block_size=32"), forced=[])[-1]
    assert block.micro_batch_tokens == 16 * 32  # data.block_size, where set, over the model's
    own = configurations(_cfg("tune=quick", "strategy=hybrid", "strategy.micro_batch_tokens=100"), forced=[])[-1]
    assert own.micro_batch_tokens == 100  # the run's own setting is kept


def test_apply_gives_the_config_a_direct_run_with_the_overrides_composes() -> None:
    candidate = Configuration("hybrid", 2, None, "int8", 5, 32)
    applied = candidate.apply(_cfg("tune=quick"))
    direct = _cfg(*candidate.overrides(), "tune=quick")
    assert applied.strategy == direct.strategy and applied.compression == direct.compression
    assert _cfg().strategy != applied.strategy  # apply copies: the run's own config is unchanged


def _row(name: str, tps: float | None, state: str = "measured") -> Row:
    strategy, *rest = name.split("/")
    tp = int(rest.pop(0)[2:]) if strategy == "hybrid" else None
    return Row(Configuration(strategy, tp, None, rest[0]), state, tps)


def test_choice_is_the_fastest_measured_unless_plain_ddp_is_within_min_gain() -> None:
    rows = [_row("ddp/none", 1000.0), _row("ddp/int8", 1020.0), _row("hybrid/tp2/none", 900.0),
            _row("ddp/int4", 5000.0, "pruned")]
    eligible = [r.candidate for r in rows]
    assert choose(rows, eligible, min_gain=0.0).candidate.name == "ddp/int8"
    assert choose(rows, eligible, min_gain=0.03).candidate.name == "ddp/none"  # 2% is within noise: keep the baseline
    # Plain DDP measured only as the reference (compression forced): never chosen, still the ratio's base.
    assert choose(rows, eligible[1:], min_gain=0.03).candidate.name == "ddp/int8"
    table = Calibration("quick", rows, rows[1].candidate, 3.0, kept="compression=int8", min_gain=0.03)
    assert "1.02x" in table.table() and "kept as set (forced): compression=int8" in table.table()
    assert table.summary()["tune_vs_plain_ddp"] == 1.02
    with pytest.raises(RuntimeError, match="no configuration could be measured"):
        choose([_row("ddp/none", None, "failed")], [PLAIN_DDP], 0.0)


def test_staged_search_compresses_only_the_layouts_measured_to_the_end() -> None:
    from lightning_deepseek.app.tune.calibrate import Calibrator

    order = configurations(_cfg("tune=quick", "trainer.devices=4", "allow_oversubscribe=true"), forced=[])
    calibrator = Calibrator(None, None, None, order, order)
    assert calibrator.first_stage(staged=False) == [c.name for c in order]
    assert calibrator.first_stage(staged=True) == ["ddp/none", "hybrid/tp2/none", "hybrid/tp4/none"]
    for row in (_row("ddp/none", 1000.0), _row("hybrid/tp2/none", 700.0, "pruned"), _row("hybrid/tp4/none", None,
                                                                                          "failed")):
        calibrator.results[row.candidate.name] = row
    assert calibrator.second_stage() == ["ddp/int8", "ddp/int4"]
    skipped = calibrator.results["hybrid/tp2/int8"]
    assert skipped.state == "skipped" and skipped.note == "hybrid/tp2/none pruned"
    assert calibrator.results["hybrid/tp4/int4"].note == "hybrid/tp4/none failed"
    # A further round only when it could change the choice: two candidates that can be chosen are left.
    calibrator.results["ddp/int8"] = _row("ddp/int8", 900.0, "pruned")
    calibrator.results["ddp/int4"] = _row("ddp/int4", 800.0, "pruned")
    assert calibrator.next_round(best=1, min_gain=0.03) == []
    calibrator.results["ddp/int4"] = _row("ddp/int4", 1020.0)  # measured, but within min_gain: DDP stays
    assert calibrator.next_round(best=1, min_gain=0.03) == []
    assert calibrator.next_round(best=None, min_gain=0.03) == ["ddp/none", "ddp/int4"]  # grid: every one again
    assert calibrator.next_round(best=1, min_gain=0.0) == ["ddp/none", "ddp/int4"]  # the choice would change
    # Compression forced: plain DDP is the reference only; the first stage still holds each layout's first.
    forced = configurations(_cfg("tune=quick", "compression=int8", "tune.bucket_cap_mb=[null,1]"), ["compression"])
    staged = Calibrator(None, None, None, [PLAIN_DDP, *forced], forced)
    assert staged.first_stage(staged=True) == ["ddp/none", "ddp/int8", "hybrid/tp2/int8"]
    table = Calibration("quick", [_row("ddp/none", 1000.0), Row(order[1], "skipped", note="x")], PLAIN_DDP, 2.0)
    assert table.summary()["tune_candidates"] == "1 measured, 1 skipped of 2"


@pytest.mark.parametrize("overrides, needle", [
    (["tune=quick", "trainer.devices=1"], "tune=quick compares multi-process configurations, but this run has one "
                                          "process (trainer.devices=1, trainer.num_nodes=1)"),
    (["tune=quick", "tune.keep=[strategy,compression]"], "tune=quick has nothing to choose from: the run keeps "
                                                         "strategy=hybrid, compression=int8"),
    (["tune=quick", "tune.mode=fast"], "tune.mode='fast' is not a calibration mode"),
    (["tune=quick", "tune.steps=0"], "tune.steps=0 is not valid"),
    (["tune=quick", "tune.compressions=[int3]"], "tune.compressions=['int3'] is not valid"),
    (["tune=quick", "tune.keep=[lr]"], "tune.keep=['lr'] names ['lr'], which calibration does not choose"),
    (["tune=quick", "tune.staged=maybe"], "tune.staged=maybe is not valid: it must be true or false"),
    (["tune=quick", "tune.noise_margin=-1"], "tune.noise_margin=-1 is not valid: it must be a number >= 0"),
    (["tune=quick", "tune.paired_margin=-2"], "tune.paired_margin=-2 is not valid: it must be a number >= 0"),
    (["tune=quick", "tune.budget=5"], "tune.budget=5 is not valid: it must be a number >= 0 and < 1"),
    (["tune=quick", "tune.planned_steps=0"], "tune.planned_steps=0 is not valid: it must be a whole number >= 1"),
])
def test_bad_tune_setting_is_one_paragraph_and_exit_2(overrides: list[str], needle: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _cfg(*overrides, f"run_dir={tmp_path / 'run'}")
    folder = RunFolder(tmp_path / "run", named_by_hydra=False)
    with pytest.raises(SystemExit) as exited:
        user_errors_exit()(prepare_training)(cfg, folder)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("lds-train: error: ") == 1
    assert needle in " ".join(err.split()), err


def test_tune_auto_trains_as_configured_where_there_is_nothing_to_choose() -> None:
    one = _cfg("tune=auto", "trainer.devices=1")
    kept = _cfg("tune=auto", "strategy=ddp", "compression=none", "tune.keep=[strategy,compression]")
    for cfg, why in ((one, "this run has one process"), (kept, "has nothing to choose from")):
        check_tune(cfg)  # no error: tune=quick and tune=grid raise here (above)
        assert why in nothing_to_choose(cfg)
    assert nothing_to_choose(_cfg("tune=auto")) is None  # the demo's settings: a calibration


def test_unknown_tune_option_on_the_command_line_names_the_options() -> None:
    with pytest.raises(ValueError, match=r"tune='fast' is not a calibration mode. Use one of auto, grid, none, quick"):
        check_tune_option(["model=tiny", "tune=fast"])
    check_tune_option(["tune=quick", "tune.steps=2"])  # known options and keys pass


def test_a_resumed_run_keeps_the_choice_its_run_folder_recorded(tmp_path: Path) -> None:
    from dataclasses import asdict

    from lightning_deepseek.app.tune.calibrate import _resumed_choice

    choice = Configuration("ddp", None, None, "int4", 1)
    (tmp_path / "tune.json").write_text(json.dumps({"choice_fields": asdict(choice)}))
    resumed = _resumed_choice(_cfg("tune=auto"), tmp_path / "checkpoints" / "last.ckpt", is_launcher=False)
    assert resumed.strategy == _cfg(*choice.overrides()).strategy
    assert resumed.compression.callback.bits == 4 and resumed.callbacks.tune_report.rows.tune_choice.endswith(
        "(resumed)")
    untuned = _cfg("tune=auto")  # a run folder without tune.json: the settings as given
    other = tmp_path / "other" / "run" / "checkpoints" / "last.ckpt"
    assert _resumed_choice(untuned, other, is_launcher=False) is untuned
