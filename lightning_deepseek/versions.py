"""The oldest dependency versions lightning-deepseek supports, checked where each dependency is first needed.

``MINIMUM`` repeats pyproject.toml's lower bounds (``tests/test_versions.py`` holds them equal). A version below one
is an ``ImportError`` of one line naming the package, the version found and the version needed: torch and Lightning
when ``lightning_deepseek`` is imported, Optuna by :mod:`lightning_deepseek.hpo`, Optuna and Hydra by the
``lds_optuna`` sweeper, torchao by the FP8 stage, transformers the first time a model built with it is planned. A
package that is not installed is left to its own import error. Cost: one metadata read per package and process.
Not checked: upper bounds (transformers ``<6`` is pip's to enforce), versions of transitive dependencies.
"""

from __future__ import annotations

import re
import sys
from functools import cache
from importlib import metadata

MINIMUM = {"torch": "2.11", "lightning": "2.5", "optuna": "4", "hydra-core": "1.3", "transformers": "5",
           "torchao": "0.18"}


def _release(version: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``; pre-releases and local tags count as their release."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in match.group().split(".")) if match else ()


@cache
def require(package: str) -> None:
    """Raise ``ImportError`` when the installed ``package`` (a key of ``MINIMUM``) is older than supported."""
    try:
        found = metadata.version(package)
    except metadata.PackageNotFoundError:
        return
    needed = MINIMUM[package]
    if _release(found) < _release(needed):
        raise ImportError(f"lightning-deepseek needs {package}>={needed}, found {package} {found}: "
                          f"pip install --upgrade '{package}>={needed}'")


def require_if_loaded(package: str, module: str) -> None:
    """:func:`require` for an optional ``package`` once its ``module`` has been imported (by the user's model)."""
    if module in sys.modules:
        require(package)
