"""The ``two_ranks`` fixture: one 2-process gloo spawn runs every 2-rank scenario of these tests (process start
and imports dominate their cost on a small machine); each test then checks one scenario's result."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import run_distributed


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tests.parallel.test_two_ranks import two_rank_scenarios

    ckpt = tmp_path_factory.mktemp("hybrid") / "resume.ckpt"
    return run_distributed(two_rank_scenarios, 2, str(ckpt), timeout=280)[0]
