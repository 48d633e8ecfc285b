"""StagedPrecision and its loss scaler on 2 real gloo processes (Lightning DDPStrategy): ranks decide together."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_deepseek import StagedPrecision
from lightning_deepseek.precision.loss_scaler import DynamicLossScaler
from tests.helpers import run_distributed
from tests.precision.tiny import InjectInf, RecordSkips, TinyRegressor, make_trainer, regression_data


def _fit_ddp(rank: int, world_size: int, inject_steps: set[int]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyRegressor()
    plugin = StagedPrecision([("16-mixed", 8), ("32-true",)], init_scale=1024.0, hysteresis=1,
                             fallback_skipped_steps=3, fallback_window=10)
    record = RecordSkips()
    # The inf goes into rank 0's gradient after DDP has averaged it, so only rank 0 sees it: without the
    # all-reduced overflow flag rank 1 would step while rank 0 skips, and the replicas would diverge.
    trainer = make_trainer(plugin, max_steps=10, callbacks=[InjectInf(inject_steps, ranks={0}), record],
                           devices=world_size, strategy="ddp")
    trainer.fit(model, regression_data(num_samples=80, batch_size=4))
    return {
        "skipped": record.skipped, "scales": record.scales, "events": plugin.events(),
        "dtypes": [model.dtypes[s] for s in range(10)],
        "params": torch.cat([p.detach().flatten() for p in model.parameters()]),
    }


def _overflow_on_rank0_only() -> tuple[bool, bool]:
    """Rank 0 alone has an inf gradient; returns (our scaler's verdict, torch GradScaler's verdict) on this rank."""
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([param], lr=0.1)
    grad = torch.ones(4)
    if torch.distributed.get_rank() == 0:
        grad[2] = float("inf")
    param.grad = grad.clone()
    ours = DynamicLossScaler(init_scale=2.0).unscale_(optimizer)
    param.grad = grad.clone()
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    torch_scaler.scale(torch.ones(()))  # GradScaler must see a scale() before unscale_()
    torch_scaler.unscale_(optimizer)
    found = torch_scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    return ours, bool(sum(v.item() for v in found.values()))


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    # One set of processes for both tests below: spawning and importing Lightning dominates their cost.
    verdicts = _overflow_on_rank0_only()
    return {"verdicts": verdicts, **_fit_ddp(rank, world_size, {2, 4, 6})}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_worker, 2, timeout=150)


def test_found_inf_is_shared_by_all_ranks(ranks):
    """Rank 0 alone overflows (as after a rank-local hook): both ranks must skip. GradScaler decides per rank."""
    (ours0, theirs0), (ours1, theirs1) = ranks[0]["verdicts"], ranks[1]["verdicts"]
    assert ours0 and ours1
    assert theirs0 and not theirs1  # the divergence our all-reduce prevents


def test_overflow_on_one_rank_skips_and_falls_back_on_all_ranks_at_the_same_step(ranks):
    rank0, rank1 = ranks
    for result in (rank0, rank1):
        assert result["skipped"] == [2, 4, 6]
        assert result["events"] == [(7, "16-mixed -> bf16-mixed (fallback)"), (8, "bf16-mixed -> 32-true")]
        assert result["dtypes"] == [torch.float16] * 7 + [torch.bfloat16] + [torch.float32] * 2
    assert rank0["scales"] == rank1["scales"]
    assert torch.equal(rank0["params"], rank1["params"])
