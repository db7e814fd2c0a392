"""The Redis broker: many machines, one Redis (or one Redis Cluster slot per queue).

Open one on a :class:`~durable_trio._redis.RedisClient` and enter it (it owns one background
task, the doorbell listener)::

    async with open_redis(url) as client, RedisBroker(client) as broker:
        await broker.push_on("q", Job("1", b"{}"))

or let it open its own client: ``async with RedisBroker.from_url(url) as broker:``.

Parts (one concern per module; the broker owns its parts and calls them, no part is a base
class of another):

    ================  =========================================================================
    ``_queue``        the key layout of one queue (:class:`~._queue.Queue`: key names under
                      its hash tag, grouped per script) and the priority range
    ``_bell``         one queue's wake-up state (:class:`~._bell.Bell`: rings counted, the last
                      empty pop), held by its :class:`~._queue.Queue`
    ``_seq``          the sequence counter's Lua helper (``take_seq``: numbers, rebuilt on
                      damage)
    ``_scripts``      the Lua sources and their registration with a client
                      (:class:`~._scripts.Scripts`)
    ``_replies``      the reply parsers: a script's reply or a stored record made into the
                      contract's types, never raising
    ``_doorbell``     the doorbell listener, an object the broker owns: one ``SUBSCRIBE``
                      (:class:`~._doorbell.PubSubDoorbell`) or one ``SSUBSCRIBE`` per queue
                      (:class:`~._doorbell.ShardedDoorbell`), and the wait of
                      :meth:`RedisBroker.wait_for_work`
    ``_slots``        the fleet-wide limits' Lua (``SupportsQueueLimits``): a lease's slot
                      freed, a full key's jobs parked and unparked, the limit set and read
    ``_lookups``      the scripts of the looks (a job's state, size, the oldest ready job)
                      and of the requeue of a failed job
    ``_repair``       the operator's calls (requeue, delete, queue stats, listing, the
                      queue's limit), an object the broker owns
    ``_identity``     the watch on the store's identity (a store emptied or replaced), an
                      object the broker owns
    ``_broker``       :class:`RedisBrokerBase` (the contract's calls) and :class:`RedisBroker`
    ``_cluster``      :class:`RedisClusterBroker`: the same parts, the sharded doorbell
    ================  =========================================================================

Key layout:
    Every key of queue ``Q`` carries the hash tag ``{Q}``, so a queue lives in one Cluster slot
    and every script touches one slot only:

    ======================  ======  ==========================================================
    ``{Q}:seq``             string  ``INCRBY`` counter: internal job ids and FIFO sequence
                                    numbers (damaged: rebuilt from the queue, see ``TAKE_SEQ``)
    ``{Q}:ready``           zset    score = priority, member = ``%016d(seq) .. n``
    ``{Q}:delayed``         zset    score = due time (server seconds), member as in ``ready``
    ``{Q}:active``          zset    score = claimed (or last renewed) at, member = lease token
    ``{Q}:jobs``            hash    ``n`` -> job bytes; ``t`` .. ``n`` -> its push time,
                                    ``"<seconds> <microseconds>"`` as the server's ``TIME``
                                    gives them, kept through retries, reclaims and delays
                                    (``queue_stats``' oldest ready age), written and deleted
                                    with the bytes in the same command; ``k`` .. ``n`` -> its
                                    concurrency key (``Job.key``; none: no field)
    ``{Q}:meta``            hash    ``n`` -> ``"priority:attempts:stalled_count:id"``
    ``{Q}:stalls``          hash    ``n`` -> stall history, JSON ``[[at, worker], ...]``
                                    (``[at, worker, 0]``: a stall that did not count)
    ``{Q}:claims``          hash    ``n`` -> ``%016d(seq) .. worker`` of the current claim:
                                    the place it had in ``ready``, and who holds it (a byte
                                    ``\x01`` before the worker: popped ahead, not started)
    ``{Q}:failed``          list    failed jobs, newest first, trimmed to ``failed_retention``
                                    (a job with damaged meta too: kept raw, see the scripts)
    ``{Q}:quarantine``      list    stored entries that name no readable job (a member of
                                    ``ready``, ``delayed`` or ``active`` without a job or
                                    meta, a replaced stall history, a rebuilt sequence
                                    counter), each with what was found,
                                    the reason and the server time; newest first, trimmed to
                                    ``quarantine_retention``
    ``{Q}:moved``           zset    score = ``n``, member as in ``ready``: the ready jobs at
                                    another place than their push's (promoted, retried, or
                                    reclaimed after one of those), for ``queue_stats``
    ``{Q}:limit``           hash    the fleet-wide limit: ``max`` (an int >= 1), ``per_key``
                                    (``1``/``0``); none: no limit (see ``_slots``)
    ``{Q}:held``            zset    per key (a ``per_key`` limit only): one member per live
                                    lease, ``<len(key)>:<key>:<token>``, score 0 (a key's
                                    slots in use: one ``ZLEXCOUNT``)
    ``{Q}:parked``          zset    ready jobs of a full key, score 0, member
                                    ``<len(key)>:<key>:`` + sign and 16 digits of priority +
                                    its ``ready`` member; one goes back to ``ready`` when a
                                    lease of its key ends
    ``{Q}:full``            string  set by a claim a queue-wide limit stopped short: the next
                                    lease to end rings the doorbell
    ``{Q}:armed``           string  set by a pop that found nothing: someone may be waiting
    ``{Q}:claimed``         string  set by a claim, cleared by a sweep that leaves none
    ======================  ======  ==========================================================

    Outside the queues, ``{durable-trio}:identity`` and ``{durable-trio}:store-lost``: the
    store's identity and its loss alarm (see :mod:`~durable_trio.brokers.redis._identity`).

    ``n`` is the job's internal id (the ``seq`` value of its push), so two pushes never collide
    even if they reuse a job id. A lease token is ``n:<random>``, 64 random bits per claim
    (drawn with :mod:`secrets` by the client, one slice per claim), so a dead token cannot be
    guessed back to life, and the ``n`` prefix keeps it unique whatever the random part.

Ordering:
    ``ready`` is scored by the priority alone; jobs of one priority are ordered by their member,
    which starts with a zero-padded sequence number (Redis orders equal scores by member, byte
    by byte). So FIFO within a priority needs no timestamp, and the priority range does not eat
    into the sequence's range as a combined ``priority * 2**k + seq`` score would: priorities
    are any integer in ``[MIN_PRIORITY, MAX_PRIORITY]`` (exact as a double score), and the
    sequence runs to 2**53 (Lua's exact integers: three centuries of a million operations a
    second on one queue). A push, a promotion and a counted retry take a new sequence number
    (the back of the priority); a reclaimed job and an immediate attempt-neutral handback get
    back the place they were popped from (kept in ``{Q}:claims``): they waited their turn once.

Scripts:
    One Lua script per multi-key step (push, claim, complete, fail, retry, renew, recover,
    size, peek), registered once with the client and run by ``EVALSHA`` (the client falls back
    to ``EVAL`` on ``NOSCRIPT``, after a restart or ``SCRIPT FLUSH``). Every script reads the
    server's clock (``TIME``); delays and thresholds travel as relative seconds. The claim
    script promotes at most ``promote_batch`` due delayed jobs per call. Claims are indexed by
    age in ``active``, so recovery is ``ZRANGEBYSCORE ... LIMIT``: O(log n + k), never a scan of
    every claim; renewal moves a claim's score.

Fleet-wide limits (:meth:`RedisBrokerBase.set_queue_limit`, see :mod:`._slots`):
    The claim script reads ``{Q}:limit`` and claims only what fits: queue-wide, ``max`` minus
    the live leases (``ZCARD {Q}:active``: a slot is a lease, so it comes back however the
    lease ends); per key, a job whose key has ``max`` live entries in ``{Q}:held`` is parked
    and the jobs behind it are claimed. Every script that ends a lease frees its slot in the
    same run (its held entry, one parked job of its key back to ``ready``) and rings the
    doorbell when a waiter was stopped by the limit; a peek (a waiter's look) answers "work"
    only for a ready job that fits. A limit key holding junk is moved to the quarantine by the
    next claim (a report): no limit until one is stored again.

Wake-up (:meth:`RedisBroker.wait_for_work`):
    A pop that finds nothing sets ``{Q}:armed`` (in the same script, atomically with finding
    nothing). A push, retry or recovery that finds the flag deletes it and ``PUBLISH``\\ es on
    the queue's doorbell channel; when nobody waits, nothing is published, so busy workers are
    not flooded with messages. Each broker keeps ONE subscription connection, subscribing a
    queue's channel the first time a task waits on it, and counts the rings per queue. A
    waiter compares the count with the one taken just before its broker's last empty pop: if
    the subscription was already confirmed when that pop was sent, no push after the pop can
    go unnoticed; otherwise it first subscribes, then re-checks (``peek``, which arms too).
    A waiter also wakes when the earliest delayed job comes due (the claim script returns that
    time). Every ``safety_poll_interval`` seconds (on a grid shared by every waiter, so the
    checks of all idle queues leave together as ONE ``MGET`` of their ``{Q}:armed`` flags) a
    waiter checks its flag: a push, retry or recovery since the flag was set would have
    deleted it, so while it stands
    nothing became ready, whatever happened to the doorbell; once it is gone (or lost to a
    flush or an eviction) the waiter returns and the caller's next pop re-arms. A silent
    subscription is ``PING``\\ ed after ``safety_poll_interval`` seconds. A lost subscription
    is reported (``on_error`` and the log), reopened with a jittered exponential backoff, and
    every queue's waiters are rung once it is back (they re-check). An idle broker therefore
    costs about ``2 / safety_poll_interval`` commands a second (one MGET, one PING), none of
    them a script, whatever the number of queues: 0.07/s at the default 30 s.

Damaged data:
    Whatever is stored, no call raises for it and nothing is dropped (see the scripts'
    conventions): a claim with an unreadable field is handed over flagged
    (:attr:`~durable_trio.brokers.ClaimedJob.damage`, failed unread by the transport, kept raw
    in ``failed``); an entry that names no readable job goes to ``quarantine``; a damaged
    ``{Q}:seq`` is rebuilt from what the queue holds by the script that meets it, which goes on
    (recorded in ``quarantine``, reported once); a key of the wrong type fails its script
    before any write (a :class:`~durable_trio.BrokerError`). Run Redis with
    ``maxmemory-policy noeviction``: entering the broker warns otherwise
    (:class:`EvictionPolicyWarning`).

Errors:
    The client raises the project's own errors: :class:`~durable_trio.BrokerUnavailable` when
    Redis cannot be reached or does not answer in time (or is out of memory, ``-OOM``:
    :class:`~durable_trio._redis.RedisOutOfMemory`, nothing of the refused script written),
    :class:`~durable_trio.BrokerError` for an error reply,
    :class:`~durable_trio.TransportClosed` once the client is closed. A worker's result push
    and its task's acknowledgement are one script (:meth:`RedisBrokerBase.push_and_complete_many`):
    a refused push never leaves its task acknowledged.

Cancellation:
    A call cancelled after its command was sent may still have run on the server (the client
    drains the reply). A cancelled pop may therefore leave a claim nobody tracks; the stalled
    sweep takes it back. The transport shields its pops for this reason.
"""

from typing import TYPE_CHECKING

from ..._lazy import lazy_getattr
from ._broker import (
    PROMOTE_BATCH,
    EvictionPolicyWarning,
    RedisBroker,
    RedisBrokerBase,
    RedisBrokerStatistics,
)
from ._queue import MAX_PRIORITY, MIN_PRIORITY

if TYPE_CHECKING:
    from ._cluster import RedisClusterBroker

# RedisClusterBroker is imported on first use (PEP 562), with the Cluster client under it: a
# broker on one ``redis://`` node never loads them. Hidden from type checkers, as in the
# package's ``__init__``.
if not TYPE_CHECKING:
    __getattr__ = lazy_getattr(globals(), {"RedisClusterBroker": "._cluster"})


def __dir__() -> list[str]:
    return sorted({*globals(), "RedisClusterBroker"})


__all__ = [
    "MAX_PRIORITY",
    "MIN_PRIORITY",
    "PROMOTE_BATCH",
    "EvictionPolicyWarning",
    "RedisBroker",
    "RedisBrokerBase",
    "RedisBrokerStatistics",
    "RedisClusterBroker",
]
