"""A step handler run within its start-to-close timeout (``RemoteTask.timeout``).

The worker cancels the handler's scope when the timeout expires (its own clock, from the
moment the handler starts) and answers the attempt with :class:`StepTimedOut`: a retryable
failure, so the engine retries it per the step's retry policy (docs/engine.md, "Step
timeouts").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from ._errors import DurableTrioError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ._wire import JSONValue, RemoteTask

__all__ = ["STEP_TIMED_OUT", "StepTimedOut", "run_within_timeout"]

#: The error code of an attempt that ran past its start-to-close timeout.
STEP_TIMED_OUT = "StepTimedOut"


class StepTimedOut(DurableTrioError):
    """A step's handler ran past its start-to-close ``timeout`` and was cancelled.

    Retryable: the engine retries the step per its retry policy.
    """

    retryable = True
    code = STEP_TIMED_OUT


async def run_within_timeout(
    handler: Callable[[RemoteTask], Awaitable[JSONValue]], task: RemoteTask
) -> JSONValue:
    """``await handler(task)``, cancelled after ``task.timeout`` seconds (if set).

    Raises:
        StepTimedOut: the handler did not return within ``task.timeout``.
    """
    timeout = task.timeout
    if timeout is None:
        return await handler(task)
    with trio.move_on_after(timeout) as scope:
        return await handler(task)
    assert scope.cancelled_caught
    raise StepTimedOut(
        f"step {task.name!r} (run {task.run_id}, step {task.step_id}, attempt {task.attempt}) "
        f"did not finish within its timeout of {timeout:g} s: its handler was cancelled"
    )
