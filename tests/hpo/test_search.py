"""The trial loop and ``search`` (Python API): asynchronous slots, resume, FAIL handling, reports."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from lightning_deepseek.hpo import FatalTrialError, SearchSpaceError, SweepFailedError, run_trials, search
from lightning_deepseek.hpo.space import build_space


def quadratic(trial: optuna.Trial, params: dict[str, Any]) -> float:
    return (params["x"] - 2.0) ** 2


def test_search_finds_the_minimum_and_writes_the_report(tmp_path: Path) -> None:
    study = search(quadratic, {"x": "interval(-10, 10)"}, n_trials=25, output_dir=tmp_path,
                   sampler={"_target_": "optuna.samplers.TPESampler", "seed": 0, "n_startup_trials": 5})
    assert abs(study.best_params["x"] - 2.0) < 1.0
    assert "best_params:" in (tmp_path / "best_params.yaml").read_text()
    assert len((tmp_path / "trials.csv").read_text().splitlines()) == 26
    assert (tmp_path / "optimization_history.png").exists()


def test_rerun_on_the_same_storage_runs_only_the_remaining_trials(tmp_path: Path) -> None:
    calls = []

    def objective(trial: optuna.Trial, params: dict[str, Any]) -> float:
        calls.append(trial.number)
        return quadratic(trial, params)

    storage = str(tmp_path / "s.journal")
    search(objective, {"x": "interval(-10, 10)"}, n_trials=3, storage=storage)
    search(objective, {"x": "interval(-10, 10)"}, n_trials=3, storage=storage)  # nothing left to do
    study = search(objective, {"x": "interval(-10, 10)"}, n_trials=5, storage=storage)
    assert calls == [0, 1, 2, 3, 4] and len(study.trials) == 5


def test_crash_is_fail_and_the_search_continues_until_the_failure_rate() -> None:
    def objective(trial: optuna.Trial, params: dict[str, Any]) -> float:
        if params["k"] == "bad":
            raise RuntimeError("out of memory")
        return 1.0

    study = search(objective, {"k": "choice(bad, good)"}, n_trials=4, max_failure_rate=1.0,
                   sampler={"_target_": "optuna.samplers.GridSampler", "seed": 0})
    failed = [t for t in study.trials if t.state == TrialState.FAIL]
    assert [t.user_attrs["fail_reason"] for t in failed] == ["out of memory"]
    assert [t.params["k"] for t in study.trials if t.state == TrialState.COMPLETE] == ["good"]
    with pytest.raises(SweepFailedError, match="max_failure_rate=0.25"):
        search(objective, {"k": "choice(bad)"}, n_trials=4, max_failure_rate=0.25)


def test_slots_refill_as_soon_as_a_trial_ends_without_a_batch_barrier() -> None:
    # Trial 0 only finishes once trial 3 has started: with batches of n_jobs=2 this could never happen.
    trial3_started = threading.Event()

    def objective(trial: optuna.Trial, params: dict[str, Any]) -> float:
        if trial.number == 0:
            assert trial3_started.wait(timeout=60), "trial 3 never started while trial 0 was running"
        if trial.number == 3:
            trial3_started.set()
        return float(trial.number)

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    space, _ = build_space({"x": "interval(0, 1)"})
    counts = run_trials(study, space, objective, n_trials=4, n_jobs=2)
    assert counts["COMPLETE"] == 4
    trial0, trial3 = study.trials[0], study.trials[3]
    assert trial3.datetime_start < trial0.datetime_complete  # a slot refilled while trial 0 still ran


def test_pruned_objective_is_marked_pruned() -> None:
    def objective(trial: optuna.Trial, params: dict[str, Any]) -> float:
        trial.report(5.0, step=1)
        raise optuna.TrialPruned("too slow")

    study = search(objective, {"x": "interval(0, 1)"}, n_trials=2)
    assert [t.state for t in study.trials] == [TrialState.PRUNED, TrialState.PRUNED]


def test_space_entries_that_are_not_search_spaces_are_rejected_by_name() -> None:
    # A plain value used to be dropped silently, and then every trial failed with KeyError('lr').
    with pytest.raises(SearchSpaceError, match=r"search\(space=\.\.\.\): 'lr': 0.01 is a float, not a search space; "
                                               r"write a sweep string .* or an Optuna distribution"):
        search(quadratic, {"x": "interval(-1, 1)", "lr": 0.01}, n_trials=1)
    with pytest.raises(SearchSpaceError, match=r"\['x=0.5'\] are fixed values, not search spaces"):
        search(quadratic, {"x": "0.5"}, n_trials=1)
    # Parse errors name this API and its entry, not the Hydra sweeper's settings.
    with pytest.raises(SearchSpaceError, match=r"^search\(space=\.\.\.\): cannot parse 'x=interval\(1e-4'") as info:
        search(quadratic, {"x": "interval(1e-4"}, n_trials=1)
    assert "hydra" not in str(info.value) and "optim.learning_rate" not in str(info.value)


def test_fatal_trial_error_stops_the_search_at_once() -> None:
    calls = []

    def objective(trial: optuna.Trial, params: dict[str, Any]) -> float:
        calls.append(trial.number)
        raise FatalTrialError("data.path='/no/such' does not exist")

    with pytest.raises(SweepFailedError, match=r"trial 0 raised FatalTrialError \(data.path='/no/such' does not "
                                               r"exist\); no further trial was started"):
        search(objective, {"x": "interval(0, 1)"}, n_trials=5, max_failure_rate=1.0)
    assert calls == [0]
