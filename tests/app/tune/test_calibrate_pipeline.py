"""``tune`` with a pipeline (``strategy.pipeline_parallel_size`` > 1): the calibration keeps the pipeline, which
leaves it one configuration (hybrid, uncompressed), so ``tune=auto`` trains with it and says why in one line; the
settings a pipeline refuses, where the run keeps them, end in one paragraph and exit 2 before any process starts."""

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from lightning_deepseek.app.errors import user_errors_exit
from lightning_deepseek.app.run import CONFIG_DIR, RunFolder
from lightning_deepseek.app.training import prepare_training
from lightning_deepseek.app.tune import Configuration, check_tune, configurations
from lightning_deepseek.app.tune.checks import nothing_to_choose
from tests.app.tune.test_calibrate import _train
from tests.helpers import run_distributed

PIPELINE = "strategy.pipeline_parallel_size=2"


def _cfg(*overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("train", overrides=["model=tiny", "trainer.devices=2", *overrides])


def test_a_pipeline_leaves_one_configuration_hybrid_uncompressed() -> None:
    for cfg in (_cfg(PIPELINE), _cfg(PIPELINE, "tune=grid", "model=moe-tiny")):
        assert configurations(cfg, forced=[], experts=4) == [Configuration("hybrid", compression="none")]
    cfg = _cfg(PIPELINE)  # the default tune=auto and compression=int8: no error, the calibration drops int8
    check_tune(cfg)
    check_tune(_cfg(PIPELINE, "tune=none", "strategy.shard_optimizer_states=true"))  # int8 and ZeRO-1 kept: trained
    why = nothing_to_choose(cfg)
    assert "has nothing to choose from: a pipeline (strategy.pipeline_parallel_size=2) is kept" in why
    assert len(configurations(_cfg(), forced=[])) == 6 and nothing_to_choose(_cfg()) is None  # the demo: unchanged


@pytest.mark.parametrize("overrides, needle", [
    (["tune.keep=[compression]"], "compression=int8 (kept on the command line or in tune.keep) with "
                                  "strategy.pipeline_parallel_size=2 and tune=auto: the calibration of a pipeline has "
                                  "one configuration, uncompressed. Pass tune=none"),
    (["trainer.devices=1"], "strategy.pipeline_parallel_size=2 does not divide the run's 1 process(es)"),
    (["strategy.tensor_parallel_size=2"], "strategy.pipeline_parallel_size=2 x strategy.tensor_parallel_size=2 "
                                          "does not divide the run's 2 process(es)"),
    (["trainer.devices=4", "allow_oversubscribe=true", "strategy.tensor_parallel_size=2",
      "strategy.expert_parallel_size=2"],
     "strategy.tensor_parallel_size=2 and strategy.expert_parallel_size=2 with strategy.pipeline_parallel_size=2 is "
     "not supported"),
    (["tune=quick"], "tune=quick has nothing to choose from: a pipeline (strategy.pipeline_parallel_size=2)"),
])
def test_a_setting_a_pipeline_refuses_is_one_paragraph_and_exit_2(overrides: list[str], needle: str, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _cfg(PIPELINE, *overrides, f"run_dir={tmp_path / 'run'}")
    with pytest.raises(SystemExit) as exited:
        user_errors_exit()(prepare_training)(cfg, RunFolder(tmp_path / "run", named_by_hydra=False))
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("lds-train: error: ") == 1
    assert needle in " ".join(err.split()), err


def test_compression_on_the_command_line_with_a_pipeline_stops_before_the_ranks_start(tmp_path: Path) -> None:
    lds_train = Path(sys.executable).parent / "lds-train"
    result = subprocess.run([str(lds_train), "model=tiny", "trainer.devices=2", PIPELINE, "compression=int8",
                             f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "lds-train: error: compression=int8 (kept on the command line or in tune.keep)" in result.stderr
    assert "Initializing distributed" not in result.stdout + result.stderr


def _pipeline_runs(rank: int, world_size: int, root: str) -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        _train([PIPELINE], Path(root) / "auto")  # the default tune=auto and compression=int8
    _train([PIPELINE, "tune=none", "compression=none"], Path(root) / "direct")
    return printed.getvalue()


def test_tune_auto_trains_a_pipeline_uncompressed_and_says_why(tmp_path: Path) -> None:
    printed = run_distributed(_pipeline_runs, 2, str(tmp_path), timeout=240)
    line = ("lds-train: tune=auto: no calibration, training with strategy=hybrid compression=none: a pipeline "
            "(strategy.pipeline_parallel_size=2) is kept as set")
    assert printed[0].count(line) == 1 and line not in printed[1]
    auto = json.loads((tmp_path / "auto" / "summary.json").read_text())
    direct = json.loads((tmp_path / "direct" / "summary.json").read_text())
    assert auto["tune_choice"] == "hybrid/none (pipeline)" and not (tmp_path / "auto" / "tune.json").exists()
    assert auto["hybrid_mesh"].endswith("(pipeline)") and "compression" not in auto  # int8 dropped
    assert auto["train_curve"] == direct["train_curve"] and len(auto["train_curve"]) == 4
    assert auto["val_curve"] == direct["val_curve"] and len(auto["val_curve"]) == 2
