"""The trial loop and ``search`` (Python API): asynchronous slots, resume, FAIL handling, reports."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from lightning_deepseek.hpo import (
    FatalTrialError,
    SearchSpaceError,
    SweepFailedError,
    SweepOutcome,
    pareto_front,
    run_trials,
    search,
    sweep_failure,
)
from lightning_deepseek.hpo.space import build_space

EMPTY = {state.name: 0 for state in TrialState}


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
    outcome = run_trials(study, space, objective, n_trials=4, n_jobs=2)
    assert outcome == SweepOutcome(counts={**EMPTY, "COMPLETE": 4}, num_finished=4, num_failed=0, aborted=False,
                                   fatal_trial=None)
    trial0, trial3 = study.trials[0], study.trials[3]
    assert trial3.datetime_start < trial0.datetime_complete  # a slot refilled while trial 0 still ran


def test_pruned_objective_is_marked_pruned() -> None:
    def objective(trial: optuna.Trial, params: dict[str, Any]) -> float:
        trial.report(5.0, step=1)
        raise optuna.TrialPruned("too slow")

    study = search(objective, {"x": "interval(0, 1)"}, n_trials=2)
    assert [t.state for t in study.trials] == [TrialState.PRUNED, TrialState.PRUNED]


def test_trial_lines_carry_the_callers_tag(capsys: pytest.CaptureFixture[str]) -> None:
    # The sweeper's lines say [hpo]; lds-train's calibration runs the same loop and says [tune].
    space, _ = build_space({"x": "interval(0, 1)"})
    for prefix in ("hpo", "tune"):
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
        run_trials(study, space, quadratic, n_trials=1, log_prefix=prefix)
        assert capsys.readouterr().err.startswith(f"[{prefix}] trial 0 COMPLETE value=")


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

    with pytest.raises(SweepFailedError, match=r"^stopped the sweep after trial 0: data.path='/no/such' does not "
                                               r"exist. No further trial was started; fix the cause, then call "
                                               r"search\(\) again on the same storage to resume.$"):
        search(objective, {"x": "interval(0, 1)"}, n_trials=5, max_failure_rate=1.0)
    assert calls == [0]


def _failing_on(numbers: set[int]):
    def objective(trial: optuna.Trial, params: dict[str, Any]) -> float:
        if trial.number in numbers:
            raise RuntimeError(f"trial {trial.number} crashed")
        return 1.0
    return objective


def test_failure_rate_is_the_failed_fraction_of_finished_trials_as_upstream() -> None:
    space = {"x": optuna.distributions.FloatDistribution(0, 1)}
    # Adapted from hydra-optuna-sweeper's test_failure_rate: 1.0 never aborts, even when every trial fails, and
    # failed trials use up the budget (the loop ends after n_trials).
    study = optuna.create_study()
    outcome = run_trials(study, space, _failing_on(set(range(5))), n_trials=5, max_failure_rate=1.0)
    assert outcome == SweepOutcome({**EMPTY, "FAIL": 5}, num_finished=5, num_failed=5, aborted=False, fatal_trial=None)
    assert sweep_failure(outcome, study, max_failure_rate=1.0, setting_prefix="", resume_hint="x") is None
    # 0.5: every second trial failing stays at 1/2, never above; upstream's n_jobs=1 batches see the same.
    outcome = run_trials(optuna.create_study(), space, _failing_on({1, 3}), n_trials=5, max_failure_rate=0.5)
    assert not outcome.aborted and outcome.num_failed == 2 and outcome.counts["COMPLETE"] == 3
    # A first trial that fails is 1/1 > 0.5: nothing more starts, and the error says why.
    study = optuna.create_study()
    outcome = run_trials(study, space, _failing_on({0}), n_trials=5, max_failure_rate=0.5)
    assert outcome == SweepOutcome({**EMPTY, "FAIL": 1}, num_finished=1, num_failed=1, aborted=True, fatal_trial=None)
    error = sweep_failure(outcome, study, max_failure_rate=0.5, setting_prefix="hydra.sweeper.", resume_hint="retry")
    assert str(error) == ("1 of 1 finished trials failed, more than hydra.sweeper.max_failure_rate=0.5; see each "
                          "trial's fail_reason (trials.csv), fix the cause, then retry to resume.")


def test_fatal_trial_is_in_the_outcome_and_the_error_names_it() -> None:
    def objective(trial: optuna.Trial, params: dict[str, Any]) -> float:
        raise FatalTrialError("no such file")

    study = optuna.create_study()
    outcome = run_trials(study, {"x": optuna.distributions.FloatDistribution(0, 1)}, objective, n_trials=3,
                         max_failure_rate=1.0)
    assert outcome.fatal_trial == 0 and outcome.failed and not outcome.aborted and outcome.num_finished == 1
    error = sweep_failure(outcome, study, max_failure_rate=1.0, setting_prefix="", resume_hint="retry",
                          fatal_why="Every trial would repeat it.")
    assert str(error) == ("stopped the sweep after trial 0: no such file. Every trial would repeat it. No further "
                          "trial was started; fix the cause, then retry to resume.")


def _dominates(a: list[float], b: list[float]) -> bool:
    return all(x <= y for x, y in zip(a, b)) and any(x < y for x, y in zip(a, b))


def test_multi_objective_search_reports_the_pareto_front(tmp_path: Path) -> None:
    def objective(trial: optuna.Trial, params: dict[str, Any]) -> list[float]:
        return [params["x"] ** 2, (params["x"] - 2) ** 2 + params["y"]]

    study = search(objective, {"x": "interval(0, 2)", "y": "range(0, 3)"}, n_trials=12,
                   direction=["minimize", "minimize"], output_dir=tmp_path,
                   sampler={"_target_": "optuna.samplers.RandomSampler", "seed": 0})
    report = yaml.safe_load((tmp_path / "best_params.yaml").read_text())
    front = report["pareto_front"]
    assert report["directions"] == ["minimize", "minimize"] and front == pareto_front(study)
    # The front is exactly the trials that no other trial dominates (checked by brute force).
    undominated = {t.number for t in study.trials if not any(_dominates(o.values, t.values) for o in study.trials)}
    assert {row["number"] for row in front} == undominated and len(front) >= 2
    # hydra-optuna-sweeper's results file, so scripts written for it read ours.
    results = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    assert results == {"name": "optuna", "solutions": [{"params": r["params"], "values": r["values"]} for r in front]}
    header = (tmp_path / "trials.csv").read_text().splitlines()[0].split(",")
    assert header[:4] == ["number", "state", "value_0", "value_1"]
    assert (tmp_path / "pareto_front.png").read_bytes()[:4] == b"\x89PNG"
    # A single value where two are expected is a FAIL that says what to return.
    study = search(lambda trial, params: 1.0, {"x": "interval(0, 2)"}, n_trials=1, max_failure_rate=1.0,
                   direction=["minimize", "maximize"])
    assert "this study has 2 objectives" in study.trials[0].user_attrs["fail_reason"]


def test_no_raw_warning_escapes_the_report(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # Optuna marks its matplotlib plots experimental (a Python warning, raised as an error here if it escaped) and
    # logs warnings of its own while plotting; the report turns those into `hpo:` lines.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any Python warning that escaped the report would fail here
        search(quadratic, {"x": "interval(-10, 10)"}, n_trials=3, output_dir=tmp_path,
               sampler={"_target_": "optuna.samplers.RandomSampler", "seed": 0})
    out, err = capfd.readouterr()
    assert "[W " not in out + err and "Warning" not in err  # no Optuna log warning, no warnings-module line
    plots = sorted(p.name for p in tmp_path.glob("*.png"))
    if "hpo: skipped param_importances.png: Tried to import 'sklearn'" in out:  # Optuna 4 without scikit-learn
        plots.append("param_importances.png")
    assert plots == ["optimization_history.png", "param_importances.png"]
