"""Operations: what an operator does to a running system, from Python (``dt.Operations``) and
from ``durable-trio runs | jobs | queues`` (the same calls).

``async with dt.open_operations(url, namespace=...) as ops:`` opens the backend (or uses one
already open) and the namespace's run store, and nothing else: no worker, no engine, no
consumer. Everything it reads is read from the store, the broker and the worker-key store, so
it works from any process, beside live engines and workers; what it changes (a cancel, a
retry, a requeue) is one atomic change in the store or the broker, which the live engines and
workers then follow. See docs/operations.md.
"""

from __future__ import annotations

import math
import time
import uuid
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import orjson
import trio

from ._arguments import check_name, check_optional_name, check_run_id, check_seconds
from ._codec import encode_envelope
from ._engine._cancel import mark_in_store
from ._engine._children import cancel_children
from ._engine._debounce import check_folding
from ._engine._errors import RunNotFound
from ._engine._new_run import record_debounced_start, record_new_run
from ._engine._records import RunPage, RunRecord, RunStatus
from ._engine._reopen import retry_run
from ._engine._stores import open_run_store
from ._engine._stores._paging import check_page
from ._engine._stores._wakes import STARTS, ring
from ._engine._tags import check_tags
from ._errors import BrokerError, ConfigError, TransportClosed
from ._logs import get_logger
from ._naming import QueueNames
from ._ops_attempts import AttemptView
from ._ops_bulk import BulkOutcome, BulkResult, RunFilter, run_bulk
from ._ops_generations import count_generations, prune_generations, show_run_generation
from ._ops_views import (
    FailedJobView,
    PruneReport,
    QueueView,
    RunDetails,
    StepView,
    TimerView,
    WorkerView,
    run_to_json,
    workers_of,
)
from ._transport._health import read_worker_health
from ._wire import ControlMessage, JobKind
from .backends import Backend, open_backend
from .brokers import (
    Job,
    SupportsFailedJobRepair,
    SupportsFailedJobs,
    SupportsQueueListing,
    SupportsQueueStats,
    SupportsSize,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

    from ._engine._advert import EngineDescriptor
    from ._engine._debounce import Debounce
    from ._engine._schedules import BackfillTick
    from ._engine._stores import RunStore
    from ._engine._stream import StreamEntry
    from ._transport._supervised import SupervisedSlot
    from .backends.sqlite import ReadOnlyOption

#: Seconds :meth:`Operations.cancel_run` waits for the broker to take the workers' cancel.
CONTROL_PUSH_TIMEOUT = 5.0
#: Seconds :meth:`Operations.cancel_run` gives the compensation of a run an engine drives
#: (the engine's own ``cancel_grace`` default), beyond what is left of the run's lease.
CANCEL_GRACE = 30.0
#: Seconds between the store reads of :meth:`Operations.cancel_run` waiting for the run's end.
CANCEL_POLL = 0.5

_log = get_logger("durable_trio")

__all__ = [
    "CANCEL_GRACE",
    "CONTROL_PUSH_TIMEOUT",
    "AttemptView",
    "BulkOutcome",
    "BulkResult",
    "FailedJobView",
    "Operations",
    "PruneReport",
    "QueueView",
    "RunDetails",
    "RunFilter",
    "RunPage",
    "StepView",
    "TimerView",
    "WorkerView",
    "open_operations",
    "run_to_json",
]


def _envelope_priority(data: bytes) -> int | None:
    try:
        envelope = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    priority = envelope.get("priority") if isinstance(envelope, dict) else None
    return priority if type(priority) is int else None


class Operations:
    """The operator's calls on one namespace of one backend (see the module docstring).

    Made by :func:`open_operations`; valid inside its block.
    """

    def __init__(self, backend: Backend, store: RunStore, namespace: str | None) -> None:
        self.backend = backend
        self.store = store
        self.namespace = namespace
        self.names = QueueNames(namespace)

    # -- runs -------------------------------------------------------------------------------

    async def list_runs(
        self,
        *,
        status: RunStatus | str | None = None,
        workflow: str | None = None,
        tenant: str | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int = 50,
        cursor: str | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> RunPage:
        """One page of runs, newest first (see :meth:`RunStore.page_runs`).

        Args:
            status: only runs of this status (a :class:`RunStatus` or its name).
            workflow: only runs of this workflow.
            tenant: only the runs a tenant pod started.
            since: only runs created at or after this time (store clock: Unix time on
                SQLite and Redis, trio's clock on ``memory://``).
            until: only runs created before this time.
            limit: at most this many (1 to 1,000).
            cursor: the ``next_cursor`` of the previous page.
            tags: only runs carrying every one of these tags (``{"customer": "c1"}``), read
                from the store's tag index.

        Raises:
            ConfigError: an unknown status, a bad limit, time, tenant, tag or cursor.
        """
        try:
            wanted = None if status is None else RunStatus(status)
        except ValueError:
            known = ", ".join(s.value for s in RunStatus)
            raise ConfigError(f"unknown run status {status!r} (known: {known})") from None
        check_page(limit, since, until, tenant)
        tagged = check_tags(tags, "list_runs: tags")
        return await self.store.page_runs(
            status=wanted,
            workflow=workflow,
            tenant=tenant,
            since=since,
            until=until,
            limit=limit,
            cursor=cursor,
            **({"tags": tagged} if tagged else {}),
        )

    async def show_run(self, run_id: str, *, generation: int | None = None) -> RunDetails:
        """The run (status, input, output, error) and its history timeline: of its current
        generation, or of a previous one (``generation``: continue-as-new, issue 34).

        Raises:
            RunNotFound: no such run.
            ConfigError: no such previous generation.
        """
        return await show_run_generation(self.store, run_id, generation)

    async def start_run(
        self,
        workflow: str,
        input: Any = None,
        *,
        run_id: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (the run's, stored; not this call's)
        tags: Mapping[str, str] | None = None,
        dedup_key: str | None = None,
        debounce: Debounce | None = None,
    ) -> str:
        """Record a new run of ``workflow`` as :meth:`Engine.start` with ``detach=True`` does
        (pending, no owner): an engine of the namespace whose app registers ``workflow``
        takes it over at once (the store rings the engines that reconcile; at their next
        reconcile if the ring is lost); with none running it waits, stored. An engine
        whose app does not register it fails it (``UnknownWorkflow``): this process has no
        app to check the name against. Idempotent by ``run_id``.

        ``dedup_key`` and ``debounce`` are :meth:`Engine.start`'s (docs/concurrency.md,
        "Debounce and dedup keys"), in the same store operations: a deduped start returns the
        unfinished run of its key; a debounced start is folded into its key's pending start,
        whose run a reconciling engine creates when it is due (a new pending start rings the
        engines, which then wait for its due time).

        Returns:
            The run id (an existing run's, if ``run_id`` names one: nothing is started; the
            unfinished run of ``dedup_key``; the run ``debounce`` folds this start into).

        Raises:
            ConfigError: ``workflow`` or ``run_id`` is empty, ``timeout`` not a number of
                seconds > 0, ``tags`` not tags, a bad ``dedup_key``; ``dedup_key`` or
                ``debounce`` with ``run_id`` or each other (see :meth:`Engine.start`).
            TypeError: ``workflow``, ``run_id`` or ``dedup_key`` is not a str, ``debounce``
                not a :class:`Debounce`.
            PayloadError: ``input`` is not a JSON value.
            EngineError: ``run_id`` exists as a run of another workflow.
        """
        check_name(workflow, "ops.start_run", "workflow")
        check_run_id(run_id, "ops.start_run")
        check_folding(run_id, None, dedup_key, debounce, "ops.start_run")
        seconds = (
            None
            if timeout is None
            else check_seconds(timeout, "ops.start_run", "timeout", positive=True)
        )
        checked = check_tags(tags, "ops.start_run: tags")
        if debounce is not None:
            folded, _ = await record_debounced_start(
                self.store, workflow, input, debounce, timeout=seconds, tags=checked
            )
            return folded
        stored, _ = await record_new_run(
            self.store, workflow, input, run_id=run_id, owner=None, lease=0.0,
            timeout=seconds, parent=None, dedup_key=dedup_key, tags=checked,
        )  # fmt: skip
        return stored.run_id

    def stream(self, run_id: str, *, after: int = 0) -> AsyncIterator[StreamEntry]:
        """The run's stream, as :meth:`Engine.stream` reads it (docs/engine.md,
        "Streaming"): its entries after seq ``after``, as they come, until the run has ended
        and its stream is read.

        Raises:
            RunNotFound: no such run.
        """
        from ._engine._stream import read_stream

        return read_stream(self.store, run_id, after=after)

    async def signal_run(self, run_id: str, name: str, payload: Any = None) -> int:
        """Send signal ``name`` with JSON ``payload`` to the run, as :meth:`Engine.signal`
        does (stored at once; the engine driving the run finds it at its next store poll).

        Returns:
            The signal's sequence number among the run's signals of that name.

        Raises:
            RunNotFound: no such run.
            RunNotSignalable: the run has finished.
            PayloadError: ``payload`` is not a JSON value.
        """
        from ._engine._context import check_unreserved
        from ._engine._signals import RunNotSignalable, encode_payload

        check_unreserved(name, "a signal name")
        text = encode_payload(payload, f"the payload of signal {name!r}")
        seq = await self.store.append_signal(run_id, name, text)
        if seq is None:
            run = await self.store.get_run(run_id)
            if run is None:
                raise RunNotFound(run_id)
            raise RunNotSignalable(
                f"run {run_id!r} is {run.status.value}: it takes no more signals"
            )
        return seq

    async def update_run(
        self,
        run_id: str,
        name: str,
        payload: Any = None,
        *,
        update_id: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (the caller's bound, not the run's)
    ) -> Any:
        """Send update ``name`` to the run and return its handler's value, as
        :meth:`Engine.update` (docs/engine.md, "Updates"): the run's driver, in any engine of
        the namespace, applies it.

        Raises:
            RunNotFound: no such run.
            UpdateRejected: refused (no handler, its validator, the run finished).
            UpdateFailed: the handler raised.
            UpdateTimeout: no outcome within ``timeout`` seconds.
        """
        from ._engine._updates import send_update

        return await send_update(
            self.store, run_id, name, payload, update_id=update_id, timeout=timeout
        )

    async def run_events(self, run_id: str) -> dict[str, Any]:
        """The run's latest events (``ctx.set_event``), by key (a damaged one: its raw text).

        Raises:
            RunNotFound: no such run.
        """
        from ._engine._signals import SignalDataError, decode_stored

        if await self.store.get_run(run_id) is None:
            raise RunNotFound(run_id)
        events: dict[str, Any] = {}
        for key, text in (await self.store.get_events(run_id)).items():
            try:
                events[key] = decode_stored(text, f"event {key!r}")
            except SignalDataError:
                events[key] = {"damaged": text}
        return events

    async def cancel_run(
        self,
        run_id: str,
        *,
        reason: str = "cancelled by an operator",
        grace: float = CANCEL_GRACE,
        wait: bool = True,
    ) -> bool:
        """Cancel the run, as :meth:`Engine.cancel` does from another engine:

        - a run an engine drives now (running, its lease held): the mark ``cancel:run`` goes
          into its history; the engine driving it finds it (every ``run_lease / 3``) and
          raises :class:`RunCancelled` inside the workflow, which may compensate (bounded by
          that engine's ``cancel_grace``). With ``wait`` this call waits for the run to end,
          at most ``grace`` seconds plus what is left of its lease; a run still not ended then
          (its engine died, or ignores marks) is settled cancelled here (``"cut": true``).
          Without ``wait`` it returns once the mark is written (the console's button): the
          driving engine, or the one that takes the run over, settles it.
        - a run nobody drives (pending, or its owner's lease expired), or ``grace=0``: settled
          cancelled in the store at once; an engine still driving it stops at its next lease
          renewal, without compensation.

        Then, like :meth:`Engine.cancel`, the workers are asked to cancel its running steps:
        one ``cancel`` control message is pushed on the namespace's control queue (best-effort,
        point-to-point, as the engine sends it), straight through the broker (no transport,
        no consumer is opened), bounded by :data:`CONTROL_PUSH_TIMEOUT` and shielded.

        Its descendants go too, unless started with ``on_parent_cancel="abandon"``: each one
        as this call without ``wait``, breadth-first from the root down, iteratively (a chain
        of any depth), once the root ended. A cancel interrupted half-way (the CLI killed) is
        finished by cancelling the root again: the walk goes on below runs already ended.

        Returns:
            Whether the run ended cancelled by this call (without ``wait``: whether the cancel
            was requested); ``False``: it had already ended, or was being cancelled already.

        Raises:
            RunNotFound: no such run.
            ConfigError: ``grace`` is negative, NaN or infinite (``0``, not a negative
                number, is "settle it at once, without compensation").
            TypeError: ``grace`` is not a number.
        """
        grace = check_seconds(grace, "cancel_run", "grace")
        cancelled = await self._cancel_one(run_id, reason=reason, grace=grace, wait=wait)
        await cancel_children(
            self.store,
            run_id,
            lambda child, why: self._cancel_one(child, reason=why, grace=grace, wait=False),
        )
        return cancelled

    async def _cancel_one(self, run_id: str, *, reason: str, grace: float, wait: bool) -> bool:
        """:meth:`cancel_run` of ``run_id`` alone."""
        run = await self.store.get_run(run_id)
        if run is None:
            raise RunNotFound(run_id)
        if run.status.terminal:
            return False
        driven = (
            run.status is RunStatus.RUNNING
            and run.owner is not None
            and run.lease_until is not None
            and self.store.now() < run.lease_until < math.inf  # (infinity: no time, damaged)
        )
        if driven and grace > 0:
            if not await mark_in_store(self.store, run_id, reason):
                return False  # a cancel is already under way
            if not wait:
                return True
            assert run.lease_until is not None
            bound = grace + max(0.0, run.lease_until - self.store.now())
            with trio.move_on_after(bound):
                # Another process settles it: the store is all there is to watch.
                while not (await self._get(run_id)).status.terminal:  # noqa: ASYNC110
                    await trio.sleep(CANCEL_POLL)
            ended = await self._get(run_id)
            if ended.status.terminal:
                if ended.status is RunStatus.CANCELLED:
                    await self._send_cancel(run_id)
                    return True
                return False
            error: dict[str, Any] = {"type": "RunCancelled", "message": reason, "cut": True}
        else:
            error = {"type": "RunCancelled", "message": reason}
        cancelled = await self.store.finish_run(run_id, RunStatus.CANCELLED, error=error)
        if cancelled:
            await self._send_cancel(run_id)
        return cancelled

    async def _get(self, run_id: str) -> RunRecord:
        run = await self.store.get_run(run_id)
        if run is None:
            raise RunNotFound(run_id)
        return run

    async def _send_cancel(self, run_id: str) -> None:
        """Push the workers' ``cancel`` control message of ``run_id`` (best-effort: a broker
        that does not take it in time is logged, the cancel in the store stands)."""
        job_id = f"ops-{uuid.uuid4().hex}"
        job = Job(
            job_id,
            encode_envelope(job_id, JobKind.CONTROL, ControlMessage("cancel", run_id=run_id)),
        )
        with trio.move_on_after(CONTROL_PUSH_TIMEOUT, shield=True) as scope:
            try:
                await self.backend.broker.push_on(self.names.control, job)
            except (BrokerError, TransportClosed) as exc:
                _log.warning("cancel of run %r not sent to the workers: %s", run_id, exc)
        if scope.cancelled_caught:
            _log.warning("cancel of run %r not sent to the workers: broker timed out", run_id)

    async def retry_run(self, run_id: str) -> RunRecord:
        """Retry a failed run: reopened in the store, a live engine takes it over at once (the
        store rings the reconciling engines, as for a detached start; at their next reconcile
        if the ring is lost) and resumes it from the step that failed it, its completed steps
        replayed, never re-run (see :meth:`Engine.retry` and docs/operations.md).

        Returns:
            The run as reopened (pending, no owner).

        Raises:
            RunNotFound: no such run.
            RunNotRetryable: it is not failed.
        """
        reopened = await retry_run(self.store, run_id)
        await ring(self.store, STARTS)
        return reopened

    # -- schedules --------------------------------------------------------------------------

    async def backfill_schedule(
        self, name: str, start: float, end: float, *, dry_run: bool = False
    ) -> tuple[BackfillTick, ...] | None:
        """Start the runs of schedule ``name``'s ticks from ``start`` to ``end`` (Unix
        seconds, both included, in the past), each exactly once, as
        :meth:`Schedules.backfill` does (``durable-trio schedules backfill``): recorded
        pending, an engine of the namespace takes each over.

        Returns:
            Each tick of the range and whether this call started its run (``None``: no such
            schedule).

        Raises:
            ConfigError: see :meth:`Schedules.backfill` (a bad or future range, more than
                1,000 ticks, a damaged schedule).
        """
        from ._engine._schedules import Schedules

        schedules = Schedules(self.store, time.time)
        return await schedules.backfill(name, start, end, dry_run=dry_run)

    async def cancel_runs(
        self,
        run_filter: RunFilter,
        *,
        reason: str = "cancelled by an operator (bulk)",
        dry_run: bool = False,
        confirm: Callable[[int], bool | Awaitable[bool]] | None = None,
        on_each: Callable[[BulkOutcome], Any] | None = None,
    ) -> BulkResult:
        """Cancel every run ``run_filter`` matches (issue 34): counted first (``confirm`` is
        told the count and may stop it; ``dry_run`` only reports), then each run once, as
        :meth:`cancel_run` without ``wait``; an ended one is skipped ("already ended"). Run
        again after an interruption, it finishes the job (see :mod:`durable_trio._ops_bulk`).

        Raises:
            ConfigError: no filter (a bulk never acts on every run), or a bad one.
        """
        return await run_bulk(
            self, "cancel", run_filter, reason=reason, dry_run=dry_run, confirm=confirm,
            on_each=on_each,
        )  # fmt: skip

    async def retry_runs(
        self,
        run_filter: RunFilter,
        *,
        dry_run: bool = False,
        confirm: Callable[[int], bool | Awaitable[bool]] | None = None,
        on_each: Callable[[BulkOutcome], Any] | None = None,
    ) -> BulkResult:
        """Retry every failed (or blocked) run ``run_filter`` matches (issue 34), as
        :meth:`cancel_runs` goes: counted, confirmed, then each once as :meth:`retry_run`; a
        run not failed is skipped ("not failed (completed)").

        Raises:
            ConfigError: no filter, or a bad one.
        """
        return await run_bulk(
            self, "retry", run_filter, dry_run=dry_run, confirm=confirm, on_each=on_each
        )

    # -- jobs -------------------------------------------------------------------------------

    async def _queue_names(self) -> list[str]:
        broker = self.backend.broker
        prefix = self.names.prefix + ":"
        if isinstance(broker, SupportsQueueStats):
            return await broker.known_queues(prefix)
        if isinstance(broker, SupportsQueueListing):
            return await broker.waiting_queues(prefix)
        return []

    async def failed_jobs(
        self, queue: str | None = None, *, limit: int = 100
    ) -> list[FailedJobView]:
        """The jobs set aside (failed for good), newest first, with their evidence: of
        ``queue``, or of every queue of the namespace (``None``); a step task's with the
        status of its run (:attr:`FailedJobView.run_status`: a job of a finished run is not
        a live failure).

        Raises:
            ConfigError: the broker keeps no failed jobs, or ``limit`` < 1.
        """
        if type(limit) is not int or limit < 1:
            raise ConfigError(f"limit is an integer >= 1, got {limit!r}")
        broker = self.backend.broker
        if not isinstance(broker, SupportsFailedJobs):
            raise ConfigError(f"the broker of {self.backend.url} keeps no failed jobs")
        queues = [queue] if queue is not None else await self._queue_names()
        found: list[FailedJobView] = []
        for name in queues:
            found.extend(
                FailedJobView(name, job) for job in await broker.failed_jobs(name, limit=limit)
            )
        found.sort(key=lambda view: view.job.failed_at, reverse=True)
        return await self._with_run_status(found[:limit])

    async def _with_run_status(self, views: list[FailedJobView]) -> list[FailedJobView]:
        """``views`` with the status of each step task's run (one read per run)."""
        statuses: dict[str, str | None] = {}
        labelled = []
        for view in views:
            run_id = view.run_id
            if run_id is not None and run_id not in statuses:
                run = await self.store.get_run(run_id)
                statuses[run_id] = None if run is None else run.status.value
            status = statuses.get(run_id) if run_id is not None else None
            labelled.append(attrs.evolve(view, run_status=status))
        return labelled

    def _repair(self) -> SupportsFailedJobRepair:
        broker = self.backend.broker
        if not isinstance(broker, SupportsFailedJobRepair):
            raise ConfigError(f"the broker of {self.backend.url} cannot requeue or delete jobs")
        return broker

    async def requeue_job(self, queue: str, job_id: str) -> bool:
        """Put a set-aside job back on ``queue`` as pending, its attempt count, stall count
        and stall history reset (its bytes, so its task and attempt, unchanged; its priority
        kept).

        Returns:
            Whether a failed job ``job_id`` was found on ``queue`` (and requeued).

        Raises:
            ConfigError: the broker cannot repair failed jobs.
        """
        broker = self._repair()
        priority = None
        if isinstance(broker, SupportsFailedJobs):
            for job in await broker.failed_jobs(queue, limit=1000):
                if job.id == job_id:
                    priority = _envelope_priority(job.data)
                    break
        return await broker.requeue_failed(queue, job_id, priority=priority)

    async def delete_job(self, queue: str, job_id: str) -> bool:
        """Remove a set-aside job from ``queue``'s failed set, for good.

        Returns:
            Whether a failed job ``job_id`` was found on ``queue`` (and deleted).

        Raises:
            ConfigError: the broker cannot repair failed jobs.
        """
        return await self._repair().delete_failed(queue, job_id)

    # -- queues and workers -----------------------------------------------------------------

    async def queues(self) -> list[QueueView]:
        """Every queue of the namespace that holds jobs (ready, delayed, claimed or set
        aside) or has a live worker, sorted by name."""
        broker = self.backend.broker
        groups = await read_worker_health(self.backend, self.names) or []
        live = {self.names.tasks(g.group): len(g.live_workers) for g in groups}
        names = sorted(set(await self._queue_names()) | set(live))
        views = []
        for name in names:
            if isinstance(broker, SupportsQueueStats):
                stats = await broker.queue_stats(name)
                views.append(
                    QueueView(
                        name,
                        stats.ready,
                        stats.delayed,
                        stats.claimed,
                        stats.failed,
                        live.get(name, 0),
                        stats.oldest_ready_age,
                        stats.limit,
                        stats.per_key,
                        stats.rate,
                        stats.rate_per,
                        stats.window,
                        stats.rate_per_key,
                        stats.window_keys,
                    )
                )
                continue
            size = await broker.size_of(name) if isinstance(broker, SupportsSize) else 0
            views.append(QueueView(name, size, None, None, None, live.get(name, 0)))
        return views

    async def workers(self) -> list[WorkerView]:
        """Every live worker instance of the namespace, once, with the groups it serves, its
        limit, in-flight steps, headroom, RSS and CPU and its last beat (what
        ``durable-trio health`` reads). Empty without a worker-key store."""
        groups = await read_worker_health(self.backend, self.names) or []
        return workers_of(groups)

    async def supervisors(self) -> list[SupervisedSlot]:
        """Every slot of the namespace's live ``worker --processes`` supervisors: its restarts,
        whether it is crash-looping, its last exit status (issue 30). Empty without a
        worker-key store."""
        from ._transport._supervised import read_supervisors

        keys = self.backend.keys
        return [] if keys is None else await read_supervisors(keys, self.names)

    async def engines(self) -> list[EngineDescriptor]:
        """Every live engine of the namespace, by id, with the workflows it runs (from its
        key: ``{prefix}-engine:{engine_id}``). Empty without a worker-key store."""
        from ._engine._advert import read_engines

        keys = self.backend.keys
        return [] if keys is None else await read_engines(keys, self.names)

    # -- retention (issue 34) ---------------------------------------------------------------

    async def prune_runs(
        self,
        older_than: float,
        *,
        workflow: str | None = None,
        dry_run: bool = False,
        batch: int = 100,
    ) -> PruneReport:
        """Delete the finished runs (completed, failed, cancelled) that ended more than
        ``older_than`` seconds ago (store clock), with their history, signals and events, batch
        after batch of ``batch`` runs (each batch one store transaction or script: each run
        whole or gone). Never an unfinished run, nor a child whose parent is unfinished. Then
        the previous generations (continue-as-new) of any run, finished or not, that ended
        before the same cut-off (never a run's current generation). Jobs
        the broker set aside (failed) are left: ``jobs failed`` shows them, ``jobs delete``
        removes one (docs/operations.md, "Retention").

        Args:
            older_than: seconds since the run's end (``> 0``).
            workflow: only runs of this workflow.
            dry_run: count them (at most: the Redis store may count a held child), delete none.
            batch: runs per store call (1 to 10,000).

        Raises:
            ConfigError: a bad ``older_than`` or ``batch``.
        """
        older_than = check_seconds(older_than, "prune_runs", "older_than", positive=True)
        check_optional_name(workflow, "prune_runs", "workflow")
        if type(batch) is not int or not 1 <= batch <= 10_000:
            raise ConfigError(f"prune_runs: batch must be an int from 1 to 10000, got {batch!r}")
        ended_before = self.store.now() - older_than
        if dry_run:
            count = await self.store.count_finished(ended_before, workflow=workflow)
            gens = await count_generations(self.store, ended_before, workflow)
            return PruneReport(ended_before, count, dry_run=True, generations=gens)
        deleted = 0
        while True:
            ids = await self.store.prune_finished(ended_before, workflow=workflow, limit=batch)
            deleted += len(ids)
            if len(ids) < batch:
                break
        gens = await prune_generations(self.store, ended_before, workflow, batch)
        return PruneReport(ended_before, deleted, dry_run=False, generations=gens)


async def discover_namespace(backend: Backend) -> str | None:
    """The namespace to operate when none was named: the only one ``backend`` holds runs or
    schedules in, else ``None`` (``"durable"``: the backend holds none yet).

    Raises:
        ConfigError: it holds several; the message names them and the flags that pick one.
        BrokerError: the backend could not be read.
    """
    listing = getattr(backend.run_stores, "namespaces", None)  # a hand-built backend's may lack it
    found: list[str] = [] if listing is None else await listing()
    if len(found) > 1:
        shown = ", ".join(repr(name) for name in found[:10]) + (", ..." if len(found) > 10 else "")
        raise ConfigError(
            f"this backend holds {len(found)} namespaces ({shown}): pick one with "
            "--namespace NAME (or --app MODULE:app, or $DURABLE_TRIO_NAMESPACE)"
        )
    return found[0] if found else None


@asynccontextmanager
async def open_operations(
    backend: str | Backend,
    *,
    namespace: str | None = None,
    existing: bool = False,
    discover: bool = False,
    read_only: ReadOnlyOption = False,
) -> AsyncIterator[Operations]:
    """Open the operator's calls on ``namespace`` of ``backend``; close what was opened on
    leaving.

    Args:
        backend: a backend URL (``memory://``, ``sqlite:///...``, ``redis://...``: as
            :func:`~durable_trio.open_backend`) or an open :class:`~durable_trio.Backend`
            (left open). ``memory://`` opens an empty backend of its own: pass the Backend
            your engines use to see their runs.
        namespace: the namespace of the engines and workers to operate (their transport
            namespace: by default their app's name; ``None``: ``"durable"``).
        existing: with a URL, a SQLite file must exist already (as
            :func:`~durable_trio.open_backend`; what the ``durable-trio`` commands pass).
        discover: with ``namespace`` ``None``, operate the only namespace the backend holds
            (see :func:`discover_namespace`; what the ``durable-trio`` commands pass).
        read_only: with a URL, open a SQLite file read-only (``True``), or only when this
            process cannot write it (``"if_needed"``: what the commands that only read pass),
            as :func:`~durable_trio.open_backend`; every change then raises
            :class:`~durable_trio.BrokerError`.

    Raises:
        ConfigError: a bad URL (see :func:`~durable_trio.open_backend`); with ``discover``,
            a backend holding several namespaces.
        BrokerUnavailable: the backend cannot be reached.
    """
    async with AsyncExitStack() as stack:
        if isinstance(backend, str):
            opened = await stack.enter_async_context(
                open_backend(backend, existing=existing, read_only=read_only)
            )
        elif isinstance(backend, Backend):
            opened = backend
        else:
            raise TypeError(f"open_operations takes a URL or a Backend, not {backend!r}")
        if namespace is None and discover:
            namespace = await discover_namespace(opened)
        store = await stack.enter_async_context(
            open_run_store(opened, namespace or QueueNames(None).prefix)
        )
        yield Operations(opened, store, namespace)
