"""Per-island (hierarchical) expert dispatch: each token crosses to another island at most once, DeepSeek-V3 style.

The flat dispatch of :mod:`lightning_deepseek.parallel.expert` sends one row per (token, expert) pair over the
whole ``ep`` group. When that group spans islands (nodes) of the topology, a token whose ``k`` experts lie on one
remote island still sends ``k`` rows over the slow link, so node-limited routing
(:mod:`lightning_deepseek.moe.node_limited`) bounds the islands a token reaches but not the bytes. DeepSeek-V3 sends
a token once to each node that holds one of its experts (to the GPU with the same local index there) and forwards
it inside the node. torch has no hierarchical all-to-all (``all_to_all_single`` over one group is flat, and NCCL's
is the same), so it is composed here from two of torch's own autograd all-to-alls over subgroups made at setup:

- the *island group*: the ranks of one ``ep`` group on one island (``P = ep / I`` of them, for ``I`` islands);
- the *peer group*: the ranks of one ``ep`` group with the same position inside their islands (one per island).

Forward of one experts module, on each rank with its own ``T`` routed tokens:
1. across islands (peer group): each token goes once to every island holding at least one of its experts, to the
   peer with this rank's position there (its own island's copy stays on this rank). A row carries the token
   (``d`` values) and its ``k`` routing weights (as extra columns, differentiable), beside the ``k`` expert ids
   (int32, a parallel tensor with the same splits); the per-island counts are exchanged first;
2. inside the island (island group): the receiving rank expands its rows to the (token, expert) pairs of its island
   and runs the flat exchange (:func:`~lightning_deepseek.parallel.expert.exchange_pairs`) over the island
   group; the experts compute; the outputs come back;
3. the receiving rank combines its island's outputs, weighted, into one row per (token, island) and returns it over
   the peer group, where the origin sums its islands' rows.
Backward is autograd through ``all_to_all_single_autograd`` (the weights get their gradients as in the flat path).
Dropless and exact: every pair is computed once by the same expert; only the order of the weighted sum may differ
(with ``k = 2`` it is the same sum).

Bytes per token and MoE layer leaving a rank for another island, forward (backward moves the same rows back,
without the ids): flat ``k (I - 1) / I`` rows of ``d``; per island, ``u`` rows of ``d + k`` values plus ``k`` int32
ids, and ``u`` rows of ``d`` back, where ``u`` is the expected number of remote islands the token uses:
``(I - 1) (1 - C(E - E/I, k) / C(E, k))`` under uniform routing, ``(I - 1) / I`` under node-limited routing with
``M = 1`` (:func:`cross_island_rows`). Inside the islands, stage 2 moves the pairs as the flat dispatch does.
Costs: two more all-to-alls per layer and direction (one of them int32 ids, forward only) and one small count
exchange; latency-bound collectives are doubled, which pays only where the slow link's bandwidth is what a step
waits for.

Not supported: islands of different sizes inside an ``ep`` group (the peer groups would not be one per island;
``expert_dispatch="auto"`` keeps the flat dispatch there, as it does without node-limited routing), overlap of
the two stages, and the GPU-specific fusion of DeepSeek's DeepEP kernels (this is two plain collectives).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from lightning_deepseek.moe.protocol import ExpertLayer
from lightning_deepseek.parallel.expert import ExpertParallel, exchange_pairs
from lightning_deepseek.parallel.groups import reused
from lightning_deepseek.parallel.topology import Topology

SETTING = "expert_routing.dispatch"
DISPATCHES = ("auto", "flat", "per_island")
Dispatch = Literal["auto", "flat", "per_island"]


def check_expert_dispatch(value: object) -> None:
    """Raise unless ``value`` is one of :data:`DISPATCHES` (at construction)."""
    if value not in DISPATCHES:
        raise ValueError(f"{SETTING}={value!r} is not a dispatch: use 'auto' (per island under node-limited "
                         "routing when an expert-parallel group spans islands of the topology, else flat), 'flat' "
                         "(one row per (token, expert) pair) or 'per_island' (each token crosses to an island once).")


@dataclass(frozen=True)
class IslandLayout:
    """How one ``ep`` group meets the islands, decided once at setup.

    Args:
        ranks: the group's global ranks, by ``ep`` position (increasing).
        islands: the island of every position, numbered 0.. in the order the group meets them.
    """

    ranks: tuple[int, ...]
    islands: tuple[int, ...]

    @property
    def num_islands(self) -> int:
        return len(set(self.islands))

    @property
    def equal(self) -> bool:
        """Whether every island holds the same number of the group's ranks."""
        return len({self.islands.count(i) for i in set(self.islands)}) == 1

    def island_ranks(self, island: int) -> list[int]:
        return [r for r, i in zip(self.ranks, self.islands) if i == island]

    def within(self, position: int) -> int:
        """The position's index among its island's ranks (its rank in the island group)."""
        return self.islands[:position].count(self.islands[position])

    def peer_ranks(self, index: int) -> list[int]:
        """The global ranks of the peer group of island index ``index``, sorted (= their group ranks)."""
        return sorted(self.island_ranks(i)[index] for i in range(self.num_islands))


def island_layout(topology: Topology, ranks: list[int]) -> IslandLayout:
    """The layout of the ``ep`` group ``ranks`` on ``topology``."""
    labels: dict[int, int] = {}
    return IslandLayout(tuple(ranks), tuple(labels.setdefault(topology.island_of(r), len(labels)) for r in ranks))


def resolve_dispatch(dispatch: Dispatch, topology: Topology | None, grid: list[list[int]],
                     node_limited: bool = False) -> str:
    """``"flat"`` or ``"per_island"`` for the ``(edp, ep)`` rank grid ``grid``; raise when ``per_island`` cannot be.

    ``"auto"`` is per island when routing is node-limited (``node_limited``: ``max_islands_per_token`` is set) and
    an ``ep`` group spans islands of equal size, else flat: measured on the CPU testbed (benchmarks/moe/REPORT.md),
    the per-island dispatch's extra collectives cost more than its bytes save at 1 Gbit, and it pays (0.78x) only with
    node-limited routing where the slow link's bandwidth is what a step waits for; a user who limits the islands asked
    for that.
    """
    if dispatch == "flat":
        return "flat"
    layouts = [island_layout(topology, row) for row in grid] if topology is not None else []
    fits = bool(layouts) and all(lay.num_islands > 1 and lay.equal for lay in layouts)
    if dispatch == "auto":
        return "per_island" if fits and node_limited else "flat"
    if not fits:
        where = (f"the expert-parallel groups {grid} lie on the islands {topology.islands}" if topology is not None
                 else "no topology is known")
        raise ValueError(f"{SETTING}='per_island' needs expert-parallel groups that span islands of equal size, "
                         f"but {where}. Declare the islands (topology='0,1;2,3' or $LDS_TOPOLOGY), raise "
                         f"expert_parallel_size across them, or use {SETTING}='auto' or 'flat'.")
    return "per_island"


class IslandDispatch:
    """The subgroups and tables of the per-island dispatch for this rank's ``ep`` group (made collectively by
    :func:`build_island_dispatch`; shared by every layer)."""

    def __init__(self, layout: IslandLayout, rank: int, island_group: dist.ProcessGroup,
                 peer_group: dist.ProcessGroup) -> None:
        position = layout.ranks.index(rank)
        self.island, index = layout.islands[position], layout.within(position)
        peers = layout.peer_ranks(index)
        if (dist.get_process_group_ranks(island_group) != layout.island_ranks(self.island)
                or dist.get_process_group_ranks(peer_group) != peers):
            raise RuntimeError("expert dispatch: torch ordered a subgroup's ranks other than sorted")
        self.island_group, self.peer_group = island_group, peer_group
        self.num_islands, self.per_island = layout.num_islands, len(layout.island_ranks(self.island))
        # per ep position: its island and its rank in the island group; per island: the peer rank receiving for it
        self._tables = {torch.device("cpu"): (
            torch.tensor(layout.islands), torch.tensor([layout.within(p) for p in range(len(layout.ranks))]),
            torch.tensor([peers.index(layout.island_ranks(i)[index]) for i in range(self.num_islands)]))}

    def _tables_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if device not in self._tables:  # copied once per device, not per forward
            self._tables[device] = tuple(t.to(device) for t in self._tables[torch.device("cpu")])
        return self._tables[device]

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_local: int,
                compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The routed experts' combined output per token (see the module docstring for the three stages)."""
        device = top_k_index.device
        position_island, position_within, island_peer = self._tables_on(device)
        num_tokens = top_k_index.size(0)
        # stage 1: one row per (token, island used), ordered by the receiving peer
        used = torch.zeros(num_tokens, self.num_islands, dtype=torch.bool, device=device)
        used.scatter_(1, position_island[top_k_index // num_local], True)
        by_peer = torch.empty_like(used)
        by_peer[:, island_peer] = used
        peer, token = by_peer.t().nonzero(as_tuple=True)
        send_counts = torch.bincount(peer, minlength=self.num_islands)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.peer_group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        payload = torch.cat([hidden[token], top_k_weights[token].to(hidden.dtype)], dim=1)
        rows = all_to_all_single_autograd(payload, recv, send, self.peer_group)
        ids = all_to_all_single_autograd(top_k_index[token].to(torch.int32), recv, send, self.peer_group).long()
        rows, weights = rows[:, :hidden.size(1)], rows[:, hidden.size(1):]
        # stage 2: this island's (row, expert) pairs over the island group, experts numbered by island rank
        row, slot = (position_island[ids // num_local] == self.island).nonzero(as_tuple=True)
        expert = ids[row, slot]
        island_expert = position_within[expert // num_local] * num_local + expert % num_local
        order = torch.argsort(island_expert, stable=True)
        counts = torch.bincount(island_expert, minlength=self.per_island * num_local)
        out = exchange_pairs(rows[row[order]], counts, num_local, self.island_group, compute)
        out = out[torch.argsort(order)] * weights[row, slot, None].to(out.dtype)
        # stage 3: one weighted row per (token, island) back to the origin, which sums its islands' rows
        partial = out.new_zeros(rows.size(0), out.size(1)).index_add(0, row, out)
        back = all_to_all_single_autograd(partial, send, recv, self.peer_group)
        return back.new_zeros(num_tokens, back.size(1)).index_add(0, token, back).to(hidden.dtype)


def build_island_dispatch(topology: Topology, grid: list[list[int]]) -> IslandDispatch:
    """Make the island and peer subgroups of every ``ep`` group (collective: every rank, once, at setup)."""
    layouts = [island_layout(topology, row) for row in grid]
    island_lists = [lay.island_ranks(i) for lay in layouts for i in range(lay.num_islands)]
    peer_lists = [lay.peer_ranks(j) for lay in layouts for j in range(len(lay.island_ranks(0)))]
    # the same subgroups again for a later fit in the same processes (lightning_deepseek.parallel.groups)
    island_group = reused(("islands", *map(tuple, island_lists)),
                          lambda: dist.new_subgroups_by_enumeration(island_lists)[0])
    peer_group = reused(("peers", *map(tuple, peer_lists)), lambda: dist.new_subgroups_by_enumeration(peer_lists)[0])
    rank = dist.get_rank()
    layout = next(lay for lay in layouts if rank in lay.ranks)
    return IslandDispatch(layout, rank, island_group, peer_group)


def apply_island_dispatch(layers: list[ExpertLayer], dispatch: IslandDispatch) -> None:
    """Route the forward of every expert-parallel layer in ``layers`` through ``dispatch``."""
    for layer in layers:
        if not isinstance(layer.experts, ExpertParallel):
            raise ValueError(f"{SETTING}: {layer.name} is not expert-parallel; call apply_expert_parallel first.")
        layer.experts._island_dispatch = dispatch


def cross_island_rows(num_experts: int, top_k: int, num_islands: int, dispatch: str, max_islands: int | None = None
                      ) -> float:
    """Expected rows per token and MoE layer that leave for another island (forward dispatch), uniform routing.

    Args:
        num_experts: routed experts of the layer, ``E / num_islands`` on each island.
        top_k: experts per token.
        num_islands: islands an ``ep`` group spans.
        dispatch: ``"flat"`` or ``"per_island"``.
        max_islands: None (no limit) or 1 (node-limited routing to one island; then a token's ``k`` rows go
            together, flat or not).
    """
    if max_islands not in (None, 1):
        raise ValueError(f"max_islands={max_islands!r}: the expected rows are given for None or 1 only.")
    if dispatch == "flat":
        return top_k * (num_islands - 1) / num_islands
    if max_islands == 1:
        return (num_islands - 1) / num_islands
    per_island = num_experts // num_islands
    missed = math.comb(num_experts - per_island, top_k) / math.comb(num_experts, top_k)
    return (num_islands - 1) * (1 - missed)


def cross_island_bytes(num_tokens: int, top_k: int, dim: int, num_experts: int, num_islands: int, dispatch: str,
                       max_islands: int | None = None, itemsize: int = 4) -> float:
    """Expected bytes one rank sends to other islands per MoE layer, forward and backward, under uniform routing.

    Flat: ``4 d`` values per crossing row (dispatch and return, forward and backward). Per island: ``d + k`` values
    and ``k`` int32 ids out, ``d`` back, and in backward ``d`` out and ``d + k`` back: ``4 d + 2 k`` values and ``k``
    ids per crossing (token, island).
    """
    rows = num_tokens * cross_island_rows(num_experts, top_k, num_islands, dispatch, max_islands)
    per_row = 4 * dim * itemsize if dispatch == "flat" else (4 * dim + 2 * top_k) * itemsize + 4 * top_k
    return rows * per_row
