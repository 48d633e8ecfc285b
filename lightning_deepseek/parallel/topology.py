"""Topology discovery: which ranks share a fast interconnect ("islands": a node, or an NVLink domain in it).

Every rank contributes its hostname and local rank (one ``all_gather_object``); ranks on one host form an
island, ordered by local rank. On NVIDIA machines with ``nvidia-ml-py`` installed (optional extra ``nvml``),
NVML's peer-to-peer NVLink status splits a host into NVLink islands. NVML numbers every GPU of the host, CUDA only
the visible ones in its own order (``CUDA_VISIBLE_DEVICES``, ``CUDA_DEVICE_ORDER``), so a rank finds its GPU in NVML
by UUID, and by the CUDA index only where that lookup fails (MIG, old drivers). A declared topology overrides discovery:
the ``topology`` argument or the ``LDS_TOPOLOGY`` environment variable, written as islands separated by ``;``
and ranks by ``,`` (``"0,1;2,3"`` = two nodes of two ranks). Clusters whose hostnames do not reflect the wiring,
and the network testbed (every namespace has the same hostname), declare it.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

ENV_VAR = "LDS_TOPOLOGY"


@dataclass(frozen=True)
class Topology:
    """Ranks grouped into islands of fast links; links between islands are slow.

    Args:
        islands: rank lists, one per island; together they hold every rank exactly once.
        source: how the topology was obtained ("declared", "hostname", "nvml").
    """

    islands: tuple[tuple[int, ...], ...]
    source: str = "declared"

    @property
    def world_size(self) -> int:
        return sum(len(island) for island in self.islands)

    def island_of(self, rank: int) -> int:
        return next(i for i, island in enumerate(self.islands) if rank in island)

    def spans_islands(self, ranks: list[int]) -> bool:
        """Whether a group of ranks has members on more than one island (its collectives cross slow links)."""
        return len({self.island_of(r) for r in ranks}) > 1


def parse_topology(text: str | list[list[int]], setting: str = "topology") -> Topology:
    """``"0,1;2,3"`` or ``[[0, 1], [2, 3]]`` to a :class:`Topology` (checked against the world size later)."""
    try:
        if isinstance(text, str):
            islands = tuple(tuple(int(r) for r in part.split(",")) for part in text.split(";") if part.strip())
        else:
            islands = tuple(tuple(int(r) for r in island) for island in text)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{setting}={text!r} is not a topology: write islands separated by ';' and ranks by ',', "
                         "for example '0,1;2,3' for two nodes of two ranks.") from exc
    if not islands or any(not island for island in islands):
        raise ValueError(f"{setting}={text!r} has an empty island: write for example '0,1;2,3'.")
    return Topology(islands, "declared")


def validate_topology(topology: Topology, world_size: int, setting: str) -> None:
    """Raise ``ValueError`` unless ``topology`` holds each of the ``world_size`` ranks exactly once."""
    ranks = sorted(r for island in topology.islands for r in island)
    if ranks != list(range(world_size)):
        raise ValueError(f"{setting} declares ranks {ranks} but the job has world size {world_size} "
                         f"(ranks 0..{world_size - 1}). Declare every rank exactly once, for example "
                         f"'{','.join(map(str, range(world_size)))}' for one node.")


def _nvlink_island(device: torch.device) -> int:
    """The lowest NVML index of the GPUs that ``device`` reaches over NVLink (its own if none); -1 without NVML."""
    try:
        import pynvml
    except ImportError:
        return -1
    try:
        pynvml.nvmlInit()
        mine = _nvml_index(pynvml, device.index, str(torch.cuda.get_device_properties(device.index).uuid))
        handle = pynvml.nvmlDeviceGetHandleByIndex(mine)
        for other in range(mine):
            status = pynvml.nvmlDeviceGetP2PStatus(handle, pynvml.nvmlDeviceGetHandleByIndex(other),
                                                   pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
            if status == pynvml.NVML_P2P_STATUS_OK:
                return other
        return mine
    except pynvml.NVMLError:
        return -1
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _nvml_index(nvml: Any, cuda_index: int, uuid: str) -> int:
    """NVML's index of the CUDA device ``cuda_index`` whose ``torch.cuda`` UUID is ``uuid`` (no ``GPU-`` prefix)."""
    try:
        return nvml.nvmlDeviceGetIndex(nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}"))
    except nvml.NVMLError:
        return cuda_index


def discover_topology(device: torch.device, local_rank: int, declared: str | list[list[int]] | None = None
                      ) -> Topology:
    """The job's topology: ``declared`` if given, else ``$LDS_TOPOLOGY``, else hostnames (refined by NVML).

    Collective: every rank must call it. Raises ``ValueError`` on all ranks alike when a declared topology does
    not match the ranks of the job.
    """
    world_size = dist.get_world_size()
    setting = "topology"
    if declared is None and os.environ.get(ENV_VAR):
        declared, setting = os.environ[ENV_VAR], f"${ENV_VAR}"
    if declared is not None:
        topology = parse_topology(declared, setting)
        validate_topology(topology, world_size, setting)
        return topology
    island = _nvlink_island(device) if device.type == "cuda" else -1
    entries: list[tuple[str, int, int] | None] = [None] * world_size
    dist.all_gather_object(entries, (socket.gethostname(), island, local_rank))
    keys: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for rank, (host, host_island, local) in enumerate(entries):
        keys.setdefault((host, host_island), []).append((local, rank))
    source = "nvml" if any(key[1] >= 0 for key in keys) else "hostname"
    return Topology(tuple(tuple(rank for _, rank in sorted(members)) for members in keys.values()), source)
