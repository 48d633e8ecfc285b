"""A small decoder-only transformer in the manner of nanoGPT: pre-norm, causal self-attention, GELU MLP.

The feed-forward block is a plain ``fc1 -> GELU -> fc2`` pair of ``nn.Linear`` layers, which is what
``HybridParallelStrategy``'s automatic plan looks for; nothing in the model knows about parallelism.
With ``n_routed_experts > 0`` the feed-forward of every block after the first ``n_dense_layers`` is the
DeepSeekMoE layer of :mod:`lightning_deepseek.models.moe` (shared + routed experts), which expert parallelism
shards (:mod:`lightning_deepseek.parallel.expert`).
Embedding and output head are not tied, so every parameter has exactly one owner when sharded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_deepseek.models.moe import SCORE_FUNCS, MoE


@dataclass
class GPTConfig:
    """Shape of the model.

    Args:
        vocab_size: number of token ids (256 for the byte-level tokenizer).
        block_size: longest sequence the position embedding covers.
        n_layer: number of transformer blocks.
        n_head: attention heads per block; must divide ``n_embd``.
        n_embd: model width.
        mlp_ratio: feed-forward hidden width as a multiple of ``n_embd``.
        dropout: dropout probability (0 for reproducible parity tests).
        bias: whether linear layers and norms have biases.
        n_routed_experts: routed experts per MoE layer; 0 keeps every feed-forward dense.
        n_shared_experts: always-on experts per MoE layer (0 for none).
        moe_top_k: routed experts per token.
        moe_hidden: hidden width of one expert; default ``mlp_ratio * n_embd // (moe_top_k + n_shared_experts)``,
            so that a token costs about what it costs in the dense model (fine-grained experts).
        n_dense_layers: the first blocks keep a dense feed-forward (DeepSeek-V3: 3).
        moe_score_func: router scores, ``"sigmoid"`` (DeepSeek-V3) or ``"softmax"``.
        moe_route_scale: factor on the normalised top-k weights (DeepSeek-V3: 2.5).
        moe_aux_loss_coef: sequence-wise balance loss coefficient (0: off; DeepSeek-V3: 1e-4).
    """

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = True
    n_routed_experts: int = 0
    n_shared_experts: int = 1
    moe_top_k: int = 2
    moe_hidden: int | None = None
    n_dense_layers: int = 0
    moe_score_func: str = "sigmoid"
    moe_route_scale: float = 1.0
    moe_aux_loss_coef: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}={getattr(self, name)} must be a positive integer.")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}: "
                "choose n_head among the divisors of n_embd."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout={self.dropout} must lie in [0, 1).")
        if self.n_routed_experts:
            self._check_moe()

    def _check_moe(self) -> None:
        if self.n_routed_experts < 0 or self.n_shared_experts < 0:
            raise ValueError(f"model.n_routed_experts={self.n_routed_experts} and model.n_shared_experts="
                             f"{self.n_shared_experts} must be >= 0.")
        if not 1 <= self.moe_top_k <= self.n_routed_experts:
            raise ValueError(f"model.moe_top_k={self.moe_top_k} must lie in [1, model.n_routed_experts="
                             f"{self.n_routed_experts}]: lower moe_top_k or add routed experts.")
        if not 0 <= self.n_dense_layers <= self.n_layer:
            raise ValueError(f"model.n_dense_layers={self.n_dense_layers} must lie in [0, model.n_layer="
                             f"{self.n_layer}].")
        if self.moe_score_func not in SCORE_FUNCS:
            raise ValueError(f"model.moe_score_func={self.moe_score_func!r} is not a score function: use one of "
                             f"{SCORE_FUNCS}.")
        if self.expert_hidden < 1:
            raise ValueError(f"model.moe_hidden={self.moe_hidden} must be a positive integer.")

    @property
    def expert_hidden(self) -> int:
        """Hidden width of one expert (``moe_hidden`` or its default)."""
        if self.moe_hidden is not None:
            return self.moe_hidden
        return self.mlp_ratio * self.n_embd // (self.moe_top_k + self.n_shared_experts)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` has the MoE feed-forward."""
        return self.n_routed_experts > 0 and layer >= self.n_dense_layers


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.n_embd
        self.fc1 = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc2(self.act(self.fc1(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, moe: bool = False) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MoE(config.n_embd, config.n_routed_experts, config.moe_top_k, config.expert_hidden,
                       config.n_shared_experts, config.moe_score_func, config.moe_route_scale,
                       config.moe_aux_loss_coef) if moe else MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only language model; ``forward(idx)`` returns logits of shape ``(batch, time, vocab)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, config.is_moe_layer(i)) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections keeps the residual stream's variance flat with depth.
        for name, param in self.named_parameters():
            if name.endswith(("proj.weight", "fc2.weight", "down.weight", "down_proj")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds model.block_size={self.config.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None
                 ) -> torch.Tensor:
        """Extend ``idx`` (batch, time) by ``max_new_tokens`` sampled tokens."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size:])[:, -1, :] / max(temperature, 1e-5)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1)], dim=1)
        return idx


# Checkpoints store the config in their hyper-parameters; a plain dataclass is safe for ``weights_only`` loading.
torch.serialization.add_safe_globals([GPTConfig])

PRESETS: dict[str, dict[str, int | float | str]] = {
    "tiny": dict(block_size=64, n_layer=2, n_head=4, n_embd=64),
    "small": dict(block_size=128, n_layer=4, n_head=4, n_embd=128),
    "gpt2-124m": dict(block_size=1024, n_layer=12, n_head=12, n_embd=768),
    # DeepSeekMoE presets: fine-grained routed experts + one shared expert, sigmoid routing, top-k normalised.
    "moe-tiny": dict(block_size=64, n_layer=2, n_head=4, n_embd=64, n_routed_experts=8, moe_top_k=2,
                     n_shared_experts=1, moe_hidden=64, n_dense_layers=0),
    "moe-small": dict(block_size=128, n_layer=4, n_head=4, n_embd=128, n_routed_experts=16, moe_top_k=2,
                      n_shared_experts=1, moe_hidden=128, n_dense_layers=1),
    # DeepSeek-V3's shape scaled to one 8-GPU node: 64 routed experts, top-8, one shared, first 3 layers dense,
    # sigmoid scores with route scale 2.5, sequence-wise aux loss 1e-4 (alongside bias balancing).
    "moe-v3-gpu": dict(block_size=2048, n_layer=12, n_head=16, n_embd=1024, n_routed_experts=64, moe_top_k=8,
                       n_shared_experts=1, moe_hidden=512, n_dense_layers=3, moe_route_scale=2.5,
                       moe_aux_loss_coef=1e-4),
}
