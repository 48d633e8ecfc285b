"""Small process helpers of ``lds-train`` (run folders, stopping a launch); standard library only."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def is_launcher() -> bool:
    """Whether this is the process the user started (not a rank that Lightning or torchrun started)."""
    return os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0"


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


def child_pids() -> list[int]:
    """The processes this one started, from ``/proc`` (empty where there is none)."""
    pids = []
    for task in Path("/proc/self/task").glob("*"):
        try:
            pids += [int(pid) for pid in (task / "children").read_text().split()]
        except OSError:
            pass
    return pids


def kill_children() -> None:
    """SIGKILL every process this one started and reap it: none is left behind (a rank blocked in a collective
    would not run a Python signal handler)."""
    for pid in child_pids():
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass  # already gone, or reaped by its Popen
