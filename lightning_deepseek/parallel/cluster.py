"""``Cluster``: what ``HybridParallelStrategy`` is told about the machines it runs on, as one validated value.

Two facts, both optional: the islands (ranks joined by fast links, usually one node each) and the figures of the
links inside and between them. Left out, the islands are discovered (``$LDS_TOPOLOGY``, else hostnames and NVML:
:mod:`~lightning_deepseek.parallel.topology`) and the links probed at start-up where there is more than one island
(:func:`~lightning_deepseek.parallel.placement.probe_links`). Placement and the ``"auto"`` settings read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_deepseek.parallel.placement import LinkCost
from lightning_deepseek.parallel.topology import parse_topology

LINK_KINDS = ("intra", "inter")


@dataclass(frozen=True)
class Cluster:
    """The machines: islands and link figures, validated at construction.

    Args:
        topology: declared islands, ``"0,1;2,3"`` or ``[[0, 1], [2, 3]]``; None: discovered at start-up.
        link_costs: ``{"intra": {"bandwidth_gbit": ..., "latency_us": ...}, "inter": {...}}``; None: probed at
            start-up where there is more than one island.
    """

    topology: str | list[list[int]] | None = None
    link_costs: dict[str, Any] | None = None
    islands: tuple[tuple[int, ...], ...] | None = field(init=False, repr=False, compare=False)
    links: dict[str, LinkCost] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        islands = parse_topology(self.topology, "cluster.topology").islands if self.topology is not None else None
        links = None
        if self.link_costs is not None:
            if not hasattr(self.link_costs, "get"):
                raise ValueError(f"cluster.link_costs={self.link_costs!r} must be a mapping with {LINK_KINDS} "
                                 "entries, e.g. {'intra': {'bandwidth_gbit': 100}, 'inter': {'bandwidth_gbit': 1}}.")
            links = {kind: LinkCost.from_config(self.link_costs.get(kind), f"cluster.link_costs[{kind!r}]")
                     for kind in LINK_KINDS}
        object.__setattr__(self, "islands", islands)
        object.__setattr__(self, "links", links)
