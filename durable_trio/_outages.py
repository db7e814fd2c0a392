"""Reports of a store or broker that fails, folded while it stays down.

Every run the engine drives retries its own call (``EngineServices.guard``), and every job a
worker finishes retries its finalize (``JobRunner``); each failed try was reported through
``on_error``: with 500 runs (or jobs) in flight, an outage of a minute logged thousands of
lines saying the same thing. :class:`OutageReports` lets the first
``PER_WINDOW`` failures of one kind of call (``"checkpointing"``, ``"reading"``, ...) through
in each window of ``WINDOW`` seconds and counts the rest; the next report of that kind says how
many were not reported. When the calls succeed again, one line says so at WARNING, with the
count. Nothing is dropped silently: every failure not reported is counted (:attr:`folded`;
the engine's ``reports_folded`` counter).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

import attrs
import trio

from ._logs import get_logger

if TYPE_CHECKING:
    import logging

__all__ = ["PER_WINDOW", "WINDOW", "OutageReports"]

#: seconds of one window
WINDOW: Final = 10.0
#: failures of one kind reported in full per window (the rest are counted)
PER_WINDOW: Final = 3


@attrs.define
class _Kind:
    since: float
    reported: int = 0
    folded: int = 0


class OutageReports:
    """Which failed calls to report, by kind; see the module's docs."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self._log = logger if logger is not None else get_logger("durable_trio")
        """Where the end of an outage is said (the engine's: ``durable_trio.engine``)."""
        self.down: dict[str, _Kind] = {}
        """The kinds failing now (empty, so false, while none is: a cheap test for the hot
        path before :meth:`succeeded`)."""
        self.folded = 0
        """Failures not reported one by one since it was made (counted into a later
        report instead)."""

    def failed(self, what: str) -> str | None:
        """A call of kind ``what`` failed: the text to add to its report (``""``: report it as
        it is), or ``None`` not to report it."""
        now = trio.current_time()
        kind = self.down.get(what)
        if kind is None or now - kind.since >= WINDOW:
            fresh = _Kind(since=now, reported=1)
            self.down[what] = fresh
            return "" if kind is None or not kind.folded else _summary(kind, now)
        if kind.reported < PER_WINDOW:
            kind.reported += 1
            return ""
        kind.folded += 1
        self.folded += 1
        return None

    def succeeded(self, what: str) -> None:
        """A call of kind ``what`` that had failed went through: the kind's outage is over
        (said once, at WARNING, when some of its failures were not reported)."""
        kind = self.down.pop(what, None)
        if kind is not None and kind.folded:
            now = trio.current_time()
            self._log.warning(
                "%s works again (%d failure(s) of it in the last %.0f s not reported one by one)",
                what, kind.folded, now - kind.since,
            )  # fmt: skip


def _summary(kind: _Kind, now: float) -> str:
    return (
        f" (and {kind.folded} more failure(s) of it in the {now - kind.since:.0f} s before,"
        " not reported one by one)"
    )
