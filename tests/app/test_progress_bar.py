"""The console's progress bar: rich's label without a negative epoch total; Lightning's choices otherwise."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from torch.utils.data import DataLoader, TensorDataset

from lightning_deepseek.app import progress_bar as module
from lightning_deepseek.app.progress_bar import StepLimitedRichProgressBar, progress_bar


class _Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(4, 4), torch.randn(4, 1)), batch_size=2)  # 2 steps an epoch


def _train_label(tmp_path: Path, **limits: int) -> str:
    pytest.importorskip("rich")
    bar = progress_bar(True, [])[0]
    trainer = pl.Trainer(**limits, callbacks=[bar], logger=False, enable_checkpointing=False,
                         enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(_Regression())
    return bar.progress.tasks[bar.train_progress_bar_id].description.strip()


def test_a_step_limited_run_shows_no_epoch_total(tmp_path: Path) -> None:
    assert _train_label(tmp_path, max_steps=5, max_epochs=-1) == "Epoch 2"  # Lightning 2.6.6: "Epoch 2/-2"


def test_an_epoch_limited_run_keeps_lightnings_label(tmp_path: Path) -> None:
    assert _train_label(tmp_path, max_epochs=3) == "Epoch 2/2"


def test_lightnings_choice_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(module, "_RICH_AVAILABLE", True)
    assert type(progress_bar(True, [])[0]) is StepLimitedRichProgressBar
    assert progress_bar(False, []) == []  # Lightning refuses a bar callback with enable_progress_bar=False
    assert progress_bar(True, [RichProgressBar()]) == []  # the user's own bar is kept, and is the only one
    monkeypatch.setattr(module, "_RICH_AVAILABLE", False)
    assert type(progress_bar(True, [])[0]) is TQDMProgressBar
