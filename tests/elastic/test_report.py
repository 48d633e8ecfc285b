"""Progress/health reports: spike detection, the incremental reader, and a non-finite loss reported by a run."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl

from lightning_deepseek.data import TextDataModule
from lightning_deepseek.elastic import ElasticTraining, GradNormMonitor, Reports, write_report
from lightning_deepseek.models import GPTConfig, LightningGPT
from tests.elastic.audit import write_corpus


def test_grad_norm_spikes_and_non_finite_norms_are_flagged() -> None:
    monitor = GradNormMonitor(spike_factor=5.0)
    assert [monitor.update(n) for n in (1.0, 1.2, 0.9, 20.0, 1.1, math.inf, math.nan)] == [
        False, False, False, True, False, True, True]
    assert 0.9 < monitor.mean < 1.2  # spikes do not drag the running mean up


def test_reader_returns_each_record_once_and_waits_for_a_partial_line(tmp_path: Path) -> None:
    path = tmp_path / "reports.jsonl"
    reports = Reports(path)
    assert reports.read_new() == []
    write_report(path, "progress", step=1)
    with open(path, "a") as handle:
        handle.write('{"event": "progress", "st')  # a writer caught mid-line
    assert [r["step"] for r in reports.read_new()] == [1]
    with open(path, "a") as handle:
        handle.write('ep": 2}\n')
    assert [r["step"] for r in reports.read_new()] == [2]
    assert reports.latest_progress["step"] == 2


class DivergingGPT(LightningGPT):
    """Its loss turns NaN at optimizer step 2 (a diverging run)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step == 2 else loss


def test_non_finite_loss_is_reported_at_once(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus.txt")
    data = TextDataModule(path=str(corpus), block_size=16, batch_size=2, cache_dir=tmp_path)
    model = DivergingGPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32))
    elastic = ElasticTraining(tmp_path / "ckpt", global_batch_size=8, report_every_n_steps=100)
    pl.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
               callbacks=[elastic]).fit(model, datamodule=data)
    records = Reports(tmp_path / "ckpt" / "reports.jsonl").read_new()
    progress = [r for r in records if r["event"] == "progress"]
    assert progress[0]["step"] == 3 and progress[0]["non_finite_loss"] and progress[0]["loss"] is None
