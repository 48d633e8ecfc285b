"""The end-of-sweep report, shared by the ``lds_optuna`` sweeper and :func:`~lightning_deepseek.hpo.search`.

Files written to the sweep folder:

- ``best_params.yaml``: trial counts and the best trial (single objective) or the Pareto front (several);
- ``optimization_results.yaml``: the same in hydra-optuna-sweeper's format (``name: optuna`` with
  ``best_params``/``best_value``, or ``solutions``: a list of ``{params, values}``), so scripts written for that
  sweeper read our sweeps unchanged;
- ``trials.csv``: every trial (state, value or one ``value_<i>`` column per objective, last reported step,
  duration, parameters, why it failed);
- plots from Optuna's matplotlib backend: optimization history, parameter importances and intermediate values
  (single objective), the Pareto front (two or three objectives).

:func:`pareto_front` is the one place that turns a multi-objective study into rows (a throughput/loss sweep
uses it too). Plot warnings are caught: a skipped plot or a plotting warning is one ``hpo:`` line, not a raw
warning. :func:`dashboard_command` is the command that opens the study in optuna-dashboard.
"""

from __future__ import annotations

import contextlib
import csv
import logging
import shlex
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.trial import TrialState


def count_states(study: optuna.Study) -> dict[str, int]:
    """Number of trials per state name (``COMPLETE``, ``PRUNED``, ``FAIL``, ``RUNNING``, ``WAITING``)."""
    counts = {state.name: 0 for state in TrialState}
    for trial in study.get_trials(deepcopy=False):
        counts[trial.state.name] += 1
    return counts


def directions(study: optuna.Study) -> list[str]:
    """``["minimize"]``, or one direction per objective."""
    return [d.name.lower() for d in study.directions]


def pareto_front(study: optuna.Study) -> list[dict[str, Any]]:
    """The non-dominated COMPLETE trials (Optuna's ``best_trials``) as ``{number, values, params}``, by number."""
    trials = sorted(study.best_trials, key=lambda t: t.number)
    return [{"number": t.number, "values": list(t.values), "params": dict(t.params)} for t in trials]


def dashboard_command(storage: str) -> str:
    """The shell command that serves ``storage`` (journal path or RDB URL) in optuna-dashboard on this machine."""
    return f"optuna-dashboard {shlex.quote(storage)}  (then open http://127.0.0.1:8080)"


def write_report(study: optuna.Study, out_dir: str | Path) -> dict[str, Any]:
    """Write the report files (module docstring) to ``out_dir``; return the summary of ``best_params.yaml``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trials = study.get_trials(deepcopy=False)
    _write_csv(trials, len(study.directions), out / "trials.csv")
    complete = any(t.state == TrialState.COMPLETE for t in trials)
    summary: dict[str, Any] = {"study_name": study.study_name, "trials": count_states(study)}
    results: dict[str, Any] = {"name": "optuna"}
    if len(study.directions) == 1:
        summary["direction"] = directions(study)[0]
        if complete:
            best = study.best_trial
            summary.update(best_trial=best.number, best_value=best.value, best_params=dict(best.params))
            results.update(best_params=dict(best.params), best_value=best.value)
    else:
        summary["directions"] = directions(study)
        summary["pareto_front"] = pareto_front(study) if complete else []
        results["solutions"] = [{"params": row["params"], "values": row["values"]} for row in summary["pareto_front"]]
    (out / "best_params.yaml").write_text(yaml.safe_dump(summary, sort_keys=False))
    (out / "optimization_results.yaml").write_text(yaml.safe_dump(results, sort_keys=False))
    summary["plots"] = _plot(study, out) if complete else []
    return summary


def _write_csv(trials: list[optuna.trial.FrozenTrial], num_objectives: int, path: Path) -> None:
    names = sorted({name for t in trials for name in t.params})
    value_columns = ["value"] if num_objectives == 1 else [f"value_{i}" for i in range(num_objectives)]
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["number", "state", *value_columns, "last_step", "duration_s",
                         *[f"params_{n}" for n in names], "fail_reason"])
        for t in trials:
            duration = t.duration.total_seconds() if t.duration is not None else None
            last_step = max(t.intermediate_values) if t.intermediate_values else None
            values = list(t.values) if t.values is not None else [None] * num_objectives
            writer.writerow([t.number, t.state.name, *values, last_step, duration,
                             *[t.params.get(n) for n in names], t.user_attrs.get("fail_reason", "")])


def _plots_for(study: optuna.Study) -> dict[str, Any]:
    from optuna.visualization import matplotlib as ovm

    if len(study.directions) == 1:
        plots = {"optimization_history.png": ovm.plot_optimization_history,
                 "param_importances.png": ovm.plot_param_importances}
        if any(t.intermediate_values for t in study.get_trials(deepcopy=False)):  # none without pruning
            plots["intermediate_values.png"] = ovm.plot_intermediate_values
        return plots
    if len(study.directions) <= 3:
        return {"pareto_front.png": ovm.plot_pareto_front}
    return {}


def _plot(study: optuna.Study, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for filename, plot in _plots_for(study).items():
        with _caught_plot_messages() as notes:
            try:
                axes = plot(study)
            # e.g. importances need 2+ parameters, and scikit-learn under Optuna 4 (ImportError)
            except (ValueError, RuntimeError, ZeroDivisionError, ImportError) as exc:
                print(f"hpo: skipped {filename}: {' '.join(str(exc).split())}", flush=True)
                continue
            figure = getattr(axes, "figure", None) or plt.gcf()
            figure.set_size_inches(7, 4.5)
            figure.tight_layout()
            figure.savefig(out / filename, dpi=100)
            plt.close(figure)
        for note in sorted(set(notes)):
            print(f"hpo: {filename}: {note}", flush=True)
        written.append(str(out / filename))
    return written


@contextlib.contextmanager
def _caught_plot_messages() -> Iterator[list[str]]:
    """Python warnings and Optuna's logged warnings while plotting, as one-line notes (not raw warnings)."""
    notes: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            notes.append(" ".join(record.getMessage().split()))

    handler = _Collect(logging.WARNING)
    optuna_logger = logging.getLogger("optuna")
    optuna_logger.addHandler(handler)
    optuna.logging.disable_default_handler()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield notes
        # Optuna marks its matplotlib plots experimental on every call; that one is not worth a line.
        notes.extend(" ".join(str(w.message).split()) for w in caught
                     if not issubclass(w.category, optuna.exceptions.ExperimentalWarning))
    finally:
        optuna.logging.enable_default_handler()
        optuna_logger.removeHandler(handler)
