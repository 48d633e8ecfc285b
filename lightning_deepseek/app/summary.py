"""``RunSummary``: the end-of-run report of ``lds-train`` (tokens/s, losses, wall time, a loss plot).

Any component (callback, strategy, precision plugin) adds to the report through the library's reporting protocol
(:mod:`lightning_deepseek.reporting`: ``summary()`` rows, ``events()`` steps to mark on the plot). Rank 0 writes
``summary.json``, ``summary.txt`` and ``loss.png`` to the run folder and prints the table.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_deepseek.reporting import Reporting, ReportingEvents


def _components(trainer: pl.Trainer) -> list[Any]:
    return [trainer.strategy, trainer.strategy.precision_plugin, *trainer.callbacks]


def _num_data_shards(trainer: pl.Trainer) -> int:
    """Ranks reading distinct batches: the distributed sampler's replicas (under a pipeline its ``dp`` size, the
    ranks of one pipeline reading the same batch), else the world."""
    sampler_kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return sampler_kwargs.get("num_replicas", trainer.world_size)


class RunSummary(Callback):
    """Collects throughput and loss curves; on rank 0 prints a summary and writes it with a plot.

    Args:
        run_dir: folder for ``summary.json``, ``summary.txt`` and ``loss.png``.
        plot: whether to draw ``loss.png``.
    """

    def __init__(self, run_dir: str | Path, plot: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.plot = plot
        self.train_curve: list[tuple[int, float]] = []
        self.val_curve: list[tuple[int, float]] = []
        self.lr_curve: list[tuple[int, float]] = []
        self.num_tokens = 0
        self.train_seconds = 0.0
        self._fit_start = 0.0
        self._batch_start = 0.0
        self.report: dict[str, Any] = {}

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_start = time.perf_counter()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._batch_start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.train_seconds += time.perf_counter() - self._batch_start
        self.num_tokens += batch[0].numel() * _num_data_shards(trainer)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None and trainer.global_step % max(1, trainer.log_every_n_steps) == 0:
            self.train_curve.append((trainer.global_step, float(loss.detach())))
            if trainer.optimizers:  # the learning rate this step used (the scheduler steps after this hook)
                self.lr_curve.append((trainer.global_step, float(trainer.optimizers[0].param_groups[0]["lr"])))

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        val = trainer.callback_metrics.get("val_loss")
        if val is not None:
            self.val_curve.append((trainer.global_step, float(val)))

    @override
    def state_dict(self) -> dict[str, Any]:
        """The curves and counts so far: a resumed run's summary covers the whole run."""
        return {"train_curve": self.train_curve, "val_curve": self.val_curve, "lr_curve": self.lr_curve,
                "num_tokens": self.num_tokens, "train_seconds": self.train_seconds}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.train_curve = [tuple(point) for point in state_dict["train_curve"]]
        self.val_curve = [tuple(point) for point in state_dict["val_curve"]]
        self.lr_curve = [tuple(point) for point in state_dict.get("lr_curve", [])]
        self.num_tokens = state_dict["num_tokens"]
        self.train_seconds = state_dict["train_seconds"]

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        from lightning_deepseek.app.checkpointing import RunInterrupted

        if isinstance(exception, RunInterrupted):  # every rank stopped at the same step: report as at the end
            self._finish(trainer, stopped_by=str(exception))

    def _finish(self, trainer: pl.Trainer, stopped_by: str | None = None) -> None:
        extras: dict[str, Any] = {}
        events: list[tuple[int, str]] = []
        for component in _components(trainer):
            if isinstance(component, Reporting):
                extras.update(component.summary())
            if isinstance(component, ReportingEvents):
                events.extend(component.events())
        # Every rank calls summary() above (it may run collectives); only rank 0 writes.
        if trainer.global_rank != 0:
            return
        self.report = {
            "steps": trainer.global_step,
            "world_size": trainer.world_size,
            "tokens_per_s": round(self.num_tokens / max(self.train_seconds, 1e-9)),
            "wall_time_s": round(time.perf_counter() - self._fit_start, 1),
            "train_loss_first": self.train_curve[0][1] if self.train_curve else None,
            "train_loss_final": self.train_curve[-1][1] if self.train_curve else None,
            "val_loss_first": self.val_curve[0][1] if self.val_curve else None,
            "val_loss_final": self.val_curve[-1][1] if self.val_curve else None,
            **extras,
        }
        if stopped_by:
            self.report["stopped_by"] = stopped_by
        self.run_dir.mkdir(parents=True, exist_ok=True)
        text = self.format(self.report)
        (self.run_dir / "summary.txt").write_text(text + "\n")
        (self.run_dir / "summary.json").write_text(json.dumps(
            {**self.report, "train_curve": self.train_curve, "val_curve": self.val_curve, "lr_curve": self.lr_curve,
             "events": events},
            indent=2, default=str))
        if self.plot:
            self._plot(events)
        print("\n" + text, flush=True)

    @staticmethod
    def format(report: dict[str, Any]) -> str:
        width = max(len(k) for k in report)
        lines = ["run summary", "-" * (width + 24)]
        for key, value in report.items():
            shown = f"{value:.5g}" if isinstance(value, float) else str(value)
            lines.append(f"{key:<{width}}  {shown}")
        return "\n".join(lines)

    def _plot(self, events: list[tuple[int, str]]) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        if self.train_curve:
            steps, losses = zip(*self.train_curve)
            ax.plot(steps, losses, color="tab:blue", alpha=0.25, linewidth=0.8, label="train loss (raw)")
            weight = min(0.9, max(0.0, 1 - 10 / len(losses)))  # about a tenth of the curve; none for a few points
            ax.plot(steps, smooth(losses, weight), color="tab:blue", label=f"train loss (smoothed, {weight:.2f})")
        if self.val_curve:
            ax.plot(*zip(*self.val_curve), "o-", color="tab:orange", label="validation loss")
        for step, label in events:
            ax.axvline(step, color="grey", linestyle=":", linewidth=1)
            ax.annotate(label, (step, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top",
                        fontsize=7, color="grey")
        handles, labels = ax.get_legend_handles_labels()
        if self.lr_curve:
            lr_ax = ax.twinx()
            lr_ax.plot(*zip(*self.lr_curve), color="tab:green", linestyle="--", linewidth=1, label="learning rate")
            lr_ax.set_ylabel("learning rate", color="tab:green")
            lr_ax.tick_params(axis="y", colors="tab:green")
            lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
            more_handles, more_labels = lr_ax.get_legend_handles_labels()
            handles, labels = handles + more_handles, labels + more_labels
        ax.set_title(f"run {self.run_dir.parent.name}/{self.run_dir.name}", fontsize=9)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("cross-entropy (nats/byte)")
        ax.legend(handles, labels, fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(self.run_dir / "loss.png", dpi=110)
        plt.close(fig)



def smooth(values: Any, weight: float = 0.9) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased so that it starts at the first value."""
    out, average = [], 0.0
    for i, value in enumerate(values, start=1):
        average = weight * average + (1 - weight) * value
        out.append(average / (1 - weight**i))
    return out
