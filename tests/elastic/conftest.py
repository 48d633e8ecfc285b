"""The elastic end-to-end tests' shared reference: one uninterrupted single-process run of their job."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.elastic.audit import JOB_OPTIONS, ReferenceRun, script_args


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReferenceRun]:
    """The ``JOB_OPTIONS`` job trained without interruption, started at the first test that asks for it: the
    torchrun and SLURM tests resize the same job, so one run is the reference of both."""
    run_dir = tmp_path_factory.mktemp("reference")
    with open(run_dir / "log.txt", "w") as log_file:
        process = subprocess.Popen([sys.executable, *script_args(run_dir, **JOB_OPTIONS)], stdout=log_file,
                                   stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                   start_new_session=True)
    yield ReferenceRun(run_dir, process)
    if process.poll() is None:
        process.kill()
        process.wait()
