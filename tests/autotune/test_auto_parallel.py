"""The ``"auto"`` settings decide from timed copies on 2 real gloo processes (one spawn, several assertions):

- ``HybridParallelStrategy(tensor_parallel_size="auto")`` with ``GradientCompression(bits="auto")`` on the tiny GPT:
  every candidate timed on a DDP-wrapped copy (tp=2 with real DTensor collectives), the table printed once, every
  rank takes the same decision, the mesh and the hook follow it, the run summary shows it;
- ``GradientCompression(bits="auto")`` under Lightning's ``"ddp"`` on a transformers Llama from a tiny config (a
  model we did not write, measured through its own ``training_step``);
- ``expert_parallel_size="auto"`` on a tiny MoE GPT: ep 1 or 2 by their copies, the experts sharded accordingly;
- ``measure_copy_steps`` on tensor-parallel, expert-parallel and both-ways copies, compressed or not, and on
  tensor- and expert-parallel copies sharded by FSDP2, leaves the model and the random state alone;
- ``data_parallel_shard_size="auto"``: unsharded when it fits, sharded when ``$LDS_DEVICE_MEMORY_GIB`` is too small
  for unsharded (a meta-device model by the memory filter alone).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

from lightning_deepseek.autotune.auto_parallel import _shard
from lightning_deepseek.autotune.decision import Candidate
from lightning_deepseek.autotune.measure import MicroBatch, measure_copy_steps
from lightning_deepseek.compression import GradientCompression
from lightning_deepseek.parallel import HybridParallelStrategy
from lightning_deepseek.parallel.dims import ParallelDims
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
    return {"tables": [m for m in records.messages if ": timed copies (lightning_deepseek.autotune)" in m]}


def _scenarios(rank: int, world_size: int) -> dict[str, Any]:
    strategy = HybridParallelStrategy(tensor_parallel_size="auto", min_shard_params=0)
    compression = GradientCompression(bits="auto", warmup_steps=0, min_bucket_numel=256)
    hybrid = _fit(world_size, strategy, TinyLM(), [compression])
    decision = strategy.layout.decision
    hook_bits = compression.hook_state.config.bits if compression.hook_state is not None else None
    ddp_compression = GradientCompression(bits="auto", min_bucket_numel=256)
    llama = _fit(world_size, "ddp", TinyLlama(), [ddp_compression])
    copy_steps = _copy_steps(world_size)
    moe = HybridParallelStrategy(tensor_parallel_size=1, expert_parallel_size="auto", min_shard_params=0)
    moe_run = _fit(world_size, moe, TinyLM(**MOE), [])
    return {
        "rank": dist.get_rank(),
        "hybrid_tables": hybrid["tables"], "chosen": decision.chosen.label, "tp": strategy.parallel_dims.tp,
        "hook_bits": hook_bits, "decided_tokens": decision.tokens,
        "seconds": {e.candidate: e.seconds for e in decision.entries},
        "summary": {**strategy.summary(), **compression.summary()},
        "llama_tables": llama["tables"], "llama_chosen": ddp_compression.decision.chosen.label,
        "llama_seconds": {e.candidate: e.seconds for e in ddp_compression.decision.entries},
        "llama_summary": ddp_compression.summary(), "llama_hook": ddp_compression.hook_state is not None,
        "copy_steps": copy_steps,
        "moe_tables": moe_run["tables"], "moe_chosen": moe.layout.decision.chosen.label, "moe_ep": moe.parallel_dims.ep,
        "moe_seconds": {e.candidate: e.seconds for e in moe.layout.decision.entries}, "moe_summary": moe.summary(),
    }


def _copy_steps(world_size: int) -> dict[str, Any]:
    """``measure_copy_steps`` on tp=2, ep=2 and tp=2 x ep=2 copies of the tiny MoE GPT, fp32 and int8; the module
    itself must stay untouched."""
    pl.seed_everything(1, verbose=False)
    module = TinyLM(**MOE)
    before = [p.detach().clone() for p in module.parameters()]
    plan = decide_plan(module, "auto", world_size, 2, False, 0)
    order = list(range(world_size))
    layouts = {Candidate(tp, ep, bits): functools.partial(_shard, dims=ParallelDims(world_size, tp=tp, ep=ep),
                                                          plan=plan, order=order, device_type="cpu")
               for tp, ep in ((2, 1), (1, 2), (2, 2)) for bits in (None, 8)}
    layouts.update({Candidate(tp, ep, None, 2): functools.partial(  # FSDP2 over both ranks: no DDP wrapper
        _shard, dims=ParallelDims(world_size, tp=tp, ep=ep, dp_shard=2), plan=plan, order=order, device_type="cpu")
        for tp, ep in ((2, 1), (1, 2))})
    data = token_data(4)[:2]
    rng = torch.get_rng_state()
    seconds = measure_copy_steps(module, MicroBatch(data, False, "two rows", 32), layouts, 25 << 20, repeats=1)
    return {"seconds": seconds, "untouched": all(torch.equal(a, p) for a, p in zip(before, module.parameters())),
            "grads": all(p.grad is None for p in module.parameters()),
            "kept_rng": torch.equal(rng, torch.get_rng_state())}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_scenarios, 2, timeout=240)


def test_hybrid_auto_times_every_candidate_and_decides_tp_and_bits_alike_on_every_rank(ranks) -> None:
    rank0, rank1 = ranks
    assert rank0["chosen"] == rank1["chosen"] and rank0["tp"] == rank1["tp"]  # one decision, every rank
    # every candidate timed on its DDP-wrapped copy (tp=2 leaves one dp rank: fp32 only), agreed over ranks
    assert set(rank0["seconds"]) == {Candidate(1), Candidate(1, 1, 8), Candidate(1, 1, 4), Candidate(2)}
    assert rank0["seconds"] == rank1["seconds"] and all(v > 0 for v in rank0["seconds"].values())
    tp, bits = rank0["tp"], rank0["hook_bits"]
    assert rank0["chosen"] == f"tp={tp} ep=1 {'fp32' if bits is None else f'int{bits}'}"
    (table,) = rank0["hybrid_tables"]  # printed once, by rank 0
    assert rank1["hybrid_tables"] == []
    assert "tensor_parallel_size='auto', GradientCompression(bits='auto'): timed copies" in table
    assert "4 DDP-wrapped copies timed, 3 rounds" in table and "micro-batch a training batch (4, 16)" in table
    assert rank0["decided_tokens"] == 4 * 16  # the placement's token count too (no example_input_array here)
    assert all(c.label in table for c in rank0["seconds"]) and f"choice: {rank0['chosen']}" in table
    summary = rank0["summary"]
    assert summary["autotune_choice"] == rank0["chosen"]
    assert set(summary["autotune_predicted_ms"]) == {c.label for c in rank0["seconds"]}
    assert summary["hybrid_mesh"].startswith(f"dp={2 // tp} x tp={tp}")


def test_bits_auto_under_ddp_decides_on_a_transformers_model(ranks) -> None:
    rank0, rank1 = ranks
    assert rank0["llama_chosen"] == rank1["llama_chosen"]
    assert set(rank0["llama_seconds"]) == {Candidate(1), Candidate(1, 1, 8), Candidate(1, 1, 4)}
    assert rank0["llama_seconds"] == rank1["llama_seconds"] and all(v > 0 for v in rank0["llama_seconds"].values())
    (table,) = rank0["llama_tables"]
    assert "GradientCompression(bits='auto'): timed copies" in table and "3 DDP-wrapped copies timed" in table
    assert rank0["llama_hook"] == (rank0["llama_chosen"] != "tp=1 ep=1 fp32")
    assert rank0["llama_summary"]["autotune_choice"] == rank0["llama_chosen"]


def test_expert_parallel_size_auto_decides_and_shards_accordingly(ranks) -> None:
    rank0, rank1 = ranks
    assert rank0["moe_chosen"] == rank1["moe_chosen"] and rank0["moe_ep"] == rank1["moe_ep"]
    assert set(rank0["moe_seconds"]) == {Candidate(1), Candidate(1, 2)} and rank0["moe_seconds"] == rank1[
        "moe_seconds"]
    (table,) = rank0["moe_tables"]
    assert "expert_parallel_size='auto': timed copies" in table
    ep = rank0["moe_ep"]
    assert rank0["moe_chosen"] == f"tp=1 ep={ep} fp32"
    assert ("expert_parallel" in rank0["moe_summary"]) == (ep == 2)


def test_tensor_expert_and_both_ways_copies_are_timed_in_training_steps(ranks) -> None:
    for rank in ranks:  # fp32 and int8 on DDP-wrapped tp=2, ep=2 and tp=2 x ep=2 copies, tp=2 and ep=2 x FSDP-2
        assert set(rank["copy_steps"]["seconds"]) == {Candidate(tp, ep, b) for tp, ep in ((2, 1), (1, 2), (2, 2))
                                                      for b in (None, 8)} | {Candidate(2, 1, None, 2),
                                                                             Candidate(1, 2, None, 2)}
        assert all(0 < v < 5 for v in rank["copy_steps"]["seconds"].values())
        assert all(rank["copy_steps"][k] for k in ("untouched", "grads", "kept_rng"))


def test_with_nothing_timed_the_simplest_layout_that_fits_is_chosen_and_the_reason_says_why(monkeypatch) -> None:
    from types import SimpleNamespace

    from lightning_deepseek.autotune import auto_parallel
    from lightning_deepseek.parallel.topology import Topology

    class Example(TinyLM):
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.model(tokens)

    module = Example()
    module.example_input_array = token_data(4).tensors[0]

    def decide(repeats: int) -> Any:  # no process group: nothing timed means no collective
        return auto_parallel.decide_parallel(
            module, SimpleNamespace(accumulate_grad_batches=1), topology=Topology(((0, 1),)), local_size=2,
            links=None, plan_for=lambda tp: decide_plan(module, "auto", 2, tp, False, 0), tp_sizes=[1, 2],
            ep_sizes=None, bits=auto_parallel.AUTO_BITS, tokens=None, placement="auto", bucket_bytes=25 << 20,
            setting="x", repeats=repeats)

    decision = decide(repeats=0)
    assert decision.chosen == Candidate()
    assert decision.reason == "the simplest layout that fits (nothing timed: repeats=0)"
    # every candidate fits, but not four copies beside the model
    plain = decision.entry(Candidate()).memory_bytes
    monkeypatch.setattr(auto_parallel, "device_memory_bytes", lambda device, local: int(2.5 * plain / 0.9))
    squeezed = decide(repeats=3)
    assert squeezed.chosen == Candidate() and all(e.fits and e.seconds is None for e in squeezed.entries)
    assert squeezed.reason.startswith("the simplest layout that fits (nothing timed: no room for 4 copies of the "
                                      "model")
    assert {e.candidate for e in decision.entries} == {Candidate(1), Candidate(1, 1, 8), Candidate(1, 1, 4),
                                                        Candidate(2)}
    assert all(e.seconds is None and e.fits for e in decision.entries)
    assert decision.tokens == module.example_input_array.numel()


def _decided(world_size: int, module: pl.LightningModule, meta: bool = False) -> dict[str, Any]:
    """Fit ``module`` 2 steps under ``data_parallel_shard_size="auto"``: the decision, its printed table, the sizes."""
    from torch.distributed.tensor import DTensor

    records = LogRecords()
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(records)
    strategy = HybridParallelStrategy(tensor_parallel_size=1, data_parallel_shard_size="auto", min_shard_params=0)
    try:
        pl.seed_everything(0, verbose=False)
        trainer = make_trainer(world_size, strategy, max_steps=2)
        if meta:
            with trainer.init_module(empty_init=True):
                module.configure_model()
        trainer.fit(module, loader(token_data(8 * world_size), 4))
    finally:
        logger.removeHandler(records)
    decision = strategy.layout.decision
    return {"dp_shard": strategy.parallel_dims.dp_shard, "reason": decision.reason,
            "bytes": {e.candidate.dp_shard: e.memory_bytes for e in decision.entries},
            "seconds": {e.candidate.dp_shard: e.seconds for e in decision.entries},
            "tables": [m for m in records.messages if "data_parallel_shard_size='auto': " in m],
            "sharded": all(isinstance(p, DTensor) for p in module.parameters()),
            "finite": all(torch.isfinite(torch.tensor(module.losses)))}


def _shard_size_auto(rank: int, world_size: int) -> dict[str, Any]:
    import os

    from lightning_deepseek.autotune.auto_parallel import HEADROOM
    from tests.parallel.test_fsdp import MetaLM

    fits = _decided(world_size, TinyLM())
    # a real budget between the unsharded layout's memory per rank and the sharded one's
    budget = (fits["bytes"][1] + fits["bytes"][2]) / 2 / HEADROOM
    states = 2 * (fits["bytes"][1] - fits["bytes"][2])  # unsharded parameters, gradients, states: no activations
    try:
        os.environ["LDS_DEVICE_MEMORY_GIB"] = repr(budget / 2**30)
        squeezed = _decided(world_size, TinyLM())
        os.environ["LDS_DEVICE_MEMORY_GIB"] = repr(0.75 * states / HEADROOM / 2**30)
        meta = _decided(world_size, MetaLM(), meta=True)
    finally:
        del os.environ["LDS_DEVICE_MEMORY_GIB"]
    return {"fits": fits, "squeezed": squeezed, "meta": meta}


def test_data_parallel_shard_size_auto_shards_only_when_memory_requires_it_on_two_processes() -> None:
    rank0, rank1 = run_distributed(_shard_size_auto, 2, timeout=240)
    fits, squeezed, meta = rank0["fits"], rank0["squeezed"], rank0["meta"]
    assert rank1["fits"]["dp_shard"] == fits["dp_shard"] and rank1["squeezed"]["dp_shard"] == 2
    # both fit: a copy of each timed (the sharded one by FSDP2, without DDP); unsharded unless FSDP paid by 5%
    assert set(fits["seconds"]) == {1, 2} and all(v > 0 for v in fits["seconds"].values())
    assert fits["bytes"][2] < fits["bytes"][1]  # half the parameters, gradients and states; the same activations
    assert fits["dp_shard"] == 1 or fits["seconds"][2] < 0.95 * fits["seconds"][1], fits
    assert fits["sharded"] == (fits["dp_shard"] == 2) and fits["finite"]
    (table,) = fits["tables"]
    assert "2 copies timed" in table and "tp=1 ep=1 dp_shard=2 fp32" in table and "choice: tp=1 ep=1" in table
    # too small for unsharded: sharded over both ranks, and the table says why
    assert squeezed["dp_shard"] == 2 and squeezed["sharded"] and squeezed["finite"]
    assert squeezed["reason"].startswith("memory requires it (tp=1 ep=1 fp32 does not fit)")
    (table,) = squeezed["tables"]
    assert "(does not fit)" in table and "choice: tp=1 ep=1 dp_shard=2 fp32" in table
    # a meta-device model: nothing can run, the memory filter alone on the parameters' bytes
    assert meta["dp_shard"] == 2 and meta["sharded"] and meta["finite"]
    assert "a model on the meta device cannot be timed" in meta["reason"]
    assert "by memory (lightning_deepseek.autotune); nothing timed nor measured" in meta["tables"][0]
