"""Placement candidates and the communication cost model (pure functions, no processes)."""

from __future__ import annotations

import pytest
import torch

from lightning_deepseek.parallel.placement import (
    CommVolume,
    LinkCost,
    candidate_mesh,
    choose_placement,
    concurrent_link,
    estimate_comm_seconds,
    probe_device,
)
from lightning_deepseek.parallel.topology import Topology, parse_topology, validate_topology

TWO_NODES = Topology(((0, 1), (2, 3)))
LINKS = {"intra": LinkCost(bandwidth=10e9, latency=5e-6), "inter": LinkCost(bandwidth=117e6, latency=1e-4)}


def test_candidates_keep_the_named_group_inside_a_node() -> None:
    assert candidate_mesh("tp_intra_node", TWO_NODES, 2, 2) == [[0, 1], [2, 3]]  # rows = tp groups
    assert candidate_mesh("dp_intra_node", TWO_NODES, 2, 2) == [[0, 2], [1, 3]]  # columns = dp groups
    # Islands listed out of rank order (a declared topology) are followed, not sorted away.
    assert candidate_mesh("tp_intra_node", Topology(((0, 2), (1, 3))), 2, 2) == [[0, 2], [1, 3]]


def test_activation_heavy_plan_keeps_tp_inside_nodes() -> None:
    volume = CommVolume(activation_bytes=8 << 20, num_colwise=8, num_rowwise=8, sharded_grad_bytes=4 << 20,
                        replicated_grad_bytes=1 << 20)
    chosen, mesh, estimates = choose_placement("auto", TWO_NODES, 2, 2, volume, LINKS)
    assert chosen == "tp_intra_node" and mesh == [[0, 1], [2, 3]]
    assert estimates["dp_intra_node"] > 10 * estimates["tp_intra_node"]


def test_gradient_heavy_plan_keeps_dp_inside_nodes() -> None:
    volume = CommVolume(activation_bytes=16 << 10, num_colwise=4, num_rowwise=4, sharded_grad_bytes=64 << 20,
                        replicated_grad_bytes=1 << 20)
    chosen, mesh, _ = choose_placement("auto", TWO_NODES, 2, 2, volume, LINKS)
    assert chosen == "dp_intra_node" and mesh == [[0, 2], [1, 3]]


def test_accumulation_multiplies_activation_traffic_only() -> None:
    volume = dict(activation_bytes=1 << 20, num_colwise=2, num_rowwise=2, sharded_grad_bytes=8 << 20,
                  replicated_grad_bytes=0)
    one = choose_placement("auto", TWO_NODES, 2, 2, CommVolume(**volume), LINKS)[2]
    eight = choose_placement("auto", TWO_NODES, 2, 2, CommVolume(**volume, micro_batches=8), LINKS)[2]
    assert eight["tp_intra_node"] == pytest.approx(one["tp_intra_node"], rel=0.1)  # its tp traffic is on fast links
    assert eight["dp_intra_node"] > 4 * one["dp_intra_node"]


def test_groups_leaving_one_island_at_once_share_its_link() -> None:
    # measured on the 1 Gbit testbed: two pairs all-reducing across the link at once took 2.0x one pair's time
    assert concurrent_link(TWO_NODES, [[0, 2], [1, 3]], LINKS) == LinkCost(117e6 / 2, 1e-4)
    assert concurrent_link(TWO_NODES, [[0, 2]], LINKS) == LINKS["inter"]
    assert concurrent_link(TWO_NODES, [[0, 1, 2, 3]], LINKS) == LINKS["inter"]  # one ring: its own link
    assert concurrent_link(TWO_NODES, [[0, 1], [2, 3]], LINKS) == LINKS["intra"]  # nothing crosses
    # the shard gradients' all-reduce over dp (two columns crossing at once) takes twice one column's time
    volume = CommVolume(0, 0, 0, 10_000_000, 0)
    shared = estimate_comm_seconds(candidate_mesh("tp_intra_node", TWO_NODES, 2, 2), TWO_NODES, volume, LINKS)
    assert shared["sharded"] == pytest.approx(2 * 10_000_000 / 117e6 + 2 * 1e-4)


def test_explicit_policy_is_kept_and_estimates_logged() -> None:
    volume = CommVolume(1 << 20, 2, 2, 8 << 20, 0)
    chosen, mesh, estimates = choose_placement("dp_intra_node", TWO_NODES, 2, 2, volume, LINKS)
    assert chosen == "dp_intra_node" and set(estimates) == {"tp_intra_node", "dp_intra_node"}


def test_topology_parsing_and_validation() -> None:
    assert parse_topology("0,1;2,3").islands == ((0, 1), (2, 3))
    assert parse_topology([[0, 2], [1, 3]]).islands == ((0, 2), (1, 3))
    with pytest.raises(ValueError, match="is not a topology"):
        parse_topology("0-1|2-3")
    with pytest.raises(ValueError, match="world size 4"):
        validate_topology(parse_topology("0,1;2"), 4, "topology")
    with pytest.raises(ValueError, match="world size 2"):
        validate_topology(parse_topology("0,1,1"), 2, "$LDS_TOPOLOGY")
    with pytest.raises(ValueError, match="bandwidth_gbit"):
        LinkCost.from_config({"latency_us": 3}, "link_costs['inter']")


@pytest.mark.parametrize(("backend_config", "cuda", "device"), [
    ("cuda:nccl", True, "cuda:3"),  # Lightning's group on GPUs: NCCL only, no CPU backend
    ("cpu:gloo,cuda:nccl", True, "cuda:3"),  # the training collectives go through NCCL: measure that
    ("cpu:gloo,cuda:gloo", True, "cpu"),  # gloo on a GPU machine
    ("cpu:gloo,cuda:gloo", False, "cpu"),
    ("cpu:gloo", False, "cpu"),
])
def test_probe_tensors_live_where_the_backend_sends(monkeypatch: pytest.MonkeyPatch, backend_config: str,
                                                    cuda: bool, device: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert probe_device(backend_config) == torch.device(device)


def test_probe_without_a_usable_backend_names_link_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="'cuda:nccl' carry neither .* Set link_costs"):
        probe_device("cuda:nccl")


def test_tokens_per_micro_batch_prefers_the_setting_then_the_measured_batch(recwarn: pytest.WarningsRecorder) -> None:
    from torch import nn

    from lightning_deepseek.parallel.placement import DEFAULT_TOKENS, tokens_per_micro_batch

    module = nn.Linear(2, 2)
    assert tokens_per_micro_batch(module, 64, warn_on_default=True, measured=32) == 64
    # The cost model's measured batch: placement assumes what the "auto" sizes were decided from, silently.
    assert tokens_per_micro_batch(module, None, warn_on_default=True, measured=32) == 32
    assert not recwarn.list
    module.example_input_array = torch.zeros(3, 5, dtype=torch.long)
    assert tokens_per_micro_batch(module, None, warn_on_default=True) == 15
    del module.example_input_array
    with pytest.warns(UserWarning, match="micro_batch_tokens"):
        assert tokens_per_micro_batch(module, None, warn_on_default=True) == DEFAULT_TOKENS
