"""The plan of ``GradientCompression`` on DDP's buckets (``PlanLayout.bits``) against a real step: a Lightning fit on
2 gloo processes with the callback's hook at int8 and int4 (lds-train's presets, no warm-up), its collectives
counted at the dispatcher (``CollectiveCounter``, as every real run of ``tests/planning`` is counted): the bytes per
(mesh dimension, op) and the model states equal, the peak within ``PEAK_TOLERANCE``. Without processes: the
two-phase exchange (more than two ranks) sends what the hook's own byte count says, and the buckets the hook leaves
fp32 are planned as DDP's all-reduce; the bits axis of ``layout=auto`` and lds-plan's ``compression=``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_deepseek import GradientCompression, HybridParallelStrategy
from lightning_deepseek.app.errors import ConfigError
from lightning_deepseek.app.plan import run_plan
from lightning_deepseek.compression.state import compressed_bytes
from lightning_deepseek.planning import PlanLayout, StepShape, plan
from lightning_deepseek.planning.ddp_exchange import ddp_exchange
from lightning_deepseek.planning.search import candidate_layouts
from tests.helpers import run_distributed
from tests.planning.real_run import PlannedModule, StepCounter
from tests.planning.test_against_real_runs import CLUSTER, DENSE, MICRO, PEAK_TOLERANCE, SEQ
from tests.planning.test_lds_plan import SMALL, config

BITS = (8, 4)
DDP = "ddp (world)"  # the plan's label of DDP's exchange


class HookStepCounter(StepCounter):
    """``StepCounter`` leaving DDP's comm hook to ``GradientCompression`` (DDP takes one hook): the collectives on
    DDP's process group, the hook's, are counted under the plan's label of DDP's exchange."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.ddp_group = trainer.strategy.ddp_module.process_group.group_name

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           idx: int) -> None:
        hook = []
        if idx == self.counted:
            hook = [c for c in self.counter.calls if c.group == self.ddp_group]
            self.counter.calls = [c for c in self.counter.calls if c.group != self.ddp_group]
        super().on_train_batch_end(trainer, pl_module, outputs, batch, idx)
        for call in hook:
            self.result["traffic"][DDP, call.op] = self.result["traffic"].get((DDP, call.op), 0) + call.num_bytes


def _compressed_steps(rank: int, world_size: int) -> list[dict[str, Any]]:
    results = []
    for bits in BITS:
        pl.seed_everything(0, verbose=False)
        counter = HookStepCounter(CLUSTER.gpus_per_node)
        compression = GradientCompression(config=replace(PlanLayout(bits=bits).compression(), warmup_steps=0))
        trainer = pl.Trainer(strategy=HybridParallelStrategy(tensor_parallel_size=1, min_shard_params=0),
                             accelerator="cpu", devices=world_size, max_steps=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, callbacks=[compression, counter])
        tokens = torch.randint(0, DENSE.vocab_size, (world_size * MICRO, SEQ))
        trainer.fit(PlannedModule(DENSE), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens),
                                                                      batch_size=MICRO))
        results.append(counter.result)
    return results


def test_compressed_plan_equals_real_step() -> None:
    real = run_distributed(_compressed_steps, 2, timeout=300)[0]
    for bits, measured in zip(BITS, real):
        report = plan(DENSE, 2, PlanLayout(bits=bits), CLUSTER, StepShape(MICRO, SEQ, "fp32", min_shard_params=0))
        planned = {"params": report.memory.params, "grads": report.memory.grads, "states": report.memory.states}
        assert planned == {k: measured[k] for k in planned}, (bits, planned, measured)
        traffic = {(row.dim, row.op): row.num_bytes for row in report.traffic}
        assert traffic == measured["traffic"] and set(traffic) == {(DDP, "all_gather")}, (bits, traffic, measured)
        assert abs(report.memory.peak - measured["peak"]) <= PEAK_TOLERANCE * measured["peak"], (bits, measured)
        assert report.memory.compression > 0 and report.codec_seconds > 0


@pytest.mark.parametrize("world_size", [4, 8])
@pytest.mark.parametrize("bits", BITS)
def test_two_phase_exchange_sends_the_hooks_bytes(world_size: int, bits: int) -> None:
    config = PlanLayout(bits=bits).compression()
    sizes, ndims = [4 * 100_000, 4 * 5_000, 4 * 64], [2, 2, 1]  # one bucket (< 1 MiB) of 105,064 values
    exchange = ddp_exchange(sizes, ndims, world_size, 25 << 20, "world", config)
    assert [c.op for c in exchange.calls] == ["all_to_all", "all_gather"]
    sent = sum((world_size - 1) * c.num_bytes // world_size for c in exchange.calls)  # ring: (W - 1) / W of each
    assert sent == compressed_bytes(sum(sizes) // 4, world_size, bits, config.block_size)


def test_buckets_the_hook_leaves_fp32() -> None:
    config = PlanLayout(bits=8).compression()
    vectors = ddp_exchange([4 * 300_000], [1], 4, 25 << 20, "world", config)  # only 1-D parameters
    small = ddp_exchange([4 * (config.min_bucket_numel - 1)], [2], 4, 25 << 20, "world", config)
    for exchange, num_bytes in ((vectors, 4 * 300_000), (small, 4 * (config.min_bucket_numel - 1))):
        assert [(c.op, c.num_bytes) for c in exchange.calls] == [("all_reduce", num_bytes)]
        assert exchange.compression_bytes == exchange.codec_bytes == 0


def test_compression_of_unmodelled_exchanges_is_refused() -> None:
    with pytest.raises(ValueError, match="data_parallel_shard_size=2 is not planned"):
        plan(DENSE, 4, PlanLayout(dp_shard=2, bits=8), CLUSTER)


def test_bits_axis_of_layout_auto() -> None:
    layouts = candidate_layouts(4, 4, [], 0)
    unsharded = [lay for lay in layouts if lay.dp_shard == 1 and lay.tp < 4 and lay.pp == 1]  # DDP over dp > 1
    assert sorted(lay.bits or 0 for lay in unsharded) == sorted([0, 4, 8] * (len(unsharded) // 3))
    assert all(lay.bits is None for lay in layouts if lay not in unsharded)
    with pytest.raises(ValueError, match="compression bits=2 cannot be planned: use None"):
        PlanLayout(bits=2)


def test_lds_plan_compression(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_plan(config(*SMALL, "compression=int8")) == 0
    table = capsys.readouterr().out
    assert "layout dp=4 tp=1 int8" in table and "| ddp (world) | all_to_all | 4 |" in table
    assert "| compression residuals and messages |" in table and "compression codec" in table
    with pytest.raises(ConfigError, match="compression='int2' must be one of none, int8, int4"):
        run_plan(config(*SMALL, "compression=int2"))
