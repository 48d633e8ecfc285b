"""DualPipeV's overlapped forward-backward (``lightning_deepseek.parallel.pipeline_overlap``) on 4 real gloo ranks.

One spawn, pp=2 x ep=2 (the ``ep`` pairs hold the same stages; their routed experts sharded over the pair, the
dispatch's all-to-alls over it): the MoE model (auxiliary loss on) trains 3 SGD steps under DualPipeV without and
with ``pipeline_overlap=True``, each rank of an ``ep`` pair on its own data, the dense gradients averaged over the
pair. Losses, every gradient and the final weights must be bitwise equal: the overlap changes when each all-to-all
is waited on, never what is computed. The overlap must really take turns (the other micro-batch computed while some
all-to-all was in flight), and a schedule other than DualPipeV is refused before any collective.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from lightning_deepseek.models.gpt import GPT, GPTConfig
from lightning_deepseek.parallel.dims import ParallelDims
from lightning_deepseek.parallel.expert import apply_expert_parallel
from lightning_deepseek.parallel.pipeline import PipelineRunner
from lightning_deepseek.parallel.pipeline_overlap import record_exposed_all_to_all
from lightning_deepseek.parallel.pipeline_split import build_stage_module, plan_pipeline_split
from tests.helpers import run_distributed

STEPS, BATCH, SEQ, VOCAB, MICRO = 3, 8, 8, 64, 4


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=2, n_embd=32, bias=False,
                         n_routed_experts=4, moe_top_k=2, n_shared_experts=1, moe_hidden=16, n_dense_layers=0,
                         moe_aux_loss_coef=1e-2))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _local(tensor: torch.Tensor) -> list:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).tolist()


def _train(overlap: bool) -> dict[str, Any]:
    mesh = ParallelDims(4, ep=2, pp=2).build_mesh("cpu")
    pp_group, ep_group = mesh["pp"].get_group(), mesh["ep"].get_group()
    model = make_model()
    split = plan_pipeline_split(model, 2, "DualPipeV")
    modules = [build_stage_module(model, split, i) for i in split.stage_indices(dist.get_rank(pp_group))]
    for module in modules:
        apply_expert_parallel(module, mesh["edp", "ep"])
    runner = PipelineRunner.from_stage_modules(split, modules, loss_fn, pp_group, MICRO, pipeline_overlap=overlap)
    params = runner.parameters()
    opt = torch.optim.SGD(params, lr=0.1)
    gen = torch.Generator().manual_seed(10 + dist.get_rank(ep_group))  # each rank of an ep pair its own data
    tokens = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=gen)
    losses, grads = [], []
    with record_exposed_all_to_all() as exposed:
        for step in range(STEPS):
            losses.append(runner.step(tokens[step, :, :-1], tokens[step, :, 1:]).item())
            for p in params:
                if not isinstance(p, DTensor):  # the dense part is data-parallel over the ep pair
                    dist.all_reduce(p.grad, group=ep_group)
                    p.grad.div_(2)
            grads.append({n: _local(p.grad) for m in runner.modules for n, p in m.named_parameters()})
            opt.step()
            opt.zero_grad()
    weights = {n: _local(p) for m in runner.modules for n, p in m.named_parameters()}
    return {"losses": losses, "grads": grads, "weights": weights, "waits": exposed.count,
            "handovers": exposed.handovers}


def _refused() -> str:
    try:
        PipelineRunner.build(make_model(), loss_fn, schedule="1F1B", num_microbatches=MICRO, pipeline_overlap=True)
    except ValueError as exc:
        return str(exc)
    return "not refused"


def scenarios(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {"plain": _train(False), "overlap": _train(True), "refused": _refused()}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(scenarios, 4, timeout=300)


def test_overlap_is_bitwise_the_plain_schedule(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        plain, overlap = result["plain"], result["overlap"]
        assert plain["losses"] == overlap["losses"], rank
        assert plain["grads"] == overlap["grads"], rank
        assert plain["weights"] == overlap["weights"], rank
    assert results[0]["plain"]["losses"] != results[1]["plain"]["losses"]  # the ep pair did see different data


def test_overlap_takes_turns(results: list[dict[str, Any]]) -> None:
    for result in results:
        assert result["plain"]["waits"] == result["overlap"]["waits"] > 0
        assert result["plain"]["handovers"] == 0
        assert result["overlap"]["handovers"] > 0


def test_other_schedules_refused(results: list[dict[str, Any]]) -> None:
    for result in results:
        assert "pipeline_overlap=True with pipeline_schedule='1F1B'" in result["refused"]
        assert "DualPipeV" in result["refused"]
