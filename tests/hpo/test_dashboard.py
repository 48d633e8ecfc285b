"""A sweep's study in the real optuna-dashboard: its HTTP API, and the page rendered by headless Chromium.

The server is started with the command the sweep prints (``dashboard_command``), on a free loopback port; every
wait is bounded and the server is killed at the end. Chromium is Debian's package (``.ci/chromium.sh`` installs
it in CI); without it the rendering test skips with the reason.
"""

from __future__ import annotations

import json
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lightning_deepseek.hpo import dashboard_command, search

BIN = Path(sys.executable).parent
START_TIMEOUT_S = 90


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A finished search's sweep folder, served by optuna-dashboard started with the printed command."""
    if shutil.which("optuna-dashboard", path=str(BIN)) is None:
        pytest.skip("optuna-dashboard is not installed (pip install -e '.[dev]')")
    out = tmp_path_factory.mktemp("sweep")
    search(lambda trial, params: (params["x"] - 2) ** 2 + params["y"], {"x": "interval(-10, 10)", "y": "range(0, 3)"},
           n_trials=6, output_dir=out, sampler={"_target_": "optuna.samplers.RandomSampler", "seed": 0})
    command = shlex.split(dashboard_command(str(out / "optuna.journal")).split("  (")[0])
    port = _free_port()
    server = subprocess.Popen([str(BIN / command[0]), *command[1:], "--host", "127.0.0.1", "--port", str(port),
                               "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                _get(f"{url}/api/studies")
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    server.kill()
                    pytest.fail(f"optuna-dashboard did not answer on {url} within {START_TIMEOUT_S}s: "
                                f"{server.communicate(timeout=10)[0][-2000:]}")
                time.sleep(0.5)
        yield {"url": url, "out": out}
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)


def test_dashboard_serves_the_sweeps_study_over_its_http_api(dashboard: dict[str, Any]) -> None:
    (study,) = _get(f"{dashboard['url']}/api/studies")["study_summaries"]
    assert study["study_name"] == "lds" and study["directions"] == ["minimize"]
    detail = _get(f"{dashboard['url']}/api/studies/{study['study_id']}")
    assert [t["state"] for t in detail["trials"]] == ["Complete"] * 6
    best = min(detail["trials"], key=lambda t: t["values"][0])
    report = (dashboard["out"] / "best_params.yaml").read_text()
    assert f"best_trial: {best['number']}" in report  # the dashboard and the report agree


def test_dashboard_page_renders_the_study_in_headless_chromium(dashboard: dict[str, Any], tmp_path: Path) -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed: run `bash .ci/chromium.sh` (CI does)")
    # --no-sandbox: Chromium refuses to run as root with its sandbox (CI containers run as root).
    page = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=15000", "--dump-dom",
         f"{dashboard['url']}/dashboard/studies/0"], capture_output=True, text=True, timeout=180)
    assert page.returncode == 0, page.stderr[-2000:]
    assert "lds (id=0)" in page.stdout  # the study's title, rendered by the dashboard's JavaScript
