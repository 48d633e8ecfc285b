"""The DeepSeekMoE feed-forward: shared expert(s) plus fine-grained routed experts, top-k routed, dropless.

Layout (DeepSeek-V2/V3): every token goes through ``n_shared_experts`` always-on SwiGLU experts (one SwiGLU of
``n_shared_experts x moe_hidden`` width) and through ``moe_top_k`` of ``n_routed_experts`` small SwiGLU experts
picked by a linear router. Router scores are sigmoid (DeepSeek-V3) or softmax; the top-k weights are normalised to
sum to one (then multiplied by ``moe_route_scale``). A per-expert bias (``Router.expert_bias``, a buffer) is added to
the scores for the top-k choice only, never to the weights: the auxiliary-loss-free balancing of DeepSeek-V3,
updated by :class:`lightning_deepseek.moe.ExpertLoadBalancing`. Node-limited routing (DeepSeek-V3's group-limited
top-k, :meth:`Router.limit_groups`, set up by :mod:`lightning_deepseek.moe.node_limited`) restricts each token's
experts to the best few groups of experts (the experts held by one node). Optional sequence-wise auxiliary loss
(``moe_aux_loss_coef``), added to the gradient inside the forward (DeepSeek's ``AddAuxiliaryLoss``), so that no
training loop has to know about it; its gradient is not multiplied by a loss scaler or by Lightning's
``1/accumulate_grad_batches`` (the effective coefficient is divided by both).

Dropless: every routed token is computed, there is no capacity and no token is dropped, so the layer is the same
function whatever the batch and however the experts are split over ranks (the basis of expert parallelism's
exactness, :mod:`lightning_deepseek.parallel.expert`).

Routed experts follow transformers 5.x's fused-experts convention, so that one expert-parallel path serves this
model and HF's Mixtral/Qwen-MoE/DeepSeek-V3: one module holding 3-D parameters ``gate_up_proj (E, 2h, d)`` and
``down_proj (E, d, h)``, an int attribute ``num_experts`` and ``forward(hidden_states (T, d), top_k_index (T, k),
top_k_weights (T, k)) -> (T, d)``. Compute: tokens sorted by expert, then ``torch._grouped_mm`` (one grouped GEMM
per projection) where the torch build runs it for the device and shapes (torch >= 2.8 on CUDA; on CPU from torch
2.13, for row strides that are 16-byte multiples), else one ``matmul`` per expert over its contiguous slice of sorted
tokens. Both give the same numbers
(tested).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_deepseek.models.config import SCORE_FUNCS  # noqa: F401 - the router's names, checked by GPTConfig

_GROUPED_MM_BROKEN: set[tuple[str, torch.dtype]] = set()
# The CPU kernel (forward and backward) is verified on torch 2.13; older CPU builds take the per-expert loop.
_CPU_GROUPED_MM = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def _grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    aligned = all(size * x.element_size() % 16 == 0 for size in (x.size(-1), weight.size(-1)))
    supported = x.device.type != "cpu" or _CPU_GROUPED_MM
    return (hasattr(torch, "_grouped_mm") and supported and aligned
            and (x.device.type, x.dtype) not in _GROUPED_MM_BROKEN)


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``x`` (rows sorted by group, ``counts[g]`` rows for group g) times ``weight[g]`` (G, K, N) per group."""
    if _grouped_mm_fits(x, weight):
        try:
            # torch's grouped GEMM is only exposed as this private op (torchtitan calls it the same way)
            return torch._grouped_mm(x, weight, offs=torch.cumsum(counts, 0, dtype=torch.int32))
        except (RuntimeError, NotImplementedError):  # this build has no kernel for the device/dtype
            _GROUPED_MM_BROKEN.add((x.device.type, x.dtype))
    pieces = [rows @ weight[g] for g, rows in enumerate(torch.split(x, counts.tolist()))]
    return torch.cat(pieces) if pieces else x.new_zeros(0, weight.size(-1))


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts in fused 3-D parameters (transformers' layout, see the module docstring).

    Args:
        num_experts: number of experts held by this module.
        dim: model width.
        hidden: hidden width of one expert.
    """

    is_moe_experts = True  # the MoE protocol marker (lightning_deepseek.moe.protocol)

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        top_k = top_k_index.size(1)
        flat_index = top_k_index.reshape(-1)
        order = torch.argsort(flat_index, stable=True)
        counts = torch.bincount(flat_index, minlength=self.num_experts)
        token = order // top_k
        gate, up = grouped_matmul(hidden_states[token], self.gate_up_proj.transpose(1, 2), counts).chunk(2, dim=-1)
        out = grouped_matmul(F.silu(gate) * up, self.down_proj.transpose(1, 2), counts)
        out = out * top_k_weights.reshape(-1)[order, None].to(out.dtype)
        return torch.zeros_like(hidden_states).index_add_(0, token, out.to(hidden_states.dtype))


def group_limited_scores(scores: torch.Tensor, groups: torch.Tensor, group_sizes: tuple[int, ...],
                         max_groups: int) -> torch.Tensor:
    """``scores`` (T, E) with every expert outside each token's ``max_groups`` best groups set to ``-inf``.

    DeepSeek-V3's group-limited (node-limited) routing: a group's score is the sum of its two highest expert
    scores (its one score for a group of one expert); ``groups`` (E,) gives each expert's group id.
    """
    group_scores = torch.stack([scores.masked_fill(groups != g, float("-inf")).topk(min(2, size), dim=-1)
                                .values.sum(dim=-1) for g, size in enumerate(group_sizes)], dim=-1)
    chosen = group_scores.topk(max_groups, dim=-1).indices
    keep = (groups[None, :, None] == chosen[:, None, :]).any(dim=-1)
    return scores.masked_fill(~keep, float("-inf"))


class Router(nn.Module):
    """Linear router: scores (T, E), top-k expert ids and normalised weights (T, k).

    ``expert_bias`` shifts the scores for the choice of experts only (aux-loss-free balancing).
    :meth:`limit_groups` restricts every token's experts to a few groups of experts (node-limited routing).
    """

    def __init__(self, dim: int, num_experts: int, top_k: int, score_func: str, route_scale: float) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_func = score_func
        self.route_scale = route_scale
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(num_experts))
        # set up by the placement of the experts (a property of the run, not of the weights): not checkpointed
        self.register_buffer("expert_groups", None, persistent=False)
        self.group_sizes: tuple[int, ...] = ()
        self.max_groups = 0

    def limit_groups(self, groups: list[int], max_groups: int) -> None:
        """Choose each token's experts inside at most ``max_groups`` groups (``groups[e]``: expert e's group id,
        0 to G-1), picked by their two best scores (DeepSeek-V3's group-limited routing).

        Args:
            groups: the group id of every expert.
            max_groups: groups a token may use, 1 to G.
        """
        sizes = tuple(groups.count(g) for g in range(max(groups) + 1))
        if len(groups) != self.num_experts or 0 in sizes or not 1 <= max_groups <= len(sizes):
            raise ValueError(f"Router.limit_groups: {len(groups)} group ids {groups} for {self.num_experts} experts "
                             f"and max_groups={max_groups}: give every expert a group id 0..G-1 and 1 <= "
                             "max_groups <= G.")
        if sum(sorted(sizes)[:max_groups]) < self.top_k:
            raise ValueError(f"max_groups={max_groups} groups of sizes {sizes} can hold fewer experts than "
                             f"top_k={self.top_k}: allow more groups.")
        self.expert_groups = torch.tensor(groups, device=self.gate.weight.device)
        self.group_sizes, self.max_groups = sizes, max_groups

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.gate(x).float()
        scores = torch.sigmoid(logits) if self.score_func == "sigmoid" else torch.softmax(logits, dim=-1)
        choice = scores + self.expert_bias
        if self.expert_groups is not None:
            choice = group_limited_scores(choice, self.expert_groups, self.group_sizes, self.max_groups)
        index = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, index)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.route_scale
        return scores, index, weights


class SwiGLU(nn.Module):
    """The shared expert(s): one SwiGLU feed-forward (``gate``/``up``/``down`` ``nn.Linear``)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class AddAuxiliaryLoss(torch.autograd.Function):
    """Identity on ``x`` whose backward also gives ``aux_loss`` the gradient one (as if added to the loss)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.dtype, ctx.device = aux_loss.dtype, aux_loss.device
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        return grad, torch.ones((), dtype=ctx.dtype, device=ctx.device)


def sequence_balance_loss(scores: torch.Tensor, index: torch.Tensor, batch: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss ``sum_i f_i P_i`` averaged over sequences (coefficient apart)."""
    num_experts, top_k = scores.size(-1), index.size(-1)
    scores = (scores / scores.sum(dim=-1, keepdim=True)).view(batch, -1, num_experts)
    tokens = scores.size(1)
    hits = torch.zeros(batch, num_experts, device=scores.device, dtype=scores.dtype)
    hits.scatter_add_(1, index.view(batch, -1), torch.ones_like(index.view(batch, -1), dtype=scores.dtype))
    load = hits * num_experts / (top_k * tokens)
    return (load * scores.mean(dim=1)).sum(dim=1).mean()


class MoE(nn.Module):
    """DeepSeekMoE feed-forward on ``(batch, time, dim)``: shared expert(s) + top-k of the routed experts.

    Args:
        dim: model width.
        num_experts: routed experts.
        top_k: routed experts per token.
        hidden: hidden width of one (routed or shared) expert.
        num_shared: always-on experts (0 for none).
        score_func: ``"sigmoid"`` or ``"softmax"``.
        route_scale: factor on the normalised top-k weights.
        aux_loss_coef: sequence-wise balance loss coefficient (0: off).
    """

    def __init__(self, dim: int, num_experts: int, top_k: int, hidden: int, num_shared: int = 1,
                 score_func: str = "sigmoid", route_scale: float = 1.0, aux_loss_coef: float = 0.0) -> None:
        super().__init__()
        self.router = Router(dim, num_experts, top_k, score_func, route_scale)
        self.experts = GroupedExperts(num_experts, dim, hidden)
        self.shared = SwiGLU(dim, num_shared * hidden) if num_shared else None
        self.aux_loss_coef = aux_loss_coef

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, _, dim = x.shape
        flat = x.reshape(-1, dim)
        scores, index, weights = self.router(flat)
        out = self.experts(flat, index, weights)
        if self.shared is not None:
            out = out + self.shared(flat)
        if self.training and self.aux_loss_coef > 0:
            out = AddAuxiliaryLoss.apply(out, self.aux_loss_coef * sequence_balance_loss(scores, index, batch))
        return out.view_as(x)
