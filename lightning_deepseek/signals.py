"""SIGTERM and SIGINT outside ``lds-train``'s training loop: while the run launches, and after its last step.

Inside the loop ``RunCheckpoint`` (``checkpointing.py``) owns both signals: the ranks agree at a step boundary,
save, and stop. ``lds-train`` installs ``OUTSIDE_TRAINING``'s handler first thing (standard library only, so that
it is in place before torch and Lightning are imported), and ``RunCheckpoint`` restores it when training ends:

- Before training starts there is nothing to save: the signal stops the launch at once, ``LaunchInterrupted`` is
  raised wherever the main thread is (importing torch, building the model, starting the ranks, the sanity
  check). ``lds-train`` stops the ranks it started, removes the run folder Hydra named (as after a configuration
  error) and exits 143 (SIGTERM) or 130 (SIGINT), without a traceback. A rank that Lightning started exits 0:
  Lightning's launcher takes a child's non-zero exit for a crash and SIGKILLs the whole job, the launcher included.
- After the last step the final checkpoint is being written: the signal is only noted; the save and teardown
  finish, and ``lds-train`` then exits 143 or 130 rather than 0, so that a scheduler sees the run was stopped.
"""

from __future__ import annotations

import os
import signal
from typing import Any

EXIT_CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}  # 128 + signal number, as a shell reports them


def exit_code(signum: int) -> int:
    """The exit code of a run stopped by ``signum``."""
    return EXIT_CODES.get(signal.Signals(signum), 128 + signum)


class LaunchInterrupted(BaseException):  # noqa: N818 - like KeyboardInterrupt, not an error of the program
    """SIGTERM or SIGINT before training started (a ``BaseException``: no ``except Exception`` swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} before training started")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return exit_code(self.signum)


class OutsideTraining:
    """The SIGTERM/SIGINT handler of an ``lds-train`` process while no training loop runs.

    Attributes:
        received: the first signal received outside the loop (0: none).
        launching: whether training has yet to start (then a signal raises ``LaunchInterrupted``).
    """

    def __init__(self) -> None:
        self.received = 0
        self.launching = True

    def install(self) -> None:
        """Handle SIGTERM and SIGINT in this process from now on (call from the main thread)."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.handle)

    def training_started(self) -> None:
        """From now on a signal is only noted (``RunCheckpoint`` calls this when it takes the signals over)."""
        self.launching = False

    def handle(self, signum: int, frame: Any) -> None:
        if self.received:
            return  # already stopping: a second signal must not interrupt the clean-up
        self.received = signum
        if self.launching:
            raise LaunchInterrupted(signum)
        os.write(2, f"\nlds-train: received {signal.Signals(signum).name} after the last step: finishing the final "
                    "checkpoint, then stopping.\n".encode())


OUTSIDE_TRAINING = OutsideTraining()
