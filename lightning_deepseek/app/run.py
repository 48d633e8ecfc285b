"""What ``lds-train`` decides before training: the validated run plan, the checkpoint to resume, the run folder.

``check_config`` checks the whole composed configuration in the launching process without importing torch or
Lightning (``config_checks.py``; this module imports neither): every group's settings, the model shape, the corpus
(read once), and ``resume`` (``auto``, a run folder, or a checkpoint) resolved to one complete checkpoint file;
the result is a frozen ``RunPlan``. ``check_with_torch`` then adds the checks that need torch (the model shape
stored in that checkpoint, the GPU count), still before any other process starts. Ranks that Lightning starts
later receive the resolved checkpoint through ``LDS_RESUME_RESOLVED`` rather than searching again.

``RunFolder`` owns the run folder Hydra created: it refuses one that a live run already uses, and a run that
fails on its configuration (or is stopped while launching) removes its folder when Hydra named it
(``outputs/<date>/<time>``) or leaves a ``FAILED`` file in it when the user named it (sweeps and batch jobs read
the log kept there).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from lightning_deepseek.app.checkpoint_files import checkpoints_in, is_complete, not_a_checkpoint
from lightning_deepseek.app.config_checks import check_gpus, check_groups, check_model_fields, describe_model_difference
from lightning_deepseek.app.errors import ConfigError
from lightning_deepseek.app.processes import is_launcher, pid_alive
from lightning_deepseek.app.tune.checks import check_tune
from lightning_deepseek.data.corpus import VOCAB_SIZE, check_splits, read_corpus
from lightning_deepseek.models.config import PRESETS, GPTConfig

CONFIG_DIR = str(Path(__file__).resolve().parent / "conf")  # packaged with the module; ./conf links here
_RESOLVED_ENV = "LDS_RESUME_RESOLVED"
_OWNER_FILE = ".lds-run.pid"


@dataclass(frozen=True)
class RunPlan:
    """The validated decisions of one run.

    Args:
        model_config: the model shape.
        data_kwargs: ``TextDataModule`` arguments (``block_size`` resolved).
        resume: the checkpoint to continue from (``None``: start fresh).
        note: what the launcher says about the resume, once.
    """

    model_config: GPTConfig
    data_kwargs: dict[str, Any]
    resume: str | None
    note: str | None = None


def build_model_config(cfg: DictConfig, vocab_size: int) -> GPTConfig:
    """``GPTConfig`` from ``model.preset`` plus any field set explicitly in the ``model`` group."""
    preset = cfg.model.preset
    if preset not in PRESETS:
        raise ConfigError(f"model.preset={preset!r} is not a known preset. Choose one of {sorted(PRESETS)} "
                          "(for example `model=tiny`).")
    check_model_fields(cfg.model)
    fields = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if k != "preset" and v is not None}
    return GPTConfig(vocab_size=vocab_size, **{**PRESETS[preset], **fields})


def check_config(cfg: DictConfig, folder: RunFolder) -> RunPlan:
    """Check every setting of a composed ``lds-train`` config without importing torch; raises ``ConfigError``
    naming the first bad one."""
    check_groups(cfg)
    model_config = build_model_config(cfg, VOCAB_SIZE)
    data_kwargs = OmegaConf.to_container(cfg.data, resolve=True)
    data_kwargs["block_size"] = data_kwargs.get("block_size") or model_config.block_size
    if data_kwargs["block_size"] > model_config.block_size:
        raise ConfigError(f"data.block_size={data_kwargs['block_size']} exceeds model.block_size="
                          f"{model_config.block_size}: lower data.block_size or pick a larger model preset.")
    check_splits(len(read_corpus(data_kwargs.get("path"))), data_kwargs["block_size"], data_kwargs["val_fraction"])
    resume, note = resolve_resume(cfg.get("resume"), folder)
    check_tune(cfg, model_config.n_routed_experts or 0)
    return RunPlan(model_config, data_kwargs, resume, note)


def check_with_torch(cfg: DictConfig, plan: RunPlan) -> None:
    """The checks that need torch (run after ``check_config``, before any other process starts): the GPU count,
    and the model shape stored in the checkpoint to resume."""
    check_gpus(cfg.trainer)
    if plan.resume is not None and plan.resume != "hpc":
        check_resume_shape(cfg.get("resume"), Path(plan.resume), plan.model_config)


def validate_config(cfg: DictConfig, folder: RunFolder) -> RunPlan:
    """``check_config`` then ``check_with_torch``: every check of a run, in the launching process."""
    plan = check_config(cfg, folder)
    check_with_torch(cfg, plan)
    return plan


def resolve_resume(resume: str | None, folder: RunFolder, model_config: GPTConfig | None = None,
                   ) -> tuple[str | None, str | None]:
    """The checkpoint that ``resume`` names, checked to be a complete checkpoint file; and a note. With
    ``model_config``, also checked to hold a model of that shape (which imports torch)."""
    if resume is None or resume == "":
        return None, None
    if resume == "hpc":  # Lightning resolves it in the run folder (SLURM)
        return resume, None
    if os.environ.get(_RESOLVED_ENV) is not None and not is_launcher():
        return os.environ[_RESOLVED_ENV] or None, None
    if resume in ("auto", "last"):  # last: Lightning's name for this run folder's newest checkpoint
        searched = folder.resume_candidates() if resume == "auto" else [folder.path]
        found = next((cps[-1] for f in searched if (cps := checkpoints_in(f))), None)
        if found is None:
            where = str(folder.path) if len(searched) == 1 else f"{folder.path} or other runs under {folder.root}"
            return _publish(None), f"resume={resume}: no complete checkpoint in {where}; starting fresh."
        path, note = found, f"resume={resume}: continuing from {found}"
    else:
        path = Path(resume).expanduser()
        if not path.exists():
            raise ConfigError(f"resume={resume!r} does not exist. Pass resume=auto, a run folder of lds-train, or a "
                              "checkpoint in it (for example resume=outputs/<date>/<time>), or drop resume.")
        if path.is_dir() and not is_complete(path):
            candidates = checkpoints_in(path)
            if not candidates:
                raise ConfigError(f"resume={resume!r} is a folder with no complete checkpoint (no checkpoints/step-*"
                                  ".ckpt, last.ckpt or hpc_ckpt_*.ckpt in it). Pass the folder of a run that saved "
                                  "one, or resume=auto.")
            path = candidates[-1]
        note = f"resume: continuing from {path}"
    if (reason := not_a_checkpoint(path)) is not None:
        raise ConfigError(f"resume={resume!r}: {reason}. Pass a checkpoint written by lds-train, its run folder, or "
                          "resume=auto.")
    if model_config is not None:
        check_resume_shape(resume, path, model_config)
    return _publish(str(path)), note


def check_resume_shape(resume: str, path: Path, model_config: GPTConfig) -> None:
    """The checkpoint at ``path`` holds a model of ``model_config``'s shape (reading it imports torch)."""
    from lightning_deepseek.app.checkpointing import checkpoint_model_config

    try:
        saved = checkpoint_model_config(path)
    except ValueError as exc:
        raise ConfigError(f"resume={resume!r}: {exc}. Pass a checkpoint written by lds-train, its run folder, or "
                          "resume=auto.") from None
    difference = describe_model_difference(saved or {}, asdict(model_config))
    if difference:
        preset = next((name for name, shape in PRESETS.items()
                       if all(saved.get(k) == v for k, v in shape.items())), None)
        hint = f"model={preset}" if preset else "the same model.* settings"
        raise ConfigError(f"resume={resume!r} holds a model of another shape: {difference}. Resume with {hint}, "
                          "or drop resume to start a new run.")


def _publish(path: str | None) -> str | None:
    os.environ[_RESOLVED_ENV] = path or ""  # ranks that Lightning starts inherit it
    return path


class RunFolder:
    """The run folder: claimed while a run uses it, removed or marked ``FAILED`` when its configuration fails.

    Args:
        path: the folder.
        named_by_hydra: whether Hydra chose the name (``outputs/<date>/<time>``), not the user.
    """

    def __init__(self, path: Path, named_by_hydra: bool) -> None:
        self.path = path
        self.named_by_hydra = named_by_hydra
        self.is_launcher = is_launcher()
        self._claimed = False

    @classmethod
    def from_config(cls, cfg: DictConfig) -> RunFolder:
        if not HydraConfig.initialized():
            return cls(Path(cfg.run_dir), named_by_hydra=False)
        hydra_cfg = HydraConfig.get()
        explicit = any(o.startswith("hydra.run.dir=") for o in hydra_cfg.overrides.hydra)
        multirun = str(hydra_cfg.mode) == "RunMode.MULTIRUN"
        return cls(Path(hydra_cfg.runtime.output_dir), named_by_hydra=not explicit and not multirun)

    @property
    def root(self) -> Path:
        return self.path.parent.parent  # outputs/ for outputs/<date>/<time>

    def resume_candidates(self) -> list[Path]:
        """Folders ``resume=auto`` searches, newest first: this run's, then (Hydra-named) the other runs'."""
        folders = [self.path]
        if self.named_by_hydra:
            others = [p for p in self.root.glob("*/*") if p.is_dir() and p != self.path]
            folders += sorted(others, key=lambda p: p.stat().st_mtime, reverse=True)
        return folders

    def claim(self) -> None:
        """Mark the folder as used by this process; refuse one that another live run uses."""
        if not self.is_launcher:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        owner = self.path / _OWNER_FILE
        try:
            pid = int(owner.read_text().strip() or 0)
        except (OSError, ValueError):
            pid = 0
        if pid and pid != os.getpid() and pid_alive(pid):
            raise FolderInUse(f"hydra.run.dir={str(self.path)!r} is in use by another lds-train run (pid {pid}). Give "
                              "each run its own folder (the default outputs/<date>/<time> is unique), or wait "
                              "for that run to end.")
        owner.write_text(str(os.getpid()))
        self._claimed = True

    def release(self) -> None:
        if self._claimed:
            (self.path / _OWNER_FILE).unlink(missing_ok=True)
            self._claimed = False

    def fail(self, exc: BaseException | str) -> None:
        """After a configuration error or a launch stopped by a signal: remove a Hydra-named folder holding no
        checkpoint and nothing but what the start-up wrote (Hydra's files, the token cache, empty loggers), else
        mark it ``FAILED`` (with the reason)."""
        if not self.is_launcher or isinstance(exc, FolderInUse) or not self.path.is_dir():
            return
        self.release()
        kept = {".hydra", _OWNER_FILE, "logs", "tb"}
        only_setup = not checkpoints_in(self.path) and all(
            p.name in kept or p.suffix == ".log" or p.name.startswith("tokens-") for p in self.path.iterdir())
        if self.named_by_hydra and only_setup:
            shutil.rmtree(self.path, ignore_errors=True)
            try:
                self.path.parent.rmdir()  # the date folder, if this was its only run
            except OSError:
                pass
            return
        (self.path / "FAILED").write_text(f"{' '.join(str(exc).split())}\n")


class FolderInUse(ConfigError):
    """The run folder belongs to another live run."""
