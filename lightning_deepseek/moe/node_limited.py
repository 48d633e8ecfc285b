"""Node-limited routing (DeepSeek-V3): each token's routed experts lie on at most ``max_islands_per_token`` islands.

Under expert parallelism the routed experts of a layer are spread over the ``ep`` ranks of a group (``E / ep``
contiguous experts each), and those ranks over the islands of the topology (nodes or NVLink domains,
:mod:`lightning_deepseek.parallel.topology`). Under the per-island dispatch
(:mod:`lightning_deepseek.parallel.expert_dispatch`, what ``expert_dispatch="auto"`` uses when an ``ep`` group spans
islands) a token crosses once to each island holding one of its experts, so the islands it uses are the slow-link
rows it costs; DeepSeek-V3 bounds them (4 of 8 nodes) by group-limited top-k: the experts held by one island form a
group, a group's score is the sum of its two highest bias-shifted scores, each token keeps its ``M`` best groups and
picks its top-k among their experts. The routing function then depends on where the experts are: the groups are
derived from the topology at every setup and never checkpointed (a resume at another EP size or topology gets the
groups of its own layout), and the one-process reference of the tests applies the same groups to be exact.

Needs a router of the MoE protocol that can limit groups (:mod:`lightning_deepseek.moe.protocol`): ours, or
transformers' DeepSeek-V3 router (``num_group``/``topk_group``; it takes equal contiguous groups, which islands of
equal size give). With the flat dispatch (``expert_dispatch="flat"``), which sends one row per (token, expert) pair,
the limit does not reduce the bytes over the slow links (a token limited to one island sends its ``k`` rows there
all the same). Costs per token: ``G`` masked top-2 over ``E`` scores for ``G`` islands (negligible next to the
experts). Not supported: limiting the islands of a model run without expert parallelism (every expert is on every
rank: nothing to limit), groups that differ between the replicas of an expert slice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_deepseek.moe.protocol import ExpertLayer, groups_attribute

if TYPE_CHECKING:  # lightning_deepseek.parallel imports this module (through its strategy)
    from lightning_deepseek.parallel.topology import Topology

SETTING = "max_islands_per_token"


def check_max_islands(value: int | None) -> None:
    """Raise unless ``value`` is None (no limit) or a positive int (at construction)."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{SETTING}={value!r} must be a positive integer (islands a token's experts may use) or "
                         "None (no limit); DeepSeek-V3 uses 4 of 8 nodes.")


def expert_islands(topology: Topology, grid: list[list[int]], num_experts: int) -> list[int]:
    """The island of every expert, numbered 0.. in the order an ``ep`` group meets them.

    Args:
        topology: the strategy's islands.
        grid: the ``(edp, ep)`` mesh's ranks; row ``i`` is one expert-parallel group holding all experts.
        num_experts: routed experts of the layer (divisible by the ``ep`` size).
    """
    patterns = set()
    for group in grid:
        labels: dict[int, int] = {}
        patterns.add(tuple(labels.setdefault(topology.island_of(rank), len(labels)) for rank in group))
    if len(patterns) > 1:
        raise ValueError(f"{SETTING}: the expert-parallel groups {grid} lie on the islands {topology.islands} in "
                         "different patterns, so their tokens would follow different routings. Declare a topology "
                         "in which every group meets the islands alike (e.g. equal islands of contiguous ranks).")
    pattern = patterns.pop()
    per_rank = num_experts // len(pattern)
    return [pattern[expert // per_rank] for expert in range(num_experts)]


def limit_routing(layers: list[ExpertLayer], topology: Topology, grid: list[list[int]], max_islands: int
                  ) -> int:
    """Restrict every layer's routing to ``max_islands`` islands; return how many islands a group spans (when that
    is not more than ``max_islands`` nothing is restricted and a warning says so).

    Args:
        layers: the expert-parallel layers.
        topology: the strategy's islands.
        grid: the ``(edp, ep)`` mesh's ranks.
        max_islands: the setting's value.
    """
    spanned = len({topology.island_of(rank) for rank in grid[0]})
    if spanned <= max_islands:
        rank_zero_warn(f"{SETTING}={max_islands} has no effect: an expert-parallel group ({grid[0]}) spans "
                       f"{spanned} island(s) of the topology {topology.islands} ({topology.source}). Node-limited "
                       f"routing needs expert-parallel groups across islands: declare them (topology='0,1;2,3' or "
                       f"$LDS_TOPOLOGY), raise expert_parallel_size, or set {SETTING} below {spanned} or to None.")
        return spanned
    for layer in layers:
        groups = expert_islands(topology, grid, layer.num_experts)
        _apply(layer, groups, max_islands)
    return spanned


def _apply(layer: ExpertLayer, groups: list[int], max_islands: int) -> None:
    router = layer.router
    if router is None:
        raise ValueError(f"{SETTING}={max_islands}: the MoE layer {layer.name} has no router that can limit groups "
                         "(a module beside the experts with limit_groups(groups, max_groups), or num_group/"
                         f"topk_group as transformers' DeepSeek-V3). Remove {SETTING}, or give the router that method.")
    per_island = sorted(groups.count(g) for g in set(groups))
    top_k = getattr(router, "top_k", 1)
    if sum(per_island[:max_islands]) < top_k:
        raise ValueError(f"{SETTING}={max_islands}: {max_islands} island(s) hold only {sum(per_island[:max_islands])} "
                         f"experts of {layer.name}, fewer than its top-k of {top_k}. Allow more islands or use "
                         "fewer routed experts per token.")
    if callable(getattr(router, "limit_groups", None)):
        router.limit_groups(groups, max_islands)
        return
    size = len(groups) // len(per_island)
    if groups != [expert // size for expert in range(len(groups))]:
        raise ValueError(f"{SETTING}={max_islands}: {layer.name}'s router takes equal contiguous groups of experts, "
                         f"but the islands hold the experts as {groups}. Declare equal islands of contiguous ranks.")
    setattr(router, groups_attribute(router), len(per_island))
    router.topk_group = max_islands
