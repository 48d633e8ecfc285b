"""``LdsOptunaSweeperImpl``, the body of the ``lds_optuna`` sweeper: Optuna >= 4 with pruning, asynchronous
trials and resume.

A drop-in for ``hydra-optuna-sweeper`` (its config fields, search-space meaning, ``custom_search_space``,
multi-objective studies and ``optimization_results.yaml``; differences are listed in docs/hpo.md and warned
at sweep start), which cannot prune (jobs never see their trial) and launches trials in blocking batches.
This sweeper:

- reads the search space from sweep overrides (``choice``/``range``/``interval``/``tag(log, ...)``),
  ``hydra.sweeper.params`` (see ``lightning_deepseek.hpo.space``) and ``custom_search_space``;
- launches one job per trial through the configured launcher, keeping ``n_jobs`` in flight from as many
  threads. The basic launcher runs jobs inside this process (global state: cwd, logging, ``sys.argv``), so it
  is sequential; process launchers (joblib, submitit) run trials concurrently;
- when the app has the ``pruning_group`` (``hpo``) with an ``optuna`` option and the study has one objective,
  tells every job its study through overrides of that group (``hpo=optuna hpo.storage=...
  hpo.study_name=... hpo.trial_number=N``) rather than environment variables, because overrides reach any
  launcher's workers (reused joblib processes, SLURM jobs) and DDP children alike;
- points ``hydra.run.dir`` of each job at its sweep subfolder and, with the basic launcher, sets ``sys.argv``
  to the trial's own command line while it runs, so that Lightning's DDP launcher (which re-runs the script
  with ``sys.argv[1:] hydra.run.dir=<run.dir>``) starts ranks > 0 on this trial, in this folder, instead of
  re-running the whole multirun;
- marks a job that returned a number (a list of them for several directions) COMPLETE, one that raised
  ``optuna.TrialPruned`` PRUNED, and any other failure (including ``sys.exit``) FAIL, then writes the report
  (``lightning_deepseek.hpo.report``) to the sweep folder and prints the best trial (or the Pareto front) and
  the optuna-dashboard command that opens the study;
- records why a trial failed in ``trials.csv`` (``fail_reason``): the exception's message, or for a job that
  called ``sys.exit`` (lds-train does on bad input) its exit code and the error it printed (the in-process
  job's ``sys.stderr`` is kept while it runs; with process launchers only the exit code is known);
- stops the sweep at once when a job exits with lds-train's user-error code 2, its error names none of the
  searched settings, and no trial of the study has finished yet: such an error does not depend on the sampled
  values, so every trial would repeat it. An error that names a searched setting (``model.n_head=3`` does not
  divide ``n_embd``), or that comes after some trial finished (so some values work), only fails its trial.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import optuna
import torch.distributed
from hydra.core.plugins import Plugins
from hydra.core.utils import JobStatus
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from hydra.utils import get_method
from omegaconf import DictConfig, OmegaConf

from lightning_deepseek.app.errors import USER_ERROR_EXIT, USER_ERROR_PREFIX, exit_on_user_error
from lightning_deepseek.hpo.loop import FatalTrialError, SweepFailedError, run_trials, sweep_failure
from lightning_deepseek.hpo.report import dashboard_command, write_report
from lightning_deepseek.hpo.space import (
    SearchSpaceError,
    build_space,
    distribution_from_config,
    parse_overrides,
    parse_space,
    to_overrides,
    upstream_notes,
)
from lightning_deepseek.hpo.study import StudyConfigError, create_study, mask_url, normalize_directions

log = logging.getLogger(__name__)
_ARGV_FLAGS_WITH_VALUE = {"-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir"}
_STDERR_KEPT_CHARS = 8192


class LdsOptunaSweeperImpl(Sweeper):
    """See the module docstring; the arguments are the fields of ``LdsOptunaSweeperConf``."""

    def __init__(self, sampler: Any, pruner: Any, direction: Any, study_name: str, storage: str | None,
                 n_trials: int, n_jobs: int, max_failure_rate: float, params: dict[str, Any] | None,
                 pruning_group: str | None, custom_search_space: str | None = None,
                 search_space: dict[str, Any] | None = None, experiment_sequence: str | None = None) -> None:
        self.sampler = _plain(sampler)
        self.pruner = _plain(pruner)
        self.direction = _plain(direction)  # checked in sweep(), where a bad value exits with the user-error contract
        self.study_name = study_name or "lds"
        self.storage = storage
        self.n_trials = n_trials
        self.n_jobs = n_jobs
        self.max_failure_rate = max_failure_rate
        self.params = _plain(params)
        self.search_space = _plain(search_space)
        self.custom_search_space = custom_search_space
        self.experiment_sequence = experiment_sequence
        self.pruning_group = pruning_group
        self._argv_lock = threading.Lock()

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> optuna.Study:
        try:
            return self._sweep(arguments)
        except (SearchSpaceError, StudyConfigError, SweepFailedError) as exc:
            exit_on_user_error(exc)

    def _sweep(self, arguments: list[str]) -> optuna.Study:
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).absolute()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        self.directions = normalize_directions(self.direction, "hydra.sweeper.direction")
        space, fixed = build_space(self.params, arguments)
        space = {**self._deprecated_search_space(), **space}
        extend_space = self._custom_search_space()
        if not space and extend_space is None:
            raise SearchSpaceError(
                "lds_optuna: the search space is empty. Add sweep overrides such as "
                "'optim.learning_rate=tag(log, interval(1e-4, 1e-2))' or a hydra.sweeper.params block.")
        storage = self.storage or str(sweep_dir / "optuna.journal")
        pruning = self._pruning_overrides(fixed, storage)
        fixed += pruning
        probe = {name: _first_value(dist) for name, dist in space.items()}
        self.validate_batch_is_legal([fixed + to_overrides(probe)])  # a typo fails here, not in every trial
        study = create_study(self.study_name, storage, self.sampler, self.pruner, self.directions, space,
                             prefix="hydra.sweeper.")
        self._warn_upstream_differences(arguments)
        n_jobs = self._effective_n_jobs()
        log.info(f"lds_optuna: study {self.study_name!r} in {mask_url(storage)}, {self.n_trials} trials, "
                 f"n_jobs={n_jobs}, directions {self.directions}, space {sorted(space)}, "
                 f"pruning {'on' if pruning else 'off'}, sweep folder {sweep_dir}")

        def run_trial(trial: optuna.Trial, params: dict[str, Any]) -> Any:
            try:
                return self._launch(trial.number, fixed + to_overrides(params), searched=params, pruning=bool(pruning))
            except FatalTrialError as exc:
                finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
                if study.get_trials(deepcopy=False, states=finished):  # other values worked: a bad draw
                    raise RuntimeError(str(exc)) from None
                raise

        outcome = run_trials(study, space, run_trial, self.n_trials, n_jobs, self.max_failure_rate, extend_space)
        best = write_report(study, sweep_dir)
        self._print_best(best, sweep_dir, storage)
        error = sweep_failure(
            outcome, study, max_failure_rate=self.max_failure_rate, setting_prefix="hydra.sweeper.",
            resume_hint="re-run the same command",
            fatal_why=f"This configuration error names none of the searched settings ({', '.join(sorted(space))}) "
                      "and no trial has finished, so every trial would repeat it.")
        if error is not None:
            raise SweepFailedError(f"lds_optuna: {error}")
        return study

    def _deprecated_search_space(self) -> dict[str, optuna.distributions.BaseDistribution]:
        """hydra-optuna-sweeper's ``search_space`` (ignored when ``params`` is set, as upstream does)."""
        if not self.search_space:
            return {}
        if self.params:
            log.warning("lds_optuna: both hydra.sweeper.params and hydra.sweeper.search_space are set; using "
                        "params and ignoring search_space (as hydra-optuna-sweeper does).")
            return {}
        log.warning("lds_optuna: hydra.sweeper.search_space is deprecated (as in hydra-optuna-sweeper); write the "
                    "space in hydra.sweeper.params, e.g. x: 'int(interval(0, 10))'.")
        return {name: distribution_from_config(name, node) for name, node in self.search_space.items()}

    def _custom_search_space(self) -> Callable[[optuna.Trial], None] | None:
        """``custom_search_space(cfg, trial)`` bound to this sweep's config, or ``None``."""
        path = self.custom_search_space
        if not path:
            return None
        try:
            if path.startswith("."):  # upstream's examples: a function of the app's own script
                function = getattr(sys.modules["__main__"], path.rsplit(".", 1)[-1])
            else:
                function = get_method(path)
        except (AttributeError, ImportError, ValueError) as exc:
            raise SearchSpaceError(f"hydra.sweeper.custom_search_space={path!r} could not be loaded "
                                   f"({' '.join(str(exc).split())}); give the dotted path of a function "
                                   "fn(cfg, trial) that calls trial.suggest_*().") from None
        config = self.config
        return lambda trial: function(config, trial)

    def _warn_upstream_differences(self, arguments: list[str]) -> None:
        grid = str((self.sampler or {}).get("_target_", "")).endswith("GridSampler")
        notes = upstream_notes([o for o in parse_space(self.params, arguments) if o.is_sweep_override()], grid)
        if self.experiment_sequence:
            notes.append("hydra.sweeper.experiment_sequence is ignored: this sweeper runs its own asynchronous loop")
        for note in notes:
            log.warning(f"lds_optuna: differs from hydra-optuna-sweeper: {note} (docs/hpo.md)")

    def _pruning_overrides(self, fixed: list[str], storage: str) -> list[str]:
        """Overrides that attach ``OptunaPruning`` in each job; none when the app has no such group option or
        the study has several objectives (Optuna cannot prune those)."""
        group = self.pruning_group
        if not group:
            return []
        options = self.hydra_context.config_loader.get_group_options(group)
        if "optuna" not in options:
            log.info(f"lds_optuna: the app has no config group option {group}=optuna; trials run without pruning "
                     "(set hydra.sweeper.pruning_group to the group that attaches OptunaPruning, or null).")
            return []
        if len(self.directions) > 1:
            log.info("lds_optuna: multi-objective study: Optuna cannot prune it, so trials run without pruning.")
            return []
        chosen = any(o.key_or_group == group for o in parse_overrides(fixed))
        identity = to_overrides({f"++{group}.storage": storage, f"++{group}.study_name": self.study_name})
        return ([] if chosen else [f"{group}=optuna"]) + identity

    def _effective_n_jobs(self) -> int:
        if self.n_jobs > 1 and _runs_in_process(self.launcher):
            log.warning(f"lds_optuna: hydra.sweeper.n_jobs={self.n_jobs} but the basic launcher runs jobs in this "
                        "process, one at a time; running sequentially. Use a process launcher (for example "
                        "hydra/launcher=joblib) for concurrent trials.")
            return 1
        return self.n_jobs

    def _launch(self, number: int, overrides: list[str], searched: Iterable[str], pruning: bool) -> Any:
        identity = [f"++{self.pruning_group}.trial_number={number}"] if pruning else []
        job = [*overrides, *identity]
        run_dir = ["hydra.run.dir=${hydra.sweep.dir}/${hydra.sweep.subdir}"]
        with self._trial_process(job) as stderr:
            try:
                (ret,) = self.launcher.launch([job + run_dir], initial_job_idx=number)
            except SystemExit as exc:  # a job that called sys.exit (lds-train does on bad input)
                raise _exit_error(exc, stderr.text if stderr is not None else "", searched) from None
        if ret.status == JobStatus.FAILED:
            # Private name: the public JobReturn.return_value re-raises too, but first logs "Error executing job"
            # with a traceback, even for a pruned trial.
            raise ret._return_value
        return ret.return_value

    @contextlib.contextmanager
    def _trial_process(self, job: list[str]) -> Iterator[_StderrTail | None]:
        """Process state of one in-process (basic launcher) job, restored afterwards; yields its stderr tail.

        ``sys.argv`` becomes this trial's single-run command line (Lightning's DDP launcher re-runs it for ranks
        > 0); Lightning's DDP launcher leaves ``LOCAL_RANK``/``MASTER_PORT``/``WORLD_SIZE`` in ``os.environ`` and
        the process group open, which would make the next trial skip launching its ranks and reuse a dead
        group, so both are undone after the job. ``sys.stderr`` is teed so that the error a job prints before
        ``sys.exit`` reaches ``fail_reason`` (a process launcher's job writes to its own process: ``None``).
        """
        if not _runs_in_process(self.launcher):
            yield None
            return
        with self._argv_lock:
            argv, environ, stderr = list(sys.argv), dict(os.environ), sys.stderr
            sys.argv = [argv[0], *_flags(argv[1:]), *job]
            sys.stderr = tail = _StderrTail(stderr)
            try:
                yield tail
            finally:
                sys.stderr = stderr
                sys.argv = argv
                os.environ.clear()
                os.environ.update(environ)
                if torch.distributed.is_available() and torch.distributed.is_initialized():
                    torch.distributed.destroy_process_group()

    def _print_best(self, best: dict[str, Any], sweep_dir: Path, storage: str) -> None:
        states = ", ".join(f"{n} {s}" for s, n in best["trials"].items() if n)
        if "best_trial" in best:
            params = " ".join(to_overrides(best["best_params"]))
            message = f"best trial {best['best_trial']}: value={best['best_value']:.5g} with {params}"
        elif best.get("pareto_front"):
            rows = [f"\n    trial {row['number']}: values={row['values']} with {' '.join(to_overrides(row['params']))}"
                    for row in best["pareto_front"]]
            message = f"Pareto front of {len(rows)} trials ({', '.join(best['directions'])}):{''.join(rows)}"
        else:
            message = "no trial completed, so there is no best trial"
        plots = ", ".join(Path(p).name for p in best["plots"]) or "no plots"
        print(f"\nlds_optuna: {message}\n  trials: {states}\n  written to {sweep_dir}: best_params.yaml, "
              f"optimization_results.yaml, trials.csv, {plots}\n  dashboard: {dashboard_command(storage)}\n"
              f"  resume or extend: re-run the same command with hydra.sweep.dir={sweep_dir}", flush=True)


class _StderrTail:
    """A text stream that writes through to ``stream`` and keeps the last characters written."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.text = ""

    def write(self, text: str) -> int:
        self.text = (self.text + text)[-_STDERR_KEPT_CHARS:]
        return self.stream.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, ...
        return getattr(self.stream, name)


def _exit_error(exc: SystemExit, stderr: str, searched: Iterable[str]) -> RuntimeError:
    """The trial's failure for a job that called ``sys.exit``: exit code and printed error, fatal or not."""
    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    message = str(exc.code) if isinstance(exc.code, str) else _error_text(stderr)
    if not message:
        return RuntimeError(f"the job exited with code {code} and printed no error (see its log)")
    reason = f"the job exited with code {code}: {message}"
    keys = [name.split("@")[0].lstrip("+~") for name in searched]
    if code == USER_ERROR_EXIT and not any(key in message for key in keys):
        return FatalTrialError(reason)
    return RuntimeError(reason)


def _error_text(stderr: str) -> str:
    """lds-train's one-paragraph error, else the last lines the job printed to stderr."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line[len(USER_ERROR_PREFIX):] for line in lines if line.startswith(USER_ERROR_PREFIX)]
    return errors[-1] if errors else " | ".join(lines[-5:])


def _runs_in_process(launcher: Any) -> bool:
    """Whether ``launcher`` is Hydra's basic launcher, which runs each job inside this process."""
    # Private name: Hydra exports no public name or flag for its basic launcher.
    from hydra._internal.core_plugins.basic_launcher import BasicLauncher

    return isinstance(launcher, BasicLauncher)


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def _flags(argv: list[str]) -> list[str]:
    """Hydra's own flags (config path/name/dir) of a command line, without ``-m`` and the overrides."""
    kept, take_next = [], False
    for token in argv:
        if take_next:
            kept.append(token)
            take_next = False
        elif token in _ARGV_FLAGS_WITH_VALUE:
            kept.append(token)
            take_next = True
        elif token.startswith("--config") and "=" in token:
            kept.append(token)
    return kept


def _first_value(dist: optuna.distributions.BaseDistribution) -> Any:
    if isinstance(dist, optuna.distributions.CategoricalDistribution):
        return dist.choices[0]
    return dist.low
