"""Sequence parallelism's checks before any rank starts: the settings it needs, and the models it can split (the
numerics run in ``test_pipeline_compose.py``'s 4-rank spawn: HF Llama and Qwen3 at pp=2 x tp=2 against one process)."""

from __future__ import annotations

import pytest

from lightning_deepseek import HybridParallelStrategy
from lightning_deepseek.parallel.pipeline_split import plan_pipeline_split
from lightning_deepseek.parallel.pipeline_stage_parallel import tensor_parallel_partial_params
from lightning_deepseek.parallel.plan import Plan, add_attention_heads, decide_plan
from lightning_deepseek.parallel.sequence_parallel import check_sequence_parallel, sequence_local_params
from tests.parallel.test_pipeline import make_model


@pytest.mark.parametrize("settings", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2},
                                      {"pipeline_parallel_size": 2, "tensor_parallel_size": "auto"}])
def test_needs_a_pipeline_and_tensor_parallelism(settings: dict) -> None:
    with pytest.raises(ValueError, match="sequence_parallel=True .* needs pipeline_parallel_size > 1 and a "
                                         "tensor_parallel_size > 1"):
        HybridParallelStrategy(sequence_parallel=True, **settings)


def _stage_plan(name: str) -> tuple[object, Plan]:
    model = make_model(name)
    plan = decide_plan(model, "auto", 4, 2, False, 0)
    return model, add_attention_heads(model, plan, 2, 0)


def test_refuses_a_block_whose_attention_stays_replicated() -> None:
    model, plan = _stage_plan("gpt")  # our GPT's fused qkv: no attention entries
    with pytest.raises(ValueError, match=r"block 'blocks\.0' holds no attention whose heads the tensor-parallel plan "
                                         "splits.*set sequence_parallel=False"):
        check_sequence_parallel(plan, plan_pipeline_split(model, 2), "", 2)


def test_sums_the_norms_of_the_blocks_over_tp() -> None:
    model, plan = _stage_plan("llama")
    split = plan_pipeline_split(model, 2)
    check_sequence_parallel(plan, split, "", 2)
    local = {n for n, p in model.named_parameters() for q in sequence_local_params(model, plan, split, [0], "")
             if p is q}
    assert local == {f"model.layers.{i}.{norm}.weight" for i in range(4)
                     for norm in ("input_layernorm", "post_attention_layernorm")}
    assert tensor_parallel_partial_params(model, plan) == []  # Llama's attention holds its projections only
