"""A step handler run within its start-to-close timeout (``RemoteTask.timeout``).

The worker cancels the handler's scope when the timeout expires (its own clock, from the
moment the handler starts) and answers the attempt with :class:`StepTimedOut`: a retryable
failure, so the engine retries it per the step's retry policy (docs/engine.md, "Step
timeouts").

A cancel lands only at a checkpoint. A handler that blocks the event loop (a blocking call in
an ``async def``) past its deadline and then returns never meets one: it returns a value
after its timeout. That attempt is answered :class:`StepTimedOut` too, its message naming the
blocking, and its value is dropped: the timeout bounds the attempt whichever way it overran,
as the engine's own guard would have judged it (docs/decisions.md, "A step that blocks the
event loop past its timeout").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from .._errors import DurableTrioError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from .._wire import JSONValue, RemoteTask

__all__ = ["STEP_TIMED_OUT", "StepBlockedTheLoop", "StepTimedOut", "run_within_timeout"]

#: The error code of an attempt that ran past its start-to-close timeout.
STEP_TIMED_OUT = "StepTimedOut"


class StepTimedOut(DurableTrioError):
    """A step's handler ran past its start-to-close ``timeout`` and was cancelled.

    Retryable: the engine retries the step per its retry policy.
    """

    retryable = True
    code = STEP_TIMED_OUT


class StepBlockedTheLoop(StepTimedOut):
    """A step's handler returned past its timeout without reaching an ``await``: it blocked
    the event loop. Retried as any timeout, but always reported (at ERROR, through the error
    hook), even on an attempt the engine retries: it is a defect in the step's code."""

    always_reported = True


async def run_within_timeout(
    handler: Callable[[RemoteTask], Awaitable[JSONValue]], task: RemoteTask
) -> JSONValue:
    """``await handler(task)``, cancelled after ``task.timeout`` seconds (if set).

    Raises:
        StepTimedOut: the handler did not return within ``task.timeout`` (cancelled, or it
            returned late: it blocked the event loop past its deadline).
    """
    timeout = task.timeout
    if timeout is None:
        return await handler(task)
    started = trio.current_time()
    with trio.move_on_after(timeout) as scope:
        output = await handler(task)
        now = trio.current_time()
        if now <= scope.deadline:
            return output
        # Returned past its deadline, its cancel never delivered: no checkpoint since the
        # deadline, so the handler held the event loop (every other task of this worker, its
        # lease renewals and beats included) until it returned.
        raise StepBlockedTheLoop(
            f"step {task.name!r} (run {task.run_id}, step {task.step_id}, attempt "
            f"{task.attempt}) ran {now - started:.1f} s, past its timeout of {timeout:g} s, "
            f"and could not be cancelled: it blocked the event loop (no await reached for "
            f"{now - scope.deadline:.1f} s after its deadline; a blocking call in an async "
            "step: make it a plain def, run in a thread, or call trio.to_thread.run_sync); "
            "its result is dropped"
        )
    assert scope.cancelled_caught
    raise StepTimedOut(
        f"step {task.name!r} (run {task.run_id}, step {task.step_id}, attempt {task.attempt}) "
        f"did not finish within its timeout of {timeout:g} s: its handler was cancelled"
    )
