"""``GPTConfig`` and the model presets: plain data, importable without torch (``lds-train`` checks the model
settings before importing torch and Lightning)."""

from __future__ import annotations

from dataclasses import dataclass

SCORE_FUNCS = ("sigmoid", "softmax")  # the MoE router's score functions (models/moe.py)


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


# Checkpoints written before this module existed name the class lightning_deepseek.models.gpt.GPTConfig (pickle,
# torch's safe globals for weights_only loading): keep that name so that they and new ones load alike.
GPTConfig.__module__ = "lightning_deepseek.models.gpt"

PRESETS: dict[str, dict[str, int | float | str]] = {
    "tiny": dict(block_size=64, n_layer=2, n_head=4, n_embd=64),
    "small": dict(block_size=128, n_layer=4, n_head=4, n_embd=128),
    "gpt2-124m": dict(block_size=1024, n_layer=12, n_head=12, n_embd=768),
    # Feed-forward-heavy (16x n_embd hidden, short sequences): where tensor parallelism pays on a slow link
    # (benchmarks/autotune/REPORT.md, the wide FFN; there with data.batch_size=2).
    "wide-ffn": dict(block_size=16, n_layer=2, n_head=4, n_embd=256, mlp_ratio=16),
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
