"""The console scripts' entry points. ``lds-train`` installs its signal handling (``signals.py``, standard library
only) before importing anything else, then runs ``cli.py``: a Ctrl-C even while Hydra loads ends the launch with
exit code 130 and no traceback. (``cli.train`` installs it too, for callers that import it directly.)"""

from __future__ import annotations

import sys

from lightning_deepseek.app.signals import OUTSIDE_TRAINING


def train() -> None:
    """``lds-train``."""
    OUTSIDE_TRAINING.install(sys.argv[1:])
    from lightning_deepseek.app import cli

    cli.train()


def sample() -> None:
    """``lds-sample``."""
    from lightning_deepseek.app import cli

    cli.sample()
