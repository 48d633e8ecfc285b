"""Step checkpoints in one process: exact resume after a crash, async snapshots, incomplete and foreign ones."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_deepseek import StagedPrecision
from lightning_deepseek.data import TextDataModule
from lightning_deepseek.elastic import CheckpointMismatchError, ElasticTraining, find_latest
from lightning_deepseek.models import GPTConfig, LightningGPT
from tests.elastic.audit import write_corpus

GLOBAL_BATCH = 8
STAGES = [("32-true", 0.3, "fraction"), ("16-mixed", 0.9, "fraction"), ("bf16-mixed", None, "fraction")]


class CrashAt(pl.Callback):
    """Simulates a worker dying right after optimizer step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("simulated crash")


class MutateAfterSave(pl.Callback):
    """Right after the (asynchronous) checkpoint of ``step`` starts, records the weights and overwrites them."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.saved: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and not self.saved:
            self.saved = {k: v.clone() for k, v in pl_module.state_dict().items()}
            with torch.no_grad():
                for param in pl_module.parameters():
                    param.add_(1.0)


def _fit(tmp_path: Path, max_steps: int, *callbacks: pl.Callback, n_embd: int = 32, ddp: bool = False,
         async_save: bool = False, staged: bool = False, strategy: DDPStrategy | None = None,
         **elastic_kwargs) -> tuple[LightningGPT, ElasticTraining]:
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        write_corpus(corpus)
    pl.seed_everything(0, verbose=False)
    data = TextDataModule(path=str(corpus), block_size=16, batch_size=2, cache_dir=tmp_path)
    model = LightningGPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=n_embd), learning_rate=3e-3,
                         warmup_steps=2)
    elastic = ElasticTraining(tmp_path / "ckpt", elastic_kwargs.pop("global_batch_size", GLOBAL_BATCH),
                              checkpoint_every_n_steps=3, async_save=async_save, **elastic_kwargs)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, callbacks=[elastic, *callbacks],
                         strategy=strategy or (DDPStrategy(process_group_backend="gloo") if ddp else "auto"),
                         plugins=[StagedPrecision(STAGES)] if staged else None)
    trainer.fit(model, datamodule=data)
    model.datamodule_batch_size = data.batch_size
    return model, elastic


class SignalAfter(pl.Callback):
    """Flags a SIGTERM after optimizer step ``step``: ElasticTraining stops at the next step boundary."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            next(c for c in trainer.callbacks if isinstance(c, ElasticTraining))._sigterm = True


def test_resume_from_an_epochs_last_step_starts_the_next_epoch(tmp_path: Path) -> None:
    # Lightning 2.6 skips on_train_epoch_start after such a resume; the data position must still restart at zero.
    steps_per_epoch = 8  # the corpus of write_corpus at block_size=16 holds 64 samples: 8 global batches of 8
    with pytest.raises(SystemExit):
        _fit(tmp_path, 100, SignalAfter(steps_per_epoch - 1))  # stops with the checkpoint of the epoch's last step
    assert find_latest(tmp_path / "ckpt").step == steps_per_epoch
    _, elastic = _fit(tmp_path, steps_per_epoch + 3)
    assert (elastic.epoch, elastic.consumed_samples, elastic.steps_in_epoch) == (1, 3 * GLOBAL_BATCH, 3)
    assert elastic.sampler.epoch == 1 and elastic.sampler.consumed_samples == 0  # set_epoch(1) restarted it


def test_a_job_resumed_at_max_steps_reports_done(tmp_path: Path) -> None:
    # Lightning skips the training loop (and on_train_end) of a fit that starts at max_steps: lds-elastic must still
    # read "done", not a job that stopped without finishing.
    _fit(tmp_path, 3)
    (tmp_path / "ckpt" / "reports.jsonl").unlink()
    _fit(tmp_path, 3)
    events = [json.loads(line)["event"] for line in (tmp_path / "ckpt" / "reports.jsonl").read_text().splitlines()]
    assert events[-1] == "done", events


@pytest.mark.parametrize("staged", [False, True], ids=["fp32", "StagedPrecision"])
def test_resume_after_a_crash_is_bitwise_identical_to_an_uninterrupted_run(tmp_path: Path, staged: bool) -> None:
    # With StagedPrecision the checkpoint falls in its FP16 stage and the resumed run crosses into BF16:
    # its stage and loss-scaler state must come back.
    reference, _ = _fit(tmp_path / "reference", 12, staged=staged)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _fit(tmp_path / "crashed", 12, CrashAt(step=11), staged=staged)  # crosses an epoch boundary (8 per epoch)
    assert find_latest(tmp_path / "crashed" / "ckpt").step == 9  # steps 10-11 are lost, no more
    resumed, elastic = _fit(tmp_path / "crashed", 12, staged=staged)
    reports = [json.loads(line) for line in (tmp_path / "crashed" / "ckpt" / "reports.jsonl").read_text().splitlines()]
    assert [r["from_step"] for r in reports if r["event"] == "resumed"] == [9]
    assert elastic.epoch == 1 and elastic.consumed_samples == 4 * GLOBAL_BATCH
    for (name, expected), actual in zip(reference.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=name)


def test_async_save_writes_the_weights_of_its_step_not_later_ones(tmp_path: Path) -> None:
    mutate = MutateAfterSave(step=3)
    _fit(tmp_path, 4, mutate, ddp=True, async_save=True)
    info = find_latest(tmp_path / "ckpt")
    assert info.step == 4
    step3 = info.path.parent / "step-00000003"
    assert (step3 / "COMPLETE").exists()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = LightningGPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32))
    state = {"model": get_state_dict(model, [])[0]}
    dcp.load(state, checkpoint_id=str(step3))
    for name, expected in mutate.saved.items():
        torch.testing.assert_close(state["model"][name], expected, rtol=0, atol=0, msg=name)


class _CountingDDP(DDPStrategy):
    """Counts how often Lightning asked for the full model or optimizer state."""

    built = 0

    def lightning_module_state_dict(self) -> dict:
        type(self).built += 1
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        type(self).built += 1
        return super().optimizer_state(optimizer)


def test_save_does_not_build_the_states_dcp_writes(tmp_path: Path) -> None:
    # A sharding strategy gathers and copies them to the host for Lightning's checkpoint dict; DCP writes them
    # itself, so the elastic save must not ask for them (it used to, then dropped them).
    _CountingDDP.built = 0
    _fit(tmp_path, 4, strategy=_CountingDDP(process_group_backend="gloo"))
    assert find_latest(tmp_path / "ckpt").step == 4
    assert _CountingDDP.built == 0


def test_incomplete_checkpoints_are_skipped_and_cleaned_up(tmp_path: Path) -> None:
    _fit(tmp_path, 3)
    ckpt = tmp_path / "ckpt"
    (ckpt / "step-00000050.tmp").mkdir()  # killed while writing
    (ckpt / "step-00000060").mkdir()  # renamed on a file system without atomic rename, marker missing
    (ckpt / "step-00000070").mkdir()
    (ckpt / "step-00000070" / "COMPLETE").write_text("{not json")
    assert find_latest(ckpt).step == 3
    _, elastic = _fit(tmp_path, 5)
    assert not (ckpt / "step-00000050.tmp").exists()
    assert json.loads((ckpt / "step-00000005" / "COMPLETE").read_text())["step"] == 5
    assert elastic.consumed_samples == 5 * GLOBAL_BATCH


def test_checkpoint_of_another_model_stops_with_a_clear_message(tmp_path: Path) -> None:
    _fit(tmp_path, 3, n_embd=32)
    with pytest.raises(CheckpointMismatchError, match="checkpoint_dir=.*different parameters"):
        _fit(tmp_path, 6, n_embd=48)
    records = [json.loads(line) for line in (tmp_path / "ckpt" / "reports.jsonl").read_text().splitlines()]
    assert records[-1]["event"] == "fatal"


def test_datamodule_without_sampler_hook_is_refused(tmp_path: Path) -> None:
    class PlainData(pl.LightningDataModule):
        batch_size = 2

        def train_dataloader(self):
            return torch.utils.data.DataLoader(range(64), batch_size=2)

    elastic = ElasticTraining(tmp_path / "ckpt", GLOBAL_BATCH)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, callbacks=[elastic])
    with pytest.raises(TypeError, match="train_sampler"):
        trainer.fit(LightningGPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)), datamodule=PlainData())


@pytest.mark.parametrize(("policy", "staged"), [("micro_batch", False), ("lr", False), ("lr", True)],
                         ids=["micro_batch", "lr", "lr-StagedPrecision"])
def test_batch_policies_other_than_accumulation(tmp_path: Path, policy: str, staged: bool) -> None:
    # StagedPrecision wraps the LR scheduler: the rescale must reach the wrapped one.
    model, elastic = _fit(tmp_path, 2, batch_policy=policy, global_batch_size=16, staged=staged)
    optimizer = model.trainer.optimizers[0]
    scheduler = model.trainer.lr_scheduler_configs[0].scheduler
    if policy == "micro_batch":  # one process, accumulate_grad_batches=1: the micro-batch carries the global batch
        assert model.datamodule_batch_size == 16 and elastic.accumulate == 1
        assert scheduler.base_lrs == [3e-3, 3e-3]
    else:  # per-rank batch kept at 2: the global batch is 2, the learning rate 2/16 of the reference
        assert model.datamodule_batch_size == 2 and elastic.lr_scale == pytest.approx(2 / 16)
        assert scheduler.base_lrs == pytest.approx([3e-3 * 2 / 16] * 2)
        assert optimizer.param_groups[0]["initial_lr"] == pytest.approx(3e-3 * 2 / 16)
