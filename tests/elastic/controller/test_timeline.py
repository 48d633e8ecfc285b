"""What lds-elastic shows a person: each resize printed with its reason, and workers.png in the run folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_deepseek.elastic import write_report
from lightning_deepseek.elastic.controller import ElasticController, JobSpec, ScalingPolicy
from lightning_deepseek.elastic.controller.policy import JobStatus
from lightning_deepseek.elastic.controller.timeline import resize_reason
from tests.elastic.controller.test_controller import InMemoryBackend


def test_each_resize_is_printed_with_its_reason(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    lagging = JobSpec("lagging", ["train.py"], 1, 4, run_dir=tmp_path / "lagging", target_samples_per_s=100.0)
    flexible = JobSpec("flexible", ["train.py"], 1, 4, run_dir=tmp_path / "flexible")
    controller = ElasticController(InMemoryBackend(), ScalingPolicy(pool_size=5, cooldown_s=0.0), [lagging, flexible])
    controller.step()
    lagging.run_dir.mkdir(parents=True)
    write_report(lagging.report_file, "progress", step=10, world_size=1, samples_per_s=20.0, max_steps=100)
    controller.step()
    printed = capsys.readouterr().out.splitlines()
    assert printed == [
        "lds-elastic: job 'lagging': 0 -> 3 workers: start at min_workers=1, grown to 3 from idle workers (pool 5)",
        "lds-elastic: job 'flexible': 0 -> 2 workers: start at min_workers=1, grown to 2 from idle workers (pool 5)",
        "lds-elastic: job 'lagging': 3 -> 4 workers: lagging: 20.0 samples/s below its target 100",
        "lds-elastic: job 'flexible': 2 -> 1 workers: workers needed by lagging",
    ]


def test_a_job_ahead_of_its_deadline_gives_a_worker_back_and_says_so() -> None:
    job = JobStatus("a", 1, 4, workers=3, samples_per_s=30.0, fraction_done=0.5, elapsed_s=100.0, deadline_s=1000.0)
    policy = ScalingPolicy(pool_size=4, cooldown_s=0.0)
    assert policy.decide([job]) == {"a": 2}
    assert resize_reason(policy, job, 2, [job], {"a": 2}) == \
        "ahead: would still meet its deadline 1000 s with one worker fewer"


def test_run_folder_gets_a_plot_of_workers_per_job(tmp_path: Path) -> None:
    job = JobSpec("a", ["train.py"], 1, 2, run_dir=tmp_path / "run")
    controller = ElasticController(InMemoryBackend(), ScalingPolicy(pool_size=2), [job], interval_s=0.01)
    job.run_dir.mkdir(parents=True)
    write_report(job.report_file, "done", step=5, world_size=2)
    controller.run(timeout_s=5)
    assert (job.run_dir / "workers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
