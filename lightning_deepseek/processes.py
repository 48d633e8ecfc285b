"""Small process helpers shared by ``lds-train`` (run folders, stopping the ranks it started) and the Optuna
sweeper (stale trials); standard library only."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (one of another user counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_processes(procs: Iterable[subprocess.Popen], signum: int = signal.SIGTERM, grace_s: float = 5.0) -> None:
    """Send ``signum`` to each process still running, wait up to ``grace_s`` for all, then SIGKILL the rest: none
    is left behind (a rank blocked in a collective may not run its Python signal handler)."""
    running = [p for p in procs if p.poll() is None]
    for proc in running:
        proc.send_signal(signum)
    deadline = time.monotonic() + grace_s
    for proc in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
