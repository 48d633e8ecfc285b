"""Dependency versions: the floors checked at import are pyproject.toml's, and one below its floor is one line
naming the package, the version found and the version needed."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from lightning_deepseek import versions

ROOT = Path(__file__).resolve().parents[1]


def _declared_floors() -> dict[str, str]:
    tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11 reads pyproject.toml")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = [*project["dependencies"], *(s for extra in project["optional-dependencies"].values() for s in extra)]
    floors = {}
    for spec in specs:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)(,<[0-9.]+)?", spec.replace(" ", ""))
        if match:
            floors[match.group(1)] = match.group(2)
    return floors


def test_floors_are_pyprojects() -> None:
    declared = _declared_floors()
    assert {package: declared[package] for package in versions.MINIMUM} == versions.MINIMUM


@pytest.mark.parametrize(("found", "ok"), [("2.4.9", False), ("2.5.0", True), ("2.5.0rc1", True), ("3.0", True)])
def test_a_version_below_the_floor_is_one_line(monkeypatch: pytest.MonkeyPatch, found: str, ok: bool) -> None:
    monkeypatch.setattr(metadata, "version", lambda package: found)
    versions.require.cache_clear()
    try:
        if ok:
            versions.require("lightning")
        else:
            with pytest.raises(ImportError) as error:
                versions.require("lightning")
            assert str(error.value) == (f"lightning-deepseek needs lightning>=2.5, found lightning {found}: "
                                        "pip install --upgrade 'lightning>=2.5'")
    finally:
        versions.require.cache_clear()


def test_the_installed_versions_pass_at_import() -> None:
    """A fresh interpreter imports the package (the check runs there) with the versions of this environment."""
    result = subprocess.run([sys.executable, "-c", "import lightning_deepseek"], capture_output=True, text=True,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
