"""``Stage("fp8")``: torchao float8 training at a stage boundary, emulated on CPU (torchao's ``emulate=True``).

Covers the layer selection (DeepSeek-V3's exclusions), the swap keeping the same Parameters, a schedule through
FP8 and out again, resume mid-FP8, FP8 against BF16 on the example GPT, and the errors. FP8 under DDP on two real
processes is in test_distributed.py.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_deepseek import StagedPrecision
from lightning_deepseek.data import TextDataModule
from lightning_deepseek.models import PRESETS, GPTConfig, LightningGPT
from lightning_deepseek.precision import float8
from lightning_deepseek.precision.float8 import Float8ConfigError, Float8Training
from tests.precision.tiny import TinyRegressor, make_trainer, regression_data

pytest.importorskip("torchao")


class MoEBlock(nn.Module):
    """A router named ``gate`` beside ``experts`` (Mixtral/Qwen-MoE naming), experts with a SwiGLU ``gate``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(32, 16, bias=False)
        self.experts = nn.ModuleList(nn.ModuleDict({"gate": nn.Linear(32, 64), "up": nn.Linear(32, 64),
                                                    "down": nn.Linear(64, 32)}) for _ in range(2))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 32)
        self.moe = MoEBlock()
        self.odd = nn.Linear(32, 20)  # 20 is not a multiple of 16
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 16)


def test_selection_follows_deepseek_v3_and_keeps_the_parameters():
    net = Net()
    params = dict(net.named_parameters())
    keys = set(net.state_dict())
    converted = Float8Training().convert(net, "cpu")
    assert sorted(converted) == [f"moe.experts.{i}.{n}" for i in range(2) for n in ("down", "gate", "up")]
    assert all(float8.is_float8(net.get_submodule(path)) for path in converted)
    assert dict(net.named_parameters()) == params and set(net.state_dict()) == keys  # same objects, same keys
    assert type(net.moe.gate) is nn.Linear and type(net.head) is nn.Linear and type(net.odd) is nn.Linear
    assert net.get_submodule(converted[0]).config.emulate  # CPU: emulated GEMMs
    assert float8.revert(net) == 6
    assert not float8.has_float8_layers(net) and dict(net.named_parameters()) == params
    assert Float8Training(exclude=("experts",)).convert(Net(), "cpu") == ["moe.gate", "head"]  # replaces the default


class WideRegressor(TinyRegressor):
    """TinyRegressor with 16-multiple dims, so that its layers are FP8-eligible."""

    def __init__(self) -> None:
        super().__init__(scheduler=False)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        self.dtypes[self.trainer.global_step] = type(self.net[2]).__name__
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def on_before_backward(self, loss):
        pass


def _fit(plugin, max_steps, ckpt_path=None, callbacks=(), **kwargs):
    torch.manual_seed(0)
    model = WideRegressor()
    trainer = make_trainer(plugin, max_steps=max_steps, callbacks=list(callbacks), **kwargs)
    trainer.fit(model, regression_data(48), ckpt_path=ckpt_path)
    return model, trainer


def test_fp8_stage_converts_at_its_boundary_and_back_and_resumes_in_fp8(tmp_path):
    def plugin():
        return StagedPrecision([("bf16", 2), ("fp8", 8), ("32-true",)])

    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=6, save_top_k=-1)
    first = plugin()
    model, trainer = _fit(first, 10, callbacks=[checkpoint], enable_checkpointing=True)
    assert [model.dtypes[s] for s in range(10)] == ["Linear"] * 2 + ["Float8Linear"] * 6 + ["Linear"] * 2
    assert first.events() == [(2, "bf16-mixed -> fp8-mixed"), (8, "fp8-mixed -> 32-true")]
    assert first.float8_layers == ["net.2"]  # net.0 has in_features 8, net.4 out_features 1
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not float8.has_float8_layers(model)

    resumed = plugin()
    model_b, _ = _fit(resumed, 10, ckpt_path=tmp_path / "epoch=0-step=6.ckpt")
    # 6 batches per epoch: the checkpoint at step 6 is at an epoch end (Lightning resumes mid-epoch inexactly).
    assert [model_b.dtypes[s] for s in range(6, 10)] == ["Float8Linear"] * 2 + ["Linear"] * 2  # resumed in FP8
    assert resumed.events() == first.events()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model_b.parameters()))


def _val_loss(plugin: StagedPrecision, cache_dir) -> float:
    pl.seed_everything(0, verbose=False)
    model = LightningGPT(GPTConfig(vocab_size=256, **{**PRESETS["tiny"], "block_size": 32}), learning_rate=3e-3,
                         warmup_steps=5)
    data = TextDataModule(block_size=32, batch_size=8, cache_dir=cache_dir)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=24, plugins=[plugin], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=4, val_check_interval=24)
    trainer.fit(model, data)
    return float(trainer.callback_metrics["val_loss"])


def test_fp8_matches_bf16_validation_loss_on_the_example_gpt(tmp_path, one_thread):
    """FP8 (emulated) against BF16 after 24 steps of the tiny GPT: within 1% relative (benchmarks: 200 steps)."""
    fp8 = StagedPrecision([("fp8",)])
    fp8_loss = _val_loss(fp8, tmp_path)
    bf16_loss = _val_loss(StagedPrecision([("bf16",)]), tmp_path)
    assert len(fp8.float8_layers) == 8  # qkv, proj, fc1, fc2 of both blocks; the head stays
    assert fp8_loss == pytest.approx(bf16_loss, rel=0.01)
    assert fp8_loss != bf16_loss  # the FP8 GEMMs really ran


def test_fp8_errors_name_the_fix(monkeypatch):
    with pytest.raises(Float8ConfigError, match="fp8_recipe='blockwise' is not a torchao float8 recipe"):
        StagedPrecision([("fp8",)], fp8_recipe="blockwise")
    with pytest.raises(Float8ConfigError, match="fp8_exclude='head' must be a list of module names"):
        StagedPrecision([("fp8",)], fp8_exclude="head")
    with pytest.raises(Float8ConfigError, match="fp8_emulate=False but the strategy runs on CPU"):
        StagedPrecision([("fp8",)], fp8_emulate=False).check_device("cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    with pytest.raises(Float8ConfigError, match=r"compute capability >= 8.9.*this GPU has 8.0.*fp8_emulate=True"):
        StagedPrecision([("fp8",)]).check_device("cuda")
    StagedPrecision([("fp8",)], fp8_emulate=True).check_device("cuda")  # the documented fallback
    with pytest.raises(ValueError, match="found no nn.Linear layer to convert"):
        _fit(StagedPrecision([("fp8",)], fp8_exclude=["net"]), 2)
    monkeypatch.setattr(float8, "torchao_available", lambda: False)
    with pytest.raises(Float8ConfigError, match=r"needs torchao.*pip install 'lightning-deepseek\[fp8\]'"):
        StagedPrecision([("32-true", 5), ("fp8",)])
    StagedPrecision([("32-true", 5), ("bf16",)])  # torchao is only needed for an FP8 stage
