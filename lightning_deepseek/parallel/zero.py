"""ZeRO-1: each replica of a parameter keeps the optimizer state of only the parameters it owns.

A parameter's *replica group* is the set of ranks that hold the same copy of it and, after the gradient
reduction, the same gradient: the whole world for a replicated parameter (DDP averages it over the world), the
``dp`` group for a tensor-parallel shard and for a pipeline stage's parameters (the ranks holding that stage).
Inside each replica group, parameters are dealt to owners (largest first, to the least loaded rank). At every
optimizer step a rank steps only what it owns; then every owner broadcasts its updated parameters (one flat
broadcast per owner and group) and the replicas agree again.

How the step skips what a rank does not own: a pre-step hook clears the gradients of the parameters owned by
other ranks (right after the step's closure, where Lightning's gradient clipping and loss-scaler checks have run
over the whole model), and every per-parameter torch optimizer skips a parameter whose ``grad`` is ``None`` (it
creates no state for it). So the user's optimizer object stays as it was built: its param groups still list every
parameter (LR schedulers, gradient clipping, loss-scaler unscaling and Lightning see the whole model), only its
``state`` shrinks to 1/group-size. Checkpoints then need no format of their own: ``get_optimizer_state_dict`` holds the
owned states under parameter names, ``torch.distributed.checkpoint`` writes the union of all ranks' keys, and a
run with another partition (another world size, or ZeRO off) reads the keys it needs.

Why not torch's ``ZeroRedundancyOptimizer``: it rebuilds the optimizer from a class and kwargs (the user's
object, referenced by schedulers and Lightning, would not be the one stepping), takes one process group for all
parameters (ours have two kinds of replica groups), broadcasts parameters with ``dist.broadcast`` on the tensors
themselves (tensor-parallel DTensor shards need their local tensors), and has its own consolidation format
instead of DCP's resharding. FSDP2 shards parameters and gradients as well (ZeRO-3), which changes the gradient
path that ``GradientCompression`` hooks into.

Supported optimizers: torch's per-parameter ones (``SHARDABLE``); anything else is refused with the reason.
Costs: per optimizer step, one broadcast of every parameter from its owner (the bytes of an all-gather of the
parameters); state memory 1/group-size of DDP's.
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_deepseek.optim import AdamW  # BF16 moments: per-parameter too

# Their step updates each parameter from its own gradient and state only; a parameter with grad None is skipped.
SHARDABLE: tuple[type[Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop,
    torch.optim.ASGD, AdamW,
)


class UnshardableOptimizerError(TypeError):
    """The optimizer's step is not per-parameter, so its state cannot be split over ranks."""


@dataclass(frozen=True)
class ReplicaGroup:
    """Ranks holding identical copies (and, after reduction, identical gradients) of some parameters."""

    ranks: tuple[int, ...]  # global ranks, in group order
    group: dist.ProcessGroup | None  # None: the default (world) group

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class Partition:
    """Who owns which parameter: decided once at setup, read at every step."""

    owner: dict[int, int] = field(default_factory=dict)  # id(param) -> global rank of its owner
    groups: tuple[tuple[ReplicaGroup, tuple[nn.Parameter, ...]], ...] = ()  # each group with its parameters

    def owned_by(self, rank: int) -> list[nn.Parameter]:
        return [p for _, params in self.groups for p in params if self.owner[id(p)] == rank]

    def state_fraction(self, rank: int) -> float:
        """Share of all parameter elements whose optimizer state ``rank`` keeps."""
        total = sum(_local(p).numel() for _, params in self.groups for p in params)
        return sum(_local(p).numel() for p in self.owned_by(rank)) / max(total, 1)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def state_bytes(optimizer: Optimizer) -> int:
    """Bytes of the optimizer state this rank holds (DTensor states: the local shard)."""
    tensors = [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    return sum(_local(t).numel() * t.element_size() for t in tensors)


def estimated_state_bytes(optimizer: Optimizer, param: torch.Tensor, group: dict[str, Any]) -> int:
    """Bytes of the state ``optimizer`` will keep for ``param`` (its local shard) in param group ``group``, before
    the first step creates it: the parameter-sized tensors of each ``SHARDABLE`` optimizer (scalar step counters
    left out); another optimizer counts as Adam's two."""
    if isinstance(optimizer, torch.optim.SGD):
        count = int(group["momentum"] != 0)
    elif isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        count = 2 + int(group.get("amsgrad", False))
    elif isinstance(optimizer, torch.optim.RMSprop):
        count = 1 + int(group["momentum"] > 0) + int(group["centered"])
    elif isinstance(optimizer, (torch.optim.Adagrad, torch.optim.ASGD)):
        count = 1
    else:  # Adadelta, Adamax, NAdam, RAdam, Rprop, lightning_deepseek's AdamW: two
        count = 2
    itemsize = optimizer.moment_dtype.itemsize if isinstance(optimizer, AdamW) else param.element_size()
    return count * _local(param).numel() * itemsize


def check_shardable(optimizer: Optimizer, index: int = 0) -> None:
    """Raise ``UnshardableOptimizerError`` for an optimizer whose step couples parameters (e.g. LBFGS)."""
    if isinstance(optimizer, SHARDABLE):
        return
    names = ", ".join(cls.__name__ for cls in SHARDABLE)
    raise UnshardableOptimizerError(
        f"shard_optimizer_states=True cannot shard {type(optimizer).__name__} (optimizer {index}): only optimizers "
        f"whose step treats each parameter on its own are supported ({names}). Use one of those, or set "
        "shard_optimizer_states=False.")


def partition(params: Iterable[nn.Parameter], replica_group_of: Callable[[nn.Parameter], ReplicaGroup]) -> Partition:
    """Deal each replica group's parameters to its ranks: largest first, each to the least loaded rank."""
    by_group: dict[tuple[int, ...], tuple[ReplicaGroup, list[nn.Parameter]]] = {}
    seen: set[int] = set()
    for param in params:
        if id(param) in seen or not param.requires_grad:
            continue
        seen.add(id(param))
        group = replica_group_of(param)
        by_group.setdefault(group.ranks, (group, []))[1].append(param)
    owner: dict[int, int] = {}
    groups = []
    for group, members in by_group.values():
        least = [(0, position, rank) for position, rank in enumerate(group.ranks)]  # (load, position): a heap
        for param in sorted(members, key=lambda p: -_local(p).numel()):  # stable: ties keep parameter order
            load, position, rank = heapq.heappop(least)  # the least loaded rank, the first of equals
            owner[id(param)] = rank
            heapq.heappush(least, (load + _local(param).numel(), position, rank))
        groups.append((group, tuple(members)))
    return Partition(owner=owner, groups=tuple(groups))


class ShardedOptimizerStates:
    """Installs ZeRO-1 on an optimizer through torch's public step hooks (see the module docstring).

    Args:
        optimizer: a torch per-parameter optimizer (``SHARDABLE``).
        partition: the owners, from :func:`partition`.
        rank: this process's global rank.
    """

    def __init__(self, optimizer: Optimizer, partition: Partition, rank: int) -> None:
        self.partition = partition
        self.rank = rank
        self._others = [p for _, params in partition.groups for p in params if partition.owner[id(p)] != rank]
        # Who sends what after each step, decided once: (group, owner, its parameters) for groups with replicas.
        self._sends = [(group, src, owned) for group, params in partition.groups if group.size > 1
                       for src in group.ranks
                       if (owned := [p for p in params if partition.owner[id(p)] == src])]
        self._paused = False
        self._handles: list[RemovableHandle] = [
            optimizer.register_step_pre_hook(self._drop_unowned_grads),
            optimizer.register_step_post_hook(self._broadcast_updates),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No broadcast inside: for torch's state-dict helpers, which step with zero grads on some ranks only."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def drop_unowned_state(self, optimizer: Optimizer) -> None:
        """Forget the states of parameters other ranks own (after loading a file that holds them all)."""
        for param in self._others:
            optimizer.state.pop(param, None)

    def _drop_unowned_grads(self, optimizer: Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        # A step with a closure (Lightning's automatic optimization) makes the gradients inside it, and clipping
        # and loss-scaler checks run at its end: drop the gradients just after it, not before.
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0] is the optimizer
        if closure is None:
            self._drop()
            return None

        def closure_then_drop() -> Any:
            loss = closure()
            self._drop()
            return loss

        return args[:1], {**kwargs, "closure": closure_then_drop}

    def _drop(self) -> None:
        for param in self._others:
            param.grad = None

    @torch.no_grad()
    def _broadcast_updates(self, optimizer: Optimizer, args: tuple, kwargs: dict) -> None:
        if not self._paused:
            self.broadcast_parameters()

    @torch.no_grad()
    def broadcast_parameters(self) -> None:
        """Every owner sends its parameters to the other replicas: one flat broadcast per owner and group."""
        for group, src, owned in self._sends:
            tensors = [_local(p) for p in owned]
            flat = torch._utils._flatten_dense_tensors(tensors)  # no public flatten with an unflatten pair
            dist.broadcast(flat, src=src, group=group.group)
            if src != self.rank:
                for tensor, value in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors)):
                    tensor.copy_(value)
