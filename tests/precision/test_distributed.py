"""StagedPrecision on 2 real gloo processes with Lightning's DDPStrategy: every rank decides together."""

from __future__ import annotations

from typing import Any

import torch

from lightning_deepseek import StagedPrecision
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


def test_overflow_on_one_rank_skips_and_falls_back_on_all_ranks_at_the_same_step():
    rank0, rank1 = run_distributed(_fit_ddp, 2, {2, 4, 6}, timeout=120)
    for result in (rank0, rank1):
        assert result["skipped"] == [2, 4, 6]
        assert result["events"] == [(7, "16-mixed -> bf16-mixed (fallback)"), (8, "bf16-mixed -> 32-true")]
        assert result["dtypes"] == [torch.float16] * 7 + [torch.bfloat16] + [torch.float32] * 2
    assert rank0["scales"] == rank1["scales"]
    assert torch.equal(rank0["params"], rank1["params"])
