"""``AdamW`` with BF16 moments: parity with torch's AdamW, half the state bytes, the loss kept, exact resume."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_deepseek.optim import AdamW, OptimizerConfigError


def _problem(seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    x = torch.randn(256, 16)
    return model, x, x.sum(dim=1, keepdim=True).sin()


def _train(model, x, y, optimizer, steps: int, schedule: bool = True) -> list[float]:
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + 0.01 * s)) if schedule else None
    losses = []
    for step in range(steps):
        batch = slice(32 * (step % 8), 32 * (step % 8 + 1))
        loss = torch.nn.functional.mse_loss(model(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if scheduler:
            scheduler.step()
        losses.append(float(loss))
    return losses


def test_fp32_moments_are_bitwise_torch_adamw():
    model, x, y = _problem()
    ours = AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters(), "weight_decay": 0.0}],
                 lr=1e-2, weight_decay=0.1, moment_dtype=torch.float32)
    _train(model, x, y, ours, steps=20)
    reference, x, y = _problem()
    theirs = torch.optim.AdamW([{"params": reference[0].parameters()},
                                {"params": reference[2].parameters(), "weight_decay": 0.0}],
                               lr=1e-2, weight_decay=0.1, foreach=False)
    _train(reference, x, y, theirs, steps=20)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_bf16_moments_halve_the_state_and_keep_the_loss():
    model, x, y = _problem()
    bf16 = AdamW(model.parameters(), lr=1e-2)
    bf16_losses = _train(model, x, y, bf16, steps=600)  # past the point where round-to-nearest freezes v
    reference, x, y = _problem()
    fp32 = AdamW(reference.parameters(), lr=1e-2, moment_dtype=torch.float32)
    fp32_losses = _train(reference, x, y, fp32, steps=600)
    assert bf16.moment_bytes() * 2 == fp32.moment_bytes() == 2 * 4 * sum(p.numel() for p in model.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    tail = slice(-50, None)  # the last 50 losses, averaged: one batch's noise is not the comparison
    bf16_tail, fp32_tail = sum(bf16_losses[tail]) / 50, sum(fp32_losses[tail]) / 50
    assert bf16_tail == pytest.approx(fp32_tail, rel=0.05)
    assert bf16_tail < bf16_losses[0] / 20  # it trains


def test_state_dict_round_trip_keeps_bf16_moments_and_resumes_exactly():
    model, x, y = _problem()
    optimizer = AdamW(model.parameters(), lr=1e-2)
    _train(model, x, y, optimizer, steps=5, schedule=False)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved = copy.deepcopy(optimizer.state_dict())  # torch returns the live state tensors
    _train(model, x, y, optimizer, steps=5, schedule=False)

    resumed, _, _ = _problem(seed=1)
    resumed.load_state_dict(saved_model)
    optimizer_b = AdamW(resumed.parameters(), lr=1e-2)
    optimizer_b.load_state_dict(saved)
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in optimizer_b.state.values())
    _train(resumed, x, y, optimizer_b, steps=5, schedule=False)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))


def test_bad_arguments_name_the_setting():
    params = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(OptimizerConfigError, match="moment_dtype=torch.float16.*torch.bfloat16"):
        AdamW(params, moment_dtype=torch.float16)
    with pytest.raises(OptimizerConfigError, match="betas"):
        AdamW(params, betas=(0.9, 1.0))
