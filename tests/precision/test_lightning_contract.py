"""Lightning's own AMP-plugin and LR-scheduler tests, adapted to a one-stage ``StagedPrecision``.

Each test names the upstream test it comes from (Lightning repository, ``tests/tests_pytorch/...``; the installed
package does not ship its tests, so these are rewritten from them). The upstream assertions are kept; where ours
differ on purpose the test asserts our behaviour and says why (see also docs/precision.md, "Lightning's contract"):

- ``plugins/precision/test_amp.py::test_optimizer_amp_scaling_support_in_step_method``: Lightning refuses gradient
  clipping with an optimizer that unscales inside ``step`` (fused Adam); our scaler unscales before the step, so
  clipping works and is tested instead.
- ``..::test_amp_forward_context_keeps_cache_enabled`` and ``..::restores_grad_mode_context_managers`` (Lightning
  after 2.6): ``forward_context`` keeps the autocast cache off as Lightning 2.6.6 does, and patches no torch
  globals (``torch.no_grad``).
- ``models/test_amp.py::test_amp_cpus``: the single-device cases; the ``ddp_spawn`` ones (three process spawns per
  case, minutes on a shared 2-core CI machine) are covered by ``test_distributed.py`` (DDP, 2 gloo processes).
- ``trainer/optimization/test_optimizers.py``: all pass unchanged with a plugin whose step is never skipped; after
  a skipped step ours do not advance step-interval schedulers where Lightning does (the last test).
"""

from __future__ import annotations

from unittest import mock
from unittest.mock import Mock, call

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn, optim
from torch.optim import Optimizer
from torch.utils.data import DataLoader, TensorDataset

from lightning_deepseek import StagedPrecision


def amp(precision: str = "bf16-mixed") -> StagedPrecision:
    """The one-stage stand-in for ``MixedPrecision(precision, device="cpu")``.

    The initial scale is one at which BoringModel does not overflow, so no step is skipped and the upstream counts
    hold (upstream runs "16-mixed" on CPU as BF16, which never skips); skipping is tested on purpose below.
    """
    return StagedPrecision([(precision,)], device="cpu", init_scale=1024.0)


def trainer(tmp_path, precision: str = "16-mixed", **kwargs) -> Trainer:
    """``Trainer(precision=...)`` of the upstream tests, with our plugin in its place."""
    options = dict(default_root_dir=tmp_path, accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
                   logger=False)
    return Trainer(**{**options, **kwargs}, plugins=[amp(precision)])


# ------------------------------------------------------------ plugins/precision/test_amp.py


def test_clip_gradients():
    """Upstream ``test_clip_gradients``: ``clip_gradients`` is a no-op when clipping is disabled."""
    optimizer = Mock(spec=Optimizer)
    precision = amp("16-mixed")
    precision.clip_grad_by_value = Mock()
    precision.clip_grad_by_norm = Mock()
    precision.clip_gradients(optimizer)
    precision.clip_grad_by_value.assert_not_called()
    precision.clip_grad_by_norm.assert_not_called()
    precision.clip_gradients(optimizer, clip_val=1.0, gradient_clip_algorithm=GradClipAlgorithmType.VALUE)
    precision.clip_grad_by_value.assert_called_once()
    precision.clip_grad_by_norm.assert_not_called()
    precision.clip_grad_by_value.reset_mock()
    precision.clip_gradients(optimizer, clip_val=1.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM)
    precision.clip_grad_by_value.assert_not_called()
    precision.clip_grad_by_norm.assert_called_once()


def test_optimizer_amp_scaling_support_in_step_method(tmp_path):
    """Upstream ``test_optimizer_amp_scaling_support_in_step_method`` expects a refusal; ours clips (difference).

    A fused Adam (``_step_supports_amp_scaling``) would unscale inside ``step`` when handed a GradScaler; our
    scaler has unscaled the gradients before ``step``, so clipping sees true gradients and the fused step is plain.
    """

    class FusedAdamModel(BoringModel):
        def configure_optimizers(self):
            return optim.Adam(self.parameters(), lr=0.1, fused=True)

    model = FusedAdamModel()
    assert model.configure_optimizers()._step_supports_amp_scaling
    before = [p.detach().clone() for p in model.parameters()]
    trainer(tmp_path, max_steps=3, limit_val_batches=0, gradient_clip_val=1.0).fit(model)
    assert all(torch.isfinite(p).all() and not torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("context", ["forward_context", "autocast_context_manager"])
def test_amp_with_no_grad_or_inference_mode(grad_mode, context):
    """Upstream ``test_amp_with_no_grad`` and ``test_amp_with_inference_mode``: a no-grad forward inside the
    autocast region does not break gradient tracking of a later forward in the same region."""
    layer = nn.Linear(2, 1)
    x = torch.randn(1, 2)
    with getattr(amp(), context)():
        with grad_mode():
            _ = layer(x)
        loss = layer(x).mean()
        loss.backward()
        assert loss.grad_fn is not None


def test_torch_autocast_cache_behavior_with_no_grad():
    """Upstream test of the same name, cache-off half: with the cache off (ours) a no-grad forward in the autocast
    region never costs the next forward its graph. The cache-on half (graph lost) holds on the torch versions
    Lightning's workaround targets; torch 2.13 no longer loses it, so that half is not asserted here."""
    layer = nn.Linear(2, 1)
    x = torch.randn(1, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        with torch.no_grad():
            _ = layer(x)
        loss = layer(x).mean()
        assert loss.grad_fn is not None


def test_amp_autocast_context_manager_disables_cache():
    """Upstream test of the same name; plus ours: ``forward_context`` too (Lightning 2.6.6), no torch patching."""
    precision = amp()
    with precision.autocast_context_manager():
        assert not torch.is_autocast_cache_enabled()
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    no_grad = torch.no_grad
    with precision.forward_context():
        assert not torch.is_autocast_cache_enabled()
        assert torch.no_grad is no_grad


def test_fp32_stage_autocast_context_manager_is_disabled_autocast():
    """Ours: in an FP32 stage the context manager is a disabled ``torch.autocast`` (also inside an outer one)."""
    with torch.autocast("cpu", dtype=torch.bfloat16), amp("32-true").autocast_context_manager():
        assert not torch.is_autocast_enabled("cpu")


# ------------------------------------------------------------ models/test_amp.py


class AMPTestModel(BoringModel):
    """Upstream ``AMPTestModel``: every step runs under autocast of the plugin's dtype."""

    def step(self, batch):
        self._assert_autocast_enabled()
        output = self(batch)
        expected = torch.bfloat16 if self.trainer.precision_plugin.precision == "bf16-mixed" else torch.float16
        assert output.dtype == expected
        return self.loss(output)

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        self._assert_autocast_enabled()
        return self(batch)

    def _assert_autocast_enabled(self):
        assert torch.is_autocast_enabled(self.trainer.precision_plugin.device)


@pytest.mark.parametrize(("strategy", "precision", "devices"), [
    ("single_device", "16-mixed", 1),
    ("single_device", "bf16-mixed", 1),
])  # upstream's ddp_spawn cases (3 spawns each) are left to test_distributed.py: DDP on 2 real gloo processes
def test_amp_cpus(tmp_path, strategy, precision, devices):
    """Upstream ``test_amp_cpus``: fit, test and predict under autocast with each strategy."""
    t = trainer(tmp_path, precision, devices=devices, strategy=strategy, max_epochs=1, limit_train_batches=1,
                limit_val_batches=1, limit_test_batches=1, limit_predict_batches=1, enable_checkpointing=False)
    model = AMPTestModel()
    t.fit(model)
    t.test(model)
    t.predict(model)
    scaler = t.precision_plugin.scaler  # GradScaler's getters
    assert scaler.get_scale() == scaler.state_dict()["scale"] == 1024.0 and t.precision_plugin.num_skipped_steps == 0


@pytest.mark.parametrize("clip_val", [0, 10])
@mock.patch("torch.nn.utils.clip_grad_norm_")
def test_precision_16_clip_gradients(mock_clip_grad_norm, clip_val, tmp_path):
    """Upstream test of the same name: clipping is only called if the value is greater than 0."""
    trainer(tmp_path, max_epochs=1, limit_train_batches=4, limit_val_batches=0, gradient_clip_val=clip_val).fit(
        BoringModel())
    assert mock_clip_grad_norm.called == (clip_val > 0)


# ------------------------------------------------------------ trainer/optimization/test_optimizers.py


def test_optimizer_with_scheduling(tmp_path):
    """Upstream test of the same name: an epoch-interval StepLR advances once in one epoch."""
    model = BoringModel()
    t = trainer(tmp_path, max_epochs=1, limit_val_batches=0.1, limit_train_batches=0.2, val_check_interval=0.5)
    t.fit(model)
    assert len(t.lr_scheduler_configs) == 1
    assert [pg["lr"] for pg in t.optimizers[0].param_groups] == [0.1 * 0.1]


def test_multi_optimizer_with_scheduling(tmp_path):
    """Upstream test of the same name: manual optimization steps the schedulers from ``self.lr_schedulers()``."""

    class Model(BoringModel):
        init_lr = 5e-4

        def training_step(self, batch, batch_idx):
            opt1, opt2 = self.optimizers()
            loss = self.loss(self.step(batch))
            opt1.zero_grad()
            opt2.zero_grad()
            self.manual_backward(loss)
            opt1.step()
            opt2.step()

        def on_train_epoch_end(self):
            scheduler1, scheduler2 = self.lr_schedulers()
            assert isinstance(scheduler1, optim.lr_scheduler.StepLR)  # the user's own objects
            scheduler1.step()
            scheduler2.step()

        def configure_optimizers(self):
            optimizer1 = optim.Adam(self.parameters(), lr=self.init_lr)
            optimizer2 = optim.Adam(self.parameters(), lr=self.init_lr)
            return [optimizer1, optimizer2], [optim.lr_scheduler.StepLR(optimizer1, step_size=1),
                                              optim.lr_scheduler.StepLR(optimizer2, step_size=1)]

    model = Model()
    model.automatic_optimization = False
    t = trainer(tmp_path, max_epochs=1, limit_val_batches=0.1, limit_train_batches=0.2)
    t.fit(model)
    assert len(t.lr_scheduler_configs) == 2
    assert [pg["lr"] for o in t.optimizers for pg in o.param_groups] == [model.init_lr * 0.1] * 2


def test_reducelronplateau_scheduling(tmp_path):
    """Upstream test of the same name: the plateau scheduler's config is kept as configured."""

    class TestModel(BoringModel):
        def training_step(self, batch, batch_idx):
            self.log("foo", batch_idx)
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self):
            optimizer = optim.Adam(self.parameters())
            return {"optimizer": optimizer, "lr_scheduler": optim.lr_scheduler.ReduceLROnPlateau(optimizer),
                    "monitor": "foo"}

    t = trainer(tmp_path, fast_dev_run=True)
    t.fit(TestModel())
    config = t.lr_scheduler_configs[0]
    assert isinstance(config.scheduler, optim.lr_scheduler.ReduceLROnPlateau)
    assert (config.monitor, config.interval, config.frequency, config.reduce_on_plateau) == ("foo", "epoch", 1, True)


@pytest.mark.parametrize("check_val_every_n_epoch", [1, 2])
@mock.patch("torch.optim.lr_scheduler.StepLR.step")
def test_lr_scheduler_epoch_step_frequency(mocked_sched, check_val_every_n_epoch, tmp_path):
    """Upstream test of the same name: an epoch scheduler steps once per epoch (+1 at construction)."""
    epochs = 4
    trainer(tmp_path, limit_train_batches=2, limit_val_batches=2, check_val_every_n_epoch=check_val_every_n_epoch,
            max_epochs=epochs).fit(BoringModel())
    assert mocked_sched.call_count == epochs + 1


@pytest.mark.parametrize(("every_n_train_steps", "epoch_interval"), [(None, True), (2, False), (2, True)])
def test_lr_scheduler_state_updated_before_saving(tmp_path, every_n_train_steps, epoch_interval):
    """Upstream test of the same name: the checkpoint holds the scheduler state after its last step."""
    batches, max_epochs, lr, gamma = 2, 1, 1, 10

    class TestModel(BoringModel):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=lr)
            config = {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=gamma)}
            if not epoch_interval:
                config["interval"] = "step"
            return [optimizer], [config]

        def on_save_checkpoint(self, checkpoint):
            state = checkpoint["lr_schedulers"][0]
            assert self.trainer.global_step == batches
            compare_to = max_epochs if epoch_interval else batches
            assert state["_step_count"] - 1 == compare_to
            assert state["_last_lr"] == [lr * gamma**compare_to]
            self.on_save_checkpoint_called = True

    model = TestModel()
    # A huge lr with gamma 10 would overflow FP16; BF16 keeps the upstream numbers.
    trainer(tmp_path, "bf16-mixed", max_epochs=max_epochs, limit_train_batches=batches, limit_val_batches=1,
            callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=every_n_train_steps)]).fit(model)
    assert model.on_save_checkpoint_called


@pytest.mark.parametrize("save_on_train_epoch_end", [False, True])
def test_plateau_scheduler_lr_step_interval_updated_after_saving(tmp_path, save_on_train_epoch_end):
    """Upstream test of the same name: step-interval plateau and plain schedulers around checkpointing."""
    batches = 4

    class Model(BoringModel):
        def training_step(self, batch, batch_idx):
            self.log("foo", batch_idx)
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self):
            optimizer = torch.optim.Adam(self.parameters())
            plateau = {"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer), "interval": "step",
                       "monitor": "foo"}
            step = {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1), "interval": "step"}
            return [optimizer], [plateau, step]

        def on_save_checkpoint(self, checkpoint):
            assert checkpoint["lr_schedulers"][0]["last_epoch"] == batches - (not save_on_train_epoch_end)
            assert checkpoint["lr_schedulers"][1]["_step_count"] - 1 == batches
            self.on_save_checkpoint_called = True

    model = Model()
    trainer(tmp_path, max_epochs=1, limit_train_batches=batches, limit_val_batches=1,
            callbacks=[ModelCheckpoint(dirpath=tmp_path, save_on_train_epoch_end=save_on_train_epoch_end)]).fit(model)
    assert model.on_save_checkpoint_called


class CustomEpochScheduler:
    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self, epoch): ...

    def state_dict(self): ...

    def load_state_dict(self, state_dict): ...


class CustomBoringModel(BoringModel):
    def lr_scheduler_step(self, scheduler, metric):
        if isinstance(scheduler, torch.optim.lr_scheduler.StepLR):  # step-level: the user's own StepLR arrives
            super().lr_scheduler_step(scheduler, metric)
        elif isinstance(scheduler, CustomEpochScheduler):  # epoch-level, custom scheduler
            scheduler.step(epoch=self.current_epoch)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.layer.parameters(), lr=1e-2)
        step_level = {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1), "interval": "step"}
        return [optimizer], [step_level, CustomEpochScheduler(optimizer)]


def test_lr_scheduler_step_hook(tmp_path):
    """Upstream test of the same name: the user's ``lr_scheduler_step`` receives their own schedulers."""
    max_epochs, limit_train_batches = 3, 2
    t = trainer(tmp_path, enable_checkpointing=False, max_epochs=max_epochs, limit_train_batches=limit_train_batches,
                limit_val_batches=0)
    with (mock.patch.object(CustomEpochScheduler, "step") as mock_method_epoch,
          mock.patch.object(torch.optim.lr_scheduler.StepLR, "step") as mock_method_step):
        t.fit(CustomBoringModel())
    assert mock_method_epoch.mock_calls == [call(epoch=e) for e in range(max_epochs)]
    assert mock_method_step.call_count == max_epochs * limit_train_batches + 1  # +1: the StepLR constructor


def test_lr_scheduler_step_hook_is_not_called_for_step_schedulers_after_a_skipped_step(tmp_path):
    """Ours (the documented difference): after a skipped FP16 step the user's hook is not called for step-interval
    schedulers (Lightning calls it after every step); epoch-level schedulers are never held back."""

    class InfOnSecondStep(CustomBoringModel):
        def on_after_backward(self):
            if self.trainer.global_step == 1:
                self.layer.weight.grad[0, 0] = float("inf")

    max_epochs, limit_train_batches = 3, 2
    t = trainer(tmp_path, enable_checkpointing=False, max_epochs=max_epochs, limit_train_batches=limit_train_batches,
                limit_val_batches=0)
    with (mock.patch.object(CustomEpochScheduler, "step") as mock_method_epoch,
          mock.patch.object(torch.optim.lr_scheduler.StepLR, "step") as mock_method_step):
        t.fit(InfOnSecondStep())
    assert t.precision_plugin.num_skipped_steps == 1
    assert mock_method_epoch.mock_calls == [call(epoch=e) for e in range(max_epochs)]  # step 1 ends epoch 0
    assert mock_method_step.call_count == max_epochs * limit_train_batches + 1 - 1


@mock.patch("torch.optim.lr_scheduler.StepLR.step")
def test_lr_scheduler_step_across_epoch_boundaries(mocked_sched, tmp_path):
    """Upstream test of the same name: a step scheduler with frequency 5 across epoch boundaries."""

    class StepAcrossEpochsModel(LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(32, 2)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).float().pow(2).mean()

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(21, 32), torch.randn(21, 2)), batch_size=3)

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.layer.parameters(), lr=0.1)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
            config = {"scheduler": scheduler, "interval": "step", "frequency": 5}
            return {"optimizer": optimizer, "lr_scheduler": config}

    trainer(tmp_path, limit_train_batches=7, max_epochs=3).fit(StepAcrossEpochsModel())
    assert abs(mocked_sched.call_count - (7 * 3 - 1) // 5) <= 1
