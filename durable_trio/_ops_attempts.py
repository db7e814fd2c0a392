"""A step's attempts as ``runs show`` shows them, from its stored attempt log
(:attr:`StepRecord.attempts <durable_trio.StepRecord.attempts>`) and its current attempt.

Nothing here trusts the log's shape: an entry that cannot be read is skipped with a note, a
log that was cut to its bound or written before logs existed says which attempts it lacks, so
a damaged or old checkpoint still shows what can be shown.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from ._engine._records import ATTEMPT_LOG_LIMIT, StepState, attempt_started
from ._wire import JSONValue

if TYPE_CHECKING:
    from ._engine._records import StepRecord

__all__ = ["AttemptView", "attempt_views"]


@attrs.frozen
class AttemptView:
    """One attempt of a step, as the store knows it.

    An ended attempt comes from the step's attempt log (see
    :attr:`StepRecord.attempts <durable_trio.StepRecord.attempts>`): its start, end, outcome,
    error, worker and last beat. The current attempt of a pending step comes from the
    checkpoint itself (its start, its last beat and the worker that beat). A checkpoint written
    before attempt logs existed lists its earlier attempts by number only.
    """

    attempt: int
    status: str
    """``running`` (the current attempt of a pending step), ``waiting`` (held back by its
    retry backoff until ``started_at``), or how it ended: ``completed``, ``failed``,
    ``timed_out`` (a start-to-close, schedule-to-start or heartbeat timeout), ``stalled`` (its
    claims' leases kept being lost) or ``abandoned`` (an operator retried the run while it
    ran); ``interrupted``: it was running or waiting when its run ended (cancelled, failed,
    completed), so it never will end (:func:`~durable_trio._ops.details_of` derives it from
    the run's status)."""
    started_at: float | None = None
    """Store clock: when its task was dispatched, or became due after its backoff."""
    ended_at: float | None = None
    """Store clock: when its result was applied."""
    error: JSONValue = None
    """Its error (``{"message", "code"?, "retryable"?}``), if it did not complete."""
    heartbeat: JSONValue = None
    """The attempt's last beat (``{"at", "sentAt", ...}``), if it beat."""
    worker: str | None = None
    """The worker instance that ran it, when known (from its result or its beats)."""
    deliveries: int = 1
    """How many claims of its task ran it, as far as the result applied says: more than 1
    when the broker took the task back from a claim whose lease it lost (a worker blocked or
    stopped) and handed it out again, one attempt number for all of them."""
    stalls: JSONValue = None
    """Those earlier claims, ``{"at", "worker"}`` each (the newest 10), when known."""
    lease_lost_at: float | None = None
    """When the lease of the claim whose result was applied was lost while it ran (its task
    was, or may be, run again by another claim)."""

    def redelivery_note(self) -> str | None:
        """One line on this attempt's extra runs, or ``None`` (one claim, unbroken)."""
        if self.deliveries <= 1 and self.lease_lost_at is None:
            return None
        parts = []
        if self.deliveries > 1:
            lost = [
                f"{s.get('worker') or 'an unknown worker'} at {s.get('at')}"
                for s in (self.stalls if isinstance(self.stalls, list) else [])
                if isinstance(s, dict)
            ]
            taken = f" (taken back from {', '.join(lost)})" if lost else ""
            parts.append(f"ran on {self.deliveries} claims of its task{taken}")
        if self.lease_lost_at is not None:
            parts.append(
                f"the lease of the claim that answered was lost at {self.lease_lost_at} while "
                "it ran, so its task may have run again"
            )
        return f"attempt {self.attempt} " + "; ".join(parts)

    @property
    def duration(self) -> float | None:
        """``ended_at - started_at`` in seconds, when both are known."""
        if self.started_at is None or self.ended_at is None:
            return None
        return max(0.0, self.ended_at - self.started_at)

    def to_json(self) -> dict[str, Any]:
        """As ``durable-trio runs show --json`` prints it."""
        return {
            "attempt": self.attempt,
            "status": self.status,
            "startedAt": self.started_at,
            "endedAt": self.ended_at,
            "duration": self.duration,
            "error": self.error,
            "heartbeat": self.heartbeat,
            "worker": self.worker,
            "deliveries": self.deliveries,
            "stalls": self.stalls,
            "leaseLostAt": self.lease_lost_at,
        }


def _number(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok else None


def _logged(entry: Any) -> AttemptView | str:
    """One log entry as a view, or a note saying why it cannot be read."""
    if isinstance(entry, dict) and "damaged" in entry:
        return f"attempt log damaged: {entry['damaged']}"
    attempt = entry.get("attempt") if isinstance(entry, dict) else None
    outcome = entry.get("outcome") if isinstance(entry, dict) else None
    if type(attempt) is not int or attempt < 1 or not isinstance(outcome, str):
        return f"attempt log entry damaged, skipped: {repr(entry)[:80]}"
    worker = entry.get("worker")
    deliveries = entry.get("deliveries")
    return AttemptView(
        attempt,
        outcome,
        started_at=_number(entry.get("startedAt")),
        ended_at=_number(entry.get("endedAt")),
        error=entry.get("error"),
        heartbeat=entry.get("heartbeat"),
        worker=worker if isinstance(worker, str) else None,
        deliveries=deliveries if type(deliveries) is int and deliveries > 1 else 1,
        stalls=entry.get("stalls"),
        lease_lost_at=_number(entry.get("leaseLostAt")),
    )


def _current(step: StepRecord, now: float | None) -> AttemptView:
    """The current attempt, from the checkpoint (no log entry of it)."""
    beat = step.heartbeat
    beat = beat if isinstance(beat, dict) and beat.get("attempt") == step.attempt else None
    worker = beat.get("worker") if beat is not None else None
    worker = worker if isinstance(worker, str) else None
    if step.status is StepState.PENDING:
        started = attempt_started(step)
        waiting = step.attempt > 1 and step.wake_at is not None
        if now is not None:
            waiting = waiting and started > now
        return AttemptView(
            step.attempt,
            "waiting" if waiting else "running",
            started_at=started,
            heartbeat=beat,
            worker=worker,
        )
    # Settled before attempt logs existed: its end is the checkpoint's last change.
    return AttemptView(
        step.attempt,
        step.status.value,
        started_at=attempt_started(step),
        ended_at=step.updated_at,
        error=step.error if step.status is StepState.FAILED else None,
        heartbeat=beat,
        worker=worker,
    )


def attempt_views(
    step: StepRecord, now: float | None = None
) -> tuple[tuple[AttemptView, ...], tuple[str, ...]]:
    """Every attempt of ``step`` that can be shown, oldest first, and notes on what cannot.

    Args:
        step: a remote or local step's checkpoint.
        now: the store's clock (tells a retry still in its backoff from one running);
            ``None``: a retry with a ``wake_at`` shows as waiting.

    Returns:
        ``(attempts, notes)``.
    """
    notes: list[str] = []
    logged: dict[int, AttemptView] = {}
    for entry in step.attempts:
        view = _logged(entry)
        if isinstance(view, str):
            notes.append(view)
        else:
            logged[view.attempt] = view
            redelivered = view.redelivery_note()
            if redelivered is not None:
                notes.append(redelivered)
    if logged:
        first = min(logged)
        if first > 1:
            notes.append(
                f"attempts 1 to {first - 1} are not in the log (it keeps the last "
                f"{ATTEMPT_LOG_LIMIT}, or they ended before it was kept)"
            )
        earlier = [v for n, v in sorted(logged.items()) if n != step.attempt]
    else:
        # No log (a checkpoint from before attempt logs, or a damaged one): numbers only.
        first = max(1, step.attempt - ATTEMPT_LOG_LIMIT)
        if first > 1:
            notes.append(f"attempts 1 to {first - 1} are not shown")
        earlier = [AttemptView(n, "failed") for n in range(first, step.attempt)]
        if earlier and step.error is not None and step.status is StepState.PENDING:
            earlier[-1] = AttemptView(step.attempt - 1, "failed", error=step.error)
    current = logged.get(step.attempt) or _current(step, now)
    return (*earlier, current), tuple(notes)
