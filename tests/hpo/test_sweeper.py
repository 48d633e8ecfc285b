"""The ``lds_optuna`` Hydra sweeper end to end: ``lds-train -m`` as real processes on tiny trials."""

from __future__ import annotations

import csv
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from hydra_plugins.lightning_deepseek_sweeper._impl import _exit_error
from lightning_deepseek.hpo import FatalTrialError, open_storage
from tests.helpers import Background

BIN = Path(sys.executable).parent
TRIAL = ["model=tiny", "model.block_size=16", "data.batch_size=4", "trainer.devices=1", "trainer.max_steps=8",
         "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "trainer.log_every_n_steps=2",
         "trainer.enable_progress_bar=false", "plot=false", "optim.warmup_steps=1", "tune=none"]


def sweep_cmd(sweep_dir: Path, *args: str) -> list[str]:
    return [str(BIN / "lds-train"), "-m", "hydra/sweeper=lds_optuna", "hydra.sweeper.sampler.seed=0",
            f"hydra.sweep.dir={sweep_dir}", *TRIAL, *args]


def load(sweep_dir: Path, name: str = "lds") -> optuna.Study:
    return optuna.load_study(study_name=name, storage=open_storage(str(sweep_dir / "optuna.journal")))


def states(study: optuna.Study) -> list[str]:
    return [t.state.name for t in study.get_trials(deepcopy=False)]


def test_sweep_prunes_then_resumes_only_the_remaining_trials(tmp_path: Path) -> None:
    cmd = sweep_cmd(tmp_path, "hydra.sweeper.n_trials=6", "optim.learning_rate=tag(log, interval(1e-5, 3e-1))")
    # First run: killed (like a lost machine) while trial 3 trains.
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "3" / ".hydra").exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        first.kill()
        first.wait(timeout=30)
    before = {t.number: t.datetime_complete for t in load(tmp_path).get_trials(deepcopy=False) if t.state.is_finished()}
    # Usually trials 0-2 are done and 3 is cut off; a trial pruned at its first report can finish before the kill
    # lands, and then the next one is the one cut off (or none had started).
    assert set(before) == set(range(len(before))) and len(before) >= 3, sorted(before)

    second = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    study = load(tmp_path)
    finished = [t for t in study.get_trials(deepcopy=False) if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(finished) == 6
    # Trials of the first run were kept as they were, not re-run; a trial cut off by the kill is FAIL.
    for number, completed_at in before.items():
        assert study.trials[number].datetime_complete == completed_at
    failed = [t for t in study.trials if t.state == TrialState.FAIL]
    assert [t.number for t in failed] in ([len(before)], [])  # the one cut off by the kill, if one was running
    assert all(t.user_attrs["fail_reason"] == "its sweeper process died" for t in failed)
    assert len(failed) == 1 or len(before) > 3  # trial 3 was running when its folder appeared: it was cut off
    assert len(study.trials) == 6 + len(failed)  # the kept ones + the cut-off one + the ones still missing
    assert {"COMPLETE", "PRUNED"} <= set(states(study))
    pruned = [t for t in study.trials if t.state == TrialState.PRUNED]
    assert all(max(t.intermediate_values) < 8 for t in pruned)  # stopped before max_steps
    # Reports of the sweep: best parameters, CSV of every trial, plots; the best trial printed.
    best = (tmp_path / "best_params.yaml").read_text()
    assert f"best_trial: {study.best_trial.number}" in best and "optim.learning_rate" in best
    rows = list(csv.DictReader((tmp_path / "trials.csv").open()))
    assert [r["state"] for r in rows] == states(study)
    assert (tmp_path / "optimization_history.png").read_bytes()[:4] == b"\x89PNG"
    assert "lds_optuna: best trial" in second.stdout
    assert (tmp_path / str(study.best_trial.number) / "summary.json").exists()


@pytest.fixture(scope="module", autouse=True)
def early(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Path, Background]]]:
    """Three of the sweeps below, started with the module: each spends ~10 s importing on one core, while the first
    test's sweeps use the other. Name -> (sweep folder, its process)."""
    sweeps = {
        # n_head=3 does not divide n_embd=64: lds-train rejects it (exit code 2) inside the job.
        "crashing": ["hydra.sweeper.n_trials=2", "hydra/sweeper/sampler=grid", "hydra/sweeper/pruner=none",
                     "hydra.sweeper.max_failure_rate=1.0", "model.n_head=choice(3,4)"],
        # hpo.monitor (a documented override, once rejected by Hydra as "not in struct") names a metric that is
        # never logged: lds-train exits 2 whatever the learning rate, so the sweep must not try 4 trials.
        "repeated_error": ["hydra.sweeper.n_trials=4", "hydra.sweeper.max_failure_rate=1.0", "hpo.monitor=val_los",
                           "optim.learning_rate=tag(log, interval(1e-4, 1e-2))"],
        "bad_sampler": ["hydra.sweeper.sampler._target_=optuna.samplers.TPESamplr",
                        "optim.learning_rate=interval(1e-4, 1e-2)"],
    }
    started = {}
    for name, args in sweeps.items():
        folder = tmp_path_factory.mktemp(name)
        started[name] = (folder / "sweep", Background(sweep_cmd(folder / "sweep", *args), folder / "logs"))
    yield started
    for _, run in started.values():
        run.kill()


def test_crashing_job_is_marked_fail_and_the_sweep_goes_on(early: dict[str, tuple[Path, Background]]) -> None:
    tmp_path, run = early["crashing"]
    result = run.finish(timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    study = load(tmp_path)
    by_head = {t.params["model.n_head"]: t for t in study.trials}
    # The error names the searched setting: it depends on the sampled value, so only this trial fails.
    reason = by_head[3].user_attrs["fail_reason"]
    assert by_head[3].state == TrialState.FAIL and reason.startswith("the job exited with code 2: ")
    assert "not divisible by model.n_head=3" in reason  # the job's own error, not only its exit code
    assert by_head[4].state == TrialState.COMPLETE
    assert "not divisible by model.n_head=3" in result.stderr


@pytest.mark.parametrize(("code", "stderr", "searched", "reason", "fatal"), [
    # lds-train's user error naming no searched setting: every trial would repeat it.
    (2, "UserWarning: slow\nlds-train: error: data.path='x' does not exist\n(set LDS_DEBUG=1 for the full traceback)\n",
     ["optim.learning_rate"], "the job exited with code 2: data.path='x' does not exist", True),
    # The same kind of error naming a searched setting depends on the sampled value.
    (2, "lds-train: error: n_embd=64 is not divisible by model.n_head=3\n", ["model.n_head"],
     "the job exited with code 2: n_embd=64 is not divisible by model.n_head=3", False),
    # A crash (exit 1) is counted as a failure; its last lines are the reason.
    (1, "Traceback (most recent call last):\n  File x\nRuntimeError: boom\n", ["a"],
     "the job exited with code 1: Traceback (most recent call last): | File x | RuntimeError: boom", False),
    # Nothing printed (e.g. a process launcher's job): only the exit code is known, never fatal.
    (2, "", ["a"], "the job exited with code 2 and printed no error (see its log)", False),
])
def test_an_exiting_job_fails_with_its_printed_error(code: int, stderr: str, searched: list[str], reason: str,
                                                     fatal: bool) -> None:
    error = _exit_error(SystemExit(code), stderr, searched)
    assert str(error) == reason and isinstance(error, FatalTrialError) == fatal


def test_a_config_error_that_every_trial_would_repeat_stops_the_sweep_at_once(
        early: dict[str, tuple[Path, Background]]) -> None:
    tmp_path, run = early["repeated_error"]  # hpo.monitor=val_los, 4 trials asked for (see ``early``)
    result = run.finish(timeout=240)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    study = load(tmp_path)
    assert states(study) == ["FAIL"]
    reason = study.trials[0].user_attrs["fail_reason"]
    assert reason.startswith("the job exited with code 2: OptunaPruning: monitor='val_los' was never logged")
    assert [r["fail_reason"] for r in csv.DictReader((tmp_path / "trials.csv").open())] == [reason]
    assert ("lds-train: error: lds_optuna: stopped the sweep after trial 0: the job exited with code 2: "
            "OptunaPruning: monitor='val_los'") in result.stderr
    assert "names none of the searched settings (optim.learning_rate)" in result.stderr


def test_bad_sampler_fails_before_any_trial_with_the_field_named(early: dict[str, tuple[Path, Background]]) -> None:
    # (Every kind of bad search-space string is covered in-process by test_space.py.)
    tmp_path, run = early["bad_sampler"]  # sampler._target_=optuna.samplers.TPESamplr (see ``early``)
    result = run.finish(timeout=120)
    assert result.returncode == 2
    assert "hydra.sweeper.sampler._target_='optuna.samplers.TPESamplr' could not be built" in result.stderr
    assert not list(tmp_path.glob("[0-9]*"))  # no trial folder: nothing was launched


def test_ddp_trials_run_in_their_folder_and_a_pruned_one_stops_on_both_ranks(tmp_path: Path) -> None:
    result = subprocess.run(
        sweep_cmd(tmp_path, "trainer.devices=2", "hydra.sweeper.n_trials=2", "hydra/sweeper/sampler=grid",
                  "hydra/sweeper/pruner=none", "hydra.sweeper.pruner._target_=optuna.pruners.ThresholdPruner",
                  "+hydra.sweeper.pruner.upper=5.0", "optim.learning_rate=choice(0.03,0.00001)"),
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    study = load(tmp_path)
    by_lr = {t.params["optim.learning_rate"]: t for t in study.trials}
    slow, fast = by_lr[0.00001], by_lr[0.03]
    # lr=1e-5 is still near ln(256) = 5.5 at the first validation: pruned there, on both ranks (a rank that
    # kept training would hang rank 0 in the next collective, and the sweep would never reach the next trial).
    assert slow.state == TrialState.PRUNED and set(slow.intermediate_values) == {2}
    assert fast.state == TrialState.COMPLETE
    for trial, steps in ((slow, 2), (fast, 8)):
        folder = tmp_path / str(trial.number)
        assert (folder / "train_ddp_process_1.log").exists()  # rank 1 ran this trial, in this trial's folder
        summary = (folder / "summary.json").read_text()
        assert f'"steps": {steps},' in summary and '"world_size": 2,' in summary
