"""Rank placement: the rank order of the ``(dp, tp)`` mesh, chosen by policy or by a communication cost model.

Candidates:
- ``tp_intra_node``: each ``tp`` group inside one island (Megatron's rule); ``dp`` groups cross islands.
- ``dp_intra_node``: each ``dp`` group inside one island, ``tp`` groups across islands (the seed document's rule).
- ``auto``: the candidate with the lowest estimated communication time per optimizer step.
On one island (one node) every rank order communicates over the same links: nothing is probed or estimated
and ``auto`` is ``tp_intra_node``. A fixed policy without ``link_costs`` is not probed either.

Cost model (per optimizer step, ring algorithms, ``n`` ranks in a group, link of bandwidth ``B`` and latency
``a``; a group crossing islands runs at the slow link's figures, and ``k`` groups of one kind that leave the same
island at once share its link, ``B / k`` each: on the 1 Gbit testbed two pairs all-reducing across the link at once
took 2.0x one pair's time, 78 ms against 38 ms for 4.5 MiB, benchmarks/hybrid/REPORT.md):
- tensor-parallel activations, per micro-batch: each column-wise layer all-gathers its input in forward and
  reduce-scatters the input gradient in backward, each row-wise layer reduce-scatters its output and
  all-gathers the output gradient: ``(n - 1) * (M / B + a)`` each, ``M`` the bytes of one rank's activations;
- data-parallel gradients, once per step: an all-reduce ``2 (n - 1) / n * S / B + 2 (n - 1) a`` of the sharded
  parameters over ``dp`` and of the replicated ones over the world.
Compute is the same for every candidate and left out. :func:`estimate_comm_seconds` gives the terms apart (tensor
parallel, shard gradients, replicated gradients), :func:`comm_volume` the volume of a plan, and
:func:`all_reduce_seconds` / :func:`all_to_all_seconds` the ring formulas: the cost model of the ``"auto"``
settings (:mod:`lightning_deepseek.autotune`) builds on them.
Link figures come from ``link_costs`` or from a short point-to-point probe at start-up (a small and a 4 MiB message,
between two ranks of one island and two ranks of different islands). The probe sends what the default group's
backend carries: tensors on the current GPU when CUDA tensors go through NCCL (Lightning's default on GPUs, a group
without a CPU backend), CPU tensors on gloo. NCCL's send and recv return to the host once queued, so the probe
synchronizes the GPU around each exchange.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_deepseek.parallel.detection import linear_shape
from lightning_deepseek.parallel.plan import Plan
from lightning_deepseek.parallel.topology import Topology

POLICIES = ("auto", "tp_intra_node", "dp_intra_node")
DEFAULT_TOKENS = 2048


@dataclass(frozen=True)
class LinkCost:
    """Bandwidth (bytes/s) and latency (s) of one link class."""

    bandwidth: float
    latency: float

    @classmethod
    def from_config(cls, spec: dict, setting: str) -> LinkCost:
        try:
            return cls(float(spec["bandwidth_gbit"]) * 1e9 / 8, float(spec.get("latency_us", 0.0)) * 1e-6)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{setting}={spec!r} needs 'bandwidth_gbit' (and optionally 'latency_us'), for example "
                             "{'bandwidth_gbit': 1, 'latency_us': 50}.") from exc


@dataclass(frozen=True)
class CommVolume:
    """What one optimizer step communicates, from the plan and the micro-batch shape.

    Args:
        activation_bytes: bytes of one rank's activations entering one sharded block (tokens x width x itemsize).
        num_colwise: column-wise layers (one all-gather forward, one reduce-scatter backward per micro-batch).
        num_rowwise: row-wise layers (one reduce-scatter forward, one all-gather backward per micro-batch).
        sharded_grad_bytes: gradient bytes of one rank's tensor-parallel shards (all-reduced over ``dp``).
        replicated_grad_bytes: gradient bytes of the replicated parameters (all-reduced over the world).
        micro_batches: micro-batches per optimizer step (gradient accumulation).
    """

    activation_bytes: int
    num_colwise: int
    num_rowwise: int
    sharded_grad_bytes: int
    replicated_grad_bytes: int
    micro_batches: int = 1


def candidate_mesh(policy: str, topology: Topology, dp_size: int, tp_size: int) -> list[list[int]]:
    """The ``dp x tp`` rank grid of ``policy``: row ``i`` is a ``tp`` group, column ``j`` a ``dp`` group."""
    order = [rank for island in topology.islands for rank in sorted(island)]
    if policy == "tp_intra_node":
        return [order[i * tp_size:(i + 1) * tp_size] for i in range(dp_size)]
    if policy == "dp_intra_node":
        return [[order[j * dp_size + i] for j in range(tp_size)] for i in range(dp_size)]
    raise ValueError(f"placement={policy!r} is not a placement policy: use one of {POLICIES}.")


def _link(topology: Topology, ranks: list[int], links: dict[str, LinkCost]) -> LinkCost:
    return links["inter"] if topology.spans_islands(ranks) else links["intra"]


def concurrent_link(topology: Topology, groups: list[list[int]], links: dict[str, LinkCost]) -> LinkCost:
    """The link each of ``groups`` gets when they all communicate at once (the slowest group's): a group crossing
    islands runs at the slow link, whose bandwidth is shared by every group leaving the same island."""
    slowest = max((_link(topology, g, links) for g in groups), key=lambda c: c.latency + 1 / c.bandwidth)
    crossing = [set(g) for g in groups if topology.spans_islands(g)]
    sharing = max((sum(1 for g in crossing if g & set(island)) for island in topology.islands), default=1)
    return LinkCost(slowest.bandwidth / max(sharing, 1), slowest.latency)


def estimate_comm_seconds(mesh: list[list[int]], topology: Topology, volume: CommVolume,
                          links: dict[str, LinkCost]) -> dict[str, float]:
    """Communication seconds of one optimizer step on ``mesh``, by kind (the slowest group of each kind counts,
    the groups of a kind sharing the links they cross):
    ``tp`` (activations), ``sharded`` (shard gradients over ``dp``), ``replicated`` (gradients over the world)."""
    tp_size, dp_size = len(mesh[0]), len(mesh)
    seconds = {"tp": 0.0, "sharded": 0.0, "replicated": 0.0}
    if tp_size > 1:
        link = concurrent_link(topology, mesh, links)
        per_op = (tp_size - 1) * (volume.activation_bytes / link.bandwidth + link.latency)
        seconds["tp"] = volume.micro_batches * 2 * (volume.num_colwise + volume.num_rowwise) * per_op
    if dp_size > 1 and volume.sharded_grad_bytes:
        link = concurrent_link(topology, [[row[j] for row in mesh] for j in range(tp_size)], links)
        seconds["sharded"] = all_reduce_seconds(volume.sharded_grad_bytes, dp_size, link)
    world = [r for row in mesh for r in row]
    if len(world) > 1:
        seconds["replicated"] = all_reduce_seconds(volume.replicated_grad_bytes, len(world),
                                                   _link(topology, world, links))
    return seconds


def estimate_step_seconds(mesh: list[list[int]], topology: Topology, volume: CommVolume,
                          links: dict[str, LinkCost]) -> float:
    """Communication seconds of one optimizer step on ``mesh`` (the slowest group of each kind counts)."""
    return sum(estimate_comm_seconds(mesh, topology, volume, links).values())


def all_reduce_seconds(num_bytes: int, n: int, link: LinkCost) -> float:
    """Ring all-reduce of ``num_bytes`` over ``n`` ranks: ``2 (n - 1) / n * S / B + 2 (n - 1) a``."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * num_bytes / link.bandwidth + 2 * (n - 1) * link.latency


def all_to_all_seconds(num_bytes: int, n: int, link: LinkCost) -> float:
    """All-to-all of ``num_bytes`` per rank over ``n`` ranks: ``(n - 1) / n * M / B + (n - 1) a``."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * num_bytes / link.bandwidth + (n - 1) * link.latency


def group_link(topology: Topology, ranks: list[int], links: dict[str, LinkCost]) -> LinkCost:
    """The link a group of ``ranks`` runs at: the slow one if it crosses islands."""
    return _link(topology, ranks, links)


def comm_volume(module: nn.Module, plan: Plan, tp_size: int, tokens: int, micro_batches: int) -> CommVolume:
    """What one optimizer step of ``module`` sharded by ``plan`` over ``tp_size`` ranks communicates.

    Args:
        tokens: rows entering a feed-forward layer per rank and micro-batch.
        micro_batches: micro-batches per optimizer step.
    """
    modules = dict(module.named_modules())
    itemsize = next(module.parameters()).element_size()
    sharded = sum(p.numel() for e in plan for p in modules[e.name].parameters())
    total = sum(p.numel() for p in module.parameters())
    width = max((linear_shape(modules[e.name])[0] for e in plan if e.style == "colwise"), default=0)
    return CommVolume(
        activation_bytes=tokens * width * itemsize,
        num_colwise=sum(e.style == "colwise" for e in plan),
        num_rowwise=sum(e.style == "rowwise" for e in plan),
        sharded_grad_bytes=sharded * itemsize // tp_size,
        replicated_grad_bytes=(total - sharded) * itemsize,
        micro_batches=micro_batches,
    )


def probe_device(backend_config: str) -> torch.device:
    """The device of the probe's tensors for a group of ``backend_config`` (``dist.get_backend_config()``).

    The current GPU where CUDA tensors go through a backend of their own (NCCL) or where the group has no CPU
    backend; the CPU where gloo carries CPU tensors.
    """
    backends = dict(pair.split(":", 1) for pair in backend_config.split(","))
    if "cuda" in backends and torch.cuda.is_available() and (backends["cuda"] != "gloo" or "cpu" not in backends):
        return torch.device("cuda", torch.cuda.current_device())
    if "cpu" in backends:
        return torch.device("cpu")
    raise ValueError(f"placement='auto' probes the links, but the process group's backends {backend_config!r} "
                     "carry neither CPU tensors nor CUDA tensors on this machine. Set link_costs, for example "
                     "{'intra': {'bandwidth_gbit': 400}, 'inter': {'bandwidth_gbit': 100, 'latency_us': 5}}, "
                     "or a fixed placement.")


def probe_links(topology: Topology, size_bytes: int = 4 << 20, repeats: int = 3) -> dict[str, LinkCost]:
    """Measure intra- and inter-island links by timed send/recv between two ranks; collective, all ranks call it.

    A link class that the topology lacks (one island, or islands of one rank) gets the other's figures.
    """
    pairs: dict[str, tuple[int, int]] = {}
    for island in topology.islands:
        if len(island) > 1:
            pairs["intra"] = (island[0], island[1])
            break
    if len(topology.islands) > 1:
        pairs["inter"] = (topology.islands[0][0], topology.islands[1][0])
    device = probe_device(dist.get_backend_config())
    rank = dist.get_rank()
    measured = torch.zeros(len(pairs), 2, dtype=torch.float64, device=device)
    for i, (a, b) in enumerate(pairs.values()):
        if rank in (a, b):
            peer = b if rank == a else a
            small = _ping_pong(torch.zeros(1, device=device), rank == a, peer, repeats)
            large = _ping_pong(torch.zeros(size_bytes // 4, device=device), rank == a, peer, repeats)
            measured[i, 0], measured[i, 1] = small, max(large - small, 1e-9)
        dist.barrier()
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    seconds = measured.tolist()
    links = {name: LinkCost(bandwidth=size_bytes / seconds[i][1], latency=seconds[i][0])
             for i, name in enumerate(pairs)}
    fallback = next(iter(links.values()), LinkCost(1e12, 0.0))
    return {"intra": links.get("intra", fallback), "inter": links.get("inter", fallback)}


def _ping_pong(buffer: torch.Tensor, first: bool, peer: int, repeats: int) -> float:
    """Median one-way seconds of ``buffer`` between this rank and ``peer``."""
    times = []
    for _ in range(repeats + 1):
        _synchronize(buffer.device)
        start = time.perf_counter()
        if first:
            dist.send(buffer, peer)
            dist.recv(buffer, peer)
        else:
            dist.recv(buffer, peer)
            dist.send(buffer, peer)
        _synchronize(buffer.device)
        times.append((time.perf_counter() - start) / 2)
    return sorted(times[1:])[len(times[1:]) // 2]


def _synchronize(device: torch.device) -> None:
    # gloo's send/recv block until done; NCCL's only queue work on the GPU.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def choose_placement(policy: str, topology: Topology, dp_size: int, tp_size: int, volume: CommVolume,
                     links: dict[str, LinkCost]) -> tuple[str, list[list[int]], dict[str, float]]:
    """The chosen policy, its rank grid, and the estimated seconds of every candidate."""
    estimates = {
        name: estimate_step_seconds(candidate_mesh(name, topology, dp_size, tp_size), topology, volume, links)
        for name in POLICIES[1:]
    }
    chosen = min(estimates, key=estimates.__getitem__) if policy == "auto" else policy
    return chosen, candidate_mesh(chosen, topology, dp_size, tp_size), estimates


def describe_placement(requested: str, chosen: str, grid: list[list[int]], topology: Topology,
                       estimates: dict[str, float], links: dict[str, LinkCost] | None, link_source: str) -> str:
    """The placement line rank 0 logs at setup: the mesh, and why this rank order (estimates and link figures only
    where links were probed or configured)."""
    islands = [list(island) for island in topology.islands]
    head = (f"HybridParallelStrategy placement: {chosen}, mesh (dp x tp) = {grid}; "
            f"topology {islands} ({topology.source})")
    if len(islands) == 1:
        return (f"{head}: one island, so every rank order communicates over the same links and the placement has "
                "nothing to choose (no link measured, no estimate made).")
    if links is None:
        return (f"{head}: placement={requested!r} as set; links not measured, no estimate made (placement='auto' "
                "probes them; link_costs declares them).")
    figures = ", ".join(f"{k}={v * 1e3:.1f} ms" for k, v in estimates.items())
    link_text = ", ".join(f"{k} {c.bandwidth * 8 / 1e9:.2f} Gbit/s {c.latency * 1e6:.0f} us" for k, c in links.items())
    how = "the lowest estimate" if requested == "auto" else f"placement={requested!r} as set"
    return f"{head}: {how}; estimated communication per step: {figures}; links {link_source}: {link_text}."


@dataclass(frozen=True)
class Placement:
    """The placement decided at setup: the policy, the ``(dp, tp)`` rank grid, the estimate of every candidate
    (empty when nothing was estimated) and the link figures used (None when none were)."""

    policy: str
    grid: list[list[int]]
    estimates: dict[str, float]
    links: dict[str, LinkCost] | None


def place(requested: str, topology: Topology, dp_size: int, tp_size: int, links: dict[str, LinkCost] | None,
          volume: Callable[[], CommVolume]) -> Placement:
    """Choose the rank grid (collective when it probes the links) and log why, once.

    Args:
        requested: the ``placement`` setting.
        links: configured link figures (``link_costs``), or None to probe them where there is something to rank.
        volume: what one step communicates (called only when the candidates are estimated).
    """
    link_source = ""
    if len(topology.islands) > 1 and (links is not None or requested == "auto"):
        link_source = "configured" if links is not None else "probed"
        links = links if links is not None else probe_links(topology)
        policy, grid, estimates = choose_placement(requested, topology, dp_size, tp_size, volume(), links)
    else:  # one island (every rank order uses the same links) or a fixed policy with no link figures to rank
        policy = "tp_intra_node" if requested == "auto" else requested
        grid, estimates, links = candidate_mesh(policy, topology, dp_size, tp_size), {}, None
    rank_zero_info(describe_placement(requested, policy, grid, topology, estimates, links, link_source))
    return Placement(policy, grid, estimates, links)


def tokens_per_micro_batch(module: nn.Module, configured: int | None, warn_on_default: bool,
                           measured: int | None = None) -> int:
    """Rows entering a feed-forward layer per rank and micro-batch: ``micro_batch_tokens`` if set, else those of
    the micro-batch the cost model measured (``measured``, so that placement and the cost model's choice of ``tp``
    assume the same batch), else from the module's ``example_input_array``, else 2048 (warned when
    ``warn_on_default``: an estimate depends on it)."""
    if configured is not None:
        return configured
    if measured is not None:
        return measured
    example = getattr(module, "example_input_array", None)
    if isinstance(example, torch.Tensor):
        return example.numel() if not example.is_floating_point() else example[..., 0].numel()
    if warn_on_default:
        rank_zero_warn(f"HybridParallelStrategy: placement='auto' assumes {DEFAULT_TOKENS} tokens per "
                       "micro-batch; set micro_batch_tokens (or example_input_array) for a better estimate.")
    return DEFAULT_TOKENS
