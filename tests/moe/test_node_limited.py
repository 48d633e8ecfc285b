"""Node-limited routing without processes: the group-limited top-k, the islands of the experts, the bad settings.
(On real gloo processes through the strategy, with a declared topology: tests/parallel/test_expert_strategy.py.)"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lightning_deepseek.models.moe import MoE, Router
from lightning_deepseek.moe import find_expert_layers
from lightning_deepseek.moe.node_limited import expert_islands, limit_routing
from lightning_deepseek.moe.protocol import groups_attribute
from lightning_deepseek.parallel import ExpertRouting
from lightning_deepseek.parallel.topology import parse_topology

TWO_NODES = parse_topology("0,1;2,3")


def _router(groups: list[int], max_groups: int, top_k: int = 2) -> Router:
    torch.manual_seed(0)
    router = Router(dim=16, num_experts=len(groups), top_k=top_k, score_func="sigmoid", route_scale=1.0)
    router.expert_bias.normal_(0, 0.1)
    router.limit_groups(groups, max_groups)
    return router


@pytest.mark.parametrize("max_groups", [1, 2])
def test_every_token_keeps_its_experts_inside_its_best_groups(max_groups: int) -> None:
    groups = [0, 0, 1, 1, 2, 2, 3, 3]
    router = _router(groups, max_groups)
    x = torch.randn(200, 16)
    _, index, weights = router(x)
    used = torch.tensor(groups)[index]
    assert all(len(set(row)) <= max_groups for row in used.tolist())
    torch.testing.assert_close(weights.sum(-1), torch.ones(200))
    # the kept groups are those with the highest sum of their two best bias-shifted scores (DeepSeek-V3)
    choice = torch.sigmoid(router.gate(x)) + router.expert_bias
    best = choice.view(200, 4, 2).sum(-1).topk(max_groups, dim=-1).indices.sort(-1).values
    assert all(set(row) <= set(kept) for row, kept in zip(used.tolist(), best.tolist()))


def test_all_groups_allowed_is_the_unlimited_routing() -> None:
    limited = _router([0, 0, 0, 1, 1, 1], max_groups=2)
    x = torch.randn(50, 16)
    limited_index = limited(x)[1]
    limited.expert_groups = None
    assert torch.equal(limited_index.sort(-1).values, limited(x)[1].sort(-1).values)


def test_experts_take_the_island_of_their_rank() -> None:
    assert expert_islands(TWO_NODES, [[0, 1, 2, 3]], 8) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert expert_islands(TWO_NODES, [[0, 2], [1, 3]], 4) == [0, 0, 1, 1]  # ep=2 x edp=2 across the nodes
    with pytest.raises(ValueError, match="max_islands_per_token: the expert-parallel groups"):
        expert_islands(parse_topology("0;1,2,3"), [[0, 1], [2, 3]], 4)


def _layers() -> list:
    torch.manual_seed(0)
    return find_expert_layers(MoE(dim=16, num_experts=8, top_k=2, hidden=8))


def test_limit_routing_sets_the_groups_of_every_layer() -> None:
    layers = _layers()
    assert limit_routing(layers, TWO_NODES, [[0, 1, 2, 3]], 1) == 2
    assert layers[0].router.expert_groups.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert layers[0].router.max_groups == 1


def test_max_islands_below_one_names_the_fix() -> None:
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match=rf"max_islands_per_token={bad!r} must be a positive integer"):
            ExpertRouting(max_islands_per_token=bad)


def test_one_island_warns_that_the_limit_does_nothing() -> None:
    layers = _layers()
    with pytest.warns(UserWarning, match=r"max_islands_per_token=1 has no effect: an expert-parallel group "
                                         r"\(\[0, 1\]\) spans 1 island"):
        limit_routing(layers, TWO_NODES, [[0, 1], [2, 3]], 1)
    assert layers[0].router.expert_groups is None


def test_more_islands_than_spanned_warns() -> None:
    with pytest.warns(UserWarning, match=r"max_islands_per_token=3 has no effect.*set max_islands_per_token below 2"):
        limit_routing(_layers(), TWO_NODES, [[0, 1, 2, 3]], 3)


def test_too_few_experts_on_the_allowed_islands_names_the_fix() -> None:
    torch.manual_seed(0)
    layers = find_expert_layers(MoE(dim=16, num_experts=4, top_k=3, hidden=8))
    with pytest.raises(ValueError, match=r"max_islands_per_token=1: 1 island\(s\) hold only 2 experts of "
                                         r"experts, fewer than its top-k of 3"):
        limit_routing(layers, TWO_NODES, [[0, 1, 2, 3]], 1)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
def test_transformers_deepseek_v3_router_gets_its_groups() -> None:
    from tests.moe.hf_families import build

    model = build("deepseek_v3")
    layers = find_expert_layers(model)
    limit_routing(layers, TWO_NODES, [[0, 1, 2, 3]], 1)
    router = layers[0].router
    assert (getattr(router, groups_attribute(router)), router.topk_group) == (2, 1)  # n_group in 5.0
    seen = []
    layers[0].experts.register_forward_pre_hook(lambda m, args: seen.append(args[1]))
    model(input_ids=torch.randint(0, 64, (2, 8)))
    assert all(len({e // 2 for e in row}) == 1 for row in seen[0].tolist())  # experts 0-1 or 2-3, never both
