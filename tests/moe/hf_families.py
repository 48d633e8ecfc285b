"""Tiny transformers MoE models from configs (random init, nothing downloaded), shared by the MoE tests."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lightning_deepseek.moe import find_expert_layers, register_experts

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
              max_position_embeddings=64, tie_word_embeddings=False)


def mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=4,
                                            num_experts_per_tok=2))


def qwen3_moe() -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=16,
                                              num_experts=4, num_experts_per_tok=2, head_dim=16,
                                              decoder_sparse_step=1, norm_topk_prob=True))


def qwen2_moe() -> nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=16,
                                               shared_expert_intermediate_size=32, num_experts=4,
                                               num_experts_per_tok=2, decoder_sparse_step=1))
    if not find_expert_layers(model):  # releases before 5.13 declare no experts for it: the documented registration
        for layer in model.model.layers:
            register_experts(layer.mlp.experts)
    return model


def deepseek_v3() -> nn.Module:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM(DeepseekV3Config(
        **COMMON, intermediate_size=64, moe_intermediate_size=16, first_k_dense_replace=1, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8))


FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "mixtral": mixtral, "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe, "deepseek_v3": deepseek_v3}


def build(family: str) -> nn.Module:
    """The family's tiny model, same weights on every call (seeded)."""
    torch.manual_seed(0)
    return FAMILIES[family]().float()


def hf_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens).loss
