"""DualPipe's overlapped forward-backward: one micro-batch's expert all-to-all in flight while another computes.

torch's ``ScheduleDualPipeV`` pairs, in its steady phase, the forward of one micro-batch with the backward of another
(an ``OVERLAP_F_B`` action) and then runs the two one after the other. DeepSeek's DualPipe leaves the overlapped
forward-backward to the model's author, and torchtitan's implementation (two threads meeting at a barrier around
each MoE dispatch and combine) is gone from it. This module is our own, because it has to fit our dispatch
(:func:`~lightning_deepseek.parallel.expert.exchange_pairs`) and gloo on CPU, where collectives are not streams but
work in gloo's own threads: :func:`enable_pipeline_overlap` registers :func:`overlapped_forward_backward` for
``OVERLAP_F_B`` on the schedule (torch's ``register_custom_function``), which runs the forward in the calling thread
and the backward in a second one; the two take turns holding a baton. Each all-to-all of the MoE rows (dispatch
and combine, forward and backward) is launched asynchronously by :func:`all_to_all_rows`, which then hands the
baton to the other micro-batch and waits on its handle only when the baton comes back. So only one thread computes
at a time, the order of the collectives on the ``ep`` group is the same on every rank (every rank of the group runs
the same stages), and every number is the one the schedule computes without the overlap: same operations, same
order within each micro-batch (tested bitwise on gloo).

Supports: the ``DualPipeV`` schedule (the only one with ``OVERLAP_F_B`` actions; :func:`check_pipeline_overlap`
refuses the others), the flat expert dispatch. Costs: one long-lived thread per process, and two baton hand-overs
per all-to-all; it hides an all-to-all only behind compute the other micro-batch has before its own next
all-to-all, and only while both stages still have MoE layers to run (after that the rest runs as before).
:func:`record_exposed_all_to_all` measures the time spent waiting on the row all-to-alls (also without the overlap).

Does not support: the per-island dispatch's collectives (they run unchanged, not overlapped), overlap of the small
count exchange (a blocking all-to-all of ``E`` integers per layer and forward), activation checkpointing of a MoE
block under the overlap (untested), and CUDA streams (on GPUs the backward thread runs on the default stream; untested).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd  # the only differentiable one

# torch's runtime has no public API for an action's parts: its own wait on received tensors and action type
from torch.distributed.pipelining.schedules import OVERLAP_F_B, ScheduleDualPipeV, _wait_batch_p2p

__all__ = ["ExposedAllToAll", "all_to_all_rows", "check_pipeline_overlap", "enable_pipeline_overlap",
           "overlapped_forward_backward", "record_exposed_all_to_all"]

SETTING = "pipeline_overlap"


def check_pipeline_overlap(overlap: bool, schedule: str, pp_size: int | None = None) -> None:
    """Raise unless ``overlap`` is a bool and, when True, ``schedule`` is ``"DualPipeV"`` and ``pp_size`` (where
    given) above 1 (before any collective)."""
    if not isinstance(overlap, bool):
        raise ValueError(f"{SETTING}={overlap!r} must be True or False.")
    if overlap and pp_size == 1:
        raise ValueError(f"{SETTING}=True with pipeline_parallel_size=1: the overlap pairs micro-batches of a "
                         "DualPipeV pipeline. Set pipeline_parallel_size > 1 and pipeline_schedule='DualPipeV', or "
                         f"{SETTING}=False.")
    if overlap and schedule != "DualPipeV":
        raise ValueError(f"{SETTING}=True with pipeline_schedule={schedule!r} is not supported: only DualPipeV pairs "
                         "one micro-batch's forward with another's backward (OVERLAP_F_B). Use "
                         f"pipeline_schedule='DualPipeV', or {SETTING}=False.")


class _Baton:
    """Two threads, ``"forward"`` and ``"backward"``, taking turns: the holder runs, the other waits."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._turn = "forward"
        self._done: set[str] = set()

    @staticmethod
    def _other(side: str) -> str:
        return "backward" if side == "forward" else "forward"

    def wait_turn(self, side: str) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == side)

    def pass_turn(self, side: str) -> bool:
        """Let the other side run until it passes back or finishes; whether it ran (not when it had finished)."""
        with self._cond:
            if self._other(side) in self._done:
                return False
            self._turn = self._other(side)
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._turn == side)
            return True

    def finish(self, side: str) -> None:
        with self._cond:
            self._done.add(side)
            self._turn = self._other(side)
            self._cond.notify_all()


_local = threading.local()  # .baton and .side inside an overlapped forward-backward, per thread


@dataclass
class ExposedAllToAll:
    """Seconds spent waiting on the row all-to-alls' handles, their number, and how many of them the other
    micro-batch computed behind (``handovers``), since recording began."""

    seconds: float = 0.0
    count: int = 0
    handovers: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, seconds: float, handed_over: bool) -> None:
        with self._lock:
            self.seconds += seconds
            self.count += 1
            self.handovers += handed_over


_recorder: ExposedAllToAll | None = None


@contextmanager
def record_exposed_all_to_all() -> Iterator[ExposedAllToAll]:
    """Inside the block every row all-to-all runs through :func:`all_to_all_rows`' asynchronous path (with or
    without the overlap) and adds its wait to the yielded record (this process; its threads together)."""
    global _recorder
    _recorder = ExposedAllToAll()
    try:
        yield _recorder
    finally:
        _recorder = None


def _exchange(rows: torch.Tensor, output_splits: list[int], input_splits: list[int],
              group: dist.ProcessGroup) -> torch.Tensor:
    rows = rows.contiguous()
    out = rows.new_empty((sum(output_splits), *rows.shape[1:]))
    work = dist.all_to_all_single(out, rows, output_splits, input_splits, group=group, async_op=True)
    baton = getattr(_local, "baton", None)
    handed_over = baton is not None and baton.pass_turn(_local.side)
    start = time.perf_counter()
    work.wait()
    if _recorder is not None:
        _recorder.add(time.perf_counter() - start, handed_over)
    return out


class _AllToAllRows(torch.autograd.Function):
    """The all-to-all of :func:`_exchange`; backward: the reverse all-to-all of the gradient."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, output_splits: list[int], input_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _exchange(rows, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        output_splits, input_splits = ctx.splits
        return _exchange(grad, input_splits, output_splits, ctx.group), None, None, None


def all_to_all_rows(rows: torch.Tensor, output_splits: list[int], input_splits: list[int],
                    group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` of ``rows`` over ``group`` (uneven splits): torch's own
    (``all_to_all_single_autograd``) outside an overlapped forward-backward and a recording; inside, launched
    asynchronously, with the other micro-batch running until it is waited on. The same bytes either way."""
    if getattr(_local, "baton", None) is None and _recorder is None:
        return all_to_all_single_autograd(rows, output_splits, input_splits, group)
    return _AllToAllRows.apply(rows, output_splits, input_splits, group)


@contextmanager
def _holding(baton: _Baton, side: str) -> Iterator[None]:
    _local.baton, _local.side = baton, side
    try:
        yield
    finally:
        baton.finish(side)
        _local.baton = None


def _run_forward(schedule: Any, stages: dict[int, Any], action: Any, ctx: Any) -> None:
    """The schedule's FORWARD action after its input arrived (torch's ``_PipelineScheduleRuntime``)."""
    stage, mb = stages[action.stage_index], action.microbatch_index
    schedule._assert_unsharded(stage)
    output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb])
    schedule._maybe_compute_loss(stage, output, ctx.target_mbs, mb)
    if action.stage_index + 1 in stages:  # the V's two adjacent stages on this rank hand over without sending
        stages[action.stage_index + 1].set_local_fwd_input(output, mb)


def _run_backward(schedule: Any, stages: dict[int, Any], action: Any) -> None:
    """The schedule's FULL_BACKWARD action after its gradient arrived."""
    stage, mb = stages[action.stage_index], action.microbatch_index
    schedule._assert_unsharded(stage)
    loss = schedule._maybe_get_loss(stage, mb)
    schedule.backward_counter[action.stage_index] += 1
    last = schedule.backward_counter[action.stage_index] == schedule._n_microbatches
    stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=last)
    if action.stage_index - 1 in stages:
        stages[action.stage_index - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)


def _wait_received(schedule: Any, stages: dict[int, Any], forward: Any, backward: Any) -> None:
    """Wait for the forward's input and the backward's gradient where they come from another rank."""
    f_stage, b_stage = stages[forward.stage_index], stages[backward.stage_index]
    if not f_stage.is_first and forward.stage_index - 1 not in stages:
        _wait_batch_p2p(schedule.fwd_recv_ops.pop((forward.stage_index, forward.microbatch_index)))
    if not b_stage.is_last and backward.stage_index + 1 not in stages:
        _wait_batch_p2p(schedule.bwd_recv_ops.pop((backward.stage_index, backward.microbatch_index)))


class _BackwardThread:
    """One long-lived thread per process that runs the backward halves: a new thread per action would start a thread
    and redo the per-thread set-up of the math libraries every time."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._tasks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="pipeline-overlap-backward", daemon=True).start()

    def _loop(self) -> None:
        while True:
            self._tasks.get()()

    def run(self, task: Callable[[], None]) -> threading.Event:
        """Start ``task`` there; the event is set when it has returned."""
        done = threading.Event()

        def wrapped() -> None:
            try:
                task()
            finally:
                done.set()

        self._tasks.put(wrapped)
        return done


_backward_thread: list[_BackwardThread] = []


def _the_backward_thread() -> _BackwardThread:
    if not _backward_thread or _backward_thread[0].pid != os.getpid():  # a forked child has no copy of the thread
        _backward_thread[:] = [_BackwardThread()]
    return _backward_thread[0]


def overlapped_forward_backward(action: Any, ctx: Any) -> None:
    """torch's custom function for one ``OVERLAP_F_B`` action: its forward here, its backward in a second thread,
    taking turns at each row all-to-all (see the module docstring). torch has no public runtime API: the action's
    sub-actions are run as torch's ``_PipelineScheduleRuntime`` runs them, through its private methods."""
    schedule = ctx.schedule_ref
    forward, backward = action.sub_actions
    stages = {stage.stage_index: stage for stage in schedule._stages}
    _wait_received(schedule, stages, forward, backward)
    baton, errors = _Baton(), []

    def run_backward() -> None:
        with _holding(baton, "backward"):
            baton.wait_turn("backward")
            try:
                _run_backward(schedule, stages, backward)
            except BaseException as error:  # re-raised in the calling thread
                errors.append(error)

    done = _the_backward_thread().run(run_backward)
    try:
        with _holding(baton, "forward"):
            _run_forward(schedule, stages, forward, ctx)
    finally:
        done.wait()
    if errors:
        raise errors[0]


def enable_pipeline_overlap(schedule: Any) -> None:
    """Run ``schedule``'s ``OVERLAP_F_B`` actions through :func:`overlapped_forward_backward`."""
    if not isinstance(schedule, ScheduleDualPipeV):
        raise ValueError(f"{SETTING}=True needs torch's ScheduleDualPipeV, not {type(schedule).__name__}: use "
                         f"pipeline_schedule='DualPipeV', or {SETTING}=False.")
    schedule.register_custom_function(OVERLAP_F_B, overlapped_forward_backward)
