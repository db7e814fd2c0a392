"""Step heartbeats, engine side: the last beat recorded on its step, and the
``heartbeat_timeout`` failover.

- A beat (``StepHeartbeat``, pushed by the worker running the step, see
  ``durable_trio._transport._step_beats``) is recorded on its checkpoint while the step is
  pending at the beat's attempt: ``StepRecord.heartbeat`` = ``{"attempt", "at", "sentAt",
  "details"?, "worker"?}``, ``at`` on the store clock when the engine received it, ``sentAt`` the
  worker's Unix time, ``worker`` the instance that sent it (when it says). A beat
  for another attempt, a settled step or an unknown one changes nothing (counted).
- A step declared with ``heartbeat_timeout=`` whose current attempt beat is watched: every
  ``heartbeat_check_interval`` the engine re-reads the checkpoints of the steps it waits on
  that have one, and an attempt whose last beat is older than ``heartbeat_timeout`` is failed
  (retryable, code ``heartbeat_timeout``) through result application, retried at once (no
  backoff) while attempts remain. A late result of the old attempt is then stale. The timer
  starts at the attempt's first beat: an attempt that never beat is left to the broker's
  stalled threshold (and a step's other timeouts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import trio

from .._errors import BrokerError
from .._periodic import fixed_rate
from .._wire import ControlMessage, StepError, StepResult, StepStatus
from ._records import Applied, StepKind, StepState

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from .._wire import StepHeartbeat
    from ._records import StepRecord
    from ._services import EngineServices

__all__ = [
    "HEARTBEAT_TIMEOUT",
    "last_beat_at",
    "record_beat",
    "watch_heartbeats",
]

#: The error code of an attempt failed over for want of beats.
HEARTBEAT_TIMEOUT = "heartbeat_timeout"


def last_beat_at(record: StepRecord) -> float | None:
    """Store-clock time of the last beat of ``record``'s current attempt (``None``: none)."""
    beat = record.heartbeat
    if isinstance(beat, dict) and beat.get("attempt") == record.attempt:
        at = beat.get("at")
        if isinstance(at, int | float):
            return float(at)
    return None


async def record_beat(services: EngineServices, beat: StepHeartbeat) -> None:
    """Record ``beat`` on its checkpoint (see the module docstring).

    Error handling:
        A store error propagates: the transport hands the beat back for redelivery.
    """
    store = services.store
    key = (beat.run_id, beat.step_id)
    if key in services.applying:  # a result of it is being applied: the beat is moot
        services.count("stale_heartbeats")
        return
    waiter = services.waiters.get(key)
    current = waiter.record if waiter is not None else None
    if (
        current is None
        or current.status is not StepState.PENDING
        or current.attempt != beat.attempt
    ):
        current = await store.get_step(beat.run_id, beat.step_id)
    if (
        current is None
        or current.kind is not StepKind.REMOTE
        or current.status is not StepState.PENDING
        or current.attempt != beat.attempt
    ):
        services.count("stale_heartbeats")
        return
    recorded: dict[str, Any] = {"attempt": beat.attempt, "at": store.now(), "sentAt": beat.at}
    if beat.details is not None:
        recorded["details"] = beat.details
    if beat.worker is not None:
        recorded["worker"] = beat.worker
    # A beat of this attempt proves its task went out, whatever the local copy says.
    following = attrs.evolve(current, heartbeat=recorded, dispatched=True)
    verdict = await store.update_step(following, expect_attempt=beat.attempt)
    if verdict is not Applied.APPLIED:
        services.count("stale_heartbeats")
        return
    services.count("heartbeats_recorded")
    waiter = services.waiters.get(key)
    if waiter is not None:
        waiter.beat(following)


def _expired(record: StepRecord, now: float) -> float | None:
    """Seconds since the last beat, if the attempt's beats stopped for longer than its
    ``heartbeat_timeout`` (``None``: not expired, or not watched)."""
    timeout = record.heartbeat_timeout
    if timeout is None or record.status is not StepState.PENDING:
        return None
    at = last_beat_at(record)
    if at is None or now - at <= timeout:
        return None
    return now - at


async def watch_heartbeats(
    services: EngineServices,
    fail: Callable[[StepResult], Awaitable[None]],
    interval: float,
) -> None:
    """Every ``interval``: fail over the attempts whose beats stopped (see the module
    docstring); ``fail`` applies the failed result, retried at once."""
    store = services.store
    async for _ in fixed_rate(interval, catch_up=True):
        keys = [
            key
            for key, w in services.waiters.items()
            if w.record is not None
            and w.record.heartbeat_timeout is not None
            and w.record.status is StepState.PENDING
        ]
        if not keys:
            continue
        try:
            records = await store.get_steps_many(keys)
        except BrokerError as exc:
            services.report(exc)
            continue
        now = store.now()
        for record in records:
            if record is None:
                continue
            silent = _expired(record, now)
            if silent is None:
                continue
            services.count("heartbeat_timeouts")
            error = StepError(
                message=f"no heartbeat for {silent:.3f} s "
                f"(heartbeat_timeout={record.heartbeat_timeout} s)",
                code=HEARTBEAT_TIMEOUT,
                retryable=True,
                details={"lastHeartbeat": record.heartbeat},
            )
            result = StepResult(
                record.run_id, record.step_id, record.attempt, StepStatus.FAILED, error=error
            )
            try:
                await fail(result)
            except BrokerError as exc:
                services.report(exc)
                continue
            await _stop_attempt(services, record)


async def _stop_attempt(services: EngineServices, record: StepRecord) -> None:
    """Best effort: ask the worker (whichever takes the control message: T17, docs/spec.md)
    to stop the old attempt; a worker that lives and takes it cancels the handler, whose
    result is stale."""
    message = ControlMessage(
        "cancel-step", record.run_id, record.step_id, data={"attempt": record.attempt}
    )
    try:
        with trio.move_on_after(services.options.cleanup_timeout):
            await services.transport.remote.send_control(message)
    except BrokerError as exc:
        services.report(exc)
