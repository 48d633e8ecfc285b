"""Study helpers shared by the Hydra sweeper and :func:`lightning_deepseek.hpo.search`.

- storage: a path ending in ``.journal`` (Optuna's journal file: safe for several processes on one machine
  or an NFS share), or any SQLAlchemy URL (``sqlite:///x.db``, ``postgresql://user@host/db``), opened with a
  connect timeout so an unreachable server fails in seconds with the URL (password masked) and the fix;
- sampler and pruner from ``_target_`` config nodes, checked to be Optuna samplers/pruners; the pruner's
  config is stored in the study so that every job (another process, another machine) prunes with the same rule;
- the end-of-sweep report: best parameters (YAML), all trials (CSV), optimisation history and parameter
  importance plots (PNG, Optuna's matplotlib backend).
"""

from __future__ import annotations

import csv
import logging
import math
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import optuna
import yaml
from hydra.utils import instantiate
from optuna.distributions import BaseDistribution
from optuna.trial import TrialState

from lightning_deepseek.hpo.space import grid_of

log = logging.getLogger(__name__)
PRUNER_ATTR = "lds_pruner"
CONNECT_TIMEOUT_S = 10
SAMPLERS = "optuna.samplers.TPESampler (multivariate: true), GPSampler, CmaEsSampler, RandomSampler, GridSampler"
PRUNERS = "optuna.pruners.MedianPruner, HyperbandPruner, SuccessiveHalvingPruner, NopPruner"


class StudyConfigError(ValueError):
    """Bad storage, sampler or pruner setting; the message names the field and the fix."""


def mask_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for error messages and logs)."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a URL (a file path): nothing to hide
        return url


def open_storage(url: str, field: str = "storage") -> optuna.storages.BaseStorage:
    """Open a journal file (``*.journal``) or an RDB URL; fail fast with the fix if it cannot be reached."""
    if "://" not in url:
        if not url.endswith(".journal"):
            raise StudyConfigError(f"{field}={url!r} is neither a SQLAlchemy URL (sqlite:///sweep.db, "
                                   "postgresql://user@host/db) nor a journal file path ending in .journal.")
        return _open_journal(url, field)
    import sqlalchemy.exc

    url = _postgres_driver(url)
    engine_kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        _check_sqlite_folder(url, field)
        engine_kwargs["connect_args"] = {"timeout": 60}  # seconds to wait on a locked file, not to connect
    elif url.startswith(("postgresql", "mysql")):
        engine_kwargs["connect_args"] = {"connect_timeout": CONNECT_TIMEOUT_S}
        engine_kwargs["pool_pre_ping"] = True
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)
    except (sqlalchemy.exc.ArgumentError, sqlalchemy.exc.NoSuchModuleError, ImportError, ValueError) as exc:
        raise StudyConfigError(f"{field}={mask_url(url)!r} is not a usable SQLAlchemy URL ({_first_line(exc)}). "
                               "Write e.g. sqlite:///sweep.db or postgresql://user:pass@host:5432/db (PostgreSQL "
                               "needs `pip install psycopg2-binary`).") from None
    except sqlalchemy.exc.SQLAlchemyError as exc:
        if url.startswith("sqlite"):
            raise StudyConfigError(f"{field}={url!r}: cannot open the SQLite file ({_first_line(exc)}). Check that "
                                   "the file and its folder are writable by this user.") from None
        raise StudyConfigError(f"{field}={mask_url(url)!r}: cannot connect within {CONNECT_TIMEOUT_S}s "
                               f"({_first_line(exc)}). Check that the server runs and the host, port, user and "
                               "database are right, or drop the storage setting to use the embedded journal file "
                               "in the sweep folder.") from None


def _open_journal(path: str, field: str) -> optuna.storages.BaseStorage:
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock, JournalStorage

    file = Path(path)
    existed = file.exists()
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        # The open(O_EXCL) lock, unlike the default symlink lock, also works on file systems without symlinks.
        storage = JournalStorage(JournalFileBackend(path, lock_obj=JournalFileOpenLock(path)))
    except OSError as exc:
        blocking = next((p for p in file.parents if p.is_file()), None)
        cause = f"{blocking} is a file, not a folder" if blocking else f"{exc.strerror or exc}: {exc.filename or path}"
        raise StudyConfigError(f"{field}={path!r}: cannot create or open this journal file ({cause}). Point {field} "
                               "at a *.journal file in a folder you can write to (missing folders are created)."
                               ) from None
    if not existed:
        # Creating is the normal first run; said out loud so that a mistyped path on a resume is noticed.
        log.info(f"{field}: {path} did not exist; created a new, empty study file there.")
    return storage


def _check_sqlite_folder(url: str, field: str) -> None:
    """SQLite reports a missing folder as 'unable to open database file'; say which folder instead."""
    from sqlalchemy.engine import make_url

    try:
        database = make_url(url).database
    except Exception:  # noqa: BLE001 - a malformed URL is reported by RDBStorage with its own message
        return
    if not database or database == ":memory:" or database.startswith("file:"):
        return
    folder = Path(database).absolute().parent
    if not folder.is_dir():
        problem = "is a file, not a folder" if folder.exists() else "does not exist"
        raise StudyConfigError(f"{field}={url!r}: the folder {folder} of the SQLite file {problem}. Create the folder "
                               f"(mkdir -p {folder}) or point {field} at a file in an existing folder.")


def _postgres_driver(url: str) -> str:
    """SQLAlchemy >= 2.1 maps ``postgresql://`` to psycopg 3; use psycopg2 when only that one is installed."""
    if not url.startswith("postgresql://"):
        return url
    import importlib.util

    if importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2") is not None:
        return "postgresql+psycopg2://" + url[len("postgresql://"):]
    return url


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(getattr(exc, "orig", None) or exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def build_component(node: Any, base: type, field: str, known: str,
                    space: Mapping[str, BaseDistribution] | None = None) -> Any:
    """Instantiate a sampler/pruner ``_target_`` node and check that it is an Optuna ``base``."""
    if node is None or isinstance(node, base):
        return node
    node = dict(node)
    target = node.get("_target_")
    if not target:
        raise StudyConfigError(f"{field} has no _target_; set {field}._target_ to one of {known}.")
    if str(target).endswith("GridSampler") and node.get("search_space") is None:
        node["search_space"] = grid_of(space or {})
    try:
        component = instantiate(node, _convert_="all")
    except Exception as exc:  # noqa: BLE001 - hydra wraps import and argument errors alike
        cause = exc.__cause__ or exc
        raise StudyConfigError(f"{field}._target_={target!r} could not be built ({_first_line(cause)}). "
                               f"Use one of {known} with valid arguments.") from None
    if not isinstance(component, base):
        raise StudyConfigError(f"{field}._target_={target!r} is a {type(component).__name__}, not an Optuna "
                               f"{base.__name__}. Use one of {known}.")
    return component


def create_study(study_name: str, storage: str, sampler_node: Mapping[str, Any] | None,
                 pruner_node: Mapping[str, Any] | None, direction: str,
                 space: Mapping[str, BaseDistribution], prefix: str = "") -> optuna.Study:
    """Create or load (resume) ``study_name`` and record its pruner config for the jobs.

    ``prefix`` (``"hydra.sweeper."``) is put before the field names in error messages.
    """
    if direction not in ("minimize", "maximize"):
        raise StudyConfigError(f"{prefix}direction={direction!r}: use minimize or maximize.")
    sampler = build_component(sampler_node, optuna.samplers.BaseSampler, f"{prefix}sampler", SAMPLERS, space)
    pruner = build_component(pruner_node, optuna.pruners.BasePruner, f"{prefix}pruner", PRUNERS)
    backend = open_storage(storage, field=f"{prefix}storage")
    study = optuna.create_study(study_name=study_name, storage=backend, sampler=sampler,
                                pruner=pruner, direction=direction, load_if_exists=True)
    if study.direction.name.lower() != direction:
        raise StudyConfigError(f"study {study_name!r} in {mask_url(storage)} was created with direction="
                               f"{study.direction.name.lower()}; pass that direction or a new study_name.")
    study.set_user_attr(PRUNER_ATTR, dict(pruner_node) if pruner_node is not None else None)
    return study


def load_trial(storage: str, study_name: str, trial_number: int) -> optuna.Trial:
    """The running trial ``trial_number`` of a study, with the study's pruner (used inside a job)."""
    backend = open_storage(storage, field="hpo.storage")
    try:
        study_id = backend.get_study_id_from_name(study_name)
    except KeyError:
        raise StudyConfigError(f"hpo.study_name={study_name!r} does not exist in {mask_url(storage)}; "
                               "jobs get it from the lds_optuna sweeper, do not set it by hand.") from None
    pruner_node = backend.get_study_user_attrs(study_id).get(PRUNER_ATTR)
    pruner = build_component(pruner_node, optuna.pruners.BasePruner, "pruner", PRUNERS)
    study = optuna.load_study(study_name=study_name, storage=backend, pruner=pruner)
    trial_id = backend.get_trial_id_from_study_id_trial_number(study_id, trial_number)
    if backend.get_trial(trial_id).state != TrialState.RUNNING:
        raise StudyConfigError(f"hpo.trial_number={trial_number} of study {study_name!r} is not running; "
                               "it was already finished (a resumed or repeated job?).")
    return optuna.Trial(study, trial_id)


def count_states(study: optuna.Study) -> dict[str, int]:
    """Number of trials per state name (``COMPLETE``, ``PRUNED``, ``FAIL``, ``RUNNING``, ``WAITING``)."""
    counts = {state.name: 0 for state in TrialState}
    for trial in study.get_trials(deepcopy=False):
        counts[trial.state.name] += 1
    return counts


def write_report(study: optuna.Study, out_dir: str | Path) -> dict[str, Any]:
    """Write ``best_params.yaml``, ``trials.csv`` and the plots to ``out_dir``; return the best-trial summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trials = study.get_trials(deepcopy=False)
    _write_csv(trials, out / "trials.csv")
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    best: dict[str, Any] = {"study_name": study.study_name, "direction": study.direction.name.lower(),
                            "trials": count_states(study)}
    if complete:
        trial = study.best_trial
        best.update(best_trial=trial.number, best_value=trial.value, best_params=dict(trial.params))
    (out / "best_params.yaml").write_text(yaml.safe_dump(best, sort_keys=False))
    best["plots"] = _plot(study, out) if complete else []
    return best


def _write_csv(trials: list[optuna.trial.FrozenTrial], path: Path) -> None:
    names = sorted({name for t in trials for name in t.params})
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["number", "state", "value", "last_step", "duration_s", *[f"params_{n}" for n in names],
                         "fail_reason"])
        for t in trials:
            duration = t.duration.total_seconds() if t.duration is not None else None
            last_step = max(t.intermediate_values) if t.intermediate_values else None
            writer.writerow([t.number, t.state.name, t.value, last_step, duration,
                             *[t.params.get(n) for n in names], t.user_attrs.get("fail_reason", "")])


def _plot(study: optuna.Study, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as ovm

    written = []
    plots = {"optimization_history.png": ovm.plot_optimization_history,
             "param_importances.png": ovm.plot_param_importances,
             "intermediate_values.png": ovm.plot_intermediate_values}
    for filename, plot in plots.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                axes = plot(study)
        except (ValueError, RuntimeError, ZeroDivisionError) as exc:  # e.g. importances need 2+ parameters
            print(f"hpo: skipped {filename}: {exc}", flush=True)
            continue
        figure = getattr(axes, "figure", None) or plt.gcf()
        figure.set_size_inches(7, 4.5)
        figure.tight_layout()
        figure.savefig(out / filename, dpi=100)
        plt.close(figure)
        written.append(str(out / filename))
    return written


def objective_value(value: Any) -> float:
    """``value`` as a finite float, or ``TypeError``/``ValueError`` saying what the job must return."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise TypeError(f"the job returned {value!r}; it must return the objective as a number (lds-train "
                        "returns the final val_loss: make sure validation runs, trainer.val_check_interval "
                        "<= trainer.max_steps).")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"the job returned a non-finite objective ({number}); the run diverged.")
    return number
