"""HF transformers families under ``strategy="hybrid"`` against Lightning's DDP: Llama, GPT-2 (``Conv1D``), BERT
(feed-forward split across sibling modules), ViT, Mixtral (its dense parts: routed experts are fused weights, left to
expert parallelism) and DeepSeek-V3 (MLA attention with low-rank query/key paths and their own RMSNorm, a dense
layer, a MoE layer with a shared expert). Each is built from a tiny config (random init, nothing downloaded).

One 2-process gloo spawn trains every family twice, 10 SGD steps each (DDP, then hybrid at ``tp=2``); each test
checks one family: the expected layers are sharded (from the model's declared plan or by structure), the loss of
every step and the final weights match DDP to 1e-5 relative. Dropout is off: the two runs must see the same
function.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from lightning_deepseek import HybridParallelStrategy
from tests.helpers import run_distributed
from tests.parallel.common import full_state, make_trainer, relative_error

transformers = pytest.importorskip("transformers", reason="the HF family tests need transformers (the test extra)")

STEPS, MICRO, SEQ, VOCAB, TOL = 10, 2, 8, 64, 1e-5
_LM = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)


def build(family: str) -> torch.nn.Module:
    """A tiny model of ``family`` with a loss head, dropout off."""
    t = transformers
    if family == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(**_LM, num_key_value_heads=2))
    if family == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=SEQ,
                                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                              bos_token_id=0, eos_token_id=0))
    if family == "bert":
        return t.BertForMaskedLM(t.BertConfig(**_LM, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                                              attention_probs_dropout_prob=0.0))
    if family == "vit":
        return t.ViTForImageClassification(t.ViTConfig(
            image_size=8, patch_size=4, num_channels=1, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_labels=VOCAB))
    if family == "mixtral":
        return t.MixtralForCausalLM(t.MixtralConfig(**_LM, num_key_value_heads=2, num_local_experts=4,
                                                    num_experts_per_tok=2))
    if family == "deepseek_v3":  # heads x query head width == hidden size: the shape that once crashed
        return t.DeepseekV3ForCausalLM(t.DeepseekV3Config(
            **{**_LM, "num_hidden_layers": 2}, moe_intermediate_size=16, first_k_dense_replace=1,
            num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
            v_head_dim=8))
    raise ValueError(family)


FAMILIES = ("llama", "gpt2", "bert", "vit", "mixtral", "deepseek_v3")
_SWIGLU = ("gate_proj", "up_proj", "down_proj")
EXPECTED = {  # sharded layers (relative to the family's model) and where the plan came from
    "llama": ({f"model.layers.0.mlp.{n}" for n in _SWIGLU}, "declared by LlamaForCausalLM"),
    "gpt2": ({"transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj"}, "structure"),
    "bert": ({"bert.encoder.layer.0.intermediate.dense", "bert.encoder.layer.0.output.dense"}, "structure"),
    "vit": ({"vit.layers.0.mlp.fc1", "vit.layers.0.mlp.fc2"}, "structure"),  # BERT's layout before (see below)
    "mixtral": (set(), None),  # attention stays data-parallel; routed experts are fused weights (expert parallelism)
    "deepseek_v3": ({f"model.layers.0.mlp.{n}" for n in _SWIGLU}  # never MLA's q_a_proj/q_b_proj
                    | {f"model.layers.1.mlp.shared_experts.{n}" for n in _SWIGLU}, "declared by DeepseekV3ForCausalLM"),
}


class Families(pl.LightningModule):
    """Every family in one module, trained together on one fit (their parameters are disjoint, so the summed loss
    trains each as alone); each model's own loss (labels = inputs), SGD with momentum."""

    def __init__(self) -> None:
        super().__init__()
        self.models = torch.nn.ModuleDict({family: build(family) for family in FAMILIES})
        self.losses: list[dict[str, float]] = []

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        tokens, pixels, labels = batch
        losses = {family: (model(pixel_values=pixels, labels=labels) if family == "vit"
                           else model(input_ids=tokens, labels=tokens)).loss
                  for family, model in self.models.items()}
        self.losses.append({family: loss.item() for family, loss in losses.items()})
        return sum(losses.values())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def data() -> TensorDataset:
    """Four fixed samples over and over: each global batch is the same, so the loss falls within a few steps."""
    gen = torch.Generator().manual_seed(3)
    repeats = STEPS * 2 * MICRO // 4
    tokens = torch.randint(0, VOCAB, (4, SEQ), generator=gen).repeat(repeats, 1)
    pixels = torch.randn(4, 1, 8, 8, generator=gen).repeat(repeats, 1, 1, 1)
    labels = torch.randint(0, VOCAB, (4,), generator=gen).repeat(repeats)
    return TensorDataset(tokens, pixels, labels)


def _fit(strategy: pl.strategies.Strategy) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    module = Families()
    trainer = make_trainer(2, strategy, max_steps=STEPS)
    trainer.fit(module, DataLoader(data(), batch_size=MICRO))
    losses: list[Any] = [None] * 2
    dist.all_gather_object(losses, module.losses)
    state = full_state(module)
    return {
        "losses": {f: [(a[f] + b[f]) / 2 for a, b in zip(*losses)] for f in FAMILIES},
        "state": {f: {k: v for k, v in state.items() if k.startswith(f"models.{f}.")} for f in FAMILIES},
        "plan": {e.name: e.source for e in getattr(strategy, "plan", ())},
    }


def hf_family_scenarios(rank: int, world_size: int) -> dict[str, Any]:
    from lightning.pytorch.strategies import DDPStrategy

    results = {"ddp": _fit(DDPStrategy()),
               "hybrid": _fit(HybridParallelStrategy(tensor_parallel_size=2, min_shard_params=0)),
               "plain": _fit(HybridParallelStrategy(tensor_parallel_size=1))}
    return results if rank == 0 else {}


@pytest.fixture(scope="module")
def families() -> dict[str, Any]:
    return run_distributed(hf_family_scenarios, 2, timeout=280)[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_ddp_with_its_feed_forward_sharded(families: dict[str, Any], family: str) -> None:
    ddp, hybrid = families["ddp"], families["hybrid"]
    layers, source = EXPECTED[family]
    if family == "vit" and "vit.layers.0.mlp.fc1" not in dict(build("vit").named_modules()):
        layers = {"vit.encoder.layer.0.intermediate.dense", "vit.encoder.layer.0.output.dense"}  # older 5.x
    prefix = f"models.{family}."
    sharded = {name[len(prefix):]: src for name, src in hybrid["plan"].items() if name.startswith(prefix)}
    assert set(sharded) == layers
    assert set(sharded.values()) <= {source}
    got, want = hybrid["losses"][family], ddp["losses"][family]
    assert len(got) == STEPS
    for g, w in zip(got, want):
        assert abs(g - w) <= TOL * abs(w), (got, want)
    assert relative_error(hybrid["state"][family], ddp["state"][family]) <= TOL
    assert want[-1] < 0.9 * want[0]  # it trained: parity of two frozen models would prove nothing


def test_plain_layout_trains_bitwise_as_lightning_ddp(families: dict[str, Any]) -> None:
    """tp=1, ep=1: nothing sharded, each step DDPStrategy's own (no reduction of shards to run)."""
    ddp, plain = families["ddp"], families["plain"]
    assert plain["plan"] == {}
    for family in FAMILIES:
        assert plain["losses"][family] == ddp["losses"][family]
        assert plain["state"][family].keys() == ddp["state"][family].keys() != set()
        assert all((v == ddp["state"][family][k]).all() for k, v in plain["state"][family].items())
