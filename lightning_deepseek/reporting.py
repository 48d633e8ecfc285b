"""``Reporting``: how a component of this library reports a few figures at the end of a run.

A strategy, precision plugin or callback of the library defines ``summary()`` (rows of a run summary: a setting or
a measured figure per key) and, where it has any, ``events()`` (optimizer steps worth marking on a loss plot, such
as a precision stage change). Any application can collect them from ``trainer.strategy``, its precision plugin and
``trainer.callbacks`` at the end of ``fit``; ``lds-train``'s ``RunSummary`` does. ``summary()`` may run collectives:
call it on every rank.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Reporting(Protocol):
    """A component that adds rows to a run summary."""

    def summary(self) -> dict[str, object]:
        """Rows of the run summary (collective where the figures are gathered over ranks)."""
        ...


@runtime_checkable
class ReportingEvents(Protocol):
    """A component with optimizer steps worth marking on a loss plot."""

    def events(self) -> list[tuple[int, str]]:
        """``(optimizer step, label)`` pairs."""
        ...
