"""The job runner: the claims this instance holds and the job workers that run them, one
handler per worker, each in its own cancel scope (T8, T24), with their finalize (T10; the ids
are sections of docs/spec.md)."""

from __future__ import annotations

from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import outcome
import trio
from trio_util import AsyncBool

from .._backoff import Backoff
from .._coalesce import Coalescer
from .._errors import (
    BrokerError,
    BrokerUnavailable,
    DamagedJob,
    JobError,
    LeaseLost,
    PayloadError,
    TransportClosed,
)
from .._outages import OutageReports
from .._wire import StepError
from ..brokers import SupportsClaimAhead, SupportsFinishAndClaim
from ._claims import ClaimState, JobWorker, Level, NextClaim, job_error, quarantined
from ._steps import StartDeferred

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

    from ..brokers import ClaimedJob, Job, Lease, QueueBroker
    from ._claims import Claim, ClaimTable, Loop
    from ._options import TransportOptions
    from ._slots import Slots

__all__ = ["JobRunner"]

#: How long a job whose handler met a broker error waits before it is delivered again.
_INFRASTRUCTURE_RETRY_DELAY = 1.0

#: The kinds of failure folded while the broker stays down (``JobRunner.outages``).
FINALIZING = "finalizing"
HANDLING = "handling jobs"

#: First and largest pause between two tries of a finalize the broker did not answer.
_FINALIZE_BACKOFF = Backoff(initial=0.05, maximum=2.0)


def _set_shield(scope: trio.CancelScope, shield: bool) -> None:
    """``scope.shield = shield``, on the path of every job (twice: on for its finalize, off
    after), without Trio's recalculation where it cannot change a thing: the scope entered,
    neither it nor its parent cancelled, and no deadline (then the scope stays uncancelled
    either way, and Trio's setter would walk its status to find so: eight Python calls). Any
    other case, or a Trio whose scopes lack these fields, takes the public setter."""
    try:
        status = scope._cancel_status
        if (
            status is not None
            and not status.effectively_cancelled
            and not scope._cancel_called
            and scope._deadline == _INF
            and (status._parent is None or not status._parent.effectively_cancelled)
        ):
            scope._shield = shield
            return
    except AttributeError:  # pragma: no cover - another Trio's insides
        pass
    scope.shield = shield


_INF = float("inf")

T = TypeVar("T")


class JobRunner:
    """Runs the claims of the claim table (asking the table for every change of a claim's
    state), in the job workers of the jobs level, with their finalize; and what close does to
    them: bound the finalizes in flight, abandon what still runs, hand the open claims back."""

    def __init__(
        self,
        broker: QueueBroker,
        options: TransportOptions,
        table: ClaimTable,
        *,
        completer: Callable[[str], Coalescer[Lease, bool]],
        finisher: Callable[[str], Coalescer[tuple[Lease, Job], bool]],
        batched: bool,
        answer_bad_task: Callable[[ClaimedJob, StepError], Awaitable[None]],
        report: Callable[[BaseException], None],
        finalize_retry_for: float = 0.0,
        results_queue: str | None = None,
    ) -> None:
        self._broker = broker
        # Finishing workers claim their next jobs in their finalize's round trip (where the
        # broker can, and finalizes are batched: a job's result travels with its complete).
        self._finish_and_claim = (
            broker
            if batched and results_queue is not None and isinstance(broker, SupportsFinishAndClaim)
            else None
        )
        self._in_halves = getattr(broker, "finalize_in_halves", True)
        self._results_queue = results_queue or ""
        self._claimers: dict[str, Coalescer[tuple[Lease, Job | None, NextClaim | None], bool]] = {}
        self._finalize_retry_for = finalize_retry_for
        self._options = options
        self.level = Level("jobs")
        """The tree level of the job workers (open inside :meth:`serving`)."""
        self._cancel_bound = 0.0
        """When the handlers cancelled by close must have ended (set by :meth:`drain`)."""
        self._completer = completer
        self._finisher = finisher
        self._batched = batched
        self.closing = False
        """Whether the close has begun: no loop or registration starts any more (set by
        ``Consumers.begin_close``; a field, read by every job's finalize)."""
        self._answer_bad_task = answer_bad_task
        self._report = report
        self._table = table
        self._claim_ahead = broker if isinstance(broker, SupportsClaimAhead) else None
        self._markers: dict[str, Coalescer[Lease, bool]] = {}
        self.running = 0
        """Handlers running now."""
        self.idle = AsyncBool(True)
        """True while no handler runs (close waits on it: ``wait_value(True)``)."""
        self.outages = OutageReports()
        """The reports of finalizes retried, and of handlers meeting a broker error, while the
        broker is down: folded, by kind, as the engine's (every job in flight met the outage,
        each reported at every try: thousands of lines a minute)."""

    @property
    def claims(self) -> Mapping[str, Claim]:
        """Every claim this instance holds, by lease token (read-only: the table owns them)."""
        return self._table.view

    # ------------------------------------------------------------------ close

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        """The jobs level: one job worker per running handler. Leaving it ends close phase 4:
        the handlers cancelled by :meth:`drain` get until its deadline to end (shielded), then
        the level is cancelled."""
        async with trio.open_nursery() as jobs:
            self.level.nursery = jobs
            self._cancel_bound = trio.current_time()
            try:
                yield
            finally:
                with trio.CancelScope(shield=True):
                    with trio.move_on_at(self._cancel_bound):
                        await self.idle.wait_value(True)
                    jobs.cancel_scope.cancel()

    async def drain(self) -> float:
        """Close phases 3 and 4 (T24): running handlers finish, up to ``close_timeout`` (their
        claims still renewed); what still runs is cancelled, each keeping its claim for the
        handback. Returns the deadline (``cleanup_timeout`` from now) by which the cancelled
        handlers, and the pops in flight of this instance's own inboxes, must land."""
        options = self._options
        with trio.move_on_after(options.close_timeout):
            await self.idle.wait_value(True)
        self.abandon_running()
        self._cancel_bound = trio.current_time() + options.cleanup_timeout
        return self._cancel_bound

    def bound_finalizes(self, bound: float) -> None:
        """Close: the finalizes in flight land by ``bound`` (absolute time)."""
        self._table.bound_finalizes(bound)

    def abandon_waiting(self) -> None:
        """Close: the suspects waiting to run alone never start (see ``ClaimTable``)."""
        self._table.abandon_waiting()

    def abandon_running(self) -> None:
        """Close: cancel every handler still running; each keeps its claim for the handback."""
        self._table.abandon_running()

    async def hand_back_open_claims(self) -> None:
        """Close: every claim still open goes back for immediate, attempt-neutral redelivery,
        bounded by ``cleanup_timeout``."""
        claims = self._table.take_open()
        with trio.move_on_after(self._options.cleanup_timeout) as bound:
            for claim in claims:
                try:
                    await self._broker.retry_job(
                        claim.job.lease, claim.queue, delay=0.0, count_attempt=False
                    )
                except BrokerError as exc:
                    self._report(exc)
        if bound.cancelled_caught:
            self._report(
                BrokerError("close: handing claims back timed out; the sweep recovers the rest")
            )

    # ------------------------------------------------------------------ running

    def begin_job(self, loop: Loop, job: ClaimedJob) -> None:
        """Track a popped job and hand it to an idle worker of its loop (or a new one)."""
        self.start_claim(loop, self._table.begin(loop.queue, job))

    def start_claim(self, loop: Loop, claim: Claim) -> None:
        """Run ``claim`` (begun, or a buffered one the table started) in a job worker."""
        if self.running == 0:
            self.idle.value = False
        self.running += 1
        if loop.idle:
            worker = loop.idle.pop()
            claim.scope = worker.scope
            trio.lowlevel.reschedule(worker.task, outcome.Value(claim))
        else:
            self.level.nursery.start_soon(self._job_worker, loop, claim)

    async def _job_worker(self, loop: Loop, claim: Claim) -> None:
        """Run ``claim``, then park until the loop hands this worker its next claim.

        The hot path of every job, so written flat: one coroutine per job (the handler's), the
        successful finalize inline.
        """
        on_job = loop.on_job
        slots = loop.slots
        table = self._table
        complete_job = (
            self._completer(loop.queue).submit
            if self._batched
            else lambda lease: self._broker.complete_job(lease, loop.queue)
        )
        # (asked for only where the broker finishes and claims: see ``_ask_next``)
        finish_and_claim = (
            None if self._finish_and_claim is None else self._claimer(loop).submit
        )
        with trio.CancelScope() as scope:
            me = JobWorker(trio.lowlevel.current_task(), scope)
            claim.scope = scope

            def abort(_: Any) -> trio.lowlevel.Abort:
                loop.idle.remove(me)
                return trio.lowlevel.Abort.SUCCEEDED

            while True:
                job = claim.job
                alone = False
                nxt: Claim | None = None
                """The next claim, handed over by this job's finalize (it keeps the slot)."""
                ended = False
                try:
                    error: Exception | None = None
                    result: Job | None = None
                    try:
                        if job.damage is not None:
                            error = await self._damaged(loop, job)
                        elif job.stalled_count and slots.isolate and not (
                            alone := await self._wait_alone(claim, slots)
                        ):
                            pass  # handed back (or dropped, or closing): it never ran here
                        elif not claim.ahead or await self._mark_started(claim):
                            result = await on_job(job)
                            if self.outages.down:  # (said if some were folded)
                                self.outages.succeeded(HANDLING)
                        else:
                            # Popped ahead and taken back before it started: never ran here,
                            # nothing to finalize (no double run).
                            table.drop_unstarted(claim)
                    except Exception as exc:
                        error = exc
                    # Abandoned by close (handed back in its step 6), or the lease went to
                    # another worker (T8): its outcome must not finalize someone else's claim.
                    if table.finalizing(claim):
                        # From here nobody cancels this scope: shielded, and bounded once a
                        # close starts (close sets the deadline of the finalizes in flight), so a
                        # close can never race a job's final write.
                        _set_shield(scope, True)
                        closing = self.closing
                        if closing:
                            scope.deadline = trio.current_time() + self._options.cleanup_timeout
                        try:
                            if error is not None:
                                await self._finalize(claim, error)
                            else:
                                ask = None if closing else self._ask_next(loop)
                                if ask is None:
                                    ok = await self._complete(claim, complete_job, result)
                                else:
                                    # Complete and claim the next in one round trip
                                    # (inline: every job's path on Redis). A claim landing
                                    # after the wait is handed back (``gone``).
                                    lease = job.lease
                                    try:
                                        try:
                                            assert finish_and_claim is not None
                                            ok = await finish_and_claim((lease, result, ask))
                                        finally:
                                            ask.gone = True
                                    except BrokerUnavailable as exc:
                                        ok = await self._complete(
                                            claim, complete_job, result, failed=exc
                                        )
                                    nxt = ask.claim
                                if not ok:
                                    self._report(
                                        LeaseLost(
                                            "completing the job answered 'lease lost': it was "
                                            "re-delivered meanwhile (not retried)",
                                            queue=claim.queue,
                                            job_id=job.id,
                                        )
                                    )
                        except BrokerError as exc:
                            self._report(job_error(f"finalizing failed: {exc}", claim, exc))
                        finally:
                            _set_shield(scope, False)
                    ended = True
                finally:
                    if alone:
                        slots.end_alone()
                    # Cancelled before it finished (its own scope, by close or a lost lease, or
                    # the whole transport from outside): kept for close's handback.
                    table.end(claim)
                    if nxt is not None and (
                        not ended or self.closing or not table.start_buffered(nxt)
                    ):
                        self._set_aside(nxt)
                        nxt = None
                    if nxt is None:
                        slots.release()
                        self.running -= 1
                        if self.running == 0:
                            self.idle.value = True
                if nxt is not None:
                    # Claimed by this job's finalize: run it at once, on the slot it holds.
                    nxt.scope = scope
                    claim = nxt
                    continue
                loop.idle.append(me)
                claim = await trio.lowlevel.wait_task_rescheduled(abort)
        if claim.state is ClaimState.FINALIZING and scope.cancelled_caught:
            self._report(
                JobError(
                    "finalizing timed out (broker not answering)",
                    queue=claim.queue,
                    job_id=claim.job.id,
                )
            )

    async def _wait_alone(self, claim: Claim, slots: Slots) -> bool:
        """A suspect (it stalled before, while its handler ran) waits for every other handler
        of ``slots`` to finish, taking none meanwhile, then runs alone (``True``). Waited
        ``suspect_wait`` in vain: handed back for as long (attempt-neutral; its stall uncounted
        had its worker died meanwhile: stored as not started), so an idle worker may take it
        (``False``). Close abandons it for the handback; a lost lease drops it (the
        cancellation of its scope ends the wait)."""
        table = self._table
        if self.closing:
            table.abandon(claim)
            return False
        table.wait_alone(claim)
        wait = self._options.suspect_wait
        with trio.move_on_after(wait):
            await slots.run_alone()
            table.run_alone(claim)
            return True
        table.hand_back_suspect(claim)
        scope = claim.scope
        assert scope is not None
        scope.shield = True
        try:
            ok = await self._broker.retry_job(
                claim.job.lease, claim.queue, delay=wait, count_attempt=False
            )
            if not ok:
                self._report(
                    LeaseLost(
                        "handing a suspect back answered 'lease lost'",
                        queue=claim.queue,
                        job_id=claim.job.id,
                    )
                )
        except BrokerError as exc:
            self._report(job_error(f"handing a suspect back failed: {exc}", claim, exc))
        finally:
            scope.shield = False
        return False

    async def _mark_started(self, claim: Claim) -> bool:
        """Tell the broker a claim popped ahead is starting (coalesced: the claims that start
        in one scheduling round share one call). ``False``: its lease was lost meanwhile. A
        broker error reaches the job's finalize (handed back, attempt-neutral): a handler
        never runs on a claim the broker still holds as not started."""
        marker = self._markers.get(claim.queue)
        if marker is None:
            broker, queue = self._claim_ahead, claim.queue
            assert broker is not None

            async def mark_many(leases: list[Lease]) -> list[bool]:
                return await broker.mark_started(queue, leases)

            marker = self._markers[claim.queue] = Coalescer(mark_many)
        claim.ahead = False
        return await marker.submit(claim.job.lease)

    async def _finalize(self, claim: Claim, error: Exception) -> None:
        """T10 for a job whose handler raised: hand it back (fail it for good after
        ``max_job_attempts``); fail bad input at once. (Success is completed inline by the job
        worker.) Runs shielded and bounded: a close can never race a job's final write. Each
        broker call is retried while the broker is unreachable (:meth:`_persist`)."""
        broker = self._broker
        job, queue = claim.job, claim.queue
        try:
            if isinstance(error, StartDeferred):
                # Its gate said not yet (a per-key rate): back to wait in the broker, not in
                # this worker's slot; nothing ran, so neither an attempt nor a stall.
                delay = error.delay
                ok = await self._persist(
                    claim,
                    lambda: broker.retry_job(job.lease, queue, delay=delay, count_attempt=False),
                )
            elif isinstance(error, DamagedJob):
                self._report(error)
                ok = await self._persist(
                    claim, lambda: broker.fail_job(job.lease, queue, f"damaged: {job.damage}")
                )
            elif isinstance(error, PayloadError):
                self._report(job_error(f"bad input, job failed: {error}", claim, error))
                ok = await self._persist(
                    claim, lambda: broker.fail_job(job.lease, queue, f"bad input: {error}")
                )
            elif isinstance(error, (BrokerError, TransportClosed)):
                # The handler met a broker or store outage, or a transport or engine closing
                # under it, not a bug of its own: counting it toward max_job_attempts would
                # fail the job for good — a result, a decision — and leave its run without an
                # answer. Back after a pause, attempt-neutral.
                folded = self.outages.failed(HANDLING)
                if folded is not None:
                    self._report(
                        job_error(
                            f"handler met a broker error, job handed back for "
                            f"{_INFRASTRUCTURE_RETRY_DELAY} s: {error!r}{folded}",
                            claim,
                            error,
                        )
                    )
                ok = await self._persist(
                    claim,
                    lambda: broker.retry_job(
                        job.lease, queue, delay=_INFRASTRUCTURE_RETRY_DELAY, count_attempt=False
                    ),
                )
            elif job.attempts + 1 >= self._options.max_job_attempts:
                self._report(
                    job_error(
                        f"handler failed {job.attempts + 1} times, job failed: {error!r}",
                        claim,
                        error,
                    )
                )
                reason = f"handler failed {job.attempts + 1} times: {error!r}"
                ok = await self._persist(claim, lambda: broker.fail_job(job.lease, queue, reason))
            else:
                self._report(
                    job_error(f"handler failed, job handed back: {error!r}", claim, error)
                )
                ok = await self._persist(claim, lambda: broker.retry_job(job.lease, queue))
            if not ok:
                self._report(
                    LeaseLost("finalizing answered 'lease lost'", queue=queue, job_id=job.id)
                )
        except BrokerError as exc:
            self._report(job_error(f"finalizing failed: {exc}", claim, exc))

    async def _complete(
        self,
        claim: Claim,
        complete_job: Callable[[Lease], Awaitable[bool]],
        result: Job | None,
        *,
        failed: BrokerUnavailable | None = None,
    ) -> bool:
        """Complete ``claim``'s job (pushing ``result`` with it, if any). Tried again while the
        broker is unreachable (:meth:`_persist`, entered only after a first failure; without a
        claim). ``failed``: the first try failed so already (a finish that also claimed, made
        inline by the job worker: its ask answered ``ask.claim``, or none)."""
        lease = claim.job.lease
        call: Callable[[], Awaitable[bool]]
        if result is None:
            call = partial(complete_job, lease)
        else:
            call = partial(self._finisher(claim.queue).submit, (lease, result))
        if failed is not None:
            return await self._persist(claim, call, failed)
        try:
            return await call()
        except BrokerUnavailable as exc:
            return await self._persist(claim, call, exc)

    # ------------------------------------------------------------------ finish and claim

    def _ask_next(self, loop: Loop) -> NextClaim | None:
        """An ask for the next claim of a finishing job worker (close not begun: its caller
        looked), or ``None`` when it should not claim: the broker cannot, the queue showed no
        backlog, prefetched claims wait, or its slot is not to be kept (a suspect waits to run
        alone, or the limit was cut below the slots in use)."""
        if (
            self._finish_and_claim is None
            or not loop.backlog
            or loop.buffer
            or loop.slots.gated
            or loop.slots.in_flight > loop.slots.limit
        ):
            return None
        return NextClaim(loop)

    def _claimer(self, loop: Loop) -> Coalescer[tuple[Lease, Job | None, NextClaim | None], bool]:
        """The finisher of ``loop``'s queue that also claims: the results (of the jobs that
        answer one) and completes of one batch, and one claim per ask in it, in one broker
        call."""
        queue = loop.queue
        claimer = self._claimers.get(queue)
        if claimer is None:
            broker = self._finish_and_claim
            assert broker is not None
            results, worker = self._results_queue, self._options.instance_id

            async def finish_and_claim(
                items: list[tuple[Lease, Job | None, NextClaim | None]],
            ) -> list[bool]:
                asks = [ask for _, _, ask in items if ask is not None]
                answers, claimed = await broker.finish_and_claim(
                    results,
                    [job for _, job, _ in items if job is not None],
                    queue,
                    [lease for lease, _, _ in items],
                    len(asks),
                    worker=worker,
                )
                self._hand_over(loop, claimed, asks)
                return answers

            # In two halves: one batch at the broker while the other's jobs run (where the
            # broker's calls overlap: not SQLite's, one transaction after another).
            claimer = self._claimers[queue] = Coalescer(
                finish_and_claim,
                most=(lambda: (loop.slots.limit + 1) // 2) if self._in_halves else None,
            )
        return claimer

    def _hand_over(self, loop: Loop, claimed: list[ClaimedJob], asks: list[NextClaim]) -> None:
        """Track the claims a finalize made at once (before any other task runs: renewed, and
        handed back by close, like any) and give one to each ask still waiting."""
        loop.backlog = len(claimed) >= len(asks)
        waiting = iter(asks)
        for job in claimed:
            if job.damage is not None and not job.lease.token:
                self._report(quarantined(loop.queue, job))
                continue
            claim = self._table.buffer(loop.queue, job, ahead=not job.started)
            ask = next(waiting, None)
            if ask is None or ask.gone:
                self._set_aside(claim)
            else:
                ask.claim = claim

    def _set_aside(self, claim: Claim) -> None:
        """A claim its finalize made for a worker that no longer takes it (cancelled, or
        closing): never started here, so handed back at once, attempt-neutral (or by close's
        handback, once close has begun)."""
        if not self._table.set_aside(claim):
            return  # taken back by the broker meanwhile (the lease keeper dropped it)
        if self.closing:
            return  # close's step 6 hands it back with the rest

        async def hand_back() -> None:
            with trio.CancelScope(shield=True), trio.move_on_after(self._options.cleanup_timeout):
                try:
                    await self._broker.retry_job(
                        claim.job.lease, claim.queue, delay=0.0, count_attempt=False
                    )
                except BrokerError as exc:
                    self._report(exc)
                    return  # kept: close's handback or the stalled sweep takes it back
                self._table.handed_back(claim)

        self.level.nursery.start_soon(hand_back)

    async def _persist(
        self,
        claim: Claim,
        call: Callable[[], Awaitable[T]],
        failed: BrokerUnavailable | None = None,
    ) -> T:
        """``await call()`` (a finalize: complete, fail, hand back), tried again with a
        bounded backoff while the broker is unreachable (``BrokerUnavailable``: a connection
        lost, a Redis failover under way), for as long as the claim is still ours: not lost
        (the lease keeper saw it re-delivered) and for at most ``stalled_threshold`` after
        the first failure (by then the broker's reclaim sweep may hand it to another worker).
        A close bounds it too (its deadline on the finalize's scope). Without this, a job whose
        work is done would wait for the reclaim sweep and run again."""
        give_up = trio.current_time() + self._finalize_retry_for
        error = failed
        failures = 0
        while True:
            if error is not None:
                failures += 1
                delay = _FINALIZE_BACKOFF.delay(failures)
                if claim.lost or trio.current_time() + delay > give_up or self.closing:
                    raise error
                folded = self.outages.failed(FINALIZING)
                if folded is not None:
                    self._report(
                        job_error(
                            f"finalizing failed (trying again in {delay:.2f} s): {error}{folded}",
                            claim,
                            error,
                        )
                    )
                await trio.sleep(delay)
            try:
                value = await call()
            except BrokerUnavailable as exc:
                error = exc
            else:
                if error is not None:
                    self.outages.succeeded(FINALIZING)
                return value

    async def _damaged(self, loop: Loop, job: ClaimedJob) -> DamagedJob:
        """The error that sets a damaged claim aside (its finalize fails it with the reason).
        A step task whose bytes still name its run and step first gets a RETRYABLE failed
        result: the damage is the store's, not the step's, and a retry dispatches a fresh,
        readable job, so the run neither waits forever nor fails for it."""
        error = DamagedJob(
            f"stored job unreadable, set aside: {job.damage}", queue=loop.queue, job_id=job.id
        )
        if loop.token is not None:  # a task loop
            step = StepError(message=f"damaged job: {job.damage}", code="damaged", retryable=True)
            await self._answer_bad_task(job, step)
        return error
