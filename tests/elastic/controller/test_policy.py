"""ScalingPolicy decisions on hand-made job states."""

from __future__ import annotations

import pytest

from lightning_deepseek.elastic.controller.policy import JobStatus, ScalingPolicy


def job(name: str, workers: int, **kwargs) -> JobStatus:
    kwargs.setdefault("min_workers", 1)
    kwargs.setdefault("max_workers", 4)
    return JobStatus(name=name, workers=workers, **kwargs)


def test_min_workers_above_max_workers_is_refused() -> None:
    with pytest.raises(ValueError, match=r"min_workers \(3\) <= max_workers \(2\) \(lds-elastic: --min-workers"):
        JobStatus(name="a", min_workers=3, max_workers=2)


def test_lagging_job_grows_first_and_ahead_job_gives_one_back() -> None:
    lagging = job("lag", 2, samples_per_s=50.0, target_samples_per_s=100.0)
    ahead = job("ahead", 3, samples_per_s=300.0, target_samples_per_s=100.0)
    policy = ScalingPolicy(pool_size=6)
    assert policy.classify(lagging) == "lagging" and policy.classify(ahead) == "ahead"
    assert policy.decide([lagging, ahead]) == {"lag": 4, "ahead": 2}  # the free worker and the returned one


def test_deadline_decides_lagging_and_ahead() -> None:
    policy = ScalingPolicy(pool_size=8)
    late = job("late", 2, samples_per_s=10.0, fraction_done=0.25, elapsed_s=100.0, deadline_s=200.0)
    early = job("early", 4, samples_per_s=10.0, fraction_done=0.5, elapsed_s=100.0, deadline_s=400.0)
    assert policy.classify(late) == "lagging"  # projected finish 400 s > 200 s
    assert policy.classify(early) == "ahead"  # with 3 workers: 100 + 133 s <= 360 s
    assert policy.decide([late, early]) == {"late": 4, "early": 3}


def test_waiting_and_lagging_jobs_take_workers_from_flexible_jobs_but_never_from_lagging_ones() -> None:
    policy = ScalingPolicy(pool_size=6)
    flexible = job("flex", 4, samples_per_s=100.0)
    lagging = job("lag", 2, samples_per_s=10.0, target_samples_per_s=100.0)
    waiting = job("new", 0, min_workers=2)
    assert policy.decide([flexible, lagging, waiting]) == {"flex": 1, "lag": 3, "new": 2}


def test_waiting_job_that_cannot_start_leaves_the_others_alone() -> None:
    policy = ScalingPolicy(pool_size=4)
    lagging = job("lag", 4, samples_per_s=10.0, target_samples_per_s=100.0)
    assert policy.decide([lagging, job("new", 0, min_workers=2)]) == {"lag": 4, "new": 0}


def test_idle_workers_go_to_flexible_jobs_within_their_maximum() -> None:
    policy = ScalingPolicy(pool_size=10)
    assert policy.decide([job("a", 1, max_workers=3), job("b", 1, max_workers=8)]) == {"a": 3, "b": 7}


def test_cooldown_and_non_finite_loss_block_growth() -> None:
    policy = ScalingPolicy(pool_size=8, cooldown_s=30.0)
    recent = job("recent", 1, since_resize_s=5.0, samples_per_s=1.0, target_samples_per_s=100.0)
    diverged = job("diverged", 1, healthy=False, samples_per_s=1.0, target_samples_per_s=100.0)
    assert policy.decide([recent, diverged]) == {"recent": 1, "diverged": 1}
