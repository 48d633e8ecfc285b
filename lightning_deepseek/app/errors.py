"""The user-error contract of the suite's programs (``lds-train``, ``lds-sample``, the ``lds_optuna`` sweeper).

A bad setting ends in one paragraph on stderr, prefixed ``<program>: error: ``, and exit code 2, so that callers
(the sweeper, batch scripts) tell it from a crash; ``LDS_DEBUG=1`` re-raises instead to show the traceback.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from hydra.errors import InstantiationException

USER_ERROR_EXIT = 2  # the exit code of a bad setting (the sweeper tells these from crashes)
USER_ERROR_PREFIX = "lds-train: error: "  # starts lds-train's one-paragraph message on stderr
_PLAIN_USER_ERRORS = (ValueError, TypeError, KeyError, FileNotFoundError, InstantiationException)


def user_errors() -> tuple[type[Exception], ...]:
    """The exception types that mean a bad setting: ``ValueError``, ``TypeError``, ``KeyError``,
    ``FileNotFoundError``, Hydra's ``InstantiationException`` and, once Lightning is loaded, its
    ``MisconfigurationException`` (this module stays free of Lightning: ``lds-train`` checks its configuration
    before importing it, and nothing raises Lightning's exception before then)."""
    lightning_errors = sys.modules.get("lightning.fabric.utilities.exceptions")
    if lightning_errors is None:
        return _PLAIN_USER_ERRORS
    return (*_PLAIN_USER_ERRORS, lightning_errors.MisconfigurationException)


def __getattr__(name: str) -> Any:
    if name == "USER_ERRORS":  # the former constant: the tuple as of now
        return user_errors()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class ConfigError(ValueError):
    """A setting has a bad value; the message names the setting, the value and the fix."""


def exit_on_user_error(exc: BaseException, prefix: str = USER_ERROR_PREFIX) -> NoReturn:
    """Print one paragraph for a user error and exit 2 (``LDS_DEBUG=1`` re-raises instead)."""
    if os.environ.get("LDS_DEBUG"):
        raise exc
    cause = exc
    while isinstance(cause, InstantiationException) and cause.__cause__ is not None:
        cause = cause.__cause__
    message = " ".join(str(cause).split()) or type(cause).__name__
    print(f"{prefix}{message}\n(set LDS_DEBUG=1 for the full traceback)", file=sys.stderr, flush=True)
    _log_to_files(f"{prefix}{message}")
    sys.exit(USER_ERROR_EXIT)


def _log_to_files(message: str) -> None:
    """Also put the error in the run folder's log (Hydra's ``<job>.log``), which sweeps and batch jobs keep; the
    console already has it."""
    record = logging.LogRecord("lightning_deepseek", logging.ERROR, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def user_errors_exit(prefix: str = USER_ERROR_PREFIX) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: a user error raised by the wrapped function becomes one paragraph and exit 2."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except user_errors() as exc:
                exit_on_user_error(exc, prefix)

        wrapped.__name__ = fn.__name__
        wrapped.__doc__ = fn.__doc__
        return wrapped

    return decorate
