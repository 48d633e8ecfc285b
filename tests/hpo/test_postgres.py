"""Two ``lds_optuna`` sweepers, as two processes, share one study in a real PostgreSQL server.

The server is started by ``.ci/postgres.sh`` (``.ci/run`` calls it; this test calls it too when nothing
listens). If it cannot be started, the test is skipped with the reason.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from lightning_deepseek.hpo import StudyConfigError, open_storage
from tests.hpo.test_sweeper import sweep_cmd

ROOT = Path(__file__).resolve().parents[2]
URL = os.environ.get("LDS_PG_URL", f"postgresql://postgres@127.0.0.1:{os.environ.get('LDS_PG_PORT', '55432')}/lds_hpo")


@pytest.fixture(scope="module")
def postgres_url() -> str:
    try:
        open_storage(URL)
    except StudyConfigError:
        setup = subprocess.run(["bash", str(ROOT / ".ci" / "postgres.sh")], capture_output=True, text=True,
                               timeout=300)
        try:
            open_storage(URL)
        except StudyConfigError as exc:
            print(f"PostgreSQL not available: {exc}\n{setup.stdout}{setup.stderr}")
            pytest.skip(f"PostgreSQL server could not be started by .ci/postgres.sh: {setup.stdout.strip()} {exc}")
    return URL


def test_two_sweepers_share_one_study(postgres_url: str, tmp_path: Path) -> None:
    study_name = f"shared-{uuid.uuid4().hex[:8]}"
    procs = [
        subprocess.Popen(
            sweep_cmd(tmp_path / f"machine{i}", "hydra.sweeper.n_trials=4", f"hydra.sweeper.study_name={study_name}",
                      f"hydra.sweeper.storage={postgres_url}", "hydra.sweeper.sampler.seed=" + str(i),
                      "trainer.max_steps=4", "optim.learning_rate=tag(log, interval(1e-4, 1e-1))"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-3000:]
    study = optuna.load_study(study_name=study_name, storage=open_storage(postgres_url))
    done = [t for t in study.trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    # n_trials is study-wide: together they ran 4 (5 if both asked in the same instant for the last one).
    assert 4 <= len(done) <= 5 and len(study.trials) == len(done)
    owners = {t.user_attrs["lds_owner"]["pid"] for t in study.trials}
    assert owners == {proc.pid for proc in procs}  # both sweepers ran trials
    # Each sweeper's report lists the whole study, the other's trials included.
    for i in range(2):
        rows = (tmp_path / f"machine{i}" / "trials.csv").read_text().splitlines()[1:]
        mine = sum(t.user_attrs["lds_owner"]["pid"] == procs[i].pid for t in study.trials)
        assert len(rows) > mine
