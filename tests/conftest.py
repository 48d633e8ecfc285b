"""Suite-wide isolation: every test starts from the same environment and without a process group.

``make test`` runs the files on two pytest-xdist workers (``--dist loadfile``: a file's tests, and its module
fixtures, stay on one worker); the longest files start first (:data:`LONGEST_FIRST`), so that the two workers finish
together instead of one running a long file alone at the end.

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

# The files taking a minute or about, longest first (`pytest --durations=0` on one worker; most of their time is
# spent waiting on ranks, restarts and the SLURM scheduler, which a second worker fills).
LONGEST_FIRST = ("elastic/controller/test_slurm.py", "test_examples.py", "parallel/test_pipeline_compose.py",
                 "planning/test_depth.py", "elastic/test_torchrun.py", "app/test_signals.py", "hpo/test_sweeper.py",
                 "parallel/test_fsdp.py", "planning/test_cache.py", "planning/test_against_real_runs.py",
                 "parallel/test_pipeline.py", "parallel/test_pipeline_strategy.py", "planning/test_lds_plan.py")
TESTS = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of :data:`LONGEST_FIRST` first, in its order; the others after, in their own order."""
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.relative_to(TESTS).as_posix(), len(rank))
               if item.path.is_relative_to(TESTS) else len(rank))  # a file given from elsewhere: after them


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
