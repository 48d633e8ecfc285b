"""``StepShape(dtype="fp8")`` and ``compiled``: the FLOPs of the converted ``nn.Linear`` layers at the fp8 peak, the
rest at bf16's, in a plan without a pipeline and in a pipelined one (fake world, no process group of its own)."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_deepseek.planning import ModelSpec, PlanLayout, StepShape, plan
from lightning_deepseek.planning.cluster import ClusterSpec
from lightning_deepseek.planning.estimate import COMPILE_SPEEDUP, compute_seconds

pytest.importorskip("torchao")

HIDDEN, FFN, KV, LAYERS, MICRO, SEQ = 256, 512, 128, 2, 2, 64
LLAMA = ModelSpec("llama-tiny", "hf", dict(model_type="llama", hidden_size=HIDDEN, intermediate_size=FFN,
                                           num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                           vocab_size=1024))
# casts cost nothing at this bandwidth: the compute is the FLOPs' alone
CLUSTER = ClusterSpec.from_mapping(dict(name="h100-like", gpus_per_node=8, peak_tflops={"bf16": 989.5, "fp8": 1979},
                                        memory_gib=79.6, memory_bandwidth_gbs=1e15,
                                        links={"intra": {"bandwidth_gbs": 450, "latency_us": 3},
                                               "inter": {"bandwidth_gbs": 50, "latency_us": 5}}), "test")
BF16, FP8 = CLUSTER.peak_flops("bf16"), CLUSTER.peak_flops("fp8")
# every nn.Linear but the head (q, k, v, o, gate, up, down): 2 FLOPs per weight and token, forward + 2 backward
LINEAR_FLOPS = 6 * MICRO * SEQ * LAYERS * (2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV + 3 * HIDDEN * FFN)


def expected_seconds(flops: float, fp8_flops: float, efficiency: float) -> float:
    return ((flops - fp8_flops) / BF16 + fp8_flops / FP8) / efficiency


def test_fp8_linear_gemms_at_fp8_peak() -> None:
    layout = PlanLayout(dp_shard=2)
    shape = StepShape(MICRO, SEQ, "bf16", fsdp_bf16=True)
    bf16 = plan(LLAMA, 2, layout, CLUSTER, shape, depth="full")
    fp8 = plan(LLAMA, 2, layout, CLUSTER, dataclasses.replace(shape, dtype="fp8"), depth="full")
    assert fp8.flops == bf16.flops  # the same GEMMs, FP8 or not
    assert bf16.compute_seconds == pytest.approx(bf16.flops / BF16 / 0.4, rel=1e-12)
    assert fp8.compute_seconds == pytest.approx(expected_seconds(fp8.flops, LINEAR_FLOPS, 0.4), rel=1e-9)
    compiled = dataclasses.replace(shape, dtype="fp8", compiled=True)
    assert compute_seconds(fp8.flops, LINEAR_FLOPS, 0, CLUSTER, compiled) == pytest.approx(
        fp8.compute_seconds / COMPILE_SPEEDUP, rel=1e-9)


def test_fp8_pipelined_stages() -> None:
    layout = PlanLayout(pp=2, pp_microbatches=2)
    shape = StepShape(MICRO, SEQ, "bf16")
    bf16 = plan(LLAMA, 2, layout, CLUSTER, shape)
    fp8 = plan(LLAMA, 2, layout, CLUSTER, dataclasses.replace(shape, dtype="fp8"))
    flops = sum(row.forward_seconds + row.backward_seconds for row in bf16.pipeline.stages) * BF16 * 0.4
    seconds = sum(row.forward_seconds + row.backward_seconds for row in fp8.pipeline.stages)
    assert seconds == pytest.approx(expected_seconds(flops, LINEAR_FLOPS, 0.4), rel=1e-9)


def test_unknown_dtype_names_the_choices() -> None:
    with pytest.raises(ValueError, match="dtype='fp16' must be one of .*'fp8'"):
        StepShape(dtype="fp16")
