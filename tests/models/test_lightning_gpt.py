import lightning.pytorch as pl
import torch

from lightning_deepseek.models import PRESETS, GPTConfig, LightningGPT


def test_training_lowers_the_loss_on_a_repeated_batch() -> None:
    pl.seed_everything(0)
    model = LightningGPT(GPTConfig(**PRESETS["tiny"]), learning_rate=3e-3, warmup_steps=1)
    optimizer = model.configure_optimizers()["optimizer"]
    tokens = torch.randint(0, 256, (4, 33))
    batch = (tokens[:, :-1], tokens[:, 1:])
    first = model._loss(batch).item()
    for _ in range(30):
        optimizer.zero_grad()
        model._loss(batch).backward()
        optimizer.step()
    assert model._loss(batch).item() < 0.5 * first


def test_biases_and_norms_have_no_weight_decay() -> None:
    model = LightningGPT(GPTConfig(**PRESETS["tiny"]))
    decay, no_decay = model.configure_optimizers()["optimizer"].param_groups
    assert all(p.dim() >= 2 for p in decay["params"]) and decay["weight_decay"] > 0
    assert all(p.dim() < 2 for p in no_decay["params"]) and no_decay["weight_decay"] == 0


def test_bf16_moments_option_builds_our_adamw_and_bad_values_name_the_setting() -> None:
    import pytest

    from lightning_deepseek.optim import AdamW

    config = GPTConfig(**{**PRESETS["tiny"], "vocab_size": 256})
    optimizer = LightningGPT(config, moment_dtype="bf16").configure_optimizers()["optimizer"]
    assert isinstance(optimizer, AdamW) and optimizer.moment_dtype == torch.bfloat16
    fp32 = LightningGPT(config).configure_optimizers()["optimizer"]
    assert type(fp32) is torch.optim.AdamW
    with pytest.raises(ValueError, match=r"optim.moment_dtype='fp16' .* use fp32 .* or bf16"):
        LightningGPT(config, moment_dtype="fp16")
