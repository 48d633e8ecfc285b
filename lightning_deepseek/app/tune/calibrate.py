"""``lds-train tune=auto|quick|grid``: measure candidate configurations inside the training processes, train with
the fastest.

Each configuration (:mod:`~lightning_deepseek.app.tune.configurations`: strategy, tp/ep sizes, compression, DDP
bucket size) is one trial of an Optuna study with a throughput objective, run by the project's trial loop
(:func:`lightning_deepseek.hpo.loop.run_trials`): a short ``Trainer.fit`` of a freshly seeded model on the run's own
data, ``tune.warmup_steps`` untimed steps then ``tune.steps`` timed ones, a step's time the slowest rank's. The
rounds, in order (:func:`calibrate`):

1. plain DDP without compression first (every ratio's base), then every configuration, or with ``tune.staged`` one
   per layout (strategy, tp, ep); with ``tune.prune`` Optuna's ``MedianPruner`` stops a configuration once it is
   slower than the median of those measured so far;
2. staged: the other compressions and bucket sizes of the layouts measured to the end ("skipped" rows for the
   others: compression saves a share of the data-parallel exchange, and a layout that exchanges less gains no more
   from it, so a layout that loses uncompressed is taken to lose compressed too);
3. ``tune.rounds - 1`` further rounds of plain DDP and the ``tune.recheck_best`` fastest others, alternately in
   reverse, only where they can change the choice; each configuration keeps its best round;
4. a long run (``tune.budget``, a share of the planned training time) settles the two fastest others against plain
   DDP in paired rounds until :func:`~lightning_deepseek.app.tune.choice.settle` decides or the share is spent
   (:mod:`~lightning_deepseek.app.tune.paired`); a short run has no time left in its share and skips this.

The choice is :func:`~lightning_deepseek.app.tune.choice.choose` (plain DDP unless another is faster by
``tune.min_gain`` and the measured noise) or the paired rounds' verdict; the table (``tune.txt``, ``tune.json``) and
the summary rows come from :class:`~lightning_deepseek.app.tune.table.Calibration`. The training that follows is the
run's config with the choice applied (:meth:`Configuration.apply`), through ``prepare_training`` as a direct run,
re-seeded: its losses equal those of ``lds-train <the choice's overrides> tune=none``
(tests/app/tune/test_calibrate.py). Cost: one fit per configuration and round, in the same processes (the first fit
starts them, later fits reuse the process group: a process per configuration would pay its imports each time);
counted from the moment every process is up (``launch_seconds`` apart). Not supported: configurations that need
another world size, and choosing by anything but throughput.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import logging
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import optuna
import torch
import torch.distributed as dist
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback
from omegaconf import DictConfig, OmegaConf
from optuna.distributions import CategoricalDistribution
from typing_extensions import override

from lightning_deepseek.app.tune.checks import nothing_to_choose, pipeline_reason, task_overrides
from lightning_deepseek.app.tune.choice import choose
from lightning_deepseek.app.tune.configurations import (
    PLAIN_DDP,
    Configuration,
    configurations,
    describe_forced,
    forced_settings,
    pipeline_configuration,
)
from lightning_deepseek.app.tune.paired import paired_rounds
from lightning_deepseek.app.tune.steal import cpu_times, stolen_share
from lightning_deepseek.app.tune.sweep_choice import publish, reused, shared_choice, sweep_table
from lightning_deepseek.app.tune.table import Calibration, Row, TuneReport
from lightning_deepseek.hpo.loop import run_trials


class _StepTimer(Callback):
    """Times the steps after the warm-up; reports throughput to the trial after each and stops when pruned."""

    def __init__(self, trial: optuna.Trial, warmup_batches: int, prune: bool) -> None:
        self.trial = trial
        self.warmup_batches = warmup_batches
        self.prune = prune
        self.batches = 0
        self.start = 0.0
        self.tokens = 0
        self.tokens_per_s: float | None = None
        self.step_seconds: list[float] = []  # the slowest rank's: the same on every rank (the noise margin uses them)
        self._elapsed = 0.0
        self.pruned_at: int | None = None
        self.up_at = 0.0  # the process group is up (setup hook)
        self.first_batch_at = 0.0
        self.end = 0.0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.up_at = time.perf_counter()  # after the strategy's setup_environment: every process has joined

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.batches == 0:
            self.first_batch_at = time.perf_counter()
        if self.batches == self.warmup_batches:
            self.start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.batches += 1
        if self.batches <= self.warmup_batches:
            return
        self.tokens += batch[0].numel() * trainer.world_size
        now = self.end = time.perf_counter()
        elapsed = torch.tensor([now - self.start], dtype=torch.float64)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time: the same on every rank
        self.step_seconds.append(round(float(elapsed) - self._elapsed, 4))
        self._elapsed = float(elapsed)
        self.tokens_per_s = self.tokens / max(float(elapsed), 1e-9)
        measured = self.batches - self.warmup_batches
        self.trial.report(self.tokens_per_s, measured)
        if self.prune and self.trial.should_prune():
            self.pruned_at = measured
            trainer.should_stop = True


class _InOrder(optuna.samplers.BaseSampler):
    """Proposes the candidates in the given order, one per trial (plain DDP first): a calibration measures each
    once, and the pruner needs the baseline's values before the others'."""

    def __init__(self, names: list[str]) -> None:
        self.names = names

    @override
    def infer_relative_search_space(self, study: optuna.Study, trial: Any) -> dict[str, Any]:
        return {}

    @override
    def sample_relative(self, study: optuna.Study, trial: Any, search_space: dict[str, Any]) -> dict[str, Any]:
        return {}

    @override
    def sample_independent(self, study: optuna.Study, trial: Any, param_name: str, param_distribution: Any) -> Any:
        return self.names[trial.number]


@dataclass
class Calibrator:
    cfg: DictConfig
    plan: Any
    folder: Any
    order: list[Configuration]
    eligible: list[Configuration]
    results: dict[str, Row] = field(default_factory=dict)
    up_at: float | None = None  # perf_counter when every process had joined (the first fit's setup)
    pruning: bool = True  # off for the paired rounds (paired.py): both candidates measured to the end
    fits: int = 0
    fit_means: dict[str, float] = field(default_factory=dict)  # each candidate's last fit: mean timed step seconds

    def run(self, trial: optuna.Trial, params: dict[str, Any]) -> float:
        candidate = next(c for c in self.order if c.name == params["candidate"])
        earlier = self.results.get(candidate.name)
        started = time.perf_counter()
        timer = self._timer(candidate, trial, first=trial.number == 0)
        gc.collect()  # the earlier fits' trainers and models are cyclic garbage: collect it before, not in, the timing
        try:
            self._measure(candidate, timer)
        except Exception as exc:  # noqa: BLE001 - a configuration that cannot run is a row of the table
            self.results[candidate.name] = Row(candidate, "failed", note=" ".join(str(exc).split())[:160])
            raise
        finally:
            self.fits += 1
            if self.up_at is None and timer.up_at:
                self.up_at = started = timer.up_at  # the first fit: its set-up is counted once the processes are up
        if timer.step_seconds:
            self.fit_means[candidate.name] = statistics.fmean(timer.step_seconds)
        seconds = _phases(timer, started, earlier.seconds if earlier else {})
        steps = (*earlier.step_seconds, *timer.step_seconds) if earlier else tuple(timer.step_seconds)
        if timer.pruned_at is not None and earlier is not None and earlier.state != "failed":
            self.results[candidate.name] = Row(candidate, earlier.state, earlier.tokens_per_s, earlier.note, steps,
                                               seconds)
            raise optuna.TrialPruned("slower than the median in this round; its earlier round stands")
        if timer.pruned_at is not None:
            note = f"below the median after {timer.pruned_at} timed steps"
            self.results[candidate.name] = Row(candidate, "pruned", timer.tokens_per_s, note, steps, seconds)
            raise optuna.TrialPruned(note)
        # Interference on a shared machine only ever slows a step down: a candidate's best round is its speed.
        best = max(timer.tokens_per_s or 0.0, (earlier.tokens_per_s or 0.0) if earlier else 0.0)
        state = "measured" if candidate in self.eligible else "reference"
        self.results[candidate.name] = Row(candidate, state, best, step_seconds=steps, seconds=seconds)
        return float(timer.tokens_per_s or 0.0)

    def first_stage(self, staged: bool) -> list[str]:
        """Every candidate; staged: plain DDP and the first eligible candidate of each layout."""
        if not staged:
            return [c.name for c in self.order]
        firsts = {_layout(c): c for c in reversed(self.eligible)}
        return [c.name for c in self.order if c.is_plain_ddp or firsts.get(_layout(c)) == c]

    def second_stage(self) -> list[str]:
        """The candidates not yet tried whose layout's first candidate was measured to the end; the others become
        ``skipped`` rows naming that candidate."""
        firsts = {_layout(r.candidate): r for c in self.eligible if (r := self.results.get(c.name))}
        names = []
        for candidate in self.order:
            if candidate.name in self.results:
                continue
            first = firsts.get(_layout(candidate))
            if first is None or first.state == "measured":
                names.append(candidate.name)
            else:
                self.results[candidate.name] = Row(candidate, "skipped", note=f"{first.candidate.name} {first.state}")
        return names

    def next_round(self, best: int | None, min_gain: float, backward: bool = False) -> list[str]:
        """Plain DDP and the ``best`` fastest others measured so far (``None``: all of them), in the first round's
        order, ``backward`` in reverse (plain DDP last); pruned, skipped and failed candidates are not measured
        again. Empty when the round cannot change the choice: fewer than two candidates that could be chosen are
        left, or (``best`` set) plain DDP is the choice so far (a second look at the others would only matter for a
        gain within noise).

        Why backward: the machine's speed drifts while the calibration runs (the first minute after start-up is often
        slower on a loaded machine). Plain DDP is measured first; measured again last, its two rounds bracket every
        other candidate's, so with each candidate keeping its best round a drift in either direction cannot make
        another candidate look faster than plain DDP (rounds A B C, then C B A)."""
        done = [r for c in self.order if (r := self.results.get(c.name)) and r.state in ("measured", "reference")]
        others = sorted((r for r in done if not r.candidate.is_plain_ddp), key=lambda r: -(r.tokens_per_s or 0.0))
        keep = {r.candidate for r in others[:best]} | {PLAIN_DDP}
        names = [r.candidate.name for r in done if r.candidate in keep]
        if sum(r.state == "measured" and r.candidate.name in names for r in done) < 2:
            return []
        if best is not None and choose(done, self.eligible, min_gain).candidate.is_plain_ddp:
            return []
        return names[::-1] if backward else names

    def leaders(self, count: int) -> list[Row]:
        """The ``count`` fastest eligible others by what was measured of them so far (pruned ones by their steps
        before they stopped): the ones the paired rounds put against plain DDP."""
        rows = [r for c in self.eligible if not c.is_plain_ddp and (r := self.results.get(c.name))
                and r.state in ("measured", "pruned") and r.tokens_per_s]
        return sorted(rows, key=lambda r: -(r.tokens_per_s or 0.0))[:count]

    def _timer(self, candidate: Configuration, trial: optuna.Trial, first: bool) -> _StepTimer:
        cfg = candidate.apply(self.cfg)
        tune = self.cfg.tune
        accumulate = int(cfg.trainer.get("accumulate_grad_batches", 1) or 1)
        # The first fit of a process also pays one-off costs (kernel selection, allocator growth): untimed steps.
        warmup = tune.warmup_steps + (tune.first_warmup_steps if first else 0)
        # Never pruned: plain DDP (every ratio's base) and the first eligible candidate (so that one is measured).
        prune = self.pruning and tune.prune and not candidate.is_plain_ddp and candidate != self.eligible[0]
        return _StepTimer(trial, warmup * accumulate, prune=prune)

    def _measure(self, candidate: Configuration, timer: _StepTimer) -> None:
        from lightning_deepseek.data import TextDataModule
        from lightning_deepseek.models import LightningGPT

        cfg = candidate.apply(self.cfg)
        accumulate = int(cfg.trainer.get("accumulate_grad_batches", 1) or 1)
        callbacks: list[Callback] = []
        if cfg.compression.get("callback") is not None:
            # Timed steps must be compressed ones: the compression warm-up (uncompressed steps) is skipped here.
            callbacks.append(instantiate(cfg.compression.callback, warmup_steps=0))
        callbacks += [instantiate(node) for node in (cfg.get("callbacks") or {}).values()]
        kwargs: dict[str, Any] = {k: cfg.trainer[k] for k in ("accelerator", "devices", "num_nodes",
                                                              "gradient_clip_val", "accumulate_grad_batches")
                                  if k in cfg.trainer}
        plugins = [instantiate(cfg.precision.plugin)] if cfg.precision.get("plugin") is not None else None
        if plugins is None:
            kwargs["precision"] = cfg.precision.name
        pl.seed_everything(cfg.seed, workers=True, verbose=False)
        data = TextDataModule(**self.plan.data_kwargs, cache_dir=self.folder.path)
        model = LightningGPT(self.plan.model_config, **cfg.optim)
        trainer = pl.Trainer(**kwargs, strategy=instantiate(cfg.strategy), plugins=plugins,
                             callbacks=[*callbacks, timer],
                             max_steps=timer.warmup_batches // accumulate + self.cfg.tune.steps,
                             limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=self.folder.path)
        trainer.fit(model, datamodule=data)


def _layout(candidate: Configuration) -> tuple[Any, ...]:
    """What the staged search measures first: the rank layout, apart from compression and bucket size."""
    return candidate.strategy, candidate.tensor_parallel_size, candidate.expert_parallel_size


def _phases(timer: _StepTimer, started: float, earlier: dict[str, float]) -> dict[str, float]:
    """One fit's wall time by phase (see :class:`Row`), added to the candidate's earlier rounds."""
    done = time.perf_counter()
    marks = [started, timer.first_batch_at or done, timer.start or done, timer.end or done, done]
    out = dict(earlier)
    for phase, begin, end in zip(("setup", "warmup", "timed", "teardown"), marks, marks[1:]):
        out[phase] = round(out.get(phase, 0.0) + max(end - begin, 0.0), 4)
    return out


@contextlib.contextmanager
def _quiet_trainers() -> Iterator[None]:
    """The measuring trainers' start-up lines and warnings (accelerator, strategy plan) and Optuna's trial lines
    are not printed: the table says what was measured, and the training that follows prints its own."""
    logger = logging.getLogger("lightning.pytorch")
    level, verbosity = logger.level, optuna.logging.get_verbosity()
    logger.setLevel(logging.WARNING)
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # its per-trial lines; run_trials prints its own
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)
        optuna.logging.set_verbosity(verbosity)


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    """The objects alive before the first fit (the imports, the config: hundreds of thousands) are left out of the
    garbage collector's scans until the calibration ends (``gc.freeze``), so the collection before each fit scans
    only what the fits made. Nothing is kept alive by this: frozen objects return to the collector's oldest
    generation at the end (``gc.unfreeze``)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _pruner(tune: DictConfig) -> optuna.pruners.BasePruner:
    """Optuna's ``MedianPruner`` over the timed steps (``tune.prune``): a candidate whose best throughput so far is
    below the median of the finished trials at the same step stops there, from its first timed step on."""
    if not tune.prune:
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0)


def _trials(calibrator: Calibrator, pruner: optuna.pruners.BasePruner) -> Callable[[list[str]], None]:
    """The function that measures the named configurations, in that order, as the next trials of one Optuna study
    (:meth:`Calibrator.run` each; the pruner sees every trial of the calibration)."""
    sampler = _InOrder([])
    study = optuna.create_study(direction="maximize", pruner=pruner, study_name="lds-tune", sampler=sampler)
    space = {"candidate": CategoricalDistribution([c.name for c in calibrator.order])}

    def measure(names: list[str]) -> None:
        if names:
            sampler.names += names
            # run_trials counts the failed trials of its own call only: the earlier calls' are left out of the total.
            failed = len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,)))
            run_trials(study, space, calibrator.run, n_trials=len(sampler.names) - failed, max_failure_rate=1.0,
                       log_prefix="tune")
    return measure


def calibrate(cfg: DictConfig, plan: Any, folder: Any) -> Calibration:
    """Measure the candidates of ``cfg.tune`` in this run's processes and choose; see the module docstring.

    Args:
        cfg: the composed ``lds-train`` config (``tune.mode`` quick or grid, checked by ``check_tune``).
        plan: the run's ``RunPlan`` (model shape, data arguments).
        folder: the run's ``RunFolder`` (the data cache, and where ``tune.txt`` goes).
    """
    started, cpu_before = time.perf_counter(), cpu_times()
    forced = forced_settings(cfg, task_overrides())
    experts = int(getattr(plan.model_config, "n_routed_experts", 0) or 0)
    eligible = configurations(cfg, forced, experts)
    order = eligible if eligible[0].is_plain_ddp else [PLAIN_DDP, *eligible]
    calibrator = Calibrator(cfg, plan, folder, order, eligible)
    staged = bool(cfg.tune.get("staged", False))
    quiet = contextlib.redirect_stderr(io.StringIO()) if not folder.is_launcher else contextlib.nullcontext()
    with _quiet_trainers(), _frozen_heap(), quiet:
        measure = _trials(calibrator, _pruner(cfg.tune))
        measure(calibrator.first_stage(staged))
        if staged:
            measure(calibrator.second_stage())
        for later in range(1, int(cfg.tune.rounds)):  # interleaved: every candidate left once per round
            measure(calibrator.next_round(cfg.tune.get("recheck_best"), float(cfg.tune.min_gain),
                                          backward=later % 2 == 1))
        settled = paired_rounds(calibrator, measure, cfg)
    rows = [calibrator.results.get(c.name, Row(c, "failed", note="did not run")) for c in order]
    choice = settled.choice if settled is not None else choose(
        rows, eligible, float(cfg.tune.min_gain), float(cfg.tune.noise_margin), int(cfg.tune.steps))
    up_at = calibrator.up_at or started
    return Calibration(str(cfg.tune.mode), rows, choice.candidate, time.perf_counter() - up_at,
                       describe_forced(cfg, forced), float(cfg.tune.min_gain), launch_seconds=up_at - started,
                       reason=choice.reason, margin=choice.margin, stolen=stolen_share(cpu_before, cpu_times()),
                       paired=settled.ratios if settled else {})


def calibrated_config(cfg: DictConfig, plan: Any, folder: Any) -> DictConfig:
    """``cfg`` with the calibration's choice applied and a ``TuneReport`` callback carrying the summary rows; the
    launching process prints the table and writes it to the run folder.

    Not measured: a resumed run continues with the choice its own run folder recorded (``tune.json`` beside its
    ``checkpoints``), as its checkpoint was written with it; ``tune=auto`` with nothing to choose from (one
    process, or every setting kept) trains as configured, and a pipeline run with its one configuration, saying
    why in one line; a later trial of a sweep trains with the choice of the sweep's first calibration
    (:mod:`~lightning_deepseek.app.tune.sweep_choice`).
    """
    folder.claim()
    if plan.resume is not None:
        return _resumed_choice(cfg, Path(plan.resume), folder.is_launcher)
    if nothing_to_choose(cfg, int(getattr(plan.model_config, "n_routed_experts", 0) or 0)) is not None:
        # Only tune=auto gets here (check_tune raised for quick and grid): the user's settings stand.
        return cfg if pipeline_reason(cfg) is None else _pipeline_choice(cfg, folder.is_launcher)
    table = sweep_table(cfg, forced_settings(cfg, task_overrides()))
    found = shared_choice(table)
    if found is not None:
        return _sweep_choice(cfg, found, folder)
    calibration = calibrate(cfg, plan, folder)
    if folder.is_launcher:
        calibration.write(folder.path)
        publish(table, folder.path / "tune.json")
        print(calibration.table(), flush=True)
    return _with_report(calibration.choice.apply(cfg), calibration.summary())


def _pipeline_choice(cfg: DictConfig, is_launcher: bool) -> DictConfig:
    only, why = pipeline_configuration(cfg), pipeline_reason(cfg)
    if is_launcher:
        print(f"lds-train: tune=auto: no calibration, training with {' '.join(only.overrides())}: {why}.",
              flush=True)
    return _with_report(only.apply(cfg), {"tune_choice": f"{only.name} (pipeline)", "tune_reason": why})


def _sweep_choice(cfg: DictConfig, table: Path, folder: Any) -> DictConfig:
    recorded = reused(table)
    choice = Configuration(**recorded["choice_fields"])
    if folder.is_launcher:
        folder.path.mkdir(parents=True, exist_ok=True)  # tune.json beside the checkpoints: a resume keeps the choice
        (folder.path / "tune.json").write_text(json.dumps({**recorded, "reused_from": str(table)}, indent=2))
        print(f"lds-train: tune: this sweep calibrated once ({table}): training with {choice.name} (no new "
              "calibration; tune=none on the sweep's command line trains as configured instead)", flush=True)
    ratio = next((r["vs_plain_ddp"] for r in recorded["rows"] if r["name"] == choice.name), None)
    return _with_report(choice.apply(cfg), {"tune_choice": f"{choice.name} (sweep)",
                                            "tune_vs_plain_ddp": round(ratio, 3) if ratio is not None else None})


def _resumed_choice(cfg: DictConfig, checkpoint: Path, is_launcher: bool) -> DictConfig:
    # run/checkpoints/last.ckpt, or a DCP folder run/checkpoints/step-N: the run folder is at most 3 levels up.
    found = next((p / "tune.json" for p in list(checkpoint.parents)[:3] if (p / "tune.json").is_file()), None)
    if found is None:
        return cfg  # a run without calibration: its settings are the ones given
    recorded = json.loads(found.read_text())
    choice = Configuration(**recorded["choice_fields"])
    if is_launcher:
        print(f"lds-train: tune: resuming with the choice of {found.parent}: {choice.name} (no new calibration)",
              flush=True)
    return _with_report(choice.apply(cfg), {"tune_choice": f"{choice.name} (resumed)"})


def _with_report(cfg: DictConfig, rows: dict[str, Any]) -> DictConfig:
    callbacks = OmegaConf.to_container(cfg.callbacks) if cfg.get("callbacks") else {}
    callbacks["tune_report"] = {"_target_": f"{TuneReport.__module__}.TuneReport", "rows": rows}
    cfg.callbacks = callbacks
    return cfg
