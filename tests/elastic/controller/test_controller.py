"""ElasticController: decisions from report files, applied through a backend; lds-elastic's bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_deepseek.elastic import write_report
from lightning_deepseek.elastic.controller import ElasticController, JobFailed, main
from lightning_deepseek.elastic.controller.backend import Backend, JobSpec
from lightning_deepseek.elastic.controller.policy import ScalingPolicy


class InMemoryBackend(Backend):
    """A backend whose nodes are counters: the controller's side of the interface, without processes."""

    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}
        self.calls: list[tuple[str, int]] = []

    def size(self, job: JobSpec) -> int:
        return self.sizes.get(job.name, 0)

    def scale(self, job: JobSpec, num_workers: int) -> None:
        self.calls.append((job.name, num_workers))
        self.sizes[job.name] = num_workers

    def alive(self, job: JobSpec) -> bool:
        return self.sizes.get(job.name, 0) > 0

    def stop(self, job: JobSpec) -> None:
        self.calls.append((job.name, 0))
        self.sizes[job.name] = 0


def _job(tmp_path: Path, name: str, **kwargs) -> JobSpec:
    return JobSpec(name, ["train.py"], min_workers=1, max_workers=4, run_dir=tmp_path / name, **kwargs)


def test_idle_workers_are_shared_then_a_lagging_job_takes_them_from_a_flexible_one(tmp_path: Path) -> None:
    lagging = _job(tmp_path, "lagging", target_samples_per_s=100.0)
    flexible = _job(tmp_path, "flexible")
    backend = InMemoryBackend()
    controller = ElasticController(backend, ScalingPolicy(pool_size=5, cooldown_s=0.0), [lagging, flexible])
    assert controller.step() == {"lagging": 3, "flexible": 2}  # both start, idle workers shared
    lagging.run_dir.mkdir(parents=True)
    write_report(lagging.report_file, "progress", step=10, world_size=1, samples_per_s=20.0, max_steps=100)
    assert controller.step() == {"lagging": 4, "flexible": 1}


def test_a_resize_holds_its_job_until_it_trains_at_the_new_size_then_the_cooldown_runs(tmp_path: Path) -> None:
    # On a cluster manager a resize takes tens of seconds (queue, start-up): counted from the decision, a short
    # cooldown undid grows before the new node trained, and the job never trained again.
    job = _job(tmp_path, "a")
    controller = ElasticController(InMemoryBackend(), ScalingPolicy(pool_size=4, cooldown_s=60.0), [job])
    assert controller.step() == {"a": 4}
    job.run_dir.mkdir(parents=True)
    controller.last_resize["a"] -= 100.0  # the decision was long ago, but the job has not trained at 4 yet
    write_report(job.report_file, "progress", step=3, world_size=1, samples_per_s=10.0, max_steps=100)
    assert controller.status(job).since_resize_s == 0.0
    write_report(job.report_file, "progress", step=4, world_size=4, samples_per_s=40.0, max_steps=100)
    assert 0.0 <= controller.status(job).since_resize_s < 60.0  # training at 4 now: the cooldown starts


def test_fatal_report_stops_every_job_with_its_message(tmp_path: Path) -> None:
    job = _job(tmp_path, "a")
    backend = InMemoryBackend()
    controller = ElasticController(backend, ScalingPolicy(pool_size=2), [job], interval_s=0.01)
    job.run_dir.mkdir(parents=True)
    write_report(job.report_file, "fatal", step=0, world_size=1, message="checkpoint of another model")
    with pytest.raises(JobFailed, match="checkpoint of another model"):
        controller.run(timeout_s=5)
    assert backend.calls[-1] == ("a", 0)


def test_job_that_dies_without_finishing_is_reported(tmp_path: Path) -> None:
    job = _job(tmp_path, "a")
    backend = InMemoryBackend()
    controller = ElasticController(backend, ScalingPolicy(pool_size=2), [job], interval_s=0.01)
    controller.step()
    backend.sizes["a"] = 0  # every agent exited, no "done" report
    with pytest.raises(JobFailed, match="stopped without finishing"):
        controller.step()


def test_lds_elastic_refuses_min_workers_above_max_workers(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--min-workers", "3", "--max-workers", "2", "--", "train.py"])
    assert exit_info.value.code == 2
    assert "min_workers=3 > max_workers=2" in capsys.readouterr().err


def test_controller_program_imports_neither_torch_nor_lightning() -> None:
    # It only reads report files and starts agents: the training stack stays in the training processes.
    code = ("import sys, lightning_deepseek.elastic.controller\n"
            "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout
