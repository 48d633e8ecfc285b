"""ZeRO-1 (``shard_optimizer_states=True``): two real gloo processes, one spawn for every scenario.

- parity: sharded optimizer states train exactly as unsharded ones (SGD with momentum at ``tp=2``, AdamW at
  ``dp=2``, accumulation + clipping; losses of every step and final weights, 1e-6 relative over 20 steps);
- each rank keeps the state of about half of the parameters, and the two halves cover the model;
- DCP checkpoints reshard: a ZeRO save at ``dp=2`` resumes with ZeRO off at ``tp=2`` and with ZeRO at ``dp=2``,
  with exactly the saved momenta, and both continue alike;
- with ``StagedPrecision`` (FP32 -> FP16 with loss scaling -> BF16, AdamW) an overflow on one rank skips the step
  on both ranks, and no parameter broadcast runs on the skipped step; the run matches unsharded (1e-6), and a
  resume mid-FP16 continues as the uninterrupted run (1e-6).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_deepseek import HybridParallelStrategy, StagedPrecision
from lightning_deepseek.parallel.zero import (
    ShardedOptimizerStates,
    UnshardableOptimizerError,
    check_shardable,
    partition,
)
from tests.helpers import run_distributed
from tests.parallel.common import TinyLM, full_state, loader, make_trainer, relative_error, token_data
from tests.precision.tiny import RecordSkips

STEPS, MICRO, TOL = 20, 2, 1e-6


def _fit(world_size: int, tp: int, zero: bool, adam: bool = False, accumulate: int = 1,
         clip: float | None = None, steps: int = STEPS) -> dict[str, Any]:
    dataset = token_data(steps * accumulate * world_size * MICRO)
    pl.seed_everything(0, verbose=False)
    module = TinyLM(adam=adam, lr=1e-3 if adam else 0.05)
    strategy = HybridParallelStrategy(tensor_parallel_size=tp, min_shard_params=0, shard_optimizer_states=zero)
    trainer = make_trainer(world_size, strategy, max_steps=steps, accumulate_grad_batches=accumulate,
                           gradient_clip_val=clip)
    trainer.fit(module, loader(dataset, MICRO))
    optimizer = trainer.optimizers[0]
    counts = {}
    for kind in ("replicated", "sharded"):
        params = [p for p in module.parameters() if isinstance(p, DTensor) == (kind == "sharded")]
        counts[kind] = sum(_numel(p) for p in params)
        counts[f"{kind}_stateful"] = sum(_numel(p) for p in params if optimizer.state.get(p))
    return {"losses": module.losses, "state": full_state(module), "counts": counts, "summary": strategy.summary()}


def _numel(param: torch.Tensor) -> int:
    return (param.to_local() if isinstance(param, DTensor) else param).numel()


def _momenta(module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Momentum buffers by name, from whichever rank owns them (collective)."""
    own = {}
    for name, param in module.named_parameters():
        buf = optimizer.state.get(param, {}).get("momentum_buffer")
        if buf is not None:
            own[name] = (buf.full_tensor() if hasattr(buf, "full_tensor") else buf).detach().numpy().copy()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, own)
    return {k: v for rank_state in gathered for k, v in rank_state.items()}


class _RecordLoaded(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.momenta = _momenta(pl_module, trainer.optimizers[0])


def _reshard(world_size: int, ckpt: Path) -> dict[str, Any]:
    dataset = token_data(6 * world_size * MICRO)
    pl.seed_everything(0, verbose=False)
    first = TinyLM()
    strategy = HybridParallelStrategy(tensor_parallel_size=1, shard_optimizer_states=True)
    trainer = make_trainer(world_size, strategy, max_steps=3)
    trainer.fit(first, loader(dataset, MICRO))
    trainer.save_checkpoint(ckpt)
    saved = _momenta(first, trainer.optimizers[0])
    resumed = {}
    for tp, zero in ((2, False), (1, True)):
        torch.manual_seed(tp)
        module, record = TinyLM(), _RecordLoaded()
        strategy = HybridParallelStrategy(tensor_parallel_size=tp, min_shard_params=0, shard_optimizer_states=zero)
        trainer = make_trainer(world_size, strategy, max_steps=6, callbacks=[record])
        trainer.fit(module, loader(dataset, MICRO), ckpt_path=ckpt)
        resumed[zero] = {"losses": module.losses, "momenta": record.momenta, "state": full_state(module)}
    return {"saved": saved, "resumed": resumed}


STAGED_STEPS, SKIP_AT, RESUME_AT = 8, 3, 4  # an epoch is RESUME_AT steps: Lightning resumes exactly at its end


class _InfOnRankZero(pl.Callback):
    """After the gradient reduction of step ``SKIP_AT``, rank 0 alone writes an inf into a replicated gradient."""

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step == SKIP_AT and trainer.global_rank == 0:
            pl_module.model.head.weight.grad[0, 0] = float("inf")


class _SaveAt(pl.Callback):
    def __init__(self, step: int, path: Path | None) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:  # where ModelCheckpoint saves
        if self.path is not None and trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _fit_staged(world_size: int, zero: bool, save: Path | None = None, resume: Path | None = None) -> dict[str, Any]:
    """AdamW at dp=2 through FP32 -> FP16 (loss scaling) -> BF16, one overflow on rank 0; broadcasts counted."""
    pl.seed_everything(0, verbose=False)
    module, skips = TinyLM(adam=True, lr=1e-3), RecordSkips()
    plugin = StagedPrecision([("32-true", 2), ("16-mixed", 6), ("bf16-mixed",)], init_scale=1024.0, hysteresis=1)
    strategy = HybridParallelStrategy(tensor_parallel_size=1, shard_optimizer_states=zero)
    trainer = make_trainer(world_size, strategy, max_steps=STAGED_STEPS, max_epochs=-1, plugins=[plugin],
                           callbacks=[_InfOnRankZero(), skips, _SaveAt(RESUME_AT, save)])
    broadcasts = []
    original = ShardedOptimizerStates.broadcast_parameters

    def counted(self: ShardedOptimizerStates) -> None:
        broadcasts.append(trainer.global_step)
        original(self)

    ShardedOptimizerStates.broadcast_parameters = counted  # type: ignore[method-assign]
    try:
        trainer.fit(module, loader(token_data(RESUME_AT * world_size * MICRO), MICRO), ckpt_path=resume)
    finally:
        ShardedOptimizerStates.broadcast_parameters = original  # type: ignore[method-assign]
    return {"losses": module.losses, "state": full_state(module), "skipped": skips.skipped,
            "scales": skips.scales, "broadcasts": broadcasts, "events": plugin.events()}


def _scenarios(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    ckpt = Path(tmp) / "staged.ckpt"
    out = {"staged": {"plain": _fit_staged(world_size, zero=False), "zero": _fit_staged(world_size, True, save=ckpt),
                      "resumed": _fit_staged(world_size, True, resume=ckpt)}}
    for name, kwargs in {"sgd_tp2": dict(tp=2), "adamw_dp2": dict(tp=1, adam=True),
                         "accumulate_clip_tp2": dict(tp=2, accumulate=2, clip=0.5)}.items():
        out[name] = {"plain": _fit(world_size, zero=False, **kwargs), "zero": _fit(world_size, zero=True, **kwargs)}
    out["reshard"] = _reshard(world_size, Path(tmp) / "zero.ckpt")
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_scenarios, 2, str(tmp_path_factory.mktemp("zero")), timeout=400)


@pytest.mark.parametrize("scenario", ["sgd_tp2", "adamw_dp2", "accumulate_clip_tp2"])
def test_sharded_states_train_as_unsharded(two_ranks: list[dict[str, Any]], scenario: str) -> None:
    for rank in two_ranks:
        plain, zero = rank[scenario]["plain"], rank[scenario]["zero"]
        assert len(zero["losses"]) == len(plain["losses"]) > 0
        for got, want in zip(zero["losses"], plain["losses"]):
            assert abs(got - want) <= TOL * abs(want)
        assert relative_error(zero["state"], plain["state"]) <= TOL


@pytest.mark.parametrize("scenario", ["sgd_tp2", "adamw_dp2"])
def test_every_state_is_kept_by_one_replica(two_ranks: list[dict[str, Any]], scenario: str) -> None:
    zero = [rank[scenario]["zero"]["counts"] for rank in two_ranks]
    plain = [rank[scenario]["plain"]["counts"] for rank in two_ranks]
    for counts in plain:  # unsharded: every rank keeps every state
        assert counts["replicated_stateful"] == counts["replicated"] and counts["sharded_stateful"] == counts["sharded"]
    # Replicated parameters (world replicas): each state on exactly one rank, about half on each.
    assert sum(c["replicated_stateful"] for c in zero) == zero[0]["replicated"] > 0
    assert all(0.4 <= c["replicated_stateful"] / c["replicated"] <= 0.6 for c in zero)
    # Tensor-parallel shards at dp=1 have one replica: each rank keeps its own shards' states.
    assert all(c["sharded_stateful"] == c["sharded"] for c in zero)


def test_summary_reports_state_bytes_against_ddp(two_ranks: list[dict[str, Any]]) -> None:
    for rank in two_ranks:
        summary = rank["adamw_dp2"]["zero"]["summary"]
        assert summary["hybrid_param_bytes_vs_ddp"] == 1.0  # dp=2: nothing sharded but the optimizer states
        assert 0.4 <= summary["hybrid_optimizer_state_bytes_vs_ddp"] <= 0.6
        assert "hybrid_optimizer_state_bytes_vs_ddp" not in rank["adamw_dp2"]["plain"]["summary"]


def test_zero_checkpoint_reshards_on_load(two_ranks: list[dict[str, Any]]) -> None:
    result = two_ranks[0]["reshard"]
    saved = result["saved"]
    for zero in (False, True):
        loaded = result["resumed"][zero]["momenta"]
        assert loaded.keys() == saved.keys()
        for name in saved:
            assert (loaded[name] == saved[name]).all(), name
    off, on = result["resumed"][False], result["resumed"][True]
    for got, want in zip(on["losses"], off["losses"]):
        assert abs(got - want) <= 1e-5 * abs(want)


def test_staged_precision_skips_on_every_rank_without_broadcast(two_ranks: list[dict[str, Any]]) -> None:
    for rank in two_ranks:
        plain, zero = rank["staged"]["plain"], rank["staged"]["zero"]
        assert zero["skipped"] == plain["skipped"] == [SKIP_AT]  # rank 1 had no inf and skipped too
        assert zero["scales"] == plain["scales"] and zero["events"] == plain["events"]
        steps = [s for s in range(STAGED_STEPS) if s != SKIP_AT]
        assert zero["broadcasts"] == steps  # global_step before it advances: no broadcast at SKIP_AT
        assert plain["broadcasts"] == []
        for got, want in zip(zero["losses"], plain["losses"], strict=True):
            assert abs(got - want) <= TOL * abs(want)
        assert relative_error(zero["state"], plain["state"]) <= TOL
    assert two_ranks[0]["staged"]["zero"]["state"].keys() == two_ranks[1]["staged"]["zero"]["state"].keys()
    assert relative_error(two_ranks[0]["staged"]["zero"]["state"], two_ranks[1]["staged"]["zero"]["state"]) == 0


def test_staged_zero_resumes_mid_fp16_as_uninterrupted(two_ranks: list[dict[str, Any]]) -> None:
    for rank in two_ranks:
        zero, resumed = rank["staged"]["zero"], rank["staged"]["resumed"]
        assert resumed["scales"] == zero["scales"][RESUME_AT:]  # the loss scale came back from the checkpoint
        assert resumed["broadcasts"] == list(range(RESUME_AT, STAGED_STEPS))
        for got, want in zip(resumed["losses"], zero["losses"][RESUME_AT:], strict=True):
            assert abs(got - want) <= TOL * abs(want)
        assert relative_error(resumed["state"], zero["state"]) <= TOL


def test_partition_deals_largest_first_to_least_loaded() -> None:
    from lightning_deepseek.parallel.zero import ReplicaGroup

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 40, 30, 20)]
    owners = partition(params, lambda p: ReplicaGroup((0, 1), None))
    assert [owners.owner[id(p)] for p in params] == [0, 0, 1, 1]  # 40->0, 30->1, 20->1 (30 < 40), 10->0 (40 < 50)
    assert owners.state_fraction(0) == owners.state_fraction(1) == 0.5


def test_unshardable_optimizer_is_named() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(UnshardableOptimizerError, match=r"cannot shard LBFGS .*shard_optimizer_states=False"):
        check_shardable(torch.optim.LBFGS([param]))
    check_shardable(torch.optim.AdamW([param]))


def test_one_process_warns_that_there_is_nothing_to_shard() -> None:
    pl.seed_everything(0, verbose=False)
    strategy = HybridParallelStrategy(shard_optimizer_states=True)
    trainer = make_trainer(1, strategy, max_steps=1)
    with pytest.warns(UserWarning, match="shard_optimizer_states=True on one process"):
        trainer.fit(TinyLM(), loader(token_data(2), MICRO))


def test_memory_table_shows_states_per_rank_with_and_without_zero() -> None:
    from lightning_deepseek.optim import AdamW
    from lightning_deepseek.parallel.memory import format_memory_table, memory_per_rank
    from lightning_deepseek.parallel.zero import ReplicaGroup

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (1024, 1024, 512, 512)]  # 3072 FP32 elements
    frozen = torch.nn.Parameter(torch.zeros(8), requires_grad=False)
    world = ReplicaGroup((0, 1), None)
    for optimizer, state in ((torch.optim.AdamW([*params, frozen]), 8), (AdamW(params), 4),
                             (torch.optim.SGD(params, lr=0.1, momentum=0.9), 4), (torch.optim.SGD(params, lr=0.1), 0)):
        memory = memory_per_rank([optimizer], [partition(params, lambda p: world)], world_size=2)
        ddp, plain, zero = memory["DDP"], memory["this layout"], memory["this layout + ZeRO-1"]
        assert ddp.params == ddp.grads == plain.params == zero.grads == 3072 * 4
        assert ddp.states == plain.states == 3072 * state
        assert zero.states == 3072 * state // 2  # 1024 + 512 elements on each rank
    table = format_memory_table(memory_per_rank([torch.optim.AdamW(params)], [partition(params, lambda p: world)], 2),
                                zero=True)
    assert "| optimizer states | 0.02 | 0.02 (100%) | 0.01 (50%) |" in table
    assert "this layout + ZeRO-1 (this run)" in table
