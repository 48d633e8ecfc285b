"""The ``"auto"`` settings decide from measurements on 2 real gloo processes (one spawn, several assertions):

- ``HybridParallelStrategy(tensor_parallel_size="auto")`` with ``GradientCompression(bits="auto")`` on the tiny GPT:
  the candidate table is printed once, every rank takes the same decision, the mesh and the hook follow it, the
  run summary shows it; tp=2 is timed on a sharded copy of the model (real DTensor collectives) and agreed;
- ``GradientCompression(bits="auto")`` under Lightning's ``"ddp"`` on a transformers Llama from a tiny config (a
  model we did not write, measured through its own ``training_step``);
- ``expert_parallel_size="auto"`` on a tiny MoE GPT: ep 1 or 2 by the cost model (routed bytes measured by hooks on
  the experts), and the experts sharded accordingly (ep=2 timed on an expert-parallel copy);
- the gradient exchange timed at setup (fp32 and the hook's compressed exchange on the world's group), and timed
  in training steps of DDP-wrapped tp=2 and ep=2 copies (fp32 against each compression).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

from lightning_deepseek.autotune.auto_parallel import _shard_ep, _shard_tp
from lightning_deepseek.autotune.cost_model import Candidate
from lightning_deepseek.autotune.measure import MicroBatch, measure_copy_steps, measure_exchange
from lightning_deepseek.compression import GradientCompression
from lightning_deepseek.parallel import HybridParallelStrategy
from lightning_deepseek.parallel.dims import ParallelDims
from lightning_deepseek.parallel.expert import ExpertParallelDims
from lightning_deepseek.parallel.plan import decide_plan
from tests.helpers import run_distributed
from tests.parallel.common import LogRecords, TinyLM, loader, make_trainer, token_data

MOE = dict(n_routed_experts=4, moe_top_k=2, n_shared_experts=1, moe_hidden=32, n_dense_layers=1, mlp_ratio=4)


class TinyLlama(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        import transformers as t
        self.model = t.LlamaForCausalLM(t.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=96,
                                                      num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2, max_position_embeddings=32))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch[0], labels=batch[0]).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(world_size: int, strategy: Any, module: pl.LightningModule, callbacks: list) -> dict[str, Any]:
    records = LogRecords()
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(records)
    try:
        pl.seed_everything(0, verbose=False)
        trainer = make_trainer(world_size, strategy, max_steps=2, callbacks=callbacks)
        trainer.fit(module, loader(token_data(8 * world_size), 4))
    finally:
        logger.removeHandler(records)
    return {"tables": [m for m in records.messages if ": cost model (lightning_deepseek" in m]}


def _scenarios(rank: int, world_size: int) -> dict[str, Any]:
    strategy = HybridParallelStrategy(tensor_parallel_size="auto", min_shard_params=0)
    compression = GradientCompression(bits="auto", warmup_steps=0, min_bucket_numel=256)
    hybrid = _fit(world_size, strategy, TinyLM(), [compression])
    decision = strategy.autotune_decision
    hook_bits = compression.hook_state.config.bits if compression.hook_state is not None else None
    ddp_compression = GradientCompression(bits="auto", min_bucket_numel=256)
    llama = _fit(world_size, "ddp", TinyLlama(), [ddp_compression])
    rng = torch.get_rng_state()
    exchange = measure_exchange([1 << 16, 3 << 20], (8, 4), torch.device("cpu"), repeats=1, max_bytes=1 << 20)
    exchange_kept_rng = torch.equal(rng, torch.get_rng_state())
    # with gradient_as_bucket_view, no copies of the gradients into DDP's buckets and back
    bucket_view = measure_exchange([1 << 16], (8,), torch.device("cpu"), repeats=1, copies=False)
    copy_steps = _copy_steps(world_size)
    moe = HybridParallelStrategy(tensor_parallel_size=1, expert_parallel_size="auto", min_shard_params=0)
    moe_run = _fit(world_size, moe, TinyLM(**MOE), [])
    return {
        "moe_chosen": moe.autotune_decision.chosen.label, "moe_ep": moe.parallel_dims.ep,
        "moe_summary": moe.summary(), "moe_tables": moe_run["tables"],
        "hybrid_tables": hybrid["tables"], "chosen": decision.chosen.label, "tp": strategy.parallel_dims.tp,
        "candidates": [p.candidate.label for p in decision.predictions], "hook_bits": hook_bits,
        "decided_tokens": decision.tokens,
        "summary": {**strategy.summary(), **compression.summary()},
        "llama_tables": llama["tables"], "llama_chosen": ddp_compression.decision.chosen.label,
        "llama_summary": ddp_compression.summary(),
        "llama_hook": ddp_compression.hook_state is not None,
        "rank": dist.get_rank(),
        "sharded": sorted(decision.compute.sharded), "optimizer_seconds": decision.compute.optimizer_seconds,
        "moe_sharded": sorted(moe.autotune_decision.compute.sharded),
        "tp2_parts": dict(decision.prediction(Candidate(2)).parts),
        "exchange": exchange, "exchange_kept_rng": exchange_kept_rng, "bucket_view": bucket_view,
        "decided_exchange": decision.exchange_seconds,
        "int8_parts": dict(decision.prediction(Candidate(1, 1, 8)).parts),
        "llama_exchange": ddp_compression.decision.exchange_seconds,
        "copy_steps": copy_steps,
        "decided_copy_steps": decision.compute.copy_steps,
        "fp32_parts": dict(decision.prediction(Candidate(1)).parts),
        "llama_copy_steps": ddp_compression.decision.compute.copy_steps,
        "moe_copy_steps": moe.autotune_decision.compute.copy_steps,
    }


def _copy_steps(world_size: int) -> dict[str, Any]:
    """``measure_copy_steps`` on tp=2 and ep=2 copies of the tiny MoE GPT; the module itself must stay
    untouched."""
    pl.seed_everything(1, verbose=False)
    module = TinyLM(**MOE)
    before = [p.detach().clone() for p in module.parameters()]
    plan = decide_plan(module, "auto", world_size, 2, False, 0)
    shardings = {("tp", 2): functools.partial(_shard_tp, plan.styles, ParallelDims(world_size, tp=2), [[0, 1]],
                                              "cpu"),
                 ("ep", 2): functools.partial(_shard_ep, ExpertParallelDims(world_size, 2), "cpu")}
    data = token_data(4)[:2]
    rng = torch.get_rng_state()
    copies = [(kind, 2, bits) for kind in ("tp", "ep") for bits in (None, 8, 4)]
    seconds = measure_copy_steps(module, MicroBatch(data, False, "two rows", 32), shardings, copies, 25 << 20,
                                 repeats=1)
    return {"seconds": seconds, "untouched": all(torch.equal(a, p) for a, p in zip(before, module.parameters())),
            "grads": all(p.grad is None for p in module.parameters()),
            "kept_rng": torch.equal(rng, torch.get_rng_state())}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_scenarios, 2, timeout=240)


def test_hybrid_auto_decides_tp_and_bits_from_measurements_and_prints_the_table(ranks) -> None:
    rank0, rank1 = ranks
    assert rank0["chosen"] == rank1["chosen"] and rank0["tp"] == rank1["tp"]  # one decision, every rank
    assert set(rank0["candidates"]) == {"tp=1 ep=1 fp32", "tp=1 ep=1 int8", "tp=1 ep=1 int4", "tp=2 ep=1 fp32"}
    tp, bits = rank0["tp"], rank0["hook_bits"]
    assert rank0["chosen"] == f"tp={tp} ep=1 {'fp32' if bits is None else f'int{bits}'}"
    (table,) = rank0["hybrid_tables"]  # printed once, by rank 0
    assert rank1["hybrid_tables"] == []
    assert "tensor_parallel_size='auto', GradientCompression(bits='auto'): cost model" in table
    assert "measured: 3 forward/backward passes of a training batch (4, 16)" in table
    assert rank0["decided_tokens"] == 4 * 16  # the placement's token count too (no example_input_array here)
    assert all(label in table for label in rank0["candidates"]) and f"choice: {rank0['chosen']}" in table
    summary = rank0["summary"]
    assert summary["autotune_choice"] == rank0["chosen"] and set(summary["autotune_predicted_ms"]) == set(
        rank0["candidates"])
    assert summary["hybrid_mesh"].startswith(f"dp={2 // tp} x tp={tp}")
    # tp=2 was timed on a sharded copy of the model (its collectives included), not predicted from bytes alone
    assert [tuple(k) for k in rank0["sharded"]] == [("tp", 2)] and rank0["optimizer_seconds"] > 0
    assert "sharding measured on copies (tp=2, 3 interleaved steps each" in table
    # and its whole training step on a DDP-wrapped copy, which predicts it, agreed over ranks
    assert rank0["tp2_parts"]["copy"] == rank1["tp2_parts"]["copy"] > 0
    assert rank0["tp2_parts"]["copy"] == rank0["decided_copy_steps"][("tp", 2, None)]


def test_bits_auto_under_ddp_decides_on_a_transformers_model(ranks) -> None:
    rank0, rank1 = ranks
    assert rank0["llama_chosen"] == rank1["llama_chosen"]
    (table,) = rank0["llama_tables"]
    assert "GradientCompression(bits='auto'): cost model" in table and "tp=1 ep=1 int4" in table
    assert rank0["llama_hook"] == (rank0["llama_chosen"] != "tp=1 ep=1 fp32")
    assert rank0["llama_summary"]["autotune_choice"] == rank0["llama_chosen"]


def test_expert_parallel_size_auto_decides_and_shards_accordingly(ranks) -> None:
    rank0, rank1 = ranks
    assert rank0["moe_chosen"] == rank1["moe_chosen"] and rank0["moe_ep"] == rank1["moe_ep"]
    (table,) = rank0["moe_tables"]
    assert "expert_parallel_size='auto': cost model" in table
    assert "tp=1 ep=1 fp32" in table and "tp=1 ep=2 fp32" in table
    assert [tuple(k) for k in rank0["moe_sharded"]] == [("ep", 2)]
    ep = rank0["moe_ep"]
    assert rank0["moe_chosen"] == f"tp=1 ep={ep} fp32"
    assert ("expert_parallel" in rank0["moe_summary"]) == (ep == 2)


def test_the_gradient_exchange_is_timed_on_the_world_group_and_decides_compression(ranks) -> None:
    rank0, rank1 = ranks
    # measure_exchange itself: every size, fp32 and each compression, positive; the random state untouched
    assert set(rank0["exchange"]) == {(n, b) for n in (1 << 16, 3 << 20) for b in (None, 8, 4)}
    assert all(v > 0 for v in rank0["exchange"].values()) and rank0["exchange_kept_rng"]
    assert set(rank0["bucket_view"]) == {(1 << 16, None), (1 << 16, 8)} and min(rank0["bucket_view"].values()) > 0
    # the auto settings timed the tp=1 candidates' replicated bytes, agreed over ranks, and predicted from them
    decided = rank0["decided_exchange"]
    assert decided == rank1["decided_exchange"] and all(v > 0 for v in decided.values())
    (size,) = {n for n, _ in decided}
    assert set(decided) == {(size, b) for b in (None, 8, 4)}
    assert "quantize" not in rank0["int8_parts"]  # whole copies' steps predict it (the timed exchange: fallback)
    assert "gradient exchange measured on the world's group" in rank0["hybrid_tables"][0]
    assert rank0["llama_exchange"] == rank1["llama_exchange"] and len(rank0["llama_exchange"]) == 3


def test_every_layout_is_timed_in_training_steps_of_ddp_wrapped_copies(ranks) -> None:
    rank0, rank1 = ranks
    # the hybrid auto settings (unsharded fp32, int8, int4; tp=2 leaves one dp rank: fp32 only), bits="auto" under
    # plain DDP (unsharded, each exchange) and expert_parallel_size="auto" (ep=1 and ep=2, fp32): each candidate's
    # layout and exchange timed on a whole DDP-wrapped copy, agreed over ranks
    decided = rank0["decided_copy_steps"]
    assert decided == rank1["decided_copy_steps"]
    assert set(decided) == {("tp", 1, None), ("tp", 1, 8), ("tp", 1, 4), ("tp", 2, None)}
    assert set(rank0["llama_copy_steps"]) == {("tp", 1, b) for b in (None, 8, 4)}
    assert rank0["llama_copy_steps"] == rank1["llama_copy_steps"]
    assert set(rank0["moe_copy_steps"]) == {("tp", 1, None), ("ep", 2, None)}
    assert all(v > 0 for v in [*decided.values(), *rank0["moe_copy_steps"].values()])
    # and the candidates are predicted from them
    assert rank0["fp32_parts"]["copy"] == decided[("tp", 1, None)]
    assert rank0["int8_parts"]["copy"] == decided[("tp", 1, 8)]
    (table,) = rank0["hybrid_tables"]
    assert "training steps measured on 4 DDP-wrapped copies (unsharded, tp=2" in table
    assert "training steps of the copies: unsharded fp32" in table
    assert "training steps measured on 3 DDP-wrapped copies (unsharded" in rank0["llama_tables"][0]


def test_tensor_and_expert_parallel_copies_are_timed_in_training_steps(ranks) -> None:
    for rank in ranks:  # fp32, int8 and int4 on DDP-wrapped tp=2 and ep=2 copies: positive, no side effects
        assert set(rank["copy_steps"]["seconds"]) == {(k, 2, b) for k in ("tp", "ep") for b in (None, 8, 4)}
        assert all(0 < v < 5 for v in rank["copy_steps"]["seconds"].values())
        assert all(rank["copy_steps"][k] for k in ("untouched", "grads", "kept_rng"))
