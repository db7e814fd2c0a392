"""``min_replicas=N``: a write is acknowledged only once N replicas have it (``WAIT``).

Redis replication is asynchronous: a write the master answered can be lost when the master dies
before a replica copied it. With ``?min_replicas=N&replica_timeout=S`` in the URL, every
connection appends ``WAIT N S*1000`` to each request that holds a write, in the same pipeline
(so one round trip, and the ``WAIT`` counts exactly that connection's writes, on the node that
took them: a Cluster master, or the master Sentinel named). Fewer than N replicas acknowledging
within S seconds fails the call with :class:`~durable_trio.BrokerUnavailable`: the write may
still be on the master (and may reach its replicas later), so the caller's retry or redelivery
path runs, as after any lost reply.

Which commands are writes: everything but the read-only, connection and pub/sub commands below
(and blocking pops, whose claims a lost master only hands out again). A script (``EVALSHA``)
counts as a write: the client cannot tell a read-only one.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Final

from .._errors import BrokerUnavailable

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ._url import RedisURL

__all__ = ["NO_WAIT", "check_acknowledged", "replica_wait", "waited_timeout"]

#: Commands that change no data a caller was told is stored: no ``WAIT`` after them.
NO_WAIT: Final = frozenset(
    name.encode()
    for group in (
        # reads
        "GET MGET HGET HMGET HGETALL HLEN HEXISTS HKEYS HVALS HSCAN HSTRLEN EXISTS TYPE TTL PTTL",
        "STRLEN GETRANGE LLEN LRANGE LINDEX LPOS SCARD SMEMBERS SISMEMBER SMISMEMBER SSCAN ZCARD",
        "ZRANGE ZREVRANGE ZRANGEBYSCORE ZREVRANGEBYSCORE ZSCORE ZMSCORE ZRANK ZREVRANK ZCOUNT",
        "ZSCAN SCAN KEYS DBSIZE XLEN XRANGE XREVRANGE XINFO OBJECT MEMORY EVAL_RO EVALSHA_RO",
        "FCALL_RO",
        # connection, server and cluster commands
        "PING ECHO TIME INFO ROLE CONFIG CLIENT AUTH SELECT HELLO CLUSTER ASKING READONLY",
        "READWRITE SCRIPT WAIT WAITAOF SENTINEL COMMAND",
        # pub/sub (doorbells: not data)
        "PUBLISH SPUBLISH SUBSCRIBE SSUBSCRIBE PSUBSCRIBE UNSUBSCRIBE SUNSUBSCRIBE PUNSUBSCRIBE",
        # blocking pops: a claim lost with its master is handed out again (at-least-once)
        "BLPOP BRPOP BLMOVE BRPOPLPUSH BLMPOP BZPOPMIN BZPOPMAX BZMPOP XREAD XREADGROUP",
    )
    for name in group.split()
)


def _name(command: Sequence[object]) -> bytes:
    first = command[0]
    raw = first if isinstance(first, bytes) else str(first).encode()
    return raw.upper()


def replica_wait(url: RedisURL, batch: Sequence[Sequence[object]]) -> tuple[str, int, int] | None:
    """The ``WAIT`` to append to ``batch``, or ``None`` (no ``min_replicas``, or no write).

    Args:
        url: the connection's settings (``min_replicas``, ``replica_timeout``).
        batch: the commands of one request.

    Returns:
        ``("WAIT", N, milliseconds)`` or ``None``.
    """
    if not url.min_replicas or all(_name(command) in NO_WAIT for command in batch):
        return None
    # WAIT's timeout 0 means forever: at least one millisecond.
    return ("WAIT", url.min_replicas, max(1, round(url.replica_timeout * 1000)))


def waited_timeout(url: RedisURL, reply_timeout: float | None, default: float) -> float:
    """A request's reply timeout with its ``WAIT`` in it: the replicas' time on top, so a
    ``WAIT`` that runs out is reported as too few replicas, not as a stuck connection."""
    base = default if reply_timeout is None else reply_timeout
    return base if math.isinf(base) else base + url.replica_timeout


def check_acknowledged(url: RedisURL, reply: Any) -> None:
    """Raise unless the ``WAIT`` reply counts ``min_replicas`` replicas.

    Raises:
        BrokerUnavailable: fewer replicas acknowledged in time (the write may still be on the
            master), or the node refused ``WAIT`` (a replica, ``NOPERM``).
    """
    if isinstance(reply, int) and reply >= url.min_replicas:
        return
    got = f"{reply} replica(s)" if isinstance(reply, int) else f"an error ({reply})"
    raise BrokerUnavailable(
        f"Redis at {url.address}: the write was not confirmed by min_replicas="
        f"{url.min_replicas} within replica_timeout={url.replica_timeout}s (WAIT answered "
        f"{got}); it may still be on the master and reach its replicas later"
    )
