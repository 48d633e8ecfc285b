"""``lds-train precision=staged``: the Hydra config builds the plugin, the run summary shows the stage timeline."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from lightning_deepseek.app.cli import CONFIG_DIR
from lightning_deepseek.app.training import run_training

TINY = ["model=tiny", "precision=staged", "trainer.devices=1", "trainer.max_steps=10", "data.batch_size=4",
        "trainer.val_check_interval=10", "trainer.limit_val_batches=2", "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false", "plot=false"]


def _train(tmp_path: Path, *overrides: str) -> dict:
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[*TINY, f"run_dir={tmp_path}", *overrides])
    return run_training(cfg)


def test_staged_config_trains_and_reports_the_stage_timeline(tmp_path, one_thread):
    report = _train(tmp_path)
    assert report["precision_schedule"] == "32-true [0,1) > 16-mixed [1,8) > bf16-mixed [8,end)"
    assert report["precision_final"] == "bf16-mixed"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["events"] == [[1, "32-true -> 16-mixed"], [8, "16-mixed -> bf16-mixed"]]
    with open(tmp_path / "logs" / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("precision/stage")]
    assert [float(row["precision/stage"]) for row in rows] == [0] * 1 + [1] * 7 + [2] * 2
    assert all(float(row["precision/loss_scale"]) > 0 for row in rows)


def test_schedule_beyond_max_steps_exits_2_with_one_paragraph(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _train(tmp_path, "precision.plugin.schedule=[{precision: 32-true, until: 50}, {precision: bf16-mixed}]")
    assert exit_info.value.code == 2
    assert "until=50 step ends at optimizer step 50, beyond the run's 10 optimizer steps" in capsys.readouterr().err


def test_fp8_config_trains_and_reports_the_converted_layers(tmp_path, one_thread):
    pytest.importorskip("torchao")
    report = _train(tmp_path, "precision=fp8", "trainer.max_steps=6", "trainer.val_check_interval=6")
    assert report["precision_schedule"] == "bf16-mixed [0,1) > fp8-mixed [1,end)"
    assert report["precision_final"] == "fp8-mixed" and report["fp8_layers"] == 8  # the tiny GPT, head excluded
