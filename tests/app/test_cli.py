"""End-to-end tests of the ``lds-train`` console script, run as real processes, and of ``lds-sample``'s code."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from lightning_deepseek.app.cli import run_sampling
from lightning_deepseek.app.run import CONFIG_DIR

BIN = Path(sys.executable).parent
TINY = ["model=tiny", "data.batch_size=8", "trainer.val_check_interval=20", "trainer.limit_val_batches=5",
        "trainer.log_every_n_steps=5", "trainer.enable_progress_bar=false", "tune=none"]


def run(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / script), *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp_path_factory.mktemp("run")
    result = run("lds-train", *TINY, "trainer.max_steps=60", "trainer.devices=2", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result


def test_two_process_training_lowers_validation_loss(trained_run) -> None:
    run_dir, result = trained_run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 60
    assert summary["val_loss_final"] < summary["val_loss_first"] < 5.6
    assert summary["tokens_per_s"] > 0
    assert "run summary" in result.stdout and "val_loss_final" in result.stdout
    # The suite's components are the defaults and report their own figures.
    # tensor_parallel_size="auto": the cost model's choice, the mesh it built, every candidate's prediction.
    tp = int(summary["autotune_choice"].split()[0].removeprefix("tp="))
    assert summary["autotune_choice"] in summary["autotune_predicted_ms"]
    assert summary["hybrid_mesh"].startswith(f"dp={2 // tp} x tp={tp}") and summary["compression"].startswith("int8")


def test_run_folder_has_plot_logs_and_checkpoint(trained_run) -> None:
    run_dir, result = trained_run
    assert (run_dir / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert (run_dir / "checkpoints" / "last.ckpt").exists()
    assert list(run_dir.glob("tokens-*.u8"))
    # Lightning's monitors and the gradient norm are columns of metrics.csv (and TensorBoard scalars).
    with open(run_dir / "logs" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert {"lr-AdamW/pg1", "grad_norm", "train/items_per_sec", "train/samples_per_sec"} <= set(rows[0])
    assert all(float(row["grad_norm"]) > 0 for row in rows if row["grad_norm"])
    assert f"TensorBoard: tensorboard --logdir {run_dir / 'tb'}" in result.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    learning_rates = [lr for _, lr in summary["lr_curve"]]
    assert learning_rates[0] < max(learning_rates) and learning_rates[-1] < max(learning_rates)  # warm-up, decay
    assert summary["checkpoint_saves"] >= 3 and summary["checkpoint_s_per_save"] > 0


def test_sample_prints_text_from_checkpoint(trained_run, capsys: pytest.CaptureFixture[str]) -> None:
    # lds-sample's own code on Hydra's compose, in this process (a fresh one would spend ~10 s importing torch):
    # tests/app/test_config_errors.py runs the console script itself.
    run_dir, _ = trained_run
    overrides = [f"ckpt={run_dir / 'checkpoints' / 'last.ckpt'}", "prompt=Python", "max_new_tokens=40"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("sample", overrides=overrides)
    run_sampling(cfg)  # a user error would exit 2
    stdout = capsys.readouterr().out
    assert stdout.startswith("Python") and len(stdout) >= 40


# Two cases as real processes, for the run folder's log; tests/app/test_config_errors.py has the whole battery
# in-process.
@pytest.mark.parametrize("args, needle", [
    (["data.path=/nonexistent/corpus.txt"], "data.path='/nonexistent/corpus.txt' does not exist"),
    (["+trainer.max_step=5"], "trainer.max_step is not an argument of Lightning's Trainer: did you mean "
                              "trainer.max_steps?"),
])
def test_bad_input_is_one_paragraph_and_exit_2(tmp_path: Path, args: list[str], needle: str) -> None:
    result = run("lds-train", *TINY, "trainer.max_steps=2", "trainer.devices=1", f"hydra.run.dir={tmp_path}", *args)
    assert result.returncode == 2
    assert f"lds-train: error: {needle}" in result.stderr or needle in result.stderr.split("lds-train: error:")[-1]
    assert "Traceback" not in result.stderr
    assert needle in (tmp_path / "cli.log").read_text()  # the run folder keeps it too (sweeps, batch jobs)


def test_unknown_group_option_lists_the_choices(tmp_path: Path) -> None:
    result = run("lds-train", "model=nope", f"hydra.run.dir={tmp_path}")
    assert result.returncode != 0
    assert "model/nope" in result.stderr and "tiny" in result.stderr

