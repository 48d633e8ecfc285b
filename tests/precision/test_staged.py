"""StagedPrecision in a real single-process Trainer: schedule, skipping, fallback, LR schedulers, checkpoints."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_deepseek import StagedPrecision
from lightning_deepseek.precision.schedule import ScheduleError
from lightning_deepseek.precision.staged import StagedPrecisionError, autocast_supported
from tests.precision.tiny import InjectInf, RecordSkips, TinyRegressor, make_trainer, regression_data

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _fit(plugin, max_steps, callbacks=(), num_samples=64, seed=0, scheduler=True, **kwargs):
    torch.manual_seed(seed)
    model = TinyRegressor(scheduler=scheduler)
    trainer = make_trainer(plugin, max_steps=max_steps, callbacks=list(callbacks), **kwargs)
    trainer.fit(model, regression_data(num_samples))
    return model, trainer


def test_autocast_dtype_follows_schedule_exactly():
    plugin = StagedPrecision([("32-true", 3), ("16-mixed", 0.5, "fraction"), ("bf16-mixed", 2, "epoch"), ("32-true",)])
    model, trainer = _fit(plugin, max_steps=12, num_samples=32)  # 4 steps per epoch
    assert [model.dtypes[s] for s in range(12)] == [F32] * 3 + [F16] * 3 + [BF16] * 2 + [F32] * 4
    assert [model.loss_multipliers[s] for s in range(12)] == [1] * 3 + [2**16] * 3 + [1] * 6  # scaler in FP16 only
    assert plugin.events() == [(3, "32-true -> 16-mixed"), (6, "16-mixed -> bf16-mixed"), (8, "bf16-mixed -> 32-true")]
    assert trainer.precision == "32-true"
    assert all(p.dtype == F32 for p in model.parameters())  # master weights never recast
    optimizer_state = [v for s in trainer.optimizers[0].state.values() for v in s.values() if v.is_floating_point()]
    assert optimizer_state and all(v.dtype == F32 for v in optimizer_state)


def test_inf_gradient_skips_step_backs_off_and_keeps_weights():
    snapshots = {}

    class Snapshot(RecordSkips):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            snapshots[trainer.global_step - 1] = (
                [p.detach().clone() for p in pl_module.parameters()],
                int(trainer.optimizers[0].state[pl_module.net[0].weight]["step"]),
            )

    record = Snapshot()
    plugin = StagedPrecision([("16-mixed",)], init_scale=1024.0, hysteresis=1)
    _fit(plugin, max_steps=6, callbacks=[InjectInf({3}), record])
    assert record.skipped == [3] and plugin.num_skipped_steps == 1
    assert record.scales[2] == 1024.0 and record.scales[3] == 512.0
    weights_before, adam_steps_before = snapshots[2]
    weights_after, adam_steps_after = snapshots[3]
    assert all(torch.equal(a, b) for a, b in zip(weights_before, weights_after))
    assert adam_steps_after == adam_steps_before == 3
    assert not all(torch.equal(a, b) for a, b in zip(weights_after, snapshots[4][0]))  # the next step moves them


@pytest.mark.parametrize("skip", [True, False])
def test_lr_scheduler_does_not_advance_on_skipped_step(skip):
    plugin = StagedPrecision([("16-mixed",)], init_scale=1024.0, hysteresis=1, skip_lr_scheduler_on_skipped_step=skip)
    model, trainer = _fit(plugin, max_steps=6, callbacks=[InjectInf({2, 3})])
    scheduler_steps = [0, 1, 2, 2, 2, 3] if skip else [0, 1, 2, 3, 4, 5]
    assert [model.lrs[s] for s in range(6)] == pytest.approx([0.05 / (1 + n) for n in scheduler_steps])
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert type(scheduler) is torch.optim.lr_scheduler.LambdaLR  # the user's own object, not a wrapper
    assert scheduler.last_epoch == (4 if skip else 6)
    assert "lr_scheduler_step" not in vars(model)  # the guard is gone after the fit


@pytest.mark.parametrize(("kwargs", "inject", "fallback_step", "reason"), [
    (dict(fallback_skipped_steps=3, fallback_window=10), {2, 4, 6}, 7, "3 skipped steps within 10 steps"),
    (dict(min_scale=256.0), {2, 3}, 4, "floor min_scale=256"),
])
def test_repeated_overflow_falls_back_to_bf16_for_the_rest_of_the_stage(kwargs, inject, fallback_step, reason):
    plugin = StagedPrecision([("16-mixed", 8), ("16-mixed",)], init_scale=1024.0, hysteresis=1, **kwargs)
    with pytest.warns(UserWarning, match=reason):
        model, _ = _fit(plugin, max_steps=10, callbacks=[InjectInf(inject)])
    expected = [F16] * fallback_step + [BF16] * (8 - fallback_step) + [F16] * 2  # stage 1 tries FP16 again
    assert [model.dtypes[s] for s in range(10)] == expected
    assert (fallback_step, "16-mixed -> bf16-mixed (fallback)") in plugin.events()
    assert plugin.fallbacks == {0: "bf16-mixed"}
    assert plugin.summary()["precision_fallbacks"] == "stage 0 -> bf16-mixed"


def test_checkpoint_mid_fp16_resume_continues_in_same_stage_with_same_scale(tmp_path):
    def plugin():
        # Too high an initial scale and a short growth interval: the scale moves at most steps (calibration
        # back-offs, growth, overflow with hysteresis), so any lost scaler state changes the trajectory.
        return StagedPrecision([("32-true", 2), ("16-mixed", 10), ("bf16-mixed",)], init_scale=2.0**18,
                               growth_interval=2, hysteresis=2)

    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=6, save_top_k=-1, save_last=False)
    record_a = RecordSkips()
    model_a, trainer_a = _fit(plugin(), max_steps=12, num_samples=48, callbacks=[InjectInf({7}), record_a, checkpoint],
                              enable_checkpointing=True)
    state_at_6 = torch.load(tmp_path / "epoch=0-step=6.ckpt", weights_only=False)["StagedPrecision"]
    assert record_a.precisions[5] == "16-mixed" and "stage_index" not in state_at_6  # derived, not stored
    assert state_at_6["scaler"]["scale"] == record_a.scales[5] != 2.0**18

    resumed = plugin()
    restored = {}

    class Restored(RecordSkips):
        def on_train_start(self, trainer, pl_module):
            restored.update(stage=resumed.stage_index, precision=resumed.precision, scale=resumed.loss_scale)

    record_b = Restored()
    torch.manual_seed(1)  # a different init: the checkpoint must overwrite it
    model_b = TinyRegressor()
    trainer_b = make_trainer(resumed, max_steps=12, callbacks=[InjectInf({7}), record_b])
    trainer_b.fit(model_b, regression_data(48), ckpt_path=tmp_path / "epoch=0-step=6.ckpt")
    assert restored == {"stage": 1, "precision": "16-mixed", "scale": record_a.scales[5]}
    assert record_b.scales == record_a.scales[6:] and record_b.skipped == [s for s in record_a.skipped if s >= 6]
    assert 7 in record_b.skipped
    assert resumed.events() == plugin_events(trainer_a)
    assert all(torch.equal(a, b) for a, b in zip(model_a.parameters(), model_b.parameters()))

    # A checkpoint written before the stage was derived: `stage_index` beside (step, label) events.
    old = {**state_at_6, "stage_index": 1, "events": [event[:2] for event in state_at_6["events"]]}
    from_old = plugin()
    from_old.load_state_dict(old)
    assert from_old.stage_index == 1 and from_old.precision == "16-mixed"
    assert from_old.events() == [(2, "32-true -> 16-mixed")] and from_old.loss_scale == record_a.scales[5]


def plugin_events(trainer):
    return trainer.precision_plugin.events()


def test_fp32_schedule_is_bitwise_identical_to_plain_fp32():
    staged, _ = _fit(StagedPrecision([("32-true",)]), max_steps=8)
    plain, _ = _fit(None, max_steps=8)
    assert all(torch.equal(a, b) for a, b in zip(staged.parameters(), plain.parameters()))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_fp16_stage_matches_lightning_mixed_precision_with_grad_scaler(accumulate):
    """hysteresis=1 makes our scaler follow torch.amp.GradScaler's rule, so the runs must agree bit for bit."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    inject = InjectInf({3, 5})
    ours = StagedPrecision([("16-mixed",)], init_scale=2.0**16, growth_interval=3, hysteresis=1)
    staged, _ = _fit(ours, max_steps=12, callbacks=[inject], scheduler=False, accumulate_grad_batches=accumulate,
                     num_samples=200)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    reference, _ = _fit(MixedPrecision("16-mixed", "cpu", scaler), max_steps=12, callbacks=[inject],
                        scheduler=False, accumulate_grad_batches=accumulate, num_samples=200)
    assert ours.num_skipped_steps >= 2  # the skip path is exercised (injected, and natural overflows after growth)
    assert ours.loss_scale == scaler.get_scale()
    assert all(torch.equal(a, b) for a, b in zip(staged.parameters(), reference.parameters()))


def test_bad_input_is_rejected_with_the_setting_named():
    with pytest.raises(ValueError, match="Received both `precision=16-mixed` and `plugins=.*StagedPrecision"):
        make_trainer(StagedPrecision(), precision="16-mixed")
    with pytest.raises(ScheduleError, match="unknown precision 'fp4'"):
        StagedPrecision([("fp4",)])
    with pytest.raises(ScheduleError, match="not increasing"):
        StagedPrecision([("32-true", 0.5, "fraction"), ("16-mixed", 0.2, "fraction"), ("bf16-mixed",)])
    with pytest.raises(ScheduleError, match=r"schedule\[0\].until=20 step ends at optimizer step 20, beyond"):
        _fit(StagedPrecision([("32-true", 20), ("16-mixed",)]), max_steps=8)
    with pytest.raises(StagedPrecisionError, match=r"StagedPrecision\(device='cuda'\) but the strategy runs on 'cpu'"):
        _fit(StagedPrecision(device="cuda"), max_steps=8)


def test_stage_the_device_cannot_run_is_rejected(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert not autocast_supported("cuda", BF16) and autocast_supported("cuda", F16)
    plugin = StagedPrecision([("16-mixed", 5), ("bf16-mixed",)])
    with pytest.raises(StagedPrecisionError, match=r"schedule\[1\] asks for 'bf16-mixed'.*Ampere"):
        plugin.check_device("cuda")
    assert plugin.check_device("cpu") == "cpu"
