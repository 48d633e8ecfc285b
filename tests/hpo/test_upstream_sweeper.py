"""hydra-optuna-sweeper's own tests, adapted to ``hydra/sweeper=lds_optuna`` (a config that only swaps the sweeper).

Each test names the upstream test it comes from (hydra repository,
``plugins/hydra_optuna_sweeper/tests/test_optuna_sweeper_plugin.py``). Changes beyond the sweeper's name:
Optuna >= 4 distribution classes (``IntDistribution`` for ``IntUniformDistribution``...); the example apps are
functions of this module run in-process with Hydra's own sweep runner; where our behaviour deliberately differs
(docs/hpo.md, "Differences from hydra-optuna-sweeper") the test asserts ours and says so.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.test_utils.test_utils import TSweepRunner
from omegaconf import DictConfig
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

from hydra_plugins.lightning_deepseek_sweeper.lds_optuna_sweeper import LdsOptunaSweeper
from lightning_deepseek.hpo import build_space
from lightning_deepseek.hpo.space import distribution_from_config, distribution_of, parse_overrides


def sphere(cfg: DictConfig) -> float:
    if cfg.get("error", False):
        raise RuntimeError("cfg.error is True")
    return cfg.x**2 + cfg.y**2


def binh_and_korn(cfg: DictConfig) -> tuple[float, float]:
    return 4 * cfg.x**2 + 4 * cfg.y**2, (cfg.x - 5) ** 2 + (cfg.y - 5) ** 2


def multi_dimensional_sphere(cfg: DictConfig) -> float:
    return cfg.w**2 + cfg.x**2 + cfg.y**2 + cfg.z**2


def configure(cfg: DictConfig, trial: optuna.Trial) -> None:
    """The custom search space of upstream's example: ``z`` near the sampled ``x``, and a new key ``+w``."""
    x = trial.params["x"]
    trial.suggest_float("z", x - cfg.max_z_difference_from_x, x + cfg.max_z_difference_from_x)
    trial.suggest_float("+w", 0.0, 1.0)


def _sweep(runner: TSweepRunner, tmp_path: Path, config_name: str, task: Any, *overrides: str) -> dict[str, Any]:
    """Run the sweep in-process; return ``optimization_results.yaml`` and the study (upstream's reads)."""
    storage = f"sqlite:///{tmp_path / 'test.db'}"
    sweep = runner(calling_file=__file__, calling_module=None, task_function=task, config_path="conf_upstream",
                   config_name=config_name, temp_dir=tmp_path / "sweep",
                   overrides=[f"hydra.sweeper.storage={storage}", "hydra.job.chdir=True", *overrides])
    with sweep:
        results = yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())
        study = sweep.returns
    return {"results": results, "study": study}


def test_discovery() -> None:  # upstream: test_discovery
    assert LdsOptunaSweeper.__name__ in [x.__name__ for x in Plugins.instance().discover(Sweeper)]


def _check_distribution(expected: BaseDistribution, actual: BaseDistribution) -> None:
    if not isinstance(expected, CategoricalDistribution):
        assert expected == actual
        return
    assert isinstance(actual, CategoricalDistribution)
    assert set(expected.choices) == set(actual.choices)  # shuffle() randomises the order


@pytest.mark.parametrize(("entry", "expected"), [
    ({"type": "categorical", "choices": [1, 2, 3]}, CategoricalDistribution([1, 2, 3])),
    ({"type": "int", "low": 0, "high": 10}, IntDistribution(0, 10)),
    ({"type": "int", "low": 0, "high": 10, "step": 2}, IntDistribution(0, 10, step=2)),
    ({"type": "int", "low": 0, "high": 5}, IntDistribution(0, 5)),
    ({"type": "int", "low": 1, "high": 100, "log": True}, IntDistribution(1, 100, log=True)),
    ({"type": "float", "low": 0, "high": 1}, FloatDistribution(0, 1)),
    ({"type": "float", "low": 0, "high": 10, "step": 2}, FloatDistribution(0, 10, step=2)),
    ({"type": "float", "low": 1, "high": 100, "log": True}, FloatDistribution(1, 100, log=True)),
])
def test_create_optuna_distribution_from_config(entry: dict[str, Any], expected: BaseDistribution) -> None:
    # upstream: test_create_optuna_distribution_from_config (the deprecated hydra.sweeper.search_space form)
    _check_distribution(expected, distribution_from_config("key", entry))


@pytest.mark.parametrize(("override", "expected"), [
    ("key=choice(1,2)", CategoricalDistribution([1, 2])),
    ("key=choice(true, false)", CategoricalDistribution([True, False])),
    ("key=choice('hello', 'world')", CategoricalDistribution(["hello", "world"])),
    ("key=shuffle(range(1,3))", CategoricalDistribution((1, 2))),
    ("key=range(1,3)", IntDistribution(1, 3)),
    ("key=interval(1, 5)", FloatDistribution(1, 5)),
    ("key=int(interval(1, 5))", IntDistribution(1, 5)),
    ("key=tag(log, interval(1, 5))", FloatDistribution(1, 5, log=True)),
    ("key=tag(log, int(interval(1, 5)))", IntDistribution(1, 5, log=True)),
    ("key=range(0.5, 5.5, step=1)", FloatDistribution(0.5, 5.5, step=1)),
])
def test_create_optuna_distribution_from_override(override: str, expected: BaseDistribution) -> None:
    # upstream: test_create_optuna_distribution_from_override
    _check_distribution(expected, distribution_of(parse_overrides([override])[0]))


@pytest.mark.parametrize(("overrides", "expected"), [
    (["key=choice(1,2)"], ({"key": CategoricalDistribution([1, 2])}, [])),
    (["key=5"], ({}, ["key=5"])),
    (["key1=choice(1,2)", "key2=5"], ({"key1": CategoricalDistribution([1, 2])}, ["key2=5"])),
    (["key1=choice(1,2)", "key2=5", "key3=range(1,3)"],
     ({"key1": CategoricalDistribution([1, 2]), "key3": IntDistribution(1, 3)}, ["key2=5"])),
])
def test_create_params_from_overrides(overrides: list[str], expected: tuple[Any, Any]) -> None:
    # upstream: test_create_params_from_overrides (fixed values come back as override strings, not a dict)
    space, fixed = build_space(None, overrides)
    assert (space, fixed) == expected


def test_launch_jobs(hydra_sweep_runner: TSweepRunner, tmp_path: Path) -> None:
    # upstream: test_launch_jobs, on Hydra's own test app, which has no `hpo` group (no pruning is attached and
    # nothing fails with "Could not override 'hpo'"). Upstream sweeps an empty space; ours calls that an error,
    # so one parameter is searched. n_jobs=3 on the basic launcher runs sequentially (with a warning).
    sweep = hydra_sweep_runner(calling_file=None, calling_module="hydra.test_utils.a_module", config_path="configs",
                               config_name="compose.yaml", task_function=None, temp_dir=tmp_path,
                               overrides=["hydra/sweeper=lds_optuna", "hydra/launcher=basic",
                                          "hydra.sweeper.n_trials=8", "hydra.sweeper.n_jobs=3", "+k=choice(1,2)"])
    with sweep:
        study = sweep.returns
        assert [t.value for t in study.trials] == [100.0] * 8


@pytest.mark.parametrize("with_commandline", [True, False])
def test_optuna_example(hydra_sweep_runner: TSweepRunner, tmp_path: Path, with_commandline: bool) -> None:
    # upstream: test_optuna_example
    extra = ["x=choice(0, 1, 2)", "y=0"] if with_commandline else []
    out = _sweep(hydra_sweep_runner, tmp_path, "sphere", sphere, "hydra.sweeper.study_name=test-optuna-example",
                 "hydra/sweeper/sampler=tpe", "hydra.sweeper.sampler.seed=123", "~z", *extra)
    returns, best_trial = out["results"], out["study"].best_trial
    assert returns["name"] == "optuna"
    assert returns["best_params"]["x"] == best_trial.params["x"]
    if with_commandline:
        assert "y" not in returns["best_params"] and "y" not in best_trial.params
    else:
        assert returns["best_params"]["y"] == best_trial.params["y"]
    assert returns["best_value"] == best_trial.value
    assert returns["best_value"] <= 2.27  # upstream's threshold for TPE on this space


@pytest.mark.parametrize("num_trials", [20, 1])
def test_example_with_grid_sampler(hydra_sweep_runner: TSweepRunner, tmp_path: Path, num_trials: int,
                                   caplog: pytest.LogCaptureFixture) -> None:
    # upstream: test_example_with_grid_sampler. Difference: range(-1.0, 1.0, step=1) is {-1, 0, 1} for the grid as
    # for every other sampler (upstream's grid alone drops 1.0), so the grid has 12 points; warned at start.
    with caplog.at_level(logging.WARNING):
        out = _sweep(hydra_sweep_runner, tmp_path, "grid", sphere, f"hydra.sweeper.n_trials={num_trials}",
                     "hydra.job.chdir=False")
    returns = out["results"]
    bv, bx, by, bz = (returns["best_value"], returns["best_params"]["x"], returns["best_params"]["y"],
                      returns["best_params"]["z"])
    if num_trials >= 12:
        assert len(out["study"].trials) == 12  # the whole grid, then the sweep stops
        assert bv == 1 and abs(bx) == 1 and by == 0
    else:
        assert bx in [-1, 1] and by in [-1, 0, 1]
    assert bz in ["foo", "bar"]
    assert "with the grid sampler, range(...) includes stop" in caplog.text
    assert "experiment_sequence is ignored" in caplog.text


def _dominates(a: list[float], b: list[float]) -> bool:
    return all(x <= y for x, y in zip(a, b)) and any(x < y for x, y in zip(a, b))


@pytest.mark.parametrize("with_commandline", [True, False])
def test_optuna_multi_objective_example(hydra_sweep_runner: TSweepRunner, tmp_path: Path,
                                        with_commandline: bool) -> None:
    # upstream: test_optuna_multi_objective_example (upstream's _dominates compares the rows' dict keys; this one
    # compares their values, as intended). The Pareto front is also in best_params.yaml.
    extra = ["x=range(0, 5)", "y=range(0, 3)"] if with_commandline else []
    out = _sweep(hydra_sweep_runner, tmp_path, "multi_objective", binh_and_korn, "hydra.sweeper.n_trials=20",
                 "hydra/sweeper/sampler=random", "hydra.sweeper.sampler.seed=123", *extra)
    returns = out["results"]
    assert returns["name"] == "optuna" and returns["solutions"]
    fractions = {0} if with_commandline else {0, 0.5}
    for row in returns["solutions"]:
        assert row["params"]["x"] % 1 in fractions and row["params"]["y"] % 1 in fractions
        assert not any(_dominates(other["values"], row["values"]) for other in returns["solutions"])
    assert len(returns["solutions"]) == len(out["study"].best_trials)


def test_optuna_custom_search_space_example(hydra_sweep_runner: TSweepRunner, tmp_path: Path) -> None:
    # upstream: test_optuna_custom_search_space_example
    max_z_difference_from_x = 0.3
    out = _sweep(hydra_sweep_runner, tmp_path, "custom_search_space", multi_dimensional_sphere,
                 "hydra.sweeper.n_trials=20", "hydra/sweeper/sampler=random", "hydra.sweeper.sampler.seed=123",
                 f"max_z_difference_from_x={max_z_difference_from_x}")
    returns = out["results"]
    assert returns["name"] == "optuna"
    assert abs(returns["best_params"]["x"] - returns["best_params"]["z"]) <= max_z_difference_from_x
    assert 0 <= returns["best_params"]["+w"] <= 1


def _sweeper(search_space: dict[str, Any] | None, params: dict[str, Any] | None) -> LdsOptunaSweeper:
    return LdsOptunaSweeper(sampler=None, pruner=None, direction="minimize", study_name="test", storage=None,
                            n_trials=1, n_jobs=1, max_failure_rate=0.0, params=params, pruning_group=None,
                            search_space=search_space)


@pytest.mark.parametrize(("search_space", "params", "message"), [
    (None, None, None),
    ({"x": {"type": "int", "low": 0, "high": 3}}, {"x": "choice(1, 2)"},
     "both hydra.sweeper.params and hydra.sweeper.search_space are set"),
    ({"x": {"type": "int", "low": 0, "high": 3}}, None, "hydra.sweeper.search_space is deprecated"),
    (None, {"x": "choice(1, 2)"}, None),
])
def test_warnings(search_space: dict[str, Any] | None, params: dict[str, Any] | None, message: str | None,
                  caplog: pytest.LogCaptureFixture) -> None:
    # upstream: test_warnings (Python warnings there, log warnings at sweep start here; empty dicts count as unset)
    with caplog.at_level(logging.WARNING):
        space = _sweeper(search_space, params)._deprecated_search_space()
    if message is None:
        assert not caplog.records and space == {}
    else:
        assert message in caplog.text
        assert space == ({} if params else {"x": IntDistribution(0, 3)})


@pytest.mark.parametrize("max_failure_rate", [0.5, 1.0])
def test_failure_rate(hydra_sweep_runner: TSweepRunner, tmp_path: Path, max_failure_rate: float,
                      capsys: pytest.CaptureFixture[str]) -> None:
    # upstream: test_failure_rate. Upstream lets the job's RuntimeError escape with its traceback; ours exits 2
    # with one paragraph (the sweep's user-error contract) naming the setting; the error is each trial's reason.
    args = ["hydra.sweeper.n_trials=20", "hydra.sweeper.n_jobs=2", "hydra/sweeper/sampler=random",
            "hydra.sweeper.sampler.seed=123", f"hydra.sweeper.max_failure_rate={max_failure_rate}", "+error=true"]
    if max_failure_rate < 1.0:
        with pytest.raises(SystemExit) as info:
            _sweep(hydra_sweep_runner, tmp_path, "sphere", sphere, *args)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "trial 0 FAIL: RuntimeError: cfg.error is True" in err
        assert "1 of 1 finished trials failed, more than hydra.sweeper.max_failure_rate=0.5" in err
    else:
        out = _sweep(hydra_sweep_runner, tmp_path, "sphere", sphere, *args)
        assert out["results"] == {"name": "optuna"}  # no trial completed: no best trial
        assert [t.user_attrs["fail_reason"] for t in out["study"].trials] == ["cfg.error is True"] * 20
