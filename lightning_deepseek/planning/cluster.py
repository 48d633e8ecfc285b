"""``ClusterSpec``: the machines a plan is for, as one validated value: GPUs per node, peak FLOPs per dtype, device
memory and its bandwidth, and the two link classes (inside a node, across nodes).

Link figures are per GPU and per direction (what one rank can send at once); a group whose ranks sit on more than
one node runs at the across-nodes figures (the ring's slowest hop), one inside a node at the inside figures. Nothing
is probed: a plan is for machines one does not have. The presets are YAML files of ``lds-plan``
(``lightning_deepseek/app/conf/plan/presets/cluster``); a user's own file has the same fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_deepseek.parallel.placement import LinkCost

REQUIRED = ("name", "gpus_per_node", "peak_tflops", "memory_gib", "memory_bandwidth_gbs", "links")
LINK_FIELDS = ("bandwidth_gbs", "latency_us")


class ClusterSpecError(ValueError):
    """A cluster file lacks a field or has a bad value; the message names it and the fix."""


@dataclass(frozen=True)
class ClusterSpec:
    """The machines of a plan.

    Args:
        name: the preset's or file's name.
        gpus_per_node: ranks per node (one island each, in rank order).
        peak_tflops: dense peak per dtype (``{"fp32": ..., "bf16": ..., "fp8": ...}``), 10^12 FLOP/s.
        memory_gib: memory per device, GiB.
        memory_bandwidth_gbs: device memory bandwidth, GB/s.
        intra: the link inside a node (per GPU, per direction).
        inter: the link across nodes (per GPU, per direction).
    """

    name: str
    gpus_per_node: int
    peak_tflops: dict[str, float]
    memory_gib: float
    memory_bandwidth_gbs: float
    intra: LinkCost
    inter: LinkCost

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)

    @property
    def links(self) -> dict[str, LinkCost]:
        """``{"intra": ..., "inter": ...}`` as the strategy's placement reads them."""
        return {"intra": self.intra, "inter": self.inter}

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype``; raises naming the dtypes the file declares."""
        if dtype not in self.peak_tflops:
            raise ClusterSpecError(f"cluster {self.name!r} declares no peak_tflops for {dtype!r}: it has "
                                   f"{sorted(self.peak_tflops)}. Add peak_tflops.{dtype} or choose another dtype.")
        return self.peak_tflops[dtype] * 1e12

    @classmethod
    def from_mapping(cls, spec: Mapping[str, Any], source: str) -> ClusterSpec:
        """Validate a preset or user file (``source`` names it in errors)."""
        missing = [key for key in REQUIRED if key not in spec or spec[key] is None]
        links = spec.get("links") or {}
        missing += [f"links.{kind}.{field}" for kind in ("intra", "inter") for field in LINK_FIELDS
                    if not isinstance(links.get(kind), Mapping) or links[kind].get(field) is None]
        if missing:
            raise ClusterSpecError(f"cluster file {source} lacks {', '.join(dict.fromkeys(missing))}. A cluster file "
                                   f"needs {', '.join(REQUIRED)} with links.intra and links.inter each holding "
                                   f"{' and '.join(LINK_FIELDS)} (as lds-plan's preset h100.yaml).")
        try:
            peak = {str(k): float(v) for k, v in dict(spec["peak_tflops"]).items()}
            made = cls(str(spec["name"]), int(spec["gpus_per_node"]), peak, float(spec["memory_gib"]),
                       float(spec["memory_bandwidth_gbs"]), _link(links["intra"]), _link(links["inter"]))
        except (TypeError, ValueError) as exc:
            raise ClusterSpecError(f"cluster file {source}: {exc}. Numbers are expected for gpus_per_node, "
                                   "peak_tflops.*, memory_gib, memory_bandwidth_gbs and the link figures.") from exc
        if made.gpus_per_node < 1 or not peak or min(peak.values()) <= 0:
            raise ClusterSpecError(f"cluster file {source}: gpus_per_node must be >= 1 and every peak_tflops > 0.")
        return made


def _link(spec: Mapping[str, Any]) -> LinkCost:
    return LinkCost(float(spec["bandwidth_gbs"]) * 1e9, float(spec["latency_us"]) * 1e-6)
