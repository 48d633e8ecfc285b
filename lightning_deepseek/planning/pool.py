"""``PlanPool``: the plans of one search made side by side, in worker processes, one per core.

A plan is CPU-bound Python (torch's dispatch of fake tensors through the planner's counting modes) on one core, and a
search plans hundreds of layouts independently of each other: ``workers`` processes plan that many at once. Not a
``multiprocessing.Pool`` or ``concurrent.futures`` executor: a layout must go to the worker holding the values its
plan shares with those planned before it (each worker keeps its own :class:`.cache.PlanCache`; a pipelined layout's
stepped stage copies, the costliest part of its plan, are those of the same layout at other micro-batch counts), and
those executors hand work to whichever worker is free. Here a layout goes to the worker that planned the first layout
of its :func:`affinity` key, or, for a new key, to any free worker.

Each worker is a new interpreter running this module (``python -m``), not a ``multiprocessing`` child: a fork would
copy this process's torch threads and locks, and ``spawn`` re-imports the caller's main script, which then needs an
``if __name__ == "__main__"`` guard. Costs: each worker imports torch, then builds what its first plans need; values
cached in one worker are computed again in another (the block kinds, the tensor-parallel plans). Plans are equal to
those of one process (each plan's numbers do not depend on its cache, ``tests/planning/test_cache.py``). A worker
that exits without an answer (killed, out of memory) fails the search with the layout it was planning, as does an
error other than the strategy's refusal (a ``ValueError``, returned as the layout's reason).
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import subprocess
import sys
import traceback
from collections.abc import Hashable
from multiprocessing.connection import Connection, wait

import torch

from lightning_deepseek.parallel.detection import cached_probes
from lightning_deepseek.planning.cache import PlanCache
from lightning_deepseek.planning.cluster import ClusterSpec
from lightning_deepseek.planning.layout import PlanLayout, StepShape
from lightning_deepseek.planning.models import ModelSpec
from lightning_deepseek.planning.pipeline import across_pp, optimizer_settings
from lightning_deepseek.planning.planner import plan
from lightning_deepseek.planning.report import PlanReport

Outcome = PlanReport | ValueError  # a plan, or the strategy's reason for refusing the layout


def affinity(layout: PlanLayout) -> Hashable:
    """What a plan shares with other layouts' plans through the cache: the layout but its activation checkpointing
    (ZeRO-1's optimizer step is cached across modes), ZeRO-1 and compression (a pipelined rank's stepped copies are
    shared with and without them), its micro-batches and which V schedule (the copies are shared across them too)
    and, without FSDP2, its ``pp`` (:func:`.pipeline.across_pp`)."""
    shared = layout.pp > 1 and across_pp(dataclasses.replace(layout, shard_optimizer_states=False))
    left_out = ("shard_optimizer_states", "bits") + (("pp",) if shared else ())
    return tuple(item for item in optimizer_settings(layout) if item[0] not in left_out)


class PlanPool:
    """``workers`` processes planning layouts of ``model`` at ``world_size`` on ``cluster`` (:func:`.planner.plan`'s
    arguments); ``cache``: each worker shares one :class:`PlanCache` between its plans (False: a fresh one per plan).
    Use as a context manager: the workers stop on exit."""

    def __init__(self, workers: int, model: ModelSpec, world_size: int, cluster: ClusterSpec, step: StepShape,
                 depth: str, cache: bool = True) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers!r} must be a positive number of processes.")
        self._connections: list[Connection] = []
        self._processes: list[subprocess.Popen] = []
        for _ in range(workers):
            parent, child = socket.socketpair()
            self._processes.append(subprocess.Popen([sys.executable, "-m", __name__, str(child.fileno())],
                                                    pass_fds=(child.fileno(),)))
            child.close()
            self._connections.append(Connection(parent.detach()))
            self._connections[-1].send((model, world_size, cluster, step, depth, cache))
        self._world_size = world_size
        self._owner: dict[Hashable, int] = {}
        self._planning: dict[int, tuple[int, PlanLayout]] = {}  # worker: (index, layout) in flight

    def __enter__(self) -> PlanPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def busy(self) -> bool:
        """Whether a plan is in flight."""
        return bool(self._planning)

    def idle(self) -> list[int]:
        """The workers with no plan in flight."""
        return [w for w in range(len(self._processes)) if w not in self._planning]

    def takes(self, worker: int, layout: PlanLayout) -> bool:
        """Whether ``worker`` plans ``layout``: its :func:`affinity` key is new or the worker's."""
        return self._owner.get(affinity(layout), worker) == worker

    def submit(self, worker: int, index: int, layout: PlanLayout) -> None:
        """Start planning ``layout`` (the ``index``-th candidate) on the idle ``worker``."""
        self._owner.setdefault(affinity(layout), worker)
        self._planning[worker] = (index, layout)
        self._connections[worker].send(layout)

    def result(self) -> tuple[int, PlanLayout, Outcome]:
        """The next plan to finish: its index, layout and report (or the strategy's refusal).

        Raises:
            RuntimeError: the worker failed otherwise, or exited without answering.
        """
        by_connection = {self._connections[worker]: worker for worker in self._planning}
        connection = wait(list(by_connection))[0]
        worker = by_connection[connection]
        index, layout = self._planning.pop(worker)
        try:
            kind, value = connection.recv()
        except (EOFError, OSError):  # the worker exited: its end of the socket closed without an answer
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._processes[worker].wait(timeout=5)
            raise RuntimeError(f"the lds-plan worker planning {layout.describe(self._world_size)} exited with code "
                               f"{self._processes[worker].returncode} before answering (out of memory? each worker "
                               "holds one plan's fake tensors; fewer workers hold fewer)") from None
        if kind == "error":
            raise RuntimeError(f"planning {layout.describe(self._world_size)} failed in an lds-plan worker:\n{value}")
        return index, layout, ValueError(value) if kind == "refused" else value

    def close(self) -> None:
        """Stop the workers (those still planning are terminated)."""
        for worker, connection in enumerate(self._connections):
            with contextlib.suppress(OSError):
                if worker not in self._planning:
                    connection.send(None)
        for worker, process in enumerate(self._processes):
            if worker in self._planning:
                process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            self._connections[worker].close()
        self._planning.clear()


def _serve(connection: Connection, model: ModelSpec, world_size: int, cluster: ClusterSpec, step: StepShape,
           depth: str, cache: bool) -> None:
    """A worker: plan each layout received until None, answering with ``(kind, value)``."""
    torch.set_num_threads(1)  # fake tensors: the few real ops need no thread pool beside the other workers
    shared = PlanCache() if cache else None
    with cached_probes() if cache else contextlib.nullcontext():
        while (layout := connection.recv()) is not None:
            try:
                connection.send(("report", plan(model, world_size, layout, cluster, step, depth, shared)))
            except ValueError as exc:
                connection.send(("refused", str(exc)))
            except Exception:  # noqa: BLE001 - returned to the parent, which fails the search with it
                connection.send(("error", traceback.format_exc()))


if __name__ == "__main__":  # a worker: python -m lightning_deepseek.planning.pool FD (the socket to its pool)
    _connection = Connection(int(sys.argv[1]))
    _serve(_connection, *_connection.recv())
