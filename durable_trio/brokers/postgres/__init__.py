"""The PostgreSQL broker: the queue in SQL, for many machines on one database server.

Open one with its own pool and notify hub, or attach it to a backend's::

    async with PostgresBroker.open("postgresql://app@db/app") as broker:
        await broker.push_on("q", Job("1", b"{}"))

    broker = await PostgresBroker.attach(pool, "durable_trio", hub)

Parts (one concern per module, as the SQLite broker's):
    ``_schema.py``, the tables and indexes as versioned migration steps; ``_rows.py``, every
    stored field checked as it is read, the damage and the quarantine; ``_operations.py``,
    the SQL of each call; ``_wakeup.py``, the waiters, the queues' ``NOTIFY`` channels and
    what wakes them; ``_identity.py``, the store's identity and its loss alarm (a schema
    dropped or replaced under the processes); ``_broker.py``, :class:`PostgresBroker`, which
    composes them with a :class:`~durable_trio._postgres.PgPool` and the backend's
    :class:`~durable_trio._postgres.NotifyHub`.

Tables:
    Every job that waits or is claimed is one row of ``<schema>.broker_jobs``, its queue (the
    namespace included) a column and its state one of ``ready``, ``delayed``, ``active``; a
    partial index per state holds only that state's rows. A finished job's row is deleted; a
    failed one moves to ``broker_failed`` (the newest ``failed_retention`` per queue kept); a
    row whose id cannot be read moves to ``broker_quarantine``. Ready jobs pop in (priority,
    ``seq``) order, ``seq`` from one sequence for the schema (FIFO within a priority across
    processes). Times are the server's clock, epoch seconds.

Claims:
    A pop promotes due delayed jobs (at most :data:`PROMOTE_BATCH`), then claims the first
    ready rows with ``FOR UPDATE SKIP LOCKED`` (concurrent consumers never wait for, or take,
    each other's rows), in one pipelined round trip and one transaction. A lease token is a
    random 64-bit prefix per call plus the claim's place in it. Completes, renewals and
    ``mark_started`` are one set-based statement for many leases; a worker's
    ``finish_and_claim`` (push results, complete, claim more) is one pipeline. Stall recovery
    locks the stalled claims with ``SKIP LOCKED`` too, so sweeps in many processes share the
    work, and counts the stall evidence as the SQLite broker does.

Fleet-wide limits (``SupportsQueueLimits``, :meth:`PostgresBroker.set_queue_limit`):
    A limited queue has a row in ``broker_limits``; each job carries its concurrency key
    (``ckey``, ``''`` for none). Every claim's first statement (the promote) takes the queue's
    transaction-scoped advisory lock (``pg_advisory_xact_lock`` on a hash of schema and queue)
    when, and only when, that row exists; the claim statement after it takes its READ
    COMMITTED snapshot once the lock is held, so it counts every claim committed before it and
    none can be made beside it: the count is exact for any number of brokers and processes.
    It hands out no more than the free slots, or per key skips the keys at their limit
    (``ckey NOT IN`` the full keys, counted off a partial index of the keyed claims) and keeps
    of each other key only what fits. An unlimited queue's claim takes no lock and runs the
    plain claim statement, guarded by the absence of a limit row: each broker keeps a hint
    of the queues it last saw limited, and a plain claim that finds a limit claims nothing,
    the call then claiming again with the counting statement. A lease that ends on a limited
    queue (complete, fail) notifies the queue's channel, so a waiter at the limit looks again;
    the probe of ``wait_for_work`` counts ready jobs that do not fit as no work.

Wake-up (:meth:`PostgresBroker.wait_for_work`):
    A push (retry, requeue, recovery) sends ``NOTIFY`` on its queue's channel inside its own
    transaction: delivered on commit only, folded by PostgreSQL into one per transaction and
    channel, one for a whole batch push. The channel's name is a hash of schema and queue (a
    safe identifier of fixed length). A waiter subscribes to it on the hub (one ``LISTEN``
    connection per backend) before its first look, so a push after that look is never missed;
    it also wakes when its earliest delayed job comes due, every ``poll_interval`` seconds (a
    look), and once when the hub's connection was lost and is back.

Damaged rows:
    PostgreSQL enforces column types, but another program may still write a NULL id or data,
    a negative count, a stall history that is not one, a non-finite time. A claim with such a
    field is handed over with ``ClaimedJob.damage`` (the transport fails it, kept inspectable);
    a row with a NULL id is moved to the quarantine (:meth:`PostgresBroker.quarantined`).

The store's identity:
    ``<schema>.durable_trio_store`` (the ``store`` part) holds an identity stamped when the
    tables are created; every broker checks it at its open, every ``store_check_interval``,
    after every connection its pool opens and when a call finds its tables missing, and raises
    the :class:`~durable_trio.StoreLost` alarm on a loss (see :mod:`._identity`). Missing
    tables are a ``StoreLost`` naming the schema; they are not created again by the running
    processes.

Errors and cancellation:
    Every call runs shielded and bounded by ``call_timeout``: cancelled before it starts it
    does nothing; once started it runs to its end, so a call that changed something returns.
    The driver's errors are the project's: :class:`~durable_trio.BrokerUnavailable` when the
    server cannot be reached (or a call outlives its bound), a
    :class:`~durable_trio.BrokerError` for a statement the server refused.
"""

from ._broker import CALL_TIMEOUT, POLL_INTERVAL, STORE_CHECK_INTERVAL, PostgresBroker
from ._operations import PROMOTE_BATCH
from ._wakeup import channel_for

__all__ = [
    "CALL_TIMEOUT",
    "POLL_INTERVAL",
    "PROMOTE_BATCH",
    "STORE_CHECK_INTERVAL",
    "PostgresBroker",
    "channel_for",
]
