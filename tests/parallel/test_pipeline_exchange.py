"""A pipeline's stages with ZeRO-1, ``GradientCompression`` and FP16 loss scaling: ``pp=2 x dp=2`` on 4 real gloo
processes (one spawn), each fitting ``ExchangeLM`` (SGD with momentum, FP32 master weights, no biases) on one global
batch of 8 sequences per step (each replica reads its 4; one batch per epoch), 8 optimizer steps.

- ZeRO-1 (momentum buffers sharded over each stage's two replicas) against plain ``pp x dp``: every loss and the final
  weights bitwise; half the state per rank; its DCP checkpoint after step 4 resumes (a model seeded apart) to the
  same last 4 losses and weights bitwise.
- int8 compression of the stages' ``dp`` exchange (with ZeRO-1, as ``lds-train ... compression=int8`` runs it): one
  exchange within the hook's one-step quantisation bound of the fp32 average (``tests/compression/test_hook.py``),
  replicas bitwise equal; trained 8 steps, within the bounds the DDP callback's test states against fp32 (loss 1%,
  weights 1% relative), at a quarter of the bytes.
- FP16: ``StagedPrecision`` (one FP16 stage, hysteresis 1) and Lightning's ``'16-mixed'``, with an infinite gradient
  injected on rank 3 alone at step 3: every rank skips that step and backs off to the same scale; the two plugins give
  the same losses bitwise, and one process under the same FP16 (scaled micro-batches, the step skipped) within 2e-5.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch.utils.data import DataLoader, Subset

from lightning_deepseek import GradientCompression, HybridParallelStrategy
from lightning_deepseek.compression import CompressionConfig
from lightning_deepseek.parallel.pipeline import check_pipeline_composition
from lightning_deepseek.parallel.pipeline_exchange import average_gradients, compress_exchange
from lightning_deepseek.parallel.pipeline_scaling import prepare_loss_scaling
from lightning_deepseek.parallel.zero import state_bytes
from lightning_deepseek.precision import StagedPrecision
from tests.compression.test_hook import _all_grads, _one_step_bound
from tests.helpers import run_distributed
from tests.parallel.common import full_state, loader, make_trainer, relative_error, token_data
from tests.parallel.test_pipeline_checkpoint import SaveAtStep
from tests.parallel.test_pipeline_strategy import PipelinedLM

STEPS, GLOBAL_BATCH, LAYERS, PP, OVERFLOW_STEP = 8, 8, 4, 2, 3
pytestmark = pytest.mark.timeout(900)


class ExchangeLM(PipelinedLM):
    """PipelinedLM without biases that counts the optimizer steps taken and, at ``overflow_step`` on global rank 3
    only, makes one of its gradients infinite."""

    def __init__(self, overflow_step: int | None = None) -> None:
        super().__init__(n_layer=LAYERS, bias=False)
        self.overflow_step = overflow_step
        self.steps_taken = 0
        self._hook: Any = None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = super().configure_optimizers()
        optimizer.register_step_post_hook(lambda *args: setattr(self, "steps_taken", self.steps_taken + 1))
        return optimizer

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step == self.overflow_step and dist.get_rank() == 3:
            self._hook = next(self.parameters()).register_hook(lambda grad: torch.full_like(grad, float("inf")))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(outputs, batch, batch_idx)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def _shard(world_size: int) -> DataLoader:
    """This replica's half of the one global batch (ranks 0 and 1 are the replicas: pp is the outer dimension)."""
    dp = world_size // PP
    share = GLOBAL_BATCH // dp
    start = dist.get_rank() % dp * share
    return loader(Subset(token_data(GLOBAL_BATCH), range(start, start + share)), share)


def _fit(world_size: int, zero: bool = False, compression: GradientCompression | None = None,
         save: Path | None = None, resume: Path | None = None, overflow_step: int | None = None,
         **trainer_kwargs: Any) -> dict[str, Any]:
    """Fit ExchangeLM for STEPS steps (from ``resume``: seeded apart); the mean loss of each global batch, the full
    weights, every rank's optimizer-state bytes, steps taken and final loss scale."""
    if resume is None:
        pl.seed_everything(0, verbose=False)
    else:
        torch.manual_seed(1 + dist.get_rank())
    module = ExchangeLM(overflow_step)
    callbacks = ([SaveAtStep(STEPS // 2, save)] if save is not None else []) + ([compression] if compression else [])
    strategy = HybridParallelStrategy(pipeline_parallel_size=PP, pipeline_microbatches=4, shard_optimizer_states=zero)
    trainer = make_trainer(world_size, strategy, max_steps=STEPS, callbacks=callbacks, use_distributed_sampler=False,
                           **trainer_kwargs)
    trainer.fit(module, _shard(world_size), ckpt_path=resume)
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    local = {"losses": module.losses, "state_bytes": state_bytes(trainer.optimizers[0]),
             "steps_taken": module.steps_taken, "scale": None if scaler is None else scaler.get_scale(),
             "scaler": type(scaler).__name__, "bytes_ratio": None}
    if compression is not None:
        state = compression.hook_state
        local["bytes_ratio"] = state.total_bytes_sent / state.total_bytes_fp32
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, local)
    states: list[Any] = [None] * world_size
    dist.all_gather_object(states, full_state(module))
    replicas = [g["losses"] for g in gathered[:world_size // PP]]
    return {"losses": [float(np.mean(step)) for step in zip(*replicas)], "ranks": gathered,
            "state": {k: v for s in states[::world_size // PP] for k, v in s.items()},
            "replica_states": states}


def _one_exchange(world_size: int) -> dict[str, Any]:
    """One compressed exchange of known gradients (8 bits, blocks of 128, no residual) over each ``dp`` pair, against
    the exact fp32 average: a 2-D weight compressed, a 1-D one exchanged in fp32."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group, dp_rank = groups[dist.get_rank() // 2], dist.get_rank() % 2
    module = torch.nn.Sequential(torch.nn.Linear(100, 50, bias=False), torch.nn.LayerNorm(100))
    config = CompressionConfig(bits=8, block_size=128, error_feedback=False, warmup_steps=0, min_bucket_numel=0)
    state = compress_exchange(group, module.named_parameters(), config)
    weight, norm = module[0].weight, module[1].weight
    grads = _all_grads(2, weight.numel() + norm.numel())
    weight.grad = grads[dp_rank, :weight.numel()].view_as(weight).clone()
    norm.grad = grads[dp_rank, weight.numel():].clone()
    average_gradients([weight, norm, module[1].bias], group, state)
    exact = grads.mean(0)
    bound = _one_step_bound(grads[:, :weight.numel()], 2, 8, 128)
    error = (weight.grad.reshape(-1) - exact[:weight.numel()]).abs()
    return {"within_bound": bool((error <= bound).all()), "nonzero_error": bool(error.max() > 0),
            "norm_error": float((norm.grad - exact[weight.numel():]).abs().max()),
            "bias_zero": bool((module[1].bias.grad == 0).all()),
            "weight": weight.grad.reshape(-1).tolist(), "bytes_ratio": state.bytes_sent / state.bytes_fp32}


def _shared_folder() -> Path:
    folder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    return Path(folder[0])


def _int8() -> GradientCompression:
    return GradientCompression(bits=8, block_size=64, warmup_steps=2, min_bucket_numel=1024)


def _four_ranks(rank: int, world_size: int) -> dict[str, Any]:
    root = _shared_folder()
    try:
        fp16 = StagedPrecision(schedule=[{"precision": "16-mixed"}], hysteresis=1)
        mixed = MixedPrecision("16-mixed", "cpu")  # Lightning makes precision='16-mixed' on CPU BF16
        return {"exchange": _one_exchange(world_size), "plain": _fit(world_size),
                "zero": _fit(world_size, zero=True, save=root / "zero.ckpt"),
                "zero_resumed": _fit(world_size, zero=True, resume=root / "zero.ckpt"),
                "int8": _fit(world_size, zero=True, compression=_int8()),
                "staged_fp16": _fit(world_size, overflow_step=OVERFLOW_STEP, plugins=[fp16]),
                "mixed_fp16": _fit(world_size, overflow_step=OVERFLOW_STEP, plugins=[mixed])}
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_distributed(_four_ranks, 4, timeout=840)


def test_zero1_over_each_stage_dp_is_bitwise_plain_pp_x_dp(four_ranks: list[dict[str, Any]]) -> None:
    plain, zero = four_ranks[0]["plain"], four_ranks[0]["zero"]
    assert zero["losses"] == plain["losses"] and len(plain["losses"]) == STEPS
    assert relative_error(zero["state"], plain["state"]) == 0.0
    for p, z in zip(plain["ranks"], zero["ranks"]):  # each replica keeps the momentum of about half its stage
        assert 0.3 * p["state_bytes"] < z["state_bytes"] < 0.7 * p["state_bytes"]


def test_zero1_dcp_checkpoint_resumes_bitwise(four_ranks: list[dict[str, Any]]) -> None:
    plain, resumed = four_ranks[0]["plain"], four_ranks[0]["zero_resumed"]
    assert resumed["losses"] == plain["losses"][STEPS // 2:]
    assert relative_error(resumed["state"], plain["state"]) == 0.0


def test_one_compressed_exchange_is_within_the_int8_bound(four_ranks: list[dict[str, Any]]) -> None:
    for result in (r["exchange"] for r in four_ranks):
        assert result["within_bound"] and result["nonzero_error"] and result["bias_zero"]
        assert result["norm_error"] < 1e-5  # 1-D: fp32 all-reduce (halved before the sum)
        assert 0.2 < result["bytes_ratio"] < 0.6  # the fp32 LayerNorm counts too
    assert four_ranks[0]["exchange"]["weight"] == four_ranks[1]["exchange"]["weight"]  # the same bytes dequantised


def test_int8_compression_with_zero1_trains_within_the_bound_of_fp32(four_ranks: list[dict[str, Any]]) -> None:
    plain, int8 = four_ranks[0]["plain"], four_ranks[0]["int8"]
    # The DDP callback's stated parity with fp32 after the same steps (tests/compression/test_callback.py).
    assert np.max(np.abs(np.array(int8["losses"]) - plain["losses"]) / plain["losses"]) < 0.01
    assert 0 < relative_error(int8["state"], plain["state"]) < 0.01
    replicas = int8["replica_states"]
    for a, b in ((0, 1), (2, 3)):  # every replica dequantised the same bytes
        assert all(np.array_equal(replicas[a][k], replicas[b][k]) for k in replicas[a])
    for result in int8["ranks"]:  # 6 of 8 steps compressed (2 warm-up), matrices int8, norms fp32
        assert 0.3 < result["bytes_ratio"] < 0.5


def _fp16_reference() -> list[float]:
    """One process under FP16 autocast: each replica's 4 sequences cut into the pipeline's 4 micro-batches, each
    micro-batch's loss scaled by 2**16 (2**15 after the overflow) and its backward run alone; the gradients unscaled,
    the optimizer step skipped at the overflow step."""
    pl.seed_everything(0, verbose=False)
    module = ExchangeLM()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    x, y = token_data(GLOBAL_BATCH).tensors
    losses, scale = [], 2.0**16
    for step in range(STEPS):
        step_losses = []
        for pair in zip(x.chunk(GLOBAL_BATCH), y.chunk(GLOBAL_BATCH)):
            with torch.autocast("cpu", torch.float16, cache_enabled=False):
                logits = module.model(pair[0])
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), pair[1].reshape(-1))
            (loss * scale / GLOBAL_BATCH).backward()
            step_losses.append(loss.item())
        for p in module.parameters():
            p.grad.div_(scale)
        if step == OVERFLOW_STEP:
            scale /= 2
        else:
            optimizer.step()
        optimizer.zero_grad()
        losses.append(float(np.mean(step_losses)))
    return losses


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(four_ranks: list[dict[str, Any]]) -> None:
    for name, scaler in (("staged_fp16", "DynamicLossScaler"), ("mixed_fp16", "ShardedGradScaler")):
        for result in four_ranks[0][name]["ranks"]:
            assert result["scaler"] == scaler
            assert result["steps_taken"] == STEPS - 1 and result["scale"] == 2.0**15, (name, result)


def test_fp16_loss_scaling_matches_one_process_under_fp16(four_ranks: list[dict[str, Any]]) -> None:
    staged, mixed = four_ranks[0]["staged_fp16"], four_ranks[0]["mixed_fp16"]
    assert staged["losses"] == mixed["losses"]
    assert relative_error(staged["state"], mixed["state"]) == 0.0
    np.testing.assert_allclose(staged["losses"], _fp16_reference(), rtol=2e-5)  # measured 5e-6


@pytest.mark.parametrize(("settings", "message"), [
    (dict(bits="auto"), "GradientCompression(bits='auto') with pipeline_parallel_size=2: the timed copies"),
    (dict(bits=8, data_parallel_shard_size=2), "GradientCompression(bits=8) with data_parallel_shard_size=2 and "
                                               "pipeline_parallel_size=2 is not supported yet"),
])
def test_compression_a_pipeline_cannot_take_is_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_pipeline_composition(2, "1F1B", None, **settings)
    check_pipeline_composition(2, "1F1B", None, bits=4, shard_optimizer_states=True)  # what the spawn trains


def test_a_scaler_of_another_plugin_is_refused() -> None:
    class OwnScaler(Precision):
        scaler = object()

    with pytest.raises(ValueError, match="OwnScaler has a loss scaler \\(object\\) and pipeline_parallel_size=2"):
        prepare_loss_scaling(OwnScaler(), 2)
