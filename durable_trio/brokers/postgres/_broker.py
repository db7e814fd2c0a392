"""The PostgreSQL broker: :class:`PostgresBroker`, which composes the parts of this package.

It holds a pool (:mod:`durable_trio._postgres`) and the backend's notify hub, applies its
migrations when attached (``_schema.py``), runs each call as one of ``_operations.py``'s
(shielded and bounded, errors mapped to the project's), and owns a :class:`~._wakeup.WakeUps`
that wakes its waiters, and a :class:`~._identity.StoreIdentity` that watches the store's identity
while it is entered. The package docstring (:mod:`durable_trio.brokers.postgres`) describes
the whole.
"""

from __future__ import annotations

import contextlib
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any, Final, TypeVar

import attrs
import trio

from ..._errors import BrokerError, BrokerUnavailable, ConfigError, TransportClosed
from ..._postgres import (
    NO_TABLE,
    PgMux,
    PostgresError,
    check_schema_name,
    migrate,
    open_notify_hub,
    open_pool,
    quote_ident,
    tables_missing,
)
from .._contract import RateGrant, Recovery
from .._limits import check_limit
from .._rates import check_rate, log_name
from ._identity import IDENTITY_MIGRATIONS, IDENTITY_PART, StoreIdentity
from ._operations import RECOVER_BATCH, UNBOUNDED, Operations
from ._rates import Rates
from ._schema import MIGRATIONS, PART
from ._wakeup import Waiter, WakeUps

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
    from types import TracebackType

    from ..._errors import StoreLost
    from ..._postgres import NotifyHub, PgPool
    from .._contract import (
        ClaimedJob,
        FailedJob,
        Job,
        JobState,
        Lease,
        QuarantinedEntry,
        QueueStats,
        RenewOutcome,
    )

__all__ = ["CALL_TIMEOUT", "POLL_INTERVAL", "STORE_CHECK_INTERVAL", "PostgresBroker"]

T = TypeVar("T")

#: Default seconds between two looks of a waiter nothing woke (the safety net under NOTIFY,
#: which never misses a committed push while the hub is connected and wakes every waiter after
#: it reconnects): long, so an idle worker costs the server next to nothing.
POLL_INTERVAL: Final = 30.0

#: Default seconds one broker call may take, waiting for a connection included.
CALL_TIMEOUT: Final = 30.0

#: Default seconds between two checks of the store's identity (one short ``SELECT`` each).
STORE_CHECK_INTERVAL: Final = 15.0


#: The smallest pool the finish-and-claim calls take a connection of for themselves (``PgMux``):
#: on a smaller one they share the pool, one call at a time, as every other call does.
MUX_MIN_POOL: Final = 3


class PostgresBroker:
    """A :class:`~durable_trio.brokers.QueueBroker` on PostgreSQL, with every capability.

    Many brokers in many processes may share one schema: claims skip each other's locked
    rows. Make one with :meth:`open` (its own pool and hub) or :meth:`attach` (a backend's);
    both apply the broker's migrations and check the store's identity once. While entered
    (``async with``; :meth:`open` enters it) it checks it again every ``store_check_interval``
    seconds and after every connection its pool opens (see
    :mod:`~durable_trio.brokers.postgres._identity`).

    Args:
        pool: an entered pool (not closed by the broker).
        schema: the PostgreSQL schema of the backend's tables (its migrations applied).
        hub: the backend's entered notify hub (not closed by the broker).
        failed_retention: failed jobs kept per queue (the newest).
        poll_interval: seconds between two looks of a waiter that nothing woke.
        call_timeout: seconds one call may take before it raises
            :class:`~durable_trio.BrokerUnavailable`.
        store_check_interval: seconds between two checks of the store's identity (one
            ``SELECT``); a schema dropped and created again, or its tables gone, raises the
            alarm (a :class:`~durable_trio.StoreLost`, logged at ERROR and kept in the store
            until acknowledged).
        on_error: called with each :class:`~durable_trio.StoreLost` the watch finds (once per
            alarm; also logged at ERROR).

    Raises:
        ConfigError: an option out of range, or a schema name that is not a plain identifier.
    """

    @property
    def finalize_in_halves(self) -> bool:
        """Its finalizes go in two halves (``SupportsFinishAndClaim``) when they are pipelined
        on one connection (``PgMux``, while the broker is entered, on a pool of at least
        :data:`MUX_MIN_POOL`): the server runs one half's transaction while this process works
        on the other's jobs. Otherwise one call at a time (docs/decisions.md)."""
        return self._mux is not None

    def __init__(
        self,
        pool: PgPool,
        schema: str,
        hub: NotifyHub,
        *,
        failed_retention: int = 1000,
        poll_interval: float = POLL_INTERVAL,
        call_timeout: float = CALL_TIMEOUT,
        store_check_interval: float = STORE_CHECK_INTERVAL,
        on_error: Callable[[Exception], object] | None = None,
    ) -> None:
        if failed_retention < 1:
            raise ConfigError(f"failed_retention must be at least 1, not {failed_retention!r}")
        if not poll_interval > 0 or not call_timeout > 0 or not store_check_interval > 0:
            raise ConfigError(
                f"poll_interval, call_timeout and store_check_interval must be > 0, not "
                f"{poll_interval!r}, {call_timeout!r}, {store_check_interval!r}"
            )
        self.schema = check_schema_name(schema)
        self.poll_interval = poll_interval
        self.call_timeout = call_timeout
        self._pool = pool
        self._ops = Operations(quote_ident(schema), failed_retention)
        self._rates = Rates(quote_ident(schema), schema)
        self._retention = failed_retention
        self._wakeups = WakeUps(hub, schema)
        self._closed = False
        self._identity = StoreIdentity(pool, self.schema, store_check_interval, on_error)
        self._stack: AsyncExitStack | None = None
        self._entered = False
        #: The finish-and-claim calls' pipelined connection, while the broker is entered.
        self._mux: PgMux | None = None

    @classmethod
    async def attach(
        cls, pool: PgPool, schema: str, hub: NotifyHub, **options: Any
    ) -> PostgresBroker:
        """Apply the broker's migrations in ``schema`` (and the store identity's: the first
        stamps it), make a broker on them and check the store's identity (a loss recorded in
        the store is reported at once).

        Raises:
            BrokerError: the schema holds a newer version of the broker's tables.
            BrokerUnavailable: the server cannot be reached.
        """
        broker = cls(pool, schema, hub, **options)
        await migrate(pool, broker.schema, PART, MIGRATIONS)
        await migrate(pool, broker.schema, IDENTITY_PART, IDENTITY_MIGRATIONS)
        await broker._identity.check()
        return broker

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        conninfo: str,
        *,
        schema: str = "durable_trio",
        pool_size: int = 8,
        **options: Any,
    ) -> AsyncIterator[PostgresBroker]:
        """A broker with its own pool and notify hub, for the block (``async with``).

        Args:
            conninfo: a ``postgresql://`` URL or a ``key=value`` string.
            schema: the PostgreSQL schema of the tables (created if missing).
            pool_size: the most connections the broker's pool opens.
            **options: as for :class:`PostgresBroker`.

        Raises:
            ConfigError: a bad URL or option.
            BrokerUnavailable: the server cannot be reached.
        """
        check_schema_name(schema)
        async with (
            open_pool(conninfo, size=pool_size) as pool,
            open_notify_hub(conninfo) as hub,
        ):
            broker = await cls.attach(pool, schema, hub, **options)
            async with broker:
                yield broker

    async def __aenter__(self) -> PostgresBroker:
        """Start the watch on the store's identity (until :meth:`aclose` or the block's end)."""
        if self._entered:
            raise RuntimeError("a PostgresBroker can be entered only once")
        self._entered = True
        stack = AsyncExitStack()
        nursery = await stack.enter_async_context(trio.open_nursery())
        self._stack = stack
        if self._pool.size >= MUX_MIN_POOL:
            self._mux = PgMux(self._pool, nursery)
        try:
            await nursery.start(self._identity.watch)
        except BaseException:  # cancelled while starting: leave the nursery before raising
            self._stop_background()
            self._stack = None
            await stack.aclose()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._closed = True
        self._stop_background()  # no checkpoint before the nursery is left, even when cancelled
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called."""
        return self._closed

    @property
    def pool(self) -> PgPool:
        """The pool the broker's calls run on."""
        return self._pool

    async def aclose(self) -> None:
        """Close the broker (not its pool or hub, which their maker closes) and stop its
        watch (leaving the ``async with`` waits for it). Idempotent, from any task. Later calls
        raise :class:`~durable_trio.BrokerUnavailable`."""
        self._closed = True
        self._stop_background()
        await trio.lowlevel.checkpoint()

    def _stop_background(self) -> None:
        """End what runs in the broker's nursery: the identity watch and the pipelined
        connection's reader (no checkpoint)."""
        self._identity.stop()
        if self._mux is not None:
            self._mux.close()

    async def _call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(pool, *args)`` shielded and bounded by ``call_timeout``: a call cancelled
        before it starts does nothing; once started it runs to its end (or the bound), so a
        call that changed something returns its result (the cancellation comes at the caller's
        next checkpoint), as the SQLite broker's calls do.

        Raises:
            BrokerUnavailable: the broker or its pool is closed, the server cannot be reached,
                or the call took longer than ``call_timeout`` (it may have run).
            StoreLost: the tables are missing (the schema dropped under this process); the
                watch on the store's identity checks at once.
            BrokerError: the server refused a statement.
        """
        if self._closed:
            raise BrokerUnavailable(f"the PostgreSQL broker on schema {self.schema!r} is closed")
        await trio.lowlevel.checkpoint_if_cancelled()
        # The call's one scope: its statements open none of their own (UNBOUNDED).
        deadline = trio.current_time() + self.call_timeout
        with trio.CancelScope(deadline=deadline, shield=True):
            try:
                return await fn(self._pool, *args)
            except TransportClosed as exc:
                raise BrokerUnavailable(f"the PostgreSQL pool is closed: {exc}") from exc
            except PostgresError as exc:
                if exc.sqlstate not in NO_TABLE:
                    raise
                self._identity.poke()
                raise tables_missing(self.schema, exc) from exc
        raise BrokerUnavailable(
            f"PostgreSQL did not answer a broker call within {self.call_timeout:g}s "
            "(it may have run)"
        )

    # -- required

    async def push_on(
        self, queue: str, job: Job, *, priority: int | None = None, delay: float = 0.0
    ) -> None:
        """Enqueue ``job`` and notify the queue's channel (in the push's transaction)."""
        statements = self._ops.push_statements(
            queue, job, priority or 0, delay, self._wakeups.channel(queue)
        )
        await self._call(_pipeline, statements)

    async def pop_from(self, queue: str, *, worker: str = "") -> ClaimedJob | None:
        """Promote due delayed jobs (at most ``PROMOTE_BATCH``), then claim the next ready job
        under a fresh random lease token, or return ``None`` (one round trip)."""
        claimed = await self._call(self._ops.pop, queue, 1, worker)
        return claimed[0] if claimed else None

    async def pop_many(self, queue: str, count: int, *, worker: str = "") -> list[ClaimedJob]:
        """Like :meth:`pop_from`, claiming up to ``count`` jobs in one statement."""
        if count <= 0:
            await trio.lowlevel.checkpoint()
            return []
        return await self._call(self._ops.pop, queue, count, worker)

    async def pop_ahead(
        self, queue: str, count: int, ahead: int, *, worker: str = ""
    ) -> list[ClaimedJob]:
        """:meth:`pop_many` of ``count + ahead`` jobs, the last ``ahead`` not started."""
        if count + ahead <= 0:
            await trio.lowlevel.checkpoint()
            return []
        return await self._call(self._ops.pop, queue, count, worker, ahead)

    async def mark_started(self, queue: str, leases: Sequence[Lease]) -> list[bool]:
        """Mark claims popped ahead started, and renew them (one statement)."""
        if not leases:
            await trio.lowlevel.checkpoint()
            return []
        return await self._call(self._ops.mark, self._ops.mark_started, queue, list(leases))

    async def complete_job(self, lease: Lease, queue: str) -> bool:
        """Delete a finished job. ``False``: the lease was lost, nothing changed."""
        channel = self._wakeups.channel(queue)
        (done,) = await self._call(self._ops.complete_many, queue, [lease], channel)
        return done

    async def complete_many(self, queue: str, leases: Sequence[Lease]) -> list[bool]:
        """``complete_job`` for each lease, in one statement."""
        if not leases:
            await trio.lowlevel.checkpoint()
            return []
        channel = self._wakeups.channel(queue)
        return await self._call(self._ops.complete_many, queue, list(leases), channel)

    async def push_many(
        self, queue: str, jobs: Sequence[Job], priorities: Sequence[int | None]
    ) -> None:
        """``push_on`` (no delay) for each job: one insert, one notification."""
        if len(jobs) != len(priorities):
            raise ValueError("push_many: one priority per job")
        statements = self._ops.push_many_statements(
            queue, jobs, priorities, self._wakeups.channel(queue)
        )
        if not statements:
            await trio.lowlevel.checkpoint()
            return
        await self._call(_pipeline, statements)

    async def push_and_complete_many(
        self, push_queue: str, jobs: Sequence[Job], queue: str, leases: Sequence[Lease]
    ) -> list[bool]:
        """Push then complete, in one transaction (:meth:`finish_and_claim` claiming none)."""
        done, _ = await self.finish_and_claim(push_queue, jobs, queue, leases, 0)
        return done

    async def finish_and_claim(
        self,
        push_queue: str,
        jobs: Sequence[Job],
        queue: str,
        leases: Sequence[Lease],
        count: int,
        *,
        worker: str = "",
    ) -> tuple[list[bool], list[ClaimedJob]]:
        """Push, complete, then claim up to ``count`` jobs of ``queue``: one pipeline, one
        transaction, one round trip (see ``SupportsFinishAndClaim``)."""
        ops = self._ops
        statements = ops.push_many_statements(
            push_queue, jobs, [None] * len(jobs), self._wakeups.channel(push_queue)
        )
        tokens = [lease.token for lease in leases]
        ids = [lease.job_id for lease in leases]
        complete_at = len(statements)
        if leases:
            channel = self._wakeups.channel(queue)
            statements.append((ops.complete, (queue, tokens, ids, channel)))
        limited = queue in ops.limited
        if count > 0:
            statements += ops.claim_statements(queue, count, worker, count, limited)
        if not statements:
            await trio.lowlevel.checkpoint()
            return [], []

        async def run(pool: PgPool) -> tuple[list[bool], list[ClaimedJob]]:
            mux = self._mux
            if mux is not None:  # (pipelined behind the other half's, see PgMux)
                results = await mux.pipeline(statements)
            else:
                results = await pool.pipeline(statements, command_timeout=UNBOUNDED)
            done: list[bool] = []
            if leases:
                hit = {row[0] for row in results[complete_at].rows}
                for lease in leases:
                    done.append(lease.token in hit)
                    hit.discard(lease.token)
            if count <= 0:
                return done, []
            if ops.learn(queue, results[-2]) and not limited:
                # (the queue has a limit now: its claim, under the queue's lock, after the
                # completes committed)
                claims = ops.claim_statements(queue, count, worker, count, True)
                results = await pool.pipeline(claims, command_timeout=UNBOUNDED)
            return done, await ops.read_claims(pool, results[-1])

        return await self._call(run)

    async def fail_job(self, lease: Lease, queue: str, error: str) -> bool:
        """Fail a job for good: moved to the failed table (the newest ``failed_retention``
        of the queue kept). ``False``: the lease was lost."""
        channel = self._wakeups.channel(queue)
        return await self._call(self._ops.fail_job, queue, lease, error, channel)

    async def fail_and_push(
        self, lease: Lease, queue: str, error: str, push_queue: str, job: Job
    ) -> bool:
        """:meth:`fail_job`, then (if the lease held) push ``job`` onto ``push_queue``, in one
        statement. ``False``: the lease was lost, nothing changed."""
        channels = (self._wakeups.channel(queue), self._wakeups.channel(push_queue))
        return await self._call(
            self._ops.fail_then_push, queue, lease, error, push_queue, job, channels
        )

    async def retry_job(
        self, lease: Lease, queue: str, *, delay: float = 0.0, count_attempt: bool = True
    ) -> bool:
        """Hand a claim back for redelivery after ``delay`` seconds, at the back of its
        priority (an immediate ``count_attempt=False`` handback keeps its place). ``False``:
        lease lost."""
        channel = self._wakeups.channel(queue)
        return await self._call(self._ops.retry_job, queue, lease, delay, count_attempt, channel)

    # -- capabilities

    async def renew_jobs(self, queue: str, leases: Sequence[Lease]) -> RenewOutcome:
        """Refresh ``claimed_at`` of every claim in ``leases`` still held (one statement)."""
        return await self._call(self._ops.renew_jobs, queue, list(leases))

    async def recover_stalled_jobs(
        self, queue: str, threshold: float, max_stalled: int
    ) -> Recovery:
        """Take back claims older than ``threshold`` seconds (an index range on
        (queue, claimed_at), locked with ``SKIP LOCKED``: sweeps in several processes share the
        work). Each gets a stall appended; past ``max_stalled`` it is re-leased to the caller
        and returned in ``exceeded``, otherwise put back to ready (and its channel notified)."""
        ops = self._ops
        channel = self._wakeups.channel(queue)

        async def sweep(pool: PgPool) -> Recovery:
            recovered = 0
            exceeded: list[ClaimedJob] = []
            while True:
                async with pool.transaction() as conn:
                    batch, seen = await ops.recover_batch(conn, queue, threshold, max_stalled)
                    if batch.recovered:
                        await conn.execute(
                            "SELECT pg_notify($1, '')", channel, command_timeout=UNBOUNDED
                        )
                recovered += batch.recovered
                exceeded += batch.exceeded
                if seen < RECOVER_BATCH:
                    return Recovery(recovered=recovered, exceeded=tuple(exceeded))

        return await self._call(sweep)

    async def set_queue_limit(
        self, queue: str, limit: int | None, *, per_key: bool = False
    ) -> None:
        """Store ``queue``'s fleet-wide limit (``None``: remove it) for every broker on the
        schema (see :class:`~durable_trio.brokers.SupportsQueueLimits`), and wake its waiters
        to look again. Each claim of a limited queue takes the queue's transaction-scoped
        advisory lock before it counts the queue's (or its key's) live claims, so the limit is
        exact however many processes claim (see the package docstring)."""
        limit = check_limit(limit)
        channel = self._wakeups.channel(queue)
        await self._call(self._ops.store_limit, queue, limit, per_key, channel)

    async def set_queue_rate(
        self, queue: str, count: int | None, per: float = 1.0, *, per_key: bool = False
    ) -> None:
        """Store ``queue``'s rate limit (``None``: remove it) for every broker on the schema
        (see :class:`~durable_trio.brokers.SupportsRateLimits` and :mod:`._rates`)."""
        if count is not None:
            count, per = check_rate(count, per)
        await self._call(self._rates.store, queue, count, per, per_key)

    async def take_starts(self, queue: str, want: int, key: str | None = None) -> RateGrant:
        """Log up to ``want`` starts of ``queue`` (of its ``key``) that fit its rate (one
        transaction, under the queue's rate lock)."""
        granted, retry_after, at = await self._call(self._rates.take, queue, want, key)
        return RateGrant(granted, retry_after, at)

    async def return_starts(
        self, queue: str, at: float, n: int, key: str | None = None
    ) -> None:
        """Remove ``n`` starts of ``queue`` (of its ``key``) logged at ``at``."""
        await self._call(self._rates.give_back, log_name(queue, key), at, n)

    async def queues_with_claims(self, queues: Sequence[str]) -> list[str]:
        """Those of ``queues`` holding claims (one statement on the claims' index)."""
        if not queues:
            await trio.lowlevel.checkpoint()
            return []
        rows = await self._call(_fetch, self._ops.queues_with_claims, list(queues))
        return sorted(str(row[0]) for row in rows)

    async def size_of(self, queue: str) -> int:
        """Jobs waiting to be claimed (ready and delayed)."""
        return await self._call(self._ops.size_of, queue)

    async def waiting_queues(self, prefix: str) -> list[str]:
        """The queues named ``prefix...`` holding ready or delayed jobs, sorted."""
        return await self._call(self._ops.queues, self._ops.waiting_queues, prefix)

    async def known_queues(self, prefix: str) -> list[str]:
        """The queues named ``prefix...`` holding any job (waiting, claimed or failed)."""
        return await self._call(self._ops.queues, self._ops.known_queues, prefix)

    async def job_state(self, queue: str, job_id: str) -> JobState | None:
        """Whether job ``job_id`` waits on ``queue`` or is claimed (``None``: neither)."""
        (state,) = await self._call(self._ops.job_states, queue, [job_id])
        return state

    async def job_states(self, queue: str, job_ids: Sequence[str]) -> list[JobState | None]:
        """:meth:`job_state` of each of ``job_ids``, in one statement."""
        if not job_ids:
            await trio.lowlevel.checkpoint()
            return []
        return await self._call(self._ops.job_states, queue, list(job_ids))

    async def failed_jobs(self, queue: str, *, limit: int = 100) -> list[FailedJob]:
        """The most recent failed jobs of ``queue``, newest first."""
        limit = min(limit, self._retention)
        if limit <= 0:
            await trio.lowlevel.checkpoint()
            return []
        return await self._call(self._ops.failed, queue, limit)

    async def requeue_failed(self, queue: str, job_id: str, *, priority: int | None = None) -> bool:
        """Put the newest failed job ``job_id`` back as ready, as a fresh push (its stored
        priority unless ``priority`` is given)."""
        channel = self._wakeups.channel(queue)
        return await self._call(self._ops.requeue, queue, job_id, priority, channel)

    async def delete_failed(self, queue: str, job_id: str) -> bool:
        """Remove the newest failed job ``job_id`` of ``queue`` from its failed set."""
        rows = await self._call(_fetch, self._ops.delete_failed, queue, job_id)
        return bool(rows)

    async def queue_stats(self, queue: str) -> QueueStats:
        """``queue``'s counts and its oldest ready job's age, in one statement."""
        stats = await self._call(self._ops.queue_stats, queue)
        rated = await self._call(self._rates.window, queue)
        return attrs.evolve(stats, **rated)

    async def quarantined(self, queue: str, *, limit: int = 100) -> list[QuarantinedEntry]:
        """The rows of ``queue`` whose id could not be read, moved aside by a pop or a sweep,
        newest first."""
        if limit <= 0:
            await trio.lowlevel.checkpoint()
            return []
        return await self._call(self._ops.quarantine_entries, queue, limit)

    async def wait_for_work(self, queue: str) -> None:
        """Return when ``queue`` may have work (see the package docstring).

        Returns at once if a job is ready or a delayed one is due; otherwise on a ``NOTIFY``
        saying work is ready on ``queue``, when the earliest delayed job comes due, after the
        backend's listening connection was lost and is back, or when a look every
        ``poll_interval`` finds work. It may return spuriously; it never misses a push
        committed after this broker's last empty pop (the channel is listened to before the
        first look). A look that fails returns after a pause (the consumer's next pop meets
        the error); only a closed broker raises (:class:`~durable_trio.BrokerUnavailable`).
        """
        if self._closed:
            raise BrokerUnavailable(f"the PostgreSQL broker on schema {self.schema!r} is closed")
        waiter = Waiter(queue)
        try:
            # On failure subscribed all the same: the look below meets the server as it is.
            with contextlib.suppress(BrokerUnavailable):
                await self._wakeups.watch(waiter)
            while True:
                waiter.event = trio.Event()  # before the look, so no ring slips in between
                waiter.ready = False
                try:
                    ready, due_in = await self._call(self._ops.look, queue)
                except BrokerError:
                    if self._closed:
                        raise
                    # The consumer's next pop meets the error and reports it (with its own
                    # backoff); a pause first, so a look that keeps failing is no busy loop.
                    await trio.sleep(min(1.0, self.poll_interval))
                    return
                if ready:
                    return
                timeout = self.poll_interval if due_in is None else min(due_in, self.poll_interval)
                with trio.move_on_after(timeout) as slept:
                    await waiter.event.wait()
                if waiter.ready:
                    return
                if slept.cancelled_caught and due_in is not None and due_in <= timeout:
                    return  # the earliest delayed job is due now
        finally:
            self._wakeups.unwatch(waiter)

    # -- the store's identity

    @property
    def store_loss(self) -> StoreLost | None:
        """The loss of the store this broker knows of (found or read from the store), until
        an operator acknowledges it; ``None``: none."""
        return self._identity.alarm

    async def read_store_loss(self) -> StoreLost | None:
        """The loss recorded in the store, or found by this broker and not recorded yet
        (one ``SELECT``); ``None``: none stands. Its tables missing is a loss too."""
        identity = self._identity

        async def read(pool: PgPool) -> StoreLost | None:
            return await identity.read_loss()

        return await self._call(read)

    async def acknowledge_store_loss(self) -> bool:
        """Clear the loss alarm (the running brokers clear theirs at their next check).
        ``False``: none stood."""
        identity = self._identity

        async def acknowledge(pool: PgPool) -> bool:
            return await identity.acknowledge()

        return await self._call(acknowledge)


async def _pipeline(pool: PgPool, statements: Sequence[tuple[str, Sequence[Any]]]) -> None:
    await pool.pipeline(statements, command_timeout=UNBOUNDED)


async def _fetch(pool: PgPool, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    return await pool.fetch(sql, *args, command_timeout=UNBOUNDED)
