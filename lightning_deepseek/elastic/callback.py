"""``ElasticTraining``: a Lightning callback that lets a ``torchrun --nnodes=MIN:MAX`` job change size safely.

What it does, on every rank:

- **resume**: at ``on_fit_start`` it restores the newest complete checkpoint of ``checkpoint_dir`` (model,
  optimizers, loops, LR schedulers, precision plugin, every callback's and the datamodule's
  ``state_dict``), whatever world size wrote it (see ``checkpoint.py``);
- **checkpoint** every ``checkpoint_every_n_steps`` optimizer steps (asynchronously by default), at the end
  of training, and when any rank receives SIGTERM: torchrun's agent sends SIGTERM to its workers both when
  the agent itself is stopped (shrink) and when a new agent waits to join (grow). All ranks agree on the
  stop at the next optimizer-step boundary (one 1-element all-reduce per step), write a synchronous
  checkpoint of that step, then exit with code 75 so the agents re-rendezvous at the new size. No step is
  lost on a signalled resize; a crash (SIGKILL, lost node) loses the steps since the last complete checkpoint;
- **global batch**: keeps ``global_batch_size`` constant across world sizes by setting
  ``trainer.accumulate_grad_batches`` (``batch_policy="accumulate"``) or the datamodule's ``batch_size``
  (``"micro_batch"``), or keeps the per-rank batch and scales the learning rate linearly with the global
  batch (``"lr"``); the change is logged and reported;
- **data position**: installs an ``ElasticSampler`` whose ``(epoch, consumed_samples)`` is part of this
  callback's state, so that every sample of an epoch is trained exactly once across resizes;
- **reports** progress (samples/s, loss, gradient norm) and health (gradient-norm spikes, non-finite loss)
  to a JSON-lines file that the controller reads (``report.py``).

Requirements: the datamodule exposes ``batch_size`` and a ``train_sampler`` attribute that its
``train_dataloader`` passes as ``sampler=`` when set (``TextDataModule`` does). Lightning's own SIGTERM
handling (a broadcast from rank 0 inside the signal handler) is replaced during training, because in an
elastic job any rank may be the one signalled. Costs: one tiny all-reduce per optimizer step, a gradient-norm
pass per step, and the checkpoint writes. "World size" here is the number of data-parallel replicas, from the
strategy's ``distributed_sampler_kwargs`` (the process count for DDP). Not supported: manual optimization,
iterable datasets, and an integer ``val_check_interval`` (it counts micro-batches, whose number per step
changes with the world size). We wrote our own resume path because Lightning resumes only through
``trainer.fit(ckpt_path=...)``, chosen before the job knows which checkpoints are complete.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
import warnings
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_deepseek.elastic.checkpoint import CheckpointMismatchError, ElasticCheckpointer
from lightning_deepseek.elastic.report import GradNormMonitor, write_report
from lightning_deepseek.elastic.sampler import ElasticSampler
from lightning_deepseek.parallel.clipping import total_grad_norm

log = logging.getLogger(__name__)

RESTART_EXIT_CODE = 75  # EX_TEMPFAIL: "stopped for a resize, start me again"
BatchPolicy = Literal["accumulate", "micro_batch", "lr"]


class ElasticStop(SystemExit):
    """Raised on every rank after the stop checkpoint; torchrun's agent restarts the worker at the new size."""

    def __init__(self) -> None:
        super().__init__(RESTART_EXIT_CODE)


class ElasticTraining(Callback):
    """Checkpoint, resume and rescale a job whose world size changes under ``torchrun --nnodes=MIN:MAX``.

    Args:
        checkpoint_dir: folder of the job's checkpoints, on storage every node reads.
        global_batch_size: samples per optimizer step over all ranks, kept constant across world sizes.
        checkpoint_every_n_steps: optimizer steps between periodic checkpoints.
        batch_policy: ``"accumulate"``, ``"micro_batch"`` or ``"lr"`` (see the module docstring).
        async_save: write periodic checkpoints in the background (``dcp.async_save``).
        keep_last: complete checkpoints to keep.
        report_path: JSON-lines file for the controller; ``None`` writes ``<checkpoint_dir>/reports.jsonl``.
        report_every_n_steps: optimizer steps between progress records (health events are written at once).
        seed: seed of the per-epoch data permutation.
        shuffle: permute the data every epoch.
        grad_norm_spike_factor: a gradient norm this many times its running mean is reported as a spike.
    """

    def __init__(
        self,
        checkpoint_dir: str | Path,
        global_batch_size: int,
        checkpoint_every_n_steps: int = 50,
        batch_policy: BatchPolicy = "accumulate",
        async_save: bool = True,
        keep_last: int = 2,
        report_path: str | Path | None = None,
        report_every_n_steps: int = 10,
        seed: int = 0,
        shuffle: bool = True,
        grad_norm_spike_factor: float = 5.0,
    ) -> None:
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size={global_batch_size} must be a positive integer.")
        if checkpoint_every_n_steps < 1 or report_every_n_steps < 1:
            raise ValueError(f"checkpoint_every_n_steps={checkpoint_every_n_steps} and report_every_n_steps="
                             f"{report_every_n_steps} must both be positive integers.")
        if batch_policy not in ("accumulate", "micro_batch", "lr"):
            raise ValueError(f"batch_policy={batch_policy!r} is not one of 'accumulate', 'micro_batch', 'lr'.")
        self.checkpointer = ElasticCheckpointer(checkpoint_dir, keep_last=keep_last, async_save=async_save)
        self.global_batch_size = global_batch_size
        self.checkpoint_every_n_steps = checkpoint_every_n_steps
        self.batch_policy = batch_policy
        self.report_path = Path(report_path) if report_path is not None else Path(checkpoint_dir) / "reports.jsonl"
        self.report_every_n_steps = report_every_n_steps
        self.seed = seed
        self.shuffle = shuffle
        self.grad_norms = GradNormMonitor(grad_norm_spike_factor)
        self.sampler: ElasticSampler | None = None
        # Resumable state: the data position and what the batch policy applied, so a resize is visible.
        self.epoch = 0
        self.consumed_samples = 0
        self.steps_in_epoch = 0
        self.world_size = 0
        self.accumulate = 1
        self.micro_batch_size = 0
        self.lr_scale = 1.0
        self._restored: dict[str, Any] | None = None
        self._sigterm = False
        self._last_step = 0
        self._grad_norm = float("nan")
        self._report_clock: tuple[float, int] = (time.monotonic(), 0)

    # ---------------------------------------------------------------- set-up and resume
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._reported_done = False
        if stage != "fit":
            return
        datamodule = trainer.datamodule
        if datamodule is None or not hasattr(datamodule, "train_sampler") or not hasattr(datamodule, "batch_size"):
            raise TypeError(
                "ElasticTraining needs a LightningDataModule with a `batch_size` attribute and a `train_sampler` "
                "attribute (None by default) that train_dataloader() passes as `sampler=` when set, like "
                "lightning_deepseek.data.TextDataModule. Add both to your datamodule and call trainer.fit(model, "
                "datamodule=...)."
            )
        # Data shards follow the strategy (a tensor-parallel strategy may place them by mesh coordinate).
        shard = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
        self.world_size = shard["num_replicas"]
        self.accumulate, self.micro_batch_size = self._batch_split(trainer, datamodule.batch_size)
        trainer.accumulate_grad_batches = self.accumulate
        datamodule.batch_size = self.micro_batch_size
        dataset = datamodule.train_dataloader().dataset
        self.sampler = ElasticSampler(dataset, self._actual_global_batch, self.micro_batch_size, self.world_size,
                                      shard["rank"], seed=self.seed, shuffle=self.shuffle)
        datamodule.train_sampler = self.sampler
        self.checkpointer.setup()
        # Lightning cannot see that the position lives in this callback's state and warns on every mid-epoch resume.
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")

    def _batch_split(self, trainer: pl.Trainer, batch_size: int) -> tuple[int, int]:
        """``(accumulate_grad_batches, micro_batch_size)`` for this world size under the batch policy."""
        if self.batch_policy == "lr":
            return trainer.accumulate_grad_batches, batch_size
        knob_value = batch_size if self.batch_policy == "accumulate" else trainer.accumulate_grad_batches
        per_step = self.world_size * knob_value
        if self.global_batch_size % per_step:
            knob = "micro-batch size" if self.batch_policy == "accumulate" else "accumulate_grad_batches"
            raise ValueError(
                f"ElasticTraining(global_batch_size={self.global_batch_size}) is not divisible by world size "
                f"{self.world_size} x {knob} {per_step // self.world_size}. Choose a global batch size divisible "
                "by every world size in [min_workers, max_workers] times that value, or batch_policy='lr'."
            )
        if self.batch_policy == "accumulate":
            return self.global_batch_size // per_step, batch_size
        return trainer.accumulate_grad_batches, self.global_batch_size // per_step

    @property
    def _actual_global_batch(self) -> int:
        return self.world_size * self.micro_batch_size * self.accumulate

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        info = self.checkpointer.latest()
        if info is not None:
            try:
                self.checkpointer.load(trainer, info)
            except CheckpointMismatchError as exc:
                self._report(trainer, "fatal", message=str(exc))
                raise
            rank_zero_info(f"ElasticTraining: resumed from {info.path} (step {info.step}, written at world size "
                           f"{info.world_size}, now {self.world_size}).")
            self._report(trainer, "resumed", from_step=info.step, from_world_size=info.world_size,
                         process_age_s=_process_age_s())
        self._apply_restored(trainer)
        if self.batch_policy == "lr":
            self._rescale_lr(trainer, self._actual_global_batch / self.global_batch_size)
        self.sampler.set_position(self.epoch, self.consumed_samples, self.steps_in_epoch)

    def _apply_restored(self, trainer: pl.Trainer) -> None:
        """Log a world-size change and adapt the restored progress counters to the new split."""
        old = self._restored
        self._restored = None
        if old is None:
            return
        self.lr_scale = old["lr_scale"]
        if old["world_size"] != self.world_size:
            rank_zero_info(
                f"ElasticTraining: world size {old['world_size']} -> {self.world_size}; global batch "
                f"{old['global_batch']} -> {self._actual_global_batch} (policy {self.batch_policy}): "
                f"accumulate_grad_batches {old['accumulate']} -> {self.accumulate}, micro-batch "
                f"{old['micro_batch_size']} -> {self.micro_batch_size}."
            )
            self._report(trainer, "resized", from_world_size=old["world_size"], accumulate=self.accumulate,
                         micro_batch_size=self.micro_batch_size, global_batch=self._actual_global_batch)
        # Lightning counts micro-batches of this epoch; their number per step depends on the split. increment_by
        # is the progress tracker's own method for a jump (every counter of `current` and `total`, by `delta`).
        progress = trainer.fit_loop.epoch_loop.batch_progress
        delta = self.steps_in_epoch * self.accumulate - progress.current.processed
        progress.increment_by(delta, is_last_batch=progress.is_last_batch)

    def _rescale_lr(self, trainer: pl.Trainer, scale: float) -> None:
        factor = scale / self.lr_scale
        if factor != 1.0:
            for optimizer in trainer.optimizers:
                for group in optimizer.param_groups:
                    group["lr"] *= factor
                    if "initial_lr" in group:
                        group["initial_lr"] *= factor
            for config in trainer.lr_scheduler_configs:
                # In place: the scheduler may be wrapped (StagedPrecision forwards attribute reads, not writes);
                # ReduceLROnPlateau has no base_lrs and works on the param groups scaled above.
                base_lrs = getattr(config.scheduler, "base_lrs", None)
                if base_lrs is not None:
                    base_lrs[:] = [lr * factor for lr in base_lrs]
            rank_zero_info(f"ElasticTraining: learning rate scaled by {factor:.4g} (global batch "
                           f"{self._actual_global_batch}, reference {self.global_batch_size}).")
        self.lr_scale = scale

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning registered its handler just before training; any rank may be signalled here, not only 0.
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self._last_step = trainer.global_step
        self._report_clock = (time.monotonic(), trainer.global_step)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._sigterm = True

    # ---------------------------------------------------------------- every step
    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._follow_epoch(trainer)

    def _follow_epoch(self, trainer: pl.Trainer) -> None:
        """A new epoch starts the data position at zero (the sampler's ``set_epoch`` does the same). Also called at
        every step boundary: Lightning 2.6 skips ``on_train_epoch_start`` of the epoch that follows a resume from a
        checkpoint written at an epoch's last batch (its fit loop still counts itself restarted mid-epoch)."""
        if trainer.current_epoch != self.epoch:
            self.epoch, self.consumed_samples, self.steps_in_epoch = trainer.current_epoch, 0, 0

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        # Shared with clipping: accumulates on the gradients' device, one all-reduce per shard group (not per DTensor).
        self._grad_norm = float(total_grad_norm(pl_module.parameters()))

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._last_step:
            return  # inside an accumulation window: not a step boundary
        self._last_step = step = trainer.global_step
        self._follow_epoch(trainer)
        self.consumed_samples += self._actual_global_batch
        self.steps_in_epoch += 1
        self._health(trainer, outputs)
        self.checkpointer.poll()
        if self._agree_to_stop(trainer):
            self.checkpointer.save(trainer, step, blocking=True)
            self.checkpointer.barrier()
            self._report(trainer, "stopping", checkpoint_step=step)
            rank_zero_info(f"ElasticTraining: SIGTERM, checkpointed step {step}; exiting for the resize.")
            raise ElasticStop()
        if step % self.checkpoint_every_n_steps == 0:
            self.checkpointer.save(trainer, step)

    def _agree_to_stop(self, trainer: pl.Trainer) -> bool:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self._sigterm
        flag = torch.tensor([int(self._sigterm)], device=trainer.strategy.root_device)  # NCCL needs a GPU tensor
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _health(self, trainer: pl.Trainer, outputs: Any) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        # Lightning hands back the loss divided by the accumulation steps.
        loss = float(loss.detach()) * self.accumulate if isinstance(loss, torch.Tensor) else None
        spike = self.grad_norms.update(self._grad_norm)
        non_finite = loss is not None and not math.isfinite(loss)
        step = trainer.global_step
        if spike or non_finite or step % self.report_every_n_steps == 0:
            start, start_step = self._report_clock
            now = time.monotonic()
            rate = (step - start_step) * self._actual_global_batch / max(now - start, 1e-9)
            self._report_clock = (now, step)
            self._report(trainer, "progress", samples_per_s=rate, loss=loss if not non_finite else None,
                         grad_norm=self._grad_norm if math.isfinite(self._grad_norm) else None,
                         grad_norm_spike=spike, non_finite_loss=non_finite, max_steps=trainer.max_steps)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.checkpointer.save(trainer, trainer.global_step, blocking=True)
        self._report(trainer, "done")
        self._reported_done = True

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A job resumed at max_steps trains nothing: Lightning skips the loop and on_train_end, so say it is done here.
        if 0 < trainer.max_steps <= trainer.global_step and not self._reported_done:
            self._report(trainer, "done")

    def _report(self, trainer: pl.Trainer, event: str, **fields: Any) -> None:
        if trainer.global_rank == 0:
            self.report_path.parent.mkdir(parents=True, exist_ok=True)
            write_report(self.report_path, event, step=trainer.global_step, world_size=self.world_size,
                         pid=os.getpid(), **fields)

    # ---------------------------------------------------------------- state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch, "consumed_samples": self.consumed_samples, "steps_in_epoch": self.steps_in_epoch,
            "world_size": self.world_size, "accumulate": self.accumulate,
            "micro_batch_size": self.micro_batch_size, "global_batch": self._actual_global_batch,
            "lr_scale": self.lr_scale, "grad_norm_mean": self.grad_norms.mean,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = state_dict["epoch"]
        self.consumed_samples = state_dict["consumed_samples"]
        self.steps_in_epoch = state_dict["steps_in_epoch"]
        self.grad_norms.mean = state_dict["grad_norm_mean"]
        self._restored = dict(state_dict)


def _process_age_s() -> float | None:
    """Seconds since this process started (Linux), to tell worker start-up apart from rendezvous in an outage."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")
