"""``lds-train -m hpo=pareto``: a multi-objective sweep (tokens/s, validation loss) of system settings and
hyper-parameters together; its report holds the Pareto front of the trials (a real sweep of a tiny model)."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import yaml

BIN = Path(sys.executable).parent


def _dominates(a: list[float], b: list[float]) -> bool:  # objectives: maximise tokens/s, minimise val loss
    return a[0] >= b[0] and a[1] <= b[1] and a != b


def test_pareto_sweep_reports_the_non_dominated_trials(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(BIN / "lds-train"), "-m", "hpo=pareto", "model=tiny", "trainer.devices=1", "trainer.max_steps=2",
         "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false",
         "plot=false", "hydra.sweeper.n_trials=2", f"hydra.sweep.dir={tmp_path}"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "trials.csv") as f:
        trials = {int(row["number"]): row for row in csv.DictReader(f)}
    assert len(trials) == 2 and {row["state"] for row in trials.values()} == {"COMPLETE"}
    values = {n: [float(row["value_0"]), float(row["value_1"])] for n, row in trials.items()}
    for number, (tokens_per_s, val_loss) in values.items():  # the objectives are the trial's run summary
        summary = json.loads((tmp_path / str(number) / "summary.json").read_text())
        assert tokens_per_s == summary["tokens_per_s"] and val_loss == summary["val_loss_final"]
        assert trials[number]["params_strategy"] in ("ddp", "hybrid")
    expected = sorted(n for n in values if not any(_dominates(values[m], values[n]) for m in values))
    report = yaml.safe_load((tmp_path / "best_params.yaml").read_text())
    assert report["directions"] == ["maximize", "minimize"]
    assert [row["number"] for row in report["pareto_front"]] == expected
    assert set(report["pareto_front"][0]["params"]) == {"strategy", "compression", "data.batch_size",
                                                        "optim.learning_rate"}
    assert (tmp_path / "pareto_front.png").read_bytes()[:4] == b"\x89PNG"
