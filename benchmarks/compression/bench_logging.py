"""What a callback's per-step ``log_dict`` costs a Lightning step.

``GradientCompression``, ``StagedPrecision`` and ``MoEBalancing`` logged their metrics on every step; they now log
on the steps Lightning's loggers write (``log_every_n_steps``), as Lightning's own monitors do. This times one
process training a 4 x 4 linear layer (steps of well under a millisecond, so the logging is what shows), with a
callback logging four scalars every step, on logging steps only, or not at all, the runs alternating::

    .venv/bin/python benchmarks/compression/bench_logging.py [--steps 400] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)
        self.step_times: list[float] = []
        self._start = 0.0

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def on_train_batch_start(self, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.step_times.append(time.perf_counter() - self._start)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Log(pl.Callback):
    """Logs four scalars after backward, as ``GradientCompression`` does; ``gated``: on logging steps only."""

    def __init__(self, gated: bool) -> None:
        self.gated = gated

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.gated and not trainer._logger_connector.should_update_logs:
            return
        pl_module.log_dict({"c/a": 1.0, "c/b": 2.0, "c/c": 3.0, "c/d": 4.0}, on_step=True, on_epoch=False,
                           batch_size=1)


def _median_step_ms(callbacks: list[pl.Callback], steps: int) -> float:
    module = _Tiny()
    data = DataLoader(TensorDataset(torch.randn(steps, 4)), batch_size=1)
    pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=50,
               callbacks=callbacks).fit(module, data)
    return 1e3 * statistics.median(module.step_times[steps // 8:])


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    rows = {"no logging": [], "every step": [], "logging steps (log_every_n_steps=50)": []}
    for _ in range(args.repeats):
        rows["no logging"].append(_median_step_ms([], args.steps))
        rows["every step"].append(_median_step_ms([_Log(gated=False)], args.steps))
        rows["logging steps (log_every_n_steps=50)"].append(_median_step_ms([_Log(gated=True)], args.steps))
    print("| callback | median step (per run) |\n|---|---|")
    for name, values in rows.items():
        print(f"| {name} | {statistics.median(values):.2f} ms ({', '.join(f'{v:.2f}' for v in values)}) |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    main(parser.parse_args())
