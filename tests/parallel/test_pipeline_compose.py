"""Pipeline stages composed with tensor and expert parallelism (``HybridParallelStrategy(pipeline_parallel_size=2,
tensor_parallel_size=2)`` and ``expert_parallel_size=2``) in Lightning's loop, on 4 real gloo processes, against one
process on the same global batch (FP32, SGD with momentum, 8 optimizer steps, losses and final weights to 1e-5).

One 4-rank spawn runs: pp=2 x tp=2 (our GPT's feed-forward layers sharded over each stage's two ranks, which read
the same batch) with 1F1B, and with Interleaved1F1B under gradient accumulation and clipping; pp=2 x ep=2 (the MoE
preset's routed experts sharded over each stage's two data-parallel ranks, DeepSeek-V3's shape) with DualPipeV and
its ``pipeline_overlap``, clipping and ``ExpertLoadBalancing`` (20 steps; its bias updates from every micro-batch's
routed counts, as one process makes them), and with ZeRO-1 on 1F1B (4 steps; the replicated parameters' states dealt
over each stage's two dp ranks, the experts' kept: edp=1); HF Llama and Qwen3 (a norm over each head) from tiny
configs (random init) at pp=2 x tp=2, their declared attention heads sharded beside their feed-forward layers: Llama
under every schedule (1F1B for 8 steps, the others 4), Qwen3 (losses) and with sequence parallelism under full
activation checkpointing; a pp=2 x tp=2 DCP checkpoint resumed at the same layout and without tp
(``test_pipeline_checkpoint.py``'s runs: 10 + 10 steps against 20 uninterrupted, 1e-6); ``loss_parallel``
(embedding, head and loss sharded by vocabulary): our GPT under DualPipeV with clipping and HF Llama with sequence
parallelism (4 steps), and ``trainer.predict``'s gathered logits.

One 8-rank spawn (few steps: CI's time) runs the 3-D compositions: pp=2 x tp=2 x dp_shard=2 (torchtitan's FSDP x TP x
PP; 2-D DTensors over (dp, tp), clipping, a DCP folder resumed), pp=2 x tp=2 x dp=2 with ZeRO-1, pp=2 x ep=2 x
dp_shard=4 (experts over edp=2) and pp=2 x ep=2 x dp=4 with ZeRO-1 (experts' states over edp=2).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_deepseek import HybridParallelStrategy
from lightning_deepseek.moe import ExpertLoadBalancing
from lightning_deepseek.parallel.pipeline import check_pipeline_composition
from lightning_deepseek.parallel.pipeline_overlap import record_exposed_all_to_all
from lightning_deepseek.parallel.pipeline_split import SCHEDULES, plan_pipeline_split
from lightning_deepseek.parallel.pipeline_stage_parallel import check_stage_boundaries
from lightning_deepseek.parallel.plan import Plan, PlanEntry
from tests.helpers import run_distributed
from tests.parallel.common import (
    loader,
    make_trainer,
    relative_error,
    token_data,
)
from tests.parallel.test_expert_strategy import RATE, _balancing
from tests.parallel.test_pipeline import LAYERS, SEQ, VOCAB
from tests.parallel.test_pipeline_checkpoint import SaveAtStep, _shared_folder, check_resumed
from tests.parallel.test_pipeline_checkpoint import _fit as fit_scheduled
from tests.parallel.test_pipeline_strategy import (
    MICRO,
    MOE,
    STEPS,
    TOL,
    PipelinedLlama,
    PipelinedLM,
    _fit,
    check_hf_parity,
    check_parity,
    gathered_state,
    hf_reference,
)

pytestmark = pytest.mark.timeout(900)


QWEN_STEPS = 4
# The balancing biases move by +-RATE a step: over the default STEPS a stage's can be back at exactly zero.
BALANCING_STEPS = 20


def _qwen3() -> nn.Module:
    """HF Qwen3 from a tiny config: a norm over each attention head (``q_norm``, ``k_norm``) inside the attention."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=SEQ, tie_word_embeddings=False)
    return transformers.Qwen3ForCausalLM(config).float()


def _hf(world_size: int, model: nn.Module | None = None, steps: int = STEPS, schedule: str = "1F1B",
        **settings: Any) -> dict[str, Any]:
    """An HF model (Llama by default; tiny config) at pp=2 x tp=2: its losses, final weights and tensor-parallel
    parameters."""
    module = PipelinedLlama()
    module.model = model if model is not None else module.model
    strategy = HybridParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, pipeline_schedule=schedule,
                                      pipeline_microbatches=4, min_shard_params=0, **settings)
    make_trainer(world_size, strategy, max_steps=steps).fit(module, loader(token_data(STEPS * MICRO), MICRO))
    return {"losses": module.losses, "state": gathered_state(module),
            "shards": [n for n, p in module.named_parameters() if isinstance(p, DTensor)]}


def _qwen3_reference() -> list[float]:
    return hf_reference(_qwen3(), QWEN_STEPS)


def _checkpoints(world_size: int) -> dict[str, Any]:
    """A pp=2 x tp=2 run's DCP checkpoint (tensor-parallel shards, AdamW states, LR schedule) resumed at the same
    layout and at pp=2 x dp=2 (no tp: the shards loaded whole)."""
    root = _shared_folder()
    results = {"saved": fit_scheduled(world_size, 2, save=root / "tp.ckpt", tp=2)}
    results["same"] = fit_scheduled(world_size, 2, resume=root / "tp.ckpt", tp=2)
    results["dp"] = fit_scheduled(world_size, 2, resume=root / "tp.ckpt")
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root)
    return results


# The schedules the cases above do not run, at each model-parallel size (4 steps each): every schedule composes.
OTHER_SCHEDULES = {"tp": ("ZBVZeroBubble", "DualPipeV"), "ep": ("Interleaved1F1B", "ZBVZeroBubble")}
# HF Llama at pp=2 x tp=2: 1F1B for STEPS, every other schedule for 4.
LLAMA_STEPS = {schedule: STEPS if schedule == "1F1B" else 4 for schedule in SCHEDULES}


def _predict_vocabulary_parallel(world_size: int) -> float:
    """``trainer.predict`` at pp=2 x tp=2 with ``loss_parallel`` (DualPipeV: rank 0 holds embedding and head): the
    largest relative error of the gathered logits against the unsplit model's."""
    pl.seed_everything(0, verbose=False)
    module = PipelinedLM(n_layer=LAYERS)
    data = token_data(8)
    with torch.no_grad():
        expected = module.model(data.tensors[0])
    strategy = HybridParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, pipeline_schedule="DualPipeV",
                                      pipeline_microbatches=4, min_shard_params=0, loss_parallel=True)
    logits = torch.cat(make_trainer(world_size, strategy).predict(module, loader(data, 4)))
    return float((logits - expected).abs().max() / expected.abs().max())


def _four_ranks(rank: int, world_size: int) -> dict[str, Any]:
    os.chdir(tempfile.mkdtemp())  # ExpertLoadBalancing plots into the trainer's root folder
    with record_exposed_all_to_all() as exposed:  # counts the all-to-alls the overlap hid behind compute
        ep = _fit(world_size, "DualPipeV", ep=2, clip=1.0, callbacks=[ExpertLoadBalancing(RATE)], overlap=True,
                  steps=BALANCING_STEPS, **MOE)
    return {"tp": _fit(world_size, "1F1B", tp=2),
            "tp_interleaved": _fit(world_size, "Interleaved1F1B", tp=2, accumulate=2, clip=0.5),
            "ep": {**ep, "handovers": exposed.handovers},
            "ep_zero": _fit(world_size, "1F1B", ep=2, zero=True, steps=4, **MOE),
            **{f"moe_tp_{name}": _fit(world_size, name, tp=2, steps=4, **MOE) for name in SCHEDULES},
            **{f"tp_{name}": _fit(world_size, name, tp=2, steps=4) for name in OTHER_SCHEDULES["tp"]},
            **{f"ep_{name}": _fit(world_size, name, ep=2, steps=4, **MOE) for name in OTHER_SCHEDULES["ep"]},
            **{f"llama_{name}": _hf(world_size, steps=steps, schedule=name) for name, steps in LLAMA_STEPS.items()},
            "qwen3": _hf(world_size, _qwen3(), QWEN_STEPS),
            "qwen3_sp": _hf(world_size, _qwen3(), QWEN_STEPS, sequence_parallel=True, activation_checkpointing="full"),
            "checkpoints": _checkpoints(world_size),
            "vocabulary": _fit(world_size, "DualPipeV", tp=2, steps=4, clip=0.5, loss_parallel=True),
            "llama_vocabulary": _hf(world_size, steps=4, sequence_parallel=True, loss_parallel=True),
            "predict_vocabulary": _predict_vocabulary_parallel(world_size)}


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_distributed(_four_ranks, 4, timeout=840)


def _eight_ranks(rank: int, world_size: int) -> dict[str, Any]:
    """pp=2 x tp=2 x dp_shard=2 (1F1B, clipping at 0.5, one batch per epoch): 4 steps, a DCP folder saved after the
    second, and 2 steps resumed from it, and 2 steps with ``loss_parallel``; pp=2 x tp=2 x dp=2 with ZeRO-1 (1F1B, 2
    steps); the MoE preset at pp=2 x
    ep=2 x dp_shard=4 (edp=2; 1F1B, clipping at 0.5, 2 steps), and at pp=2 x ep=2 x dp=4 with ZeRO-1 (edp=2)."""
    root = _shared_folder()
    layout = dict(tp=2, shard=2, clip=0.5, steps=1, max_steps=4)
    results = {"saved": _fit(world_size, "1F1B", callbacks=[SaveAtStep(2, root / "ckpt")], **layout),
               "resumed": _fit(world_size, "1F1B", resume=str(root / "ckpt"), **layout),
               "zero": _fit(world_size, "1F1B", tp=2, zero=True, steps=2),
               "vocabulary": _fit(world_size, "1F1B", tp=2, shard=2, clip=0.5, steps=2, loss_parallel=True),
               "ep_fsdp": _fit(world_size, "1F1B", ep=2, shard=4, clip=0.5, steps=2, **MOE),
               "ep_zero": _fit(world_size, "1F1B", ep=2, zero=True, steps=2, **MOE)}
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root)
    return results


@pytest.fixture(scope="module")
def eight_ranks() -> list[dict[str, Any]]:
    return run_distributed(_eight_ranks, 8, timeout=600)


def test_pp2_x_tp2_matches_one_process(four_ranks: list[dict[str, Any]]) -> None:
    check_parity([r["tp"] for r in four_ranks])
    # the tp ranks of a stage read the same batch: one data-parallel replica
    assert [r["tp"]["sampler"] for r in four_ranks] == [{"num_replicas": 1, "rank": 0}] * 4
    first, last = four_ranks[0]["tp"]["shards"], four_ranks[2]["tp"]["shards"]
    assert "model.blocks.0.mlp.fc1.weight" in first and "model.blocks.3.mlp.fc2.weight" in last
    assert not any("attn" in name for name in first + last)  # the plan shards the feed-forward layers only


def test_pp2_x_tp2_interleaved_with_accumulation_and_clipping(four_ranks: list[dict[str, Any]]) -> None:
    check_parity([r["tp_interleaved"] for r in four_ranks], accumulate=2, clip=0.5)
    assert "Interleaved1F1B, pp=2" in four_ranks[0]["tp_interleaved"]["table"]


def test_pp2_x_ep2_dualpipev_overlapped_with_load_balancing(four_ranks: list[dict[str, Any]]) -> None:
    check_parity([r["ep"] for r in four_ranks], clip=1.0, after_step=_balancing, **MOE)
    results = [r["ep"] for r in four_ranks]
    assert all(r["handovers"] > 0 for r in results)  # pipeline_overlap=True: all-to-alls in flight behind compute
    assert [r["sampler"]["rank"] for r in results] == [0, 1, 0, 1]  # each ep group: the stage's two dp replicas
    for first, second in ((results[0], results[1]), (results[2], results[3])):  # an ep group's biases agree
        assert first["biases"] == second["biases"] and any(any(b) for b in first["biases"].values())
        assert first["shards"] and all(".experts." in name for name in first["shards"])


def test_pp2_x_ep2_x_zero1_matches_one_process_with_states_over_each_stage_dp(four_ranks: list[dict[str, Any]]
                                                                             ) -> None:
    results = [r["ep_zero"] for r in four_ranks]
    check_parity(results, **MOE)
    for pair in (results[:2], results[2:]):  # a stage's two dp replicas; edp=1: each keeps its experts' states
        numel = pair[0]["numel"]
        replicated = {n for n in numel if n not in pair[0]["shards"]}
        owned = [set(r["with_state"]) & replicated for r in pair]
        assert not owned[0] & owned[1] and owned[0] | owned[1] == replicated  # each state kept by one replica
        for result, mine in zip(pair, owned):
            experts = set(result["shards"])
            assert experts and experts <= set(result["with_state"])
            assert result["state_bytes"] == 4 * sum(result["numel"][n] for n in experts | mine)  # FP32 momentum
            assert sum(numel[n] for n in mine) < 0.7 * sum(numel[n] for n in replicated)


@pytest.mark.parametrize("case", [f"{size}_{schedule}" for size, schedules in OTHER_SCHEDULES.items()
                                  for schedule in schedules])
def test_every_schedule_composes_with_tp_and_ep(four_ranks: list[dict[str, Any]], case: str) -> None:
    check_parity([r[case] for r in four_ranks], **(MOE if case.startswith("ep") else {}))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_x_tp2_hf_llama_matches_one_process_under_every_schedule(four_ranks: list[dict[str, Any]],
                                                                    schedule: str) -> None:
    results = [r[f"llama_{schedule}"] for r in four_ranks]
    check_hf_parity(results, LLAMA_STEPS[schedule])
    for result in results:
        # each rank's 4 layers: query, key, value, output (attention heads split) and the 3 feed-forward projections
        projections = {n.split(".")[-2] for n in result["shards"]}
        assert len(result["shards"]) == 28 and projections == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj"}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_x_tp2_moe_preset_shards_its_dense_and_shared_feed_forward(four_ranks: list[dict[str, Any]],
                                                                       schedule: str) -> None:
    results = [r[f"moe_tp_{schedule}"] for r in four_ranks]
    check_parity(results, **MOE)  # the routed experts replicated over tp, the dense and shared ones sharded
    shards = set().union(*(r["shards"] for r in results))  # every stage's, over the ranks
    assert "model.blocks.0.mlp.fc1.weight" in shards and any(".mlp.shared." in name for name in shards)
    assert not any(".experts." in name for name in shards)


def test_pp2_x_tp2_hf_qwen3_sums_its_head_norms_over_tp(four_ranks: list[dict[str, Any]]) -> None:
    # q_norm/k_norm see only their rank's heads: without the sum over tp the losses leave 1e-5 from the second step
    reference = _qwen3_reference()
    for result in four_ranks:
        np.testing.assert_allclose(result["qwen3"]["losses"], reference, rtol=TOL)
        assert len(result["qwen3"]["shards"]) == 28


def test_pp2_x_tp2_sequence_parallel_matches_one_process(four_ranks: list[dict[str, Any]]) -> None:
    # the blocks' norms on half the sequence each (their gradients summed over tp), under full checkpointing
    qwen3 = _qwen3_reference()
    for result in four_ranks:
        np.testing.assert_allclose(result["qwen3_sp"]["losses"], qwen3, rtol=TOL)


def test_loss_parallel_shards_the_vocabulary_and_matches_one_process(four_ranks: list[dict[str, Any]]) -> None:
    # our GPT under DualPipeV (rank 0 holds the embedding and the head), clipped; HF Llama with sequence parallelism
    check_parity([r["vocabulary"] for r in four_ranks], clip=0.5)
    check_hf_parity([r["llama_vocabulary"] for r in four_ranks], 4)
    assert [sorted(n for n in r["vocabulary"]["shards"] if "emb" in n or "head" in n) for r in four_ranks] == [
        ["model.head.weight", "model.tok_emb.weight"]] * 2 + [[]] * 2
    assert [[n for n in r["llama_vocabulary"]["shards"] if "emb" in n or "head" in n] for r in four_ranks] == [
        ["model.model.embed_tokens.weight"]] * 2 + [["model.lm_head.weight"]] * 2
    # predict gathers the logits whole on every rank
    assert all(r["predict_vocabulary"] <= 1e-6 for r in four_ranks)


def test_pp2_x_tp2_checkpoint_resumes_with_and_without_tp(four_ranks: list[dict[str, Any]]) -> None:
    runs = four_ranks[0]["checkpoints"]
    check_resumed(runs["saved"], runs["same"])
    check_resumed(runs["saved"], runs["dp"])


def test_pp2_x_tp2_x_fsdp2_matches_one_process_and_resumes_from_dcp(eight_ranks: list[dict[str, Any]]) -> None:
    saved, resumed = [r["saved"] for r in eight_ranks], [r["resumed"] for r in eight_ranks]
    check_parity(saved, clip=0.5)
    meshes = {**saved[0]["meshes"], **saved[-1]["meshes"]}  # the tensor-parallel layers 2-D, the others over dp
    assert meshes["model.blocks.0.mlp.fc1.weight"] == ("dp", "tp") and meshes["model.blocks.3.mlp.fc2.weight"] == (
        "dp", "tp")
    assert meshes["model.blocks.0.attn.qkv.weight"] == ("dp",) and meshes["model.head.weight"] == ("dp",)
    assert [r["sampler"]["rank"] for r in saved] == [0, 0, 1, 1] * 2  # a stage's tp ranks read one dp shard
    # the last 2 steps again from the folder (2-D shards, their momentum), seeded as the saving run
    assert len(resumed[0]["losses"][0]) == 2 and resumed[0]["losses"] == [r[2:] for r in saved[0]["losses"]]
    assert relative_error(resumed[0]["state"], saved[0]["state"]) <= TOL


def test_pp2_x_tp2_x_fsdp2_with_loss_parallel_matches_one_process(eight_ranks: list[dict[str, Any]]) -> None:
    results = [r["vocabulary"] for r in eight_ranks]  # torchtitan's 405B shape: the vocabulary over tp, FSDP2 over dp
    check_parity(results, clip=0.5)
    meshes = {**results[0]["meshes"], **results[-1]["meshes"]}
    assert meshes["model.tok_emb.weight"] == meshes["model.head.weight"] == ("dp", "tp")


def test_pp2_x_tp2_x_zero1_matches_one_process_with_states_over_each_stage_dp(eight_ranks: list[dict[str, Any]]
                                                                             ) -> None:
    results = [r["zero"] for r in eight_ranks]
    check_parity(results)
    for first in (0, 1, 4, 5):  # pp outermost, tp innermost: rank first + 2 is the other dp replica of its shards
        pair = (results[first], results[first + 2])
        numel, owned = pair[0]["numel"], [set(r["with_state"]) for r in pair]
        assert pair[0]["shards"] and not owned[0] & owned[1] and owned[0] | owned[1] == set(numel)
        for result, mine in zip(pair, owned):  # FP32 momentum of the parameters (tp shards: local) it owns
            assert result["state_bytes"] == 4 * sum(numel[n] for n in mine) < 0.7 * 4 * sum(numel.values())


def test_pp2_x_ep2_x_zero1_deals_the_experts_states_over_edp(eight_ranks: list[dict[str, Any]]) -> None:
    results = [r["ep_zero"] for r in eight_ranks]
    check_parity(results, **MOE)
    for stage in (results[:4], results[4:]):  # ep groups (0, 1), (2, 3): ranks 0 and 2 hold one slice of experts
        replicated = {n for n in stage[0]["numel"] if n not in stage[0]["shards"]}
        owned = [set(r["with_state"]) & replicated for r in stage]
        assert sum(map(len, owned)) == len(replicated) and set().union(*owned) == replicated  # once over dp=4
        for replicas in ((stage[0], stage[2]), (stage[1], stage[3])):
            experts = [set(r["with_state"]) & set(r["shards"]) for r in replicas]
            assert experts[0] and not experts[0] & experts[1] and experts[0] | experts[1] == set(replicas[0]["shards"])


def test_pp2_x_ep2_x_fsdp2_matches_one_process(eight_ranks: list[dict[str, Any]]) -> None:
    results = [r["ep_fsdp"] for r in eight_ranks]
    check_parity(results, clip=0.5, **MOE)
    for result in (results[0], results[-1]):  # the experts 2-D over the stage's (edp, ep), the rest over its dp
        experts = {n: m for n, m in result["meshes"].items() if ".experts." in n}
        assert experts and set(experts.values()) == {("edp", "ep")}
        assert {m for n, m in result["meshes"].items() if n not in experts} == {("dp",)}
        assert result["sharded"]


class _Chain(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8), nn.Linear(8, 8))


def test_a_stage_boundary_inside_a_tensor_parallel_pair_is_refused() -> None:
    split = plan_pipeline_split(_Chain(), 2, split_points=["1"])  # stage 1 begins after the column-wise layer
    plan = Plan((PlanEntry("model.0", "colwise", 288), PlanEntry("model.2", "rowwise", 264)))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 with pipeline_parallel_size=2: pipeline stage 0 "
                                         r"ends after the tensor-parallel layer 'model.0'"):
        check_stage_boundaries(plan, split, "model", 2)
    check_stage_boundaries(plan, plan_pipeline_split(_Chain(), 2, split_points=["3"]), "model", 2)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(tensor_parallel_size=2, expert_parallel_size=2), "a pipeline stage composes with tensor or expert "
                                                           "parallelism, not both yet"),
    (dict(tensor_parallel_size="per_node"), "with tensor_parallel_size='per_node' is not supported"),
])
def test_what_does_not_compose_yet_is_refused_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HybridParallelStrategy(pipeline_parallel_size=2, **kwargs)


@pytest.mark.parametrize("size", ["tensor_parallel_size", "expert_parallel_size"])
def test_compressing_a_model_parallel_stage_exchange_is_refused(size: str) -> None:
    with pytest.raises(ValueError, match=rf"with {size}=2 and GradientCompression\(bits=8\) is not supported yet"):
        check_pipeline_composition(2, "1F1B", None, bits=8, **{size: 2})
