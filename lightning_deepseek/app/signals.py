"""SIGTERM and SIGINT outside ``lds-train``'s training loop: while the run launches, and after its last step.

Inside the loop ``RunCheckpoint`` (``checkpointing.py``) owns both signals: the ranks agree at a step boundary,
save, and stop. ``lds-train`` installs ``OUTSIDE_TRAINING`` first thing (``console.py``; standard library only, so
that it is in place before Hydra, torch and Lightning load), and ``RunCheckpoint`` restores it when training ends:

- Before training starts there is nothing to save, and the main thread may be blocked in C++ for minutes (rank 0
  waits in ``init_process_group`` for ranks that a Ctrl-C already stopped), where no Python signal handler runs.
  So a watcher thread, woken by ``signal.set_wakeup_fd`` (written by the C-level handler at once), stops the
  launch itself: it SIGKILLs the ranks this process started (they have done nothing worth keeping), runs the
  registered clean-ups (``cli.py`` removes the run folder Hydra named, as after a configuration error), prints
  one line and exits 143 (SIGTERM) or 130 (SIGINT); a rank that Lightning started exits 0 (Lightning's launcher
  takes a child's non-zero exit for a crash and SIGKILLs the whole job, the launcher included).
- After the last step the final checkpoint is being written: the signal is only noted; the save and teardown
  finish, and ``lds-train`` then exits 143 or 130 rather than 0, so that a scheduler sees the run was stopped.

A Hydra multirun (``lds-train -m``, a sweep) keeps Python's own handling: its sweeper's main thread stays
responsive, and on Ctrl-C it marks the trials in flight failed.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from lightning_deepseek.app.processes import is_launcher, kill_children

EXIT_CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}  # 128 + signal number, as a shell reports them


def exit_code(signum: int) -> int:
    """The exit code of a run stopped by ``signum``."""
    return EXIT_CODES.get(signal.Signals(signum), 128 + signum)


class OutsideTraining:
    """The SIGTERM/SIGINT handling of an ``lds-train`` process while no training loop runs.

    Attributes:
        received: the first signal noted after training (0: none).
        launching: whether training has yet to start (then a signal stops the process from the watcher thread).
    """

    def __init__(self) -> None:
        self.received = 0
        self.launching = True
        self._cleanups: list[Callable[[str], None]] = []
        self._installed = False

    def install(self, argv: list[str]) -> None:
        """Handle SIGTERM and SIGINT in this process from now on, for the command line ``argv``. Not for a Hydra
        multirun (``-m``: a sweep's main thread stays responsive, and its sweeper marks the trials in flight failed
        on Ctrl-C), nor from a thread other than the main one (signal handlers belong to it)."""
        multirun = any(arg in ("-m", "--multirun") or arg.replace(" ", "") == "hydra.mode=MULTIRUN" for arg in argv)
        if self._installed or multirun or threading.current_thread() is not threading.main_thread():
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.handle)
        threading.Thread(target=self._watch, args=(read_fd,), name="lds-launch-signals", daemon=True).start()
        self._installed = True

    def begin_launch(self, cleanup: Callable[[str], None]) -> None:
        """A run starts launching (each job of a Hydra multirun too): a signal from now until its training starts
        stops the process, after ``cleanup(reason)`` (called from the watcher thread). A signal noted since the
        previous job's training (between two jobs of a sweep) stops it now."""
        self._cleanups = [cleanup]
        self.launching = True
        if self._installed and self.received:
            self._stop_launch(self.received)

    def training_started(self) -> None:
        """From now on a signal is only noted (``RunCheckpoint`` calls this when it takes the signals over)."""
        self.launching = False

    def handle(self, signum: int, frame: Any) -> None:
        """The Python-level handler (main thread): notes a signal after training; the watcher thread acts on one
        before it."""
        if self.launching or self.received:
            return
        self.received = signum
        os.write(2, f"\nlds-train: received {signal.Signals(signum).name} after the last step: finishing the final "
                    "checkpoint, then stopping.\n".encode())

    def _watch(self, read_fd: int) -> None:
        while True:
            for signum in os.read(read_fd, 64):
                if self.launching and signum in EXIT_CODES:
                    self._stop_launch(signum)

    def _stop_launch(self, signum: int) -> None:
        reason = f"stopped by {signal.Signals(signum).name} before training started"
        kill_children()
        for cleanup in self._cleanups:
            try:
                cleanup(reason)
            except Exception:  # noqa: BLE001 - exiting anyway; a clean-up that fails must not leave a traceback
                pass
        if is_launcher():
            sys.stdout.flush()
            os.write(2, f"\nlds-train: {reason}; nothing was saved.\n".encode())
        os._exit(exit_code(signum) if is_launcher() else 0)


OUTSIDE_TRAINING = OutsideTraining()
