"""Search-space syntax, sampler/pruner nodes and storage URLs: what they become, and clear errors."""

from __future__ import annotations

import logging
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from lightning_deepseek.hpo import SearchSpaceError, StudyConfigError, build_space, open_storage, to_overrides
from lightning_deepseek.hpo.space import grid_of
from lightning_deepseek.hpo.study import PRUNERS, build_component


def test_sweep_syntax_maps_to_optuna_distributions() -> None:
    # hydra-optuna-sweeper's meaning: range includes stop, interval is float unless wrapped in int(...).
    space, fixed = build_space(
        {"optim.learning_rate": "tag(log, interval(1e-4, 1e-2))", "data.batch_size": "choice(8, 16, 32)",
         "trainer.max_steps": 100},
        ["optim.warmup_steps=range(0, 100, 20)", "model.n_layer=int(interval(2, 8))", "model=choice(tiny,small)",
         "optim.weight_decay=0.05", "x=range(0.1, 0.5, 0.1)", "y=interval(2, 8)", "z=range(0, 21, 5)"])
    assert space["optim.learning_rate"] == FloatDistribution(1e-4, 1e-2, log=True)
    assert space["data.batch_size"] == CategoricalDistribution([8, 16, 32])
    assert space["optim.warmup_steps"] == IntDistribution(0, 100, step=20)
    assert space["model.n_layer"] == IntDistribution(2, 8)
    assert space["y"] == FloatDistribution(2.0, 8.0)
    assert space["z"] == IntDistribution(0, 20, step=5)  # a stop off the step grid is lowered onto it
    assert space["model"] == CategoricalDistribution(["tiny", "small"])
    assert isinstance(space["x"], FloatDistribution) and space["x"].step == pytest.approx(0.1)
    assert space["x"].high == pytest.approx(0.5)
    assert fixed == ["trainer.max_steps=100", "optim.weight_decay=0.05"]


def test_command_line_wins_over_params_block() -> None:
    space, fixed = build_space({"a": "interval(0, 1)", "b": "choice(1, 2)"}, ["a=0.5", "b=choice(3)"])
    assert fixed == ["a=0.5"] and space == {"b": CategoricalDistribution([3])}


@pytest.mark.parametrize(("entry", "message"), [
    ("tag(lg, interval(1e-4, 1e-2))", "unknown tag"),
    ("interval(1e-4", "cannot parse"),
    ("interval(1, 1)", "needs low < high"),
    ("tag(log, interval(0, 1))", "needs low > 0"),
    ("range(5, 1)", "empty or descending"),
    ("glob(*)", "not supported"),
])
def test_bad_search_space_names_the_parameter(entry: str, message: str) -> None:
    with pytest.raises(SearchSpaceError, match=message) as info:
        build_space({"optim.learning_rate": entry})
    assert "optim.learning_rate" in str(info.value)


def test_overrides_quote_strings_that_need_it() -> None:
    assert to_overrides({"a": 0.1, "b": "tiny", "c": "has space", "d": True, "e": None}) == [
        "a=0.1", "b=tiny", "c='has space'", "d=true", "e=null"]


def test_grid_needs_finite_parameters() -> None:
    # The grid holds the same values as every other sampler samples (range includes stop).
    assert grid_of(build_space({"a": "choice(1, 2)", "b": "range(0, 3)"})[0]) == {"a": [1, 2], "b": [0, 1, 2, 3]}
    with pytest.raises(SearchSpaceError, match="GridSampler: parameter a is continuous"):
        grid_of(build_space({"a": "interval(0.0, 1.0)"})[0])


def test_unknown_or_wrong_sampler_and_pruner_name_the_field() -> None:
    with pytest.raises(StudyConfigError, match=r"pruner._target_='optuna.pruners.MedianPrunr' could not be built"):
        build_component({"_target_": "optuna.pruners.MedianPrunr"}, optuna.pruners.BasePruner, "pruner", PRUNERS)
    with pytest.raises(StudyConfigError, match="is a RandomSampler, not an Optuna BasePruner"):
        build_component({"_target_": "optuna.samplers.RandomSampler"}, optuna.pruners.BasePruner, "pruner", PRUNERS)
    with pytest.raises(StudyConfigError, match="has no _target_"):
        build_component({"n_startup_trials": 3}, optuna.pruners.BasePruner, "pruner", PRUNERS)


def test_unreachable_or_malformed_storage_fails_fast_with_the_fix() -> None:
    with pytest.raises(StudyConfigError, match=r"storage='postgresql\+psycopg2://u:\*\*\*@127.0.0.1:1/x': cannot "
                                               r"connect within 10s .*Connection refused"):
        open_storage("postgresql://u:secret@127.0.0.1:1/x")
    with pytest.raises(StudyConfigError, match="not a usable SQLAlchemy URL"):
        open_storage("nosuchdb://host/db")
    with pytest.raises(StudyConfigError, match="ending in .journal"):
        open_storage("results.txt")


def test_storage_paths_that_cannot_work_name_the_setting_and_the_fix(tmp_path: Path) -> None:
    a_file = tmp_path / "results.txt"
    a_file.write_text("not a folder")
    with pytest.raises(StudyConfigError, match=rf"hydra.sweeper.storage='{a_file}/s.journal': cannot create or open "
                                               rf"this journal file \({a_file} is a file, not a folder\)"):
        open_storage(f"{a_file}/s.journal", field="hydra.sweeper.storage")
    missing = tmp_path / "no" / "such"
    with pytest.raises(StudyConfigError, match=rf"storage='sqlite:///{missing}/s.db': the folder {missing} of the "
                                               r"SQLite file does not exist\. Create the folder"):
        open_storage(f"sqlite:///{missing}/s.db")


def test_a_new_journal_file_is_announced_so_a_mistyped_resume_path_is_seen(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = str(tmp_path / "sub" / "study.journal")
    with caplog.at_level(logging.INFO, logger="lightning_deepseek.hpo.study"):
        open_storage(path)
        assert [r.getMessage() for r in caplog.records] == [
            f"storage: {path} did not exist; created a new, empty study file there."]
        open_storage(path)  # resuming an existing file: nothing to say
        assert len(caplog.records) == 1
