"""``CollectiveCounter``: the bytes one rank hands to each collective, by process group, counted at the dispatcher.

A ``TorchDispatchMode`` that sees every collective reaching torch's dispatcher: the in-place ``c10d`` ops of
``torch.distributed`` (``all_reduce``, ``broadcast``, ``all_to_all_single``, ...) and the functional collectives
that DTensor's redistributions and ``all_to_all_single_autograd`` call (forward and backward). Each call is recorded
with its process group's name and its *buffer bytes at this rank*: the largest tensor it reads or writes
(all-reduce and broadcast: the buffer; all-gather: the gathered output; reduce-scatter: the full input; all-to-all:
the larger of what is sent and received). The same counter runs in a planned step on the fake backend and in a
real step on gloo, so the two are compared call by call.

torch's ``CommDebugMode`` counts the same ops but not their bytes, and its module tracker raises on transformers'
models in torch 2.13 (their output-capturing hooks); this counter tracks no modules. Not seen here: what
``DistributedDataParallel``'s reducer sends (C++ calls the process group directly): its bytes come from its buckets
(:mod:`lightning_deepseek.planning.planner`), or, in a real run, from a comm hook.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from copy import deepcopy
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker, _State  # per-module peaks: no public names
from torch.distributed._tools.mod_tracker import ModTracker
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator  # see LocalOpsOnly
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # no public way to bypass
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, shape_wrapper

from lightning_deepseek.planning.float8 import cast_bytes, is_float8

DEVICE_QUERY = torch.ops.prim.device.default
NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "gather",
               "scatter", "send", "recv", "allgather", "allreduce_coalesced", "allgather_into_tensor_coalesced",
               "reduce_scatter_tensor_coalesced", "all_gather_into_tensor_coalesced", "all_reduce_coalesced")


@dataclass(frozen=True)
class CollectiveCall:
    """One collective at this rank: op name (``all_reduce``, ``broadcast``, ...), group name, buffer bytes and the
    phase of the step it ran in (``"forward_backward"``, ``"gradients"``, ``"optimizer"``, ``"ddp"``)."""

    op: str
    group: str
    num_bytes: int
    phase: str = "forward_backward"


def _op_name(func: Any) -> str:
    name = func._overloadpacket.__name__.strip("_")
    return {"allreduce": "all_reduce", "allgather_base": "all_gather", "all_gather_into_tensor": "all_gather",
            "reduce_scatter_base": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
            "alltoall_base": "all_to_all", "all_to_all_single": "all_to_all", "send": "send",
            "recv": "recv"}.get(name, name)


def _group_name(args: list[Any]) -> str:
    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            return dist.ProcessGroup.unbox(arg).group_name
        if isinstance(arg, dist.ProcessGroup):
            return arg.group_name
    strings = [a for a in args if isinstance(a, str)]
    return strings[-1] if strings else "?"  # the functional collectives take the group name last


class CollectiveCounter(TorchDispatchMode):
    """Records each collective (see the module docstring); ``bytes_by_group()`` sums them."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[CollectiveCall] = []
        self.phase = "forward_backward"  # set by the caller as the step moves on

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace in NAMESPACES and _op_name(func) in COLLECTIVES:
            flat, _ = tree_flatten((args, kwargs))
            tensors = [t for t in flat + tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            num_bytes = max((t.numel() * t.element_size() for t in tensors), default=0)
            self.calls.append(CollectiveCall(_op_name(func), _group_name(flat), num_bytes, self.phase))
        return out

    def bytes_by_group(self) -> dict[tuple[str, str], int]:
        """``{(group name, op): bytes}`` over every recorded call."""
        totals: dict[tuple[str, str], int] = defaultdict(int)
        for call in self.calls:
            totals[call.group, call.op] += call.num_bytes
        return dict(totals)


class LocalOpsOnly(TorchDispatchMode):
    """Entered innermost (on top of the mode stack), so that the modes below (``FlopCounter``, ``MemTracker``,
    the ``CollectiveCounter``) see what a rank runs and nothing else:

    - an op on DTensors is left to DTensor, which runs it as local ops and collectives (the modes below would
      otherwise count a tensor-parallel matmul at its global shape, ``tp`` times this rank's work);
    - the ops DTensor runs at global shapes on fake tensors to infer an output's shape (its sharding propagation,
      ``ShardingPropagator._propagate_tensor_meta_non_cached``) run past the modes below: in a real run they cost
      nothing (the patch of that private method, for the ``with`` block only, is the one place that marks them);
    - a fake tensor's device query (``prim.device``: torch's C++ asks it of every fake tensor it touches, about two
      thirds of a planned step's dispatches) is answered by the tensor itself, as ``FakeTensor`` answers it under
      no mode: it runs no op, and passing it down the Python modes cost a fifth of a plan's time.
    """

    def __init__(self, fake_mode: FakeTensorMode | None = None) -> None:
        super().__init__()
        self.fake_mode = fake_mode  # the plan's: what DTensor's propagation computes under (None in a real run)
        self._propagating = 0
        self._saved: Any = None

    def __enter__(self) -> LocalOpsOnly:
        propagate = getattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", None)
        if propagate is not None:
            def marked(prop: Any, *args: Any, **kwargs: Any) -> Any:
                self._propagating += 1
                try:
                    return propagate(prop, *args, **kwargs)
                finally:
                    self._propagating -= 1
            self._saved = propagate
            ShardingPropagator._propagate_tensor_meta_non_cached = marked
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self._saved is not None:
            ShardingPropagator._propagate_tensor_meta_non_cached = self._saved
            self._saved = None
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is DEVICE_QUERY and isinstance(args[0], FakeTensor):
            return FakeTensor.__torch_dispatch__(func, types, args, kwargs or {})
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        if self._propagating:  # past the modes below, but fake: its factory calls allocate nothing
            with _disable_current_modes(), self.fake_mode or contextlib.nullcontext():
                return func(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


class FlopCounter(TorchDispatchMode):
    """The FLOPs of the ops that reach it, by torch's formulas (``torch.utils.flop_counter``'s registry, plus
    ``custom``: op packet to an unwrapped formula taking shapes); ``total`` sums them, ``fp8`` those of the GEMMs on
    torchao's float8 operands, ``cast_bytes`` the traffic of the casts to FP8 (:mod:`.float8`).

    torch's ``FlopCounterMode`` counts the same, but also tracks modules, and the backward hooks it puts on each
    module's outputs keep tensors alive under activation checkpointing (the recompute registers them again): a
    planned peak 10% above the real run's on a checkpointed model. This counts totals only and holds nothing.
    """

    def __init__(self, custom: dict[Any, Any] | None = None) -> None:
        super().__init__()
        self.registry = {**flop_registry, **{op: shape_wrapper(f) for op, f in (custom or {}).items()}}
        self.total = 0
        self.fp8 = 0
        self.cast_bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.registry.get(func._overloadpacket)
        if formula is not None:
            flops = formula(*args, **kwargs, out_val=out)
            self.total += flops
            self.fp8 += flops if any(is_float8(a) for a in args) else 0
        elif func is torch.ops.aten._to_copy.default:
            self.cast_bytes += cast_bytes(out)
        return out


class NoModuleHooks(ModTracker):
    """A ``ModTracker`` that installs no hooks: its gradient hooks on a stage's input refuse the input-gradient
    ``autograd.grad`` of a split backward (ZBVZeroBubble, DualPipeV); the tracker's totals and running peak need
    none."""

    def __enter__(self) -> ModTracker:
        return self

    def __exit__(self, *args: Any) -> None:
        pass


class MicroBatchMemTracker(MemTracker):
    """torch's ``MemTracker`` over a step that runs a root module once per micro-batch (a pipeline stage): where
    ``MemTracker`` refuses a root module's second forward ("multiple iterative calls"), that root's statistics are
    dropped and its forward tracked afresh (the totals, the running peak and the other stages' statistics, which
    their pending backwards read, are kept); ``module_hooks=False``: no per-module tracking (:class:`NoModuleHooks`),
    for a split backward."""

    def __init__(self, module_hooks: bool = True) -> None:
        super().__init__()
        if not module_hooks:  # MemTracker takes no ModTracker argument: its private one replaced
            self._mod_tracker = NoModuleHooks()

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        try:
            super()._pre_fw_hook(module, inputs)
        except NotImplementedError:
            del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)


class RunningPeakTracker(MicroBatchMemTracker):
    """``MicroBatchMemTracker`` keeping only the running peak of the whole (what the pipeline planner reads of a
    stepped rank): torch's tracker also updates the peak of every module seen so far after each op (ops x modules:
    most of a deep stage's planning time)."""

    def _update_peak_stats(self, peak_state: _State) -> None:  # torch's hook per op; no public way to skip modules
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot["Total"]:
                self._peak_mem[device] = snapshot["Total"]


class RootPeakTracker(MemTracker):
    """torch's ``MemTracker`` keeping the per-module peaks of one module only, ``root`` (and the running peak of the
    whole): torch's updates the peak of every module seen so far after each op, ops x modules, half a plan's time on
    a model of many small modules (experts). What it keeps of ``root`` is what ``MemTracker`` keeps, equal."""

    def __init__(self, root: nn.Module) -> None:
        super().__init__()
        self._root = root

    def _update_peak_stats(self, peak_state: _State) -> None:  # torch's hook per op, for the root module alone
        current = self._curr_mem_snap
        stats = self.memory_tracking.get(self._root)
        if stats is not None and stats.mod_fqn in self._mod_tracker.parents and peak_state in stats.snapshots:
            for device, snapshot in current.items():
                if stats.local_peak.get(device, 0) < snapshot["Total"]:
                    stats.local_peak[device] = snapshot["Total"]
                    stats.snapshots[peak_state][-1][device] = deepcopy(snapshot)
        for device, snapshot in current.items():
            if self._peak_mem.get(device, 0) < snapshot["Total"]:
                self._peak_mem[device] = snapshot["Total"]
                self._peak_mem_snap[device] = deepcopy(snapshot)
