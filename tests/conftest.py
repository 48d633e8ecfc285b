"""Suite-wide isolation: every test starts from the same environment and without a process group.

A ``Trainer(devices=2)`` run inside the pytest process makes pytest itself rank 0: Lightning writes
``MASTER_PORT``, ``LOCAL_RANK``, ``WORLD_SIZE``... into ``os.environ`` and leaves the process group (and its
listening store) alive. Without this fixture a later test's subprocess inherits that port and fails with
EADDRINUSE, or joins a world it does not belong to.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist


def pytest_sessionstart(session: pytest.Session) -> None:
    """A folder or the whole suite runs: start ``run_distributed``'s forkserver while the tests are collected."""
    if any(Path(arg.split("::")[0]).is_dir() for arg in session.config.args):
        from tests.helpers import start_forkserver

        start_forkserver()


@pytest.fixture(autouse=True)
def _isolate_distributed_state() -> Iterator[None]:
    environ = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)
