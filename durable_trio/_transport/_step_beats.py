"""Step heartbeats, worker side: what a running step handler calls to say it is alive.

Each claim of a step task gets a :class:`StepBeats` (a context variable while its handler
runs). :meth:`StepBeats.heartbeat` is synchronous: it keeps the latest details and wakes the
claim's sender, a task started on the first beat; the sender pushes one ``StepHeartbeat`` at
once, then at most one per interval, each carrying the latest details (beats in between are
coalesced). The sender stops when the handler ends; a beat not pushed yet is dropped (the
result follows). Only beats the handler makes are sent: a step that never beats sends none.
"""

from __future__ import annotations

import contextvars
import time
from typing import TYPE_CHECKING

import trio

from .._errors import BrokerError, DurableTrioError
from .._json_values import check_json
from .._wire import JSONValue, RemoteTask, StepHeartbeat

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

__all__ = ["CURRENT_BEATS", "StepBeats", "beat_interval", "current_beats"]

#: The beats of the step handler running in the current task (set by the step server).
CURRENT_BEATS: contextvars.ContextVar[StepBeats] = contextvars.ContextVar("durable_trio_beats")


def current_beats() -> StepBeats | None:
    """The beats of the step handler running in this task (``None``: not in a step handler)."""
    return CURRENT_BEATS.get(None)


def beat_interval(task: RemoteTask, interval: float) -> float:
    """The push interval of ``task``'s beats: ``interval``, but at most a third of the step's
    ``heartbeat_timeout`` so a coalesced beat never arrives late."""
    timeout = task.heartbeat_timeout
    return interval if timeout is None else min(interval, timeout / 3)


class StepBeats:
    """The beats of one claim of one step task (see the module docstring)."""

    __slots__ = (
        "_closed",
        "_details",
        "_interval",
        "_pending",
        "_report",
        "_scope",
        "_send",
        "_spawn",
        "_started",
        "_wake",
        "beats",
        "sent",
        "task",
        "worker",
    )

    def __init__(
        self,
        task: RemoteTask,
        send: Callable[[StepHeartbeat], Awaitable[None]],
        spawn: Callable[[Callable[[], Awaitable[None]]], None],
        interval: float,
        report: Callable[[BaseException], None],
        worker: str | None = None,
    ) -> None:
        self.task = task
        self.worker = worker
        """The instance id of the worker running the task, sent with each beat."""
        self._send = send
        self._spawn = spawn
        self._interval = interval
        self._report = report
        self._details: JSONValue = None
        self._pending = False
        self._started = False
        self._closed = False
        self._wake: trio.Event | None = None  # made with the sender, on the first beat
        self._scope: trio.CancelScope | None = None
        self.beats = 0
        """Beats the handler made."""
        self.sent = 0
        """Beats pushed to the broker."""

    def heartbeat(self, details: JSONValue = None) -> None:
        """Say the step is alive, with optional JSON ``details`` (the latest ones win).

        Raises:
            PayloadError: ``details`` is not a JSON value.
        """
        check_json(details, "heartbeat details")
        self.beats += 1
        if self._closed:
            return
        self._details = details
        self._pending = True
        if not self._started:
            self._started = True
            self._wake = trio.Event()
            self._scope = trio.CancelScope()
            self._spawn(self._send_forever)
        elif self._wake is not None:
            self._wake.set()

    def close(self) -> None:
        """The handler ended: stop the sender (a beat not pushed yet is dropped)."""
        self._closed = True
        if self._scope is not None:
            self._scope.cancel()

    def enter(self) -> contextvars.Token[StepBeats]:
        """Make these the beats of the running task (undo with :meth:`leave`)."""
        return CURRENT_BEATS.set(self)

    @staticmethod
    def leave(token: contextvars.Token[StepBeats]) -> None:
        CURRENT_BEATS.reset(token)

    async def _send_forever(self) -> None:
        task = self.task
        assert self._scope is not None
        with self._scope:
            while True:
                if not self._pending:
                    assert self._wake is not None
                    await self._wake.wait()
                self._wake = trio.Event()  # what is set from here on is a beat not sent yet
                self._pending = False
                beat = StepHeartbeat(
                    task.run_id, task.step_id, task.attempt, time.time(), self._details,
                    self.worker,
                )
                try:
                    await self._send(beat)
                    self.sent += 1
                except (BrokerError, DurableTrioError) as exc:
                    self._report(exc)  # best effort: the next beat tries again
                await trio.sleep(self._interval)
