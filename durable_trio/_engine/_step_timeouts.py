"""Per-step timeouts: what ``@app.step(..., timeout=, schedule_to_start_timeout=)`` and
``ctx.step(..., timeout=, schedule_to_start_timeout=)`` set, and where a checkpoint keeps them.

A step's timeouts are stored inside its checkpoint's ``retry`` JSON, under ``"timeouts"``
(``{"startToClose": s, "scheduleToStart": s}``, only the ones set): the stored retry policy is
already what any engine reads to apply a result or re-dispatch an attempt, so every engine
and every run store knows the timeouts of an attempt it takes over, with no new column
(docs/decisions.md, "Step timeouts").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from .._arguments import check_seconds
from .._attrs_shared import shared_eq, shared_hash, shared_repr
from .._errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Iterable

    from ._records import StepRecord

__all__ = [
    "StepTimeouts",
    "UnknownStep",
    "check_step_known",
    "command_timeouts",
    "with_timeouts",
]

_KEY = "timeouts"


class UnknownStep(ConfigError):
    """``ctx.step`` named a step the app does not register (refused at once, where the
    engine's app registers its steps)."""


def _seconds(value: Any, call: str, argument: str) -> float | None:
    if value is None:
        return None
    return check_seconds(value, call, argument, positive=True)


@attrs.frozen(repr=False, eq=False)
class StepTimeouts:
    """A step's timeouts (``None``: not set)."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    timeout: float | None = None
    """Start-to-close: seconds one attempt's handler may run (the worker cancels it then)."""
    schedule_to_start: float | None = None
    """Seconds an attempt may wait on its queue before a worker takes it (else it fails)."""

    @classmethod
    def given(cls, call: str, timeout: Any, schedule_to_start_timeout: Any) -> StepTimeouts:
        """The timeouts passed to ``call``, checked.

        Raises:
            TypeError: one is not a number.
            ConfigError: one is not a positive, finite number of seconds.
        """
        return cls(
            _seconds(timeout, call, "timeout"),
            _seconds(schedule_to_start_timeout, call, "schedule_to_start_timeout"),
        )

    def over(self, base: StepTimeouts | None) -> StepTimeouts:
        """These timeouts, each one not set taken from ``base`` (a step's definition)."""
        if base is None:
            return self
        return StepTimeouts(
            self.timeout if self.timeout is not None else base.timeout,
            self.schedule_to_start
            if self.schedule_to_start is not None
            else base.schedule_to_start,
        )

    @classmethod
    def of(cls, step: Any) -> StepTimeouts | None:
        """A step definition's timeouts (its ``timeouts``; ``None`` for no definition)."""
        timeouts = getattr(step, "timeouts", None)
        return timeouts if isinstance(timeouts, StepTimeouts) else None

    @classmethod
    def of_record(cls, record: StepRecord) -> StepTimeouts:
        """The timeouts a checkpoint stores (none, for one written before they existed or
        whose stored value cannot be read)."""
        retry = record.retry
        stored = retry.get(_KEY) if isinstance(retry, dict) else None
        if not isinstance(stored, dict):
            return cls()
        return _read(stored)

    def to_json(self) -> dict[str, float]:
        """The timeouts set, as a checkpoint stores them."""
        out: dict[str, float] = {}
        if self.timeout is not None:
            out["startToClose"] = self.timeout
        if self.schedule_to_start is not None:
            out["scheduleToStart"] = self.schedule_to_start
        return out


def command_timeouts(command: dict[str, Any]) -> StepTimeouts:
    """The timeouts of a remote workflow's ``step`` command (none, when it names none or
    they cannot be read)."""
    stored = command.get(_KEY)
    if not isinstance(stored, dict):
        return StepTimeouts()
    return _read(stored)


def _read(stored: dict[str, Any]) -> StepTimeouts:
    def read(name: str) -> float | None:
        value = stored.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            return float(value)
        return None

    return StepTimeouts(read("startToClose"), read("scheduleToStart"))


def with_timeouts(retry: dict[str, Any], timeouts: StepTimeouts) -> dict[str, Any]:
    """``retry`` (a stored retry policy) with ``timeouts`` in it (unchanged when none set)."""
    stored = timeouts.to_json()
    return {**retry, _KEY: stored} if stored else retry


def check_step_known(name: str, app_name: str, steps: Iterable[str]) -> None:
    """Refuse step ``name`` when ``steps`` (the app's registered steps) is not empty and does
    not hold it: no worker of this app could serve it, and it would wait forever.

    Raises:
        UnknownStep: it is not one of them.
    """
    known = sorted(steps)
    if not known or name in known:
        return
    import difflib  # (only for the error: an engine's import does not pay for it)

    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise UnknownStep(
        f"ctx.step: app {app_name!r} registers no step named {name!r} (its steps: "
        f"{', '.join(map(repr, known))}){hint}"
    )
