"""The console scripts' entry points. ``lds-train`` installs its signal handling (``signals.py``, standard library
only) before importing anything else, then runs ``cli.py``: a Ctrl-C even while Hydra loads ends the launch with
exit code 130 and no traceback. (``cli.train`` installs it too, for callers that import it directly.)

Once ``lds-train`` has finished (its checkpoints, summary and logs written, Lightning torn down, or an exit code
decided), the process ends without the interpreter's teardown of torch and Lightning: a second or more of CPU per
rank that a user, a sweep or a scheduler waiting for the exit would otherwise wait for."""

from __future__ import annotations

import atexit
import os
import sys
import threading

from lightning_deepseek.app.signals import OUTSIDE_TRAINING


def train() -> None:
    """``lds-train``."""
    OUTSIDE_TRAINING.install(sys.argv[1:])
    from lightning_deepseek.app import cli

    try:
        cli.train()
    except SystemExit as exc:
        _exit_now(exc.code)
    _exit_now(0)


def sample() -> None:
    """``lds-sample``."""
    from lightning_deepseek.app import cli

    cli.sample()


def _exit_now(code: int | str | None) -> None:
    """``sys.exit(code)`` less the interpreter's teardown: other threads joined, exit handlers run (log files
    closed), standard streams flushed, then ``os._exit``."""
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # what a normal exit runs before its teardown; no public API runs them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
