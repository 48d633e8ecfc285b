"""``run_distributed`` itself: ranks forked from the preloaded forkserver start as clean as spawned ones; a failing
rank fails the run with its traceback and output, and one that dies without a word fails it at once."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tests.helpers import run_distributed


def _inspect(rank: int, world_size: int) -> dict:
    server = os.getppid()  # the forkserver (run_distributed's ranks are its children)
    total = torch.tensor([rank + 1])
    dist.all_reduce(total)
    return {
        "server_threads": len(os.listdir(f"/proc/{server}/task")),
        "torch_threads": torch.get_num_threads(),
        "preloaded": "lightning.pytorch" in sys.modules,
        "marker": os.environ.get("LDS_TEST_MARKER"),
        "rank_env": os.environ["RANK"],
        "sum": int(total),
    }


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread counts from /proc")
def test_forkserver_is_clean(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LDS_TEST_MARKER", "set-after-the-server-started")  # the server may predate this test
    results = run_distributed(_inspect, 2)
    for rank, res in enumerate(results):
        assert res["server_threads"] == 1  # forking a multi-threaded process could deadlock the child
        assert res["torch_threads"] == 1
        assert res["preloaded"]
        assert res["marker"] == "set-after-the-server-started"  # the caller's environment, not the server's
        assert res["rank_env"] == str(rank)
        assert res["sum"] == 3  # a real collective over both ranks


def _fail_on_rank_one(rank: int, world_size: int) -> int:
    print(f"rank {rank} was here", flush=True)
    if rank == 1:
        raise ValueError("rank one fails")
    return rank


def test_a_failing_rank_fails_the_test_with_its_traceback_and_output() -> None:
    with pytest.raises(AssertionError, match="rank 1:(.|\n)*ValueError: rank one fails") as failure:
        run_distributed(_fail_on_rank_one, 2, timeout=60)
    assert "--- rank 1 output" in str(failure.value) and "rank 1 was here" in str(failure.value)


def _abort_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        print("rank 1 aborts", flush=True)
        os.abort()  # as glibc does on a corrupted heap: no traceback, no report
    return rank  # rank 0 reports: the run waits on rank 1 alone


def test_a_rank_that_dies_without_reporting_fails_the_run_at_once() -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError, match="rank 1 ended by signal SIGABRT without reporting") as failure:
        run_distributed(_abort_on_rank_one, 2, timeout=120)
    assert time.monotonic() - started < 60  # not the run's whole timeout
    assert "rank 1 aborts" in str(failure.value) and "Fatal Python error: Aborted" in str(failure.value)
    assert "_abort_on_rank_one" in str(failure.value)  # faulthandler: where the rank was when it died


def _talk(rank: int, world_size: int) -> int:
    print(f"noise from rank {rank}", flush=True)
    print(f"warning from rank {rank}", file=sys.stderr, flush=True)
    return rank


def test_ranks_output_stays_out_of_the_terminal(capfd: pytest.CaptureFixture[str]) -> None:
    assert run_distributed(_talk, 2) == [0, 1]
    out, err = capfd.readouterr()
    assert "noise from rank" not in out + err
