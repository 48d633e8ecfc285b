"""``LostRankWatchdog``: a rank that dies (SIGKILL, out of memory) ends the job with a message naming it.

Under Lightning's one-machine launcher the launching process is rank 0 and starts the other ranks as
children. Lightning's own observer polls them every 5 s and, when one dies, SIGKILLs everything, rank 0
included, before rank 0 can say which rank was lost or where its last checkpoint is. The watchdog takes that
supervision over: rank 0 polls its children each second, a child watches that its parent (rank 0) is alive.
When a peer is gone the process records it; the collective that fails next (gloo notices a closed peer at once)
ends ``fit``, and ``lds-train`` prints one paragraph naming the lost rank. If the process is still running
``grace_s`` later (blocked in something that does not notice), the watchdog prints that paragraph itself and
exits 1. Ranks started by an external launcher (torchrun, srun) rely on the collective timeout instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from typing_extensions import override


class LostRankWatchdog(Callback):
    """Watches the other ranks of a one-machine job and names a lost one.

    Args:
        grace_s: seconds the process may take to fail on its own once a peer is lost.
        poll_s: seconds between checks.
        describe: called with the lost-rank sentence; returns the whole paragraph (e.g. adds how to resume).
    """

    def __init__(self, grace_s: float = 10.0, poll_s: float = 1.0, describe: Any = None) -> None:
        self.grace_s = grace_s
        self.poll_s = poll_s
        self.describe = describe or (lambda sentence: sentence)
        self.lost: str | None = None  # e.g. "rank 1 (pid 123) was killed by SIGKILL"
        self._children: dict[int, subprocess.Popen] = {}
        self._parent_pid = 0
        self._done = threading.Event()
        self._reported = threading.Lock()

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        launcher = trainer.strategy.launcher
        if trainer.world_size < 2 or not isinstance(launcher, _SubprocessScriptLauncher):
            return
        if trainer.local_rank == 0 and launcher.procs:
            self._children = {rank: proc for rank, proc in enumerate(launcher.procs, start=1)}
            launcher.procs.clear()  # Lightning's observer watches this list: an empty one makes it stop
        elif trainer.local_rank > 0 and "LOCAL_RANK" in os.environ:
            self._parent_pid = os.getppid()
        else:
            return
        threading.Thread(target=self._watch, name="lds-lost-rank-watchdog", daemon=True).start()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._done.set()

    def report(self) -> str | None:
        """The paragraph for a lost rank, once (``None`` if no rank was lost or it was already printed)."""
        if self.lost is None or not self._reported.acquire(blocking=False):
            return None
        return self.describe(self.lost)

    def _watch(self) -> None:
        while not self._done.wait(self.poll_s):
            self.lost = self._find_lost()
            if self.lost is not None:
                break
        if self.lost is None or self._done.wait(self.grace_s):
            return
        paragraph = self.report()
        if paragraph is not None:
            print(f"lds-train: error: {paragraph}", file=sys.stderr, flush=True)
        os._exit(1)

    def _find_lost(self) -> str | None:
        for rank, proc in self._children.items():
            code = proc.poll()
            if code:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                if code == 2:
                    how = "exited with code 2 (a setting it rejected: see the message above or its log)"
                if code == -9:
                    how = "was killed by SIGKILL (out of memory, or killed by hand or by the scheduler)"
                return f"rank {rank} (pid {proc.pid}) {how}"
        if self._parent_pid and os.getppid() != self._parent_pid:
            return f"rank 0 (pid {self._parent_pid}) is gone"
        return None


def wait_for_watchdog(watchdog: LostRankWatchdog, seconds: float) -> None:
    """Give the watchdog up to ``seconds`` to find a lost peer after a collective failed (it polls)."""
    deadline = time.monotonic() + seconds
    while watchdog.lost is None and time.monotonic() < deadline:
        watchdog.lost = watchdog._find_lost()
        if watchdog.lost is None:
            time.sleep(0.1)
