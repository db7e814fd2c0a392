"""Result application: what the transport hands the engine (step results, remote workflow
decisions, step events, turn heartbeats), applied to the run store.

Idempotent application: a result is applied by compare-and-set on its checkpoint (still
pending, at the result's attempt, run unfinished). Anything else — a duplicate delivery, a
result for an attempt already retried, a result for a finished run — changes nothing and is
counted (:meth:`~._engine.Engine.statistics`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import trio

from .._errors import DurableTrioError
from .._telemetry import step_applied
from .._wire import StepError, StepStatus
from ._app import ConcurrencyKeyError
from ._heartbeats import record_beat
from ._records import (
    Applied,
    StepKind,
    StepRecord,
    StepState,
    ended_attempt,
    error_to_json,
)
from ._remote_run import RemoteRunDriver, apply_decision, apply_step_event
from ._runtime import fail_unsent, send_step
from ._stores._wakes import ring, step_key

if TYPE_CHECKING:
    from .._wire import StepEvent, StepHeartbeat, StepResult, WorkflowDecision
    from ._services import EngineServices

__all__ = ["ResultHandler", "result_worker"]

_VERDICT_COUNTER = {
    Applied.APPLIED: "results_applied",
    Applied.DUPLICATE: "duplicate_results",
    Applied.STALE: "stale_results",
    Applied.MISSING: "orphan_results",
    Applied.RUN_FINISHED: "orphan_results",
}


def result_worker(result: StepResult) -> str | None:
    """The worker instance that ran ``result``'s attempt, as far as the result tells: its
    delivery evidence, else (a stalled attempt, failed by the poison bridge) the worker whose
    lease was lost last. ``None``: unknown (then the attempt's last beat may name it)."""
    delivery = result.delivery
    worker = delivery.get("worker") if isinstance(delivery, dict) else None
    if isinstance(worker, str):
        return worker
    details = result.error.details if result.error is not None else None
    stalls = details.get("stalls") if isinstance(details, dict) else None
    if isinstance(stalls, list) and stalls and isinstance(stalls[-1], dict):
        last = stalls[-1].get("worker")
        if isinstance(last, str) and last:
            return last
    return None


class ResultHandler:
    """Applies what the transport's loops receive for one engine (see the module docstring).

    The engine registers its methods with the transport; they hold no state of their own (the
    steps being applied are :class:`~._waits.Applying`'s, which the drivers read).
    """

    def __init__(self, services: EngineServices) -> None:
        self.services = services

    def next_state(
        self, current: StepRecord, result: StepResult, *, retry_now: bool = False
    ) -> tuple[StepRecord, float]:
        """The checkpoint after ``result`` (and the retry delay, if it is a retry; none when
        ``retry_now``)."""
        # A result came back, so the attempt was dispatched (whatever the local copy says).
        now = self.services.store.now()
        worker = result_worker(result)
        if result.status is StepStatus.COMPLETED:
            completed = attrs.evolve(
                current,
                status=StepState.COMPLETED,
                output=result.output,
                dispatched=True,
                attempts=ended_attempt(
                    current, ended_at=now, worker=worker, delivery=result.delivery
                ),
            )
            return completed, 0.0
        error = result.error or StepError(message="the step failed without an error")
        current = attrs.evolve(
            current,
            attempts=ended_attempt(
                current,
                ended_at=now,
                error=error_to_json(error),
                worker=worker,
                delivery=result.delivery,
            ),
        )
        from ._stored_retry import StoredRetry  # (imported with the first failed attempt)

        policy = StoredRetry.from_json(current.retry)
        if error.retryable and policy.retries_after(current.attempt, error.code):
            delay = (
                0.0
                if retry_now
                else policy.delay(current.attempt, rng=self.services.rng_for(current))
            )
            retry = attrs.evolve(
                current,
                attempt=current.attempt + 1,
                wake_at=now + delay,
                dispatched=False,
                error=error_to_json(error),
            )
            return retry, delay
        failed = attrs.evolve(
            current, status=StepState.FAILED, error=error_to_json(error), dispatched=True
        )
        return failed, 0.0

    async def on_result(self, result: StepResult, *, retry_now: bool = False) -> None:
        """Apply one step result, idempotently (see the module docstring). ``retry_now``: a
        retry is dispatched at once, with no backoff (a heartbeat-timeout failover).

        Error handling:
            A store error propagates: the transport hands the result back for redelivery.
        """
        services = self.services
        store = services.store
        key = (result.run_id, result.step_id)
        waiter = services.waiters.get(key)
        current = waiter.record if waiter is not None else None
        if (
            current is None
            or current.status is not StepState.PENDING
            or current.attempt != result.attempt
        ):
            # The local view may lag behind the store (another engine moved the step on): the
            # store decides.
            current = await store.get_step(result.run_id, result.step_id)
        if current is None or current.kind is not StepKind.REMOTE:
            services.count("orphan_results")
            return
        if current.status is not StepState.PENDING:
            services.count("duplicate_results")
            if (
                result.status is StepStatus.COMPLETED
                and current.status is StepState.COMPLETED
                and current.attempt == result.attempt
            ):
                self._record_duplicate(result)
            return
        if current.attempt != result.attempt:
            services.count("stale_results")
            if current.attempt == result.attempt + 1 and not current.dispatched:
                # This result's first application checkpointed the retry, then stopped before
                # the retry's dispatch was confirmed (cancelled: its claim's lease lost);
                # the redelivery finishes the job, or nobody would while this engine lives.
                # While that first application is still under way here, wait for it: it may
                # yet dispatch (a duplicated result) or be cancelled (a lost lease).
                applying = services.applying.get(key)
                if applying is not None:
                    await applying.wait()
                    found = await store.get_step(result.run_id, result.step_id)
                    if found is None or found.dispatched or found.attempt != current.attempt:
                        return
                    current = found
                services.count("redispatched")
                await send_step(services, current, services.waiters.get(key))
            return
        following, delay = self.next_state(current, result, retry_now=retry_now)
        done = services.applying.begin(key)  # copies arriving meanwhile wait for us
        try:
            verdict = await store.update_step(following, expect_attempt=current.attempt)
            services.count(_VERDICT_COUNTER[verdict])
            if verdict is Applied.DUPLICATE and result.status is StepStatus.COMPLETED:
                # Another copy (or engine) settled it meanwhile: a duplicate if it completed
                # this same attempt.
                found = await store.get_step(result.run_id, result.step_id)
                if (
                    found is not None
                    and found.status is StepState.COMPLETED
                    and found.attempt == result.attempt
                ):
                    self._record_duplicate(result)
            if verdict is not Applied.APPLIED:
                return
            step_applied(current, following, result, services.workflow_of(result.run_id), delay)
            if result.status is StepStatus.COMPLETED:
                services.duplicates.applied(
                    result.run_id, result.step_id, result.attempt, result.delivery
                )
            waiter = services.waiters.get(key)
            if waiter is not None:
                waiter.update(following)
            else:
                # Applied for a run driven elsewhere (several engines): its engine re-reads
                # the run's waited checkpoints at once, not at its next watch tick.
                await ring(store, step_key(result.run_id))
            if following.status is StepState.PENDING:
                services.count("retries")
                try:
                    await services.dispatch(following, delay)
                except ConcurrencyKeyError as exc:  # a key function that failed this time
                    await fail_unsent(services, following, waiter, exc)
                except DurableTrioError as exc:  # the same task went out before: not expected
                    services.report(exc)
        finally:
            services.applying.end(key, done)

    def _record_duplicate(self, result: StepResult) -> None:
        """The step completed twice for one attempt: never applied again, but recorded with
        its cause (a lease lost, or one result delivered twice)."""
        services = self.services
        services.count("duplicate_completions")
        services.duplicates.record(
            result.run_id, result.step_id, result.attempt, result.delivery, services.store.now()
        )

    async def on_decision(self, decision: WorkflowDecision) -> None:
        """Apply a remote workflow turn's decision (see :func:`~._remote_run.apply_decision`).
        Applied for a run driven elsewhere (several engines), it rings the store's wakes: the
        driving engine sends the next turn at once, not at its next look."""
        await apply_decision(self.services, decision)
        store = self.services.store
        if decision.run_id not in self.services.drivers:
            await ring(store, step_key(decision.run_id))

    async def on_step_event(self, event: StepEvent) -> None:
        """Checkpoint a workflow worker's local step (see
        :func:`~._remote_run.apply_step_event`)."""
        await apply_step_event(self.services, event)

    async def on_heartbeat(self, beat: StepHeartbeat) -> None:
        """A running remote workflow turn beats: its run's driver waits on. A running step
        beats: the beat is recorded on its checkpoint (:func:`~._heartbeats.record_beat`)."""
        if beat.step_id.startswith("turn:"):
            driver = self.services.drivers.get(beat.run_id)
            if isinstance(driver, RemoteRunDriver):
                driver.beat()
            await trio.lowlevel.checkpoint()
            return
        await record_beat(self.services, beat)

    async def fail_over(self, result: StepResult) -> None:
        """Apply a heartbeat-timeout failure: retried at once while attempts remain."""
        await self.on_result(result, retry_now=True)
