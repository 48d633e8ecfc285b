"""Study helpers shared by the Hydra sweeper and :func:`lightning_deepseek.hpo.search`.

- storage: a path ending in ``.journal`` (Optuna's journal file: safe for several processes on one machine
  or an NFS share), or any SQLAlchemy URL (``sqlite:///x.db``, ``postgresql://user@host/db``), opened with a
  connect timeout so an unreachable server fails in seconds with the URL (password masked) and the fix;
- sampler and pruner from ``_target_`` config nodes, checked to be Optuna samplers/pruners; the pruner's
  config is stored in the study so that every job (another process, another machine) prunes with the same rule;
(the end-of-sweep report is ``report.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna
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
                 pruner_node: Mapping[str, Any] | None, direction: str | Sequence[str],
                 space: Mapping[str, BaseDistribution], prefix: str = "") -> optuna.Study:
    """Create or load (resume) ``study_name`` and record its pruner config for the jobs.

    ``direction`` is one direction, or a list of them for a multi-objective study (which Optuna cannot prune:
    its pruner is recorded as none). ``prefix`` (``"hydra.sweeper."``) goes before field names in errors.
    """
    wanted = normalize_directions(direction, f"{prefix}direction")
    if len(wanted) > 1:
        pruner_node = None
    sampler = build_component(sampler_node, optuna.samplers.BaseSampler, f"{prefix}sampler", SAMPLERS, space)
    pruner = build_component(pruner_node, optuna.pruners.BasePruner, f"{prefix}pruner", PRUNERS)
    backend = open_storage(storage, field=f"{prefix}storage")
    study = optuna.create_study(study_name=study_name, storage=backend, sampler=sampler,
                                pruner=pruner, directions=wanted, load_if_exists=True)
    found = [d.name.lower() for d in study.directions]
    if found != wanted:
        raise StudyConfigError(f"study {study_name!r} in {mask_url(storage)} was created with {prefix}direction="
                               f"{found if len(found) > 1 else found[0]}; pass that direction or a new study_name.")
    study.set_user_attr(PRUNER_ATTR, dict(pruner_node) if pruner_node is not None else None)
    return study


def normalize_directions(direction: str | Sequence[str], field: str = "direction") -> list[str]:
    """``direction`` as a list of ``minimize``/``maximize`` (one per objective); an error names ``field``."""
    wanted = [direction] if isinstance(direction, str) else list(direction)
    # hydra-optuna-sweeper's Direction enum arrives as its name (``Direction.minimize`` -> "minimize").
    wanted = [str(getattr(d, "name", d)).lower() for d in wanted]
    if not wanted or any(d not in ("minimize", "maximize") for d in wanted):
        raise StudyConfigError(f"{field}={direction!r}: use minimize or maximize, or a list of them (one per "
                               "objective) for a multi-objective study, e.g. [minimize, maximize].")
    return wanted


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
