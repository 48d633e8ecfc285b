"""One large-world plan per model preset, kept fast by planning two of its layers (the shapes of each layer are the
preset's): parameters per rank against the count from the config's shapes, and the collectives each layout makes."""

from __future__ import annotations

import time

import pytest
import yaml

from lightning_deepseek.app.plan import PRESETS_DIR, resolve_cluster
from lightning_deepseek.planning import ModelSpec, PlanLayout, StepShape, plan

FP32 = 4
STEP = StepShape(1, 128, "bf16")
H100 = resolve_cluster("h100")


def preset(name: str, **overrides: object) -> ModelSpec:
    spec = yaml.safe_load((PRESETS_DIR / "model" / f"{name}.yaml").read_text())
    return ModelSpec(name, spec["source"], {**spec["config"], **overrides})


def llama_params(c: dict, tp: int) -> int:
    """Parameters per rank of a Llama-shaped model whose feed-forward is sharded over ``tp``."""
    d, h, layers, head = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], d_head(c)
    attention = 2 * d * d + 2 * d * c["num_key_value_heads"] * head
    return 2 * c["vocab_size"] * d + d + layers * (attention + 3 * d * h // tp + 2 * d)


def d_head(c: dict) -> int:
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


@pytest.mark.parametrize(("name", "world_size", "tp"), [("llama3-8b", 1024, 8), ("llama3-70b", 2048, 8),
                                                         ("llama3-405b", 2048, 8)])
def test_llama_presets(name: str, world_size: int, tp: int) -> None:
    model = preset(name, num_hidden_layers=2)
    started = time.perf_counter()
    report = plan(model, world_size, PlanLayout(tp=tp), H100, STEP)
    assert time.perf_counter() - started < 60
    assert report.memory.params == FP32 * llama_params(dict(model.config), tp)
    assert report.memory.grads == report.memory.params
    ops = {(t.dim, t.op) for t in report.traffic}
    assert {("tp", "all_gather"), ("tp", "reduce_scatter"), ("dp", "all_reduce"),
            ("ddp (world)", "all_reduce")} <= ops


def test_mixtral_preset_expert_parallel() -> None:
    model = preset("mixtral-8x7b", num_hidden_layers=2)
    c = dict(model.config)
    d, h, experts = c["hidden_size"], c["intermediate_size"], c["num_local_experts"]
    report = plan(model, 1024, PlanLayout(ep=8, shard_optimizer_states=True), H100, STEP)
    attention = 2 * d * d + 2 * d * c["num_key_value_heads"] * d_head(c)
    layer = attention + experts * d + 3 * d * h * experts // 8 + 2 * d
    assert report.memory.params == FP32 * (2 * c["vocab_size"] * d + d + 2 * layer)
    assert report.memory.states_max >= report.memory.states
    assert {("ep", "all_to_all"), ("edp", "all_reduce"), ("edp", "broadcast")} <= {(t.dim, t.op)
                                                                                   for t in report.traffic}


@pytest.mark.parametrize(("name", "overrides", "world_size", "ep"), [
    ("qwen3-30b-a3b", {"num_hidden_layers": 2}, 1024, 16),
    ("deepseek-v3", {"num_hidden_layers": 2, "first_k_dense_replace": 1}, 2048, 64),
])
def test_moe_presets(name: str, overrides: dict, world_size: int, ep: int) -> None:
    report = plan(preset(name, **overrides), world_size, PlanLayout(ep=ep, shard_optimizer_states=True), H100, STEP)
    traffic = {(t.dim, t.op): t for t in report.traffic}
    assert traffic["ep", "all_to_all"].link == "inter" if ep > 8 else "intra"
    assert report.step_seconds > report.compute_seconds > 0 and 0 < report.mfu < 1
