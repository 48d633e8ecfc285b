"""The DeepSeekMoE feed-forward: routing, dropless exactness, grouped compute, presets and bad settings."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_deepseek.models import GPT, PRESETS, GPTConfig
from lightning_deepseek.models import moe as moe_module
from lightning_deepseek.models.moe import MoE, Router, grouped_matmul, sequence_balance_loss


def _reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the weighted sum of the chosen experts' SwiGLU outputs plus the shared expert."""
    flat = x.reshape(-1, x.size(-1))
    _, index, weights = layer.router(flat)
    experts = layer.experts
    rows = []
    for t, token in enumerate(flat):
        out = layer.shared(token)
        for e, w in zip(index[t].tolist(), weights[t]):
            gate, up = (experts.gate_up_proj[e] @ token).chunk(2)
            out = out + w * (experts.down_proj[e] @ (F.silu(gate) * up))
        rows.append(out)
    return torch.stack(rows).view_as(x)


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_every_routed_token_is_computed(score_func: str) -> None:
    torch.manual_seed(0)
    layer = MoE(dim=16, num_experts=6, top_k=3, hidden=8, num_shared=1, score_func=score_func)
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(layer(x), _reference(layer, x), rtol=1e-5, atol=1e-6)


def test_dropless_output_does_not_depend_on_the_batch() -> None:
    torch.manual_seed(0)
    layer = MoE(dim=16, num_experts=8, top_k=2, hidden=16)
    x = torch.randn(4, 7, 16)
    together = layer(x)
    for i in range(4):  # a token's output is the same whichever tokens share its experts
        torch.testing.assert_close(layer(x[i:i + 1]), together[i:i + 1], rtol=1e-6, atol=1e-7)


def test_router_weights_are_normalised_and_the_bias_only_moves_the_choice() -> None:
    torch.manual_seed(0)
    router = Router(dim=8, num_experts=4, top_k=2, score_func="sigmoid", route_scale=2.5)
    x = torch.randn(10, 8)
    scores, index, weights = router(x)
    torch.testing.assert_close(weights.sum(-1), torch.full((10,), 2.5))
    torch.testing.assert_close(weights, scores.gather(1, index) / scores.gather(1, index).sum(-1, keepdim=True) * 2.5)
    router.expert_bias[3] = 10.0  # every token now picks expert 3, and its weight still comes from the raw score
    scores_b, index_b, weights_b = router(x)
    torch.testing.assert_close(scores_b, scores)
    assert (index_b == 3).any(dim=1).all()
    torch.testing.assert_close(weights_b, scores.gather(1, index_b) / scores.gather(1, index_b).sum(-1, keepdim=True)
                               * 2.5)


def test_grouped_mm_and_the_per_expert_loop_agree() -> None:
    torch.manual_seed(0)
    x = torch.randn(12, 8, requires_grad=True)
    weight = torch.randn(3, 8, 16, requires_grad=True)
    counts = torch.tensor([5, 0, 7])
    grouped = grouped_matmul(x, weight, counts)
    loop = torch.cat([x[:5] @ weight[0], x[5:] @ weight[2]])
    torch.testing.assert_close(grouped, loop)
    moe_module._GROUPED_MM_BROKEN.add(("cpu", torch.float32))
    try:
        torch.testing.assert_close(grouped_matmul(x, weight, counts), loop)
    finally:
        moe_module._GROUPED_MM_BROKEN.discard(("cpu", torch.float32))


def test_aux_loss_adds_its_gradient_inside_the_forward() -> None:
    torch.manual_seed(0)
    layer = MoE(dim=16, num_experts=4, top_k=2, hidden=8, aux_loss_coef=0.1)
    x = torch.randn(3, 5, 16)
    layer(x).sum().backward()
    with_aux = layer.router.gate.weight.grad.clone()
    layer.zero_grad()
    layer.aux_loss_coef = 0.0
    out = layer(x)
    scores, index, _ = layer.router(x.reshape(-1, 16))
    (out.sum() + 0.1 * sequence_balance_loss(scores, index, 3)).backward()
    torch.testing.assert_close(layer.router.gate.weight.grad, with_aux)


def test_balanced_routing_gives_aux_loss_one() -> None:
    scores = torch.full((4, 4), 0.25)
    index = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]])
    assert sequence_balance_loss(scores, index, batch=1).item() == pytest.approx(1.0)


@pytest.mark.parametrize("preset", ["moe-tiny", "moe-small"])
def test_moe_presets_train(preset: str) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**PRESETS[preset]))
    kinds = [type(block.mlp).__name__ for block in model.blocks]
    assert kinds == ["MLP"] * PRESETS[preset]["n_dense_layers"] + ["MoE"] * (len(kinds) - kinds.count("MLP"))
    idx = torch.randint(0, 256, (2, 16))
    F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(moe_top_k=9), "model.moe_top_k=9 must lie in \\[1, model.n_routed_experts=8\\]"),
    (dict(moe_score_func="relu"), "model.moe_score_func='relu'"),
    (dict(n_dense_layers=3), "model.n_dense_layers=3"),
])
def test_bad_moe_settings_name_the_setting(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GPTConfig(**{**PRESETS["moe-tiny"], **overrides})
