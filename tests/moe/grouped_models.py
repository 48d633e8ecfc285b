"""Tiny language models whose MoE layers are not transformers': torchtitan's ``MoE`` (its ``GroupedExperts``, called
``experts(rows, num_tokens_per_expert)`` after its own router and token sorting, BF16 expert compute) and a user's
own layer of the same ``"grouped"`` convention in FP32, registered with ``register_experts``. Shared by the protocol
tests and the expert-parallel parity runs; random init from a seed, nothing downloaded."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_deepseek.moe import register_experts

VOCAB, DIM, HIDDEN, NUM_EXPERTS, TOP_K = 64, 16, 32, 4, 2


class UserGroupedExperts(nn.Module):
    """A user's experts of the ``"grouped"`` convention: SwiGLU per expert on its contiguous slice of rows."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = NUM_EXPERTS
        self.w_in = nn.Parameter(torch.randn(NUM_EXPERTS, DIM, 2 * HIDDEN) * 0.2)
        self.w_out = nn.Parameter(torch.randn(NUM_EXPERTS, HIDDEN, DIM) * 0.2)

    def forward(self, rows: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        outs = []
        for e, chunk in enumerate(torch.split(rows, num_tokens_per_expert.tolist())):
            gate, up = (chunk @ self.w_in[e]).chunk(2, dim=-1)
            outs.append((F.silu(gate) * up) @ self.w_out[e])
        return torch.cat(outs)


class UserMoE(nn.Module):
    """Router (softmax top-k, ``expert_bias`` for the choice only), sort, experts, weight and scatter back."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, NUM_EXPERTS, bias=False)
        self.experts = register_experts(UserGroupedExperts())
        self.register_buffer("expert_bias", torch.zeros(NUM_EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.size(-1))
        scores = self.gate(flat).softmax(dim=-1)
        index = torch.topk(scores + self.expert_bias, TOP_K, dim=-1).indices
        weights = scores.gather(1, index)
        order = torch.argsort(index.flatten(), stable=True)
        counts = torch.bincount(index.flatten(), minlength=NUM_EXPERTS)
        out = self.experts(flat[order // TOP_K], counts) * weights.flatten()[order, None]
        combined = torch.zeros_like(flat).index_add_(0, order // TOP_K, out)
        return combined.view_as(x)


def titan_moe() -> nn.Module:
    """torchtitan 0.3's MoE layer: token-choice top-k router with ``expert_bias_E``, grouped experts."""
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    config = MoE.Config(
        num_experts=NUM_EXPERTS,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=DIM, hidden_dim=HIDDEN, num_experts=NUM_EXPERTS),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=NUM_EXPERTS, top_k=TOP_K)),
        router=TokenChoiceTopKRouter.Config(num_experts=NUM_EXPERTS, top_k=TOP_K, score_func="softmax",
                                            gate=Linear.Config(in_features=DIM, out_features=NUM_EXPERTS)))
    return config.build()


class MoELM(nn.Module):
    """Embedding, two residual MoE layers (each after a LayerNorm), a linear head; ``kind``: ``"titan"``/``"user"``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norms = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(2))
        self.moes = nn.ModuleList((titan_moe() if kind == "titan" else UserMoE()) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return self.head(x)


def build(kind: str) -> MoELM:
    """The model of ``kind`` with the same weights on every call (all parameters drawn from one seed)."""
    torch.manual_seed(0)
    model = MoELM(kind)
    with torch.no_grad():
        for param in model.parameters():  # torchtitan leaves its expert weights uninitialised (torch.empty)
            param.normal_(0, 0.2)
    return model


def loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
