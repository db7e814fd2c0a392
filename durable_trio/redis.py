"""A Trio-native Redis client: the one durable_trio's Redis broker and stores speak through.

Connect by URL, send commands, pipelines and Lua scripts, subscribe, and follow a Redis
Cluster or a Sentinel-managed master, all inside ``trio.run``, with no asyncio bridge
(docs/redis-client.md)::

    from durable_trio.redis import open_redis

    async with open_redis("redis://127.0.0.1:6379/0") as client:
        await client.execute("SET", "greeting", "hello")
        assert await client.execute("GET", "greeting") == b"hello"

**URLs.** :func:`open_redis` takes ``redis://[[user]:password@]host[:port][/db]``,
``rediss://`` (TLS) and ``redis+sentinel://[[user]:password@]s1:26379,s2:26379/MASTER[/db]``
(the master the sentinels name, followed through failovers); :func:`open_redis_cluster` takes
``redis+cluster://host1:port1,host2:port2`` (``rediss+cluster://``: TLS). Query options:
``client_name``, ``ssl_cert_reqs``, ``ssl_ca_certs``, ``min_replicas`` and ``replica_timeout``
(a write acknowledged only once that many replicas have it: ``WAIT`` in the same round trip).

**Replies** come as hiredis parses them: ``bytes`` for strings, ``int``, ``None`` for nil,
``list`` for arrays; an error reply is raised as :class:`RedisReplyError` (inside an array or
with ``pipeline(..., raise_on_error=False)`` it is returned as that value instead).

**Concurrency.** One client is shared by any number of tasks. Each connection has one writer
and one reader; the commands that the tasks send during one pass of Trio's scheduler leave in
one write per connection (auto-pipelining; the first on an idle connection leaves at once, so
the server works on it while the pass runs on), and replies come back in order. The pool opens
connections lazily, up to ``pool_size`` (one by default, as ioredis's: concurrent callers cost
least on one connection), and replaces dead ones (with a backoff).

**Cancellation** (the rules the broker relies on):

* a call cancelled after its command was queued never takes its reply slot out of the queue,
  so the connection's replies and callers can never get out of step: on a pooled connection
  its reply is read and dropped and the connection kept (``trio.move_on_after`` around a call
  costs nothing more);
* on a :meth:`~RedisClient.dedicated` connection (blocking commands such as ``BLPOP``,
  ``MULTI``/``WATCH``) the connection is discarded instead, so a cancelled ``BLPOP`` cannot pop
  an item nobody will read;
* a command waiting past its ``reply_timeout`` (default: the client's ``command_timeout``)
  discards its connection: every call waiting on it gets :class:`RedisCommandTimeout` or
  :class:`~durable_trio.BrokerUnavailable`, never a hang;
* a cancelled (or timed-out) command may still have run on the server: it is never retried by
  the client.

**Errors** are durable_trio's (``durable_trio.BrokerError`` and below): connection problems and
timeouts are :class:`~durable_trio.BrokerUnavailable`; error replies :class:`RedisReplyError`,
except the transient ones (``-LOADING``, ``-BUSY``, ``-TRYAGAIN``...), :class:`RedisBusyReply`,
out of memory (``-OOM``), :class:`RedisOutOfMemory` (both unavailable too), and refused
credentials (``-WRONGPASS``, ``-NOAUTH``, ``-NOPERM``), :class:`RedisAuthError`, and a refused
database number (``SELECT``), :class:`RedisDatabaseRefused` (both also a
:class:`~durable_trio.ConfigError`); a closed
client raises :class:`~durable_trio.TransportClosed`.

This module is the client's public face: the names below are the API durable_trio keeps
stable. It re-exports the implementation of ``durable_trio._redis`` (the broker imports that
directly: the same objects).
"""

from __future__ import annotations

from ._redis import (
    ClusterStats,
    Connection,
    ConnectionStats,
    MasterLocator,
    RedisArg,
    RedisAuthError,
    RedisBusyReply,
    RedisClient,
    RedisClusterClient,
    RedisClusterURL,
    RedisCommandTimeout,
    RedisCrossSlotError,
    RedisDatabaseRefused,
    RedisOutOfMemory,
    RedisReplyError,
    RedisURL,
    Script,
    SentinelURL,
    ShardedSubscription,
    Subscription,
    key_slot,
    open_redis,
    open_redis_cluster,
    parse_redis_cluster_url,
    parse_redis_url,
    parse_sentinel_url,
)

__all__ = [
    "ClusterStats",
    "Connection",
    "ConnectionStats",
    "MasterLocator",
    "RedisArg",
    "RedisAuthError",
    "RedisBusyReply",
    "RedisClient",
    "RedisClusterClient",
    "RedisClusterURL",
    "RedisCommandTimeout",
    "RedisCrossSlotError",
    "RedisDatabaseRefused",
    "RedisOutOfMemory",
    "RedisReplyError",
    "RedisURL",
    "Script",
    "SentinelURL",
    "ShardedSubscription",
    "Subscription",
    "key_slot",
    "open_redis",
    "open_redis_cluster",
    "parse_redis_cluster_url",
    "parse_redis_url",
    "parse_sentinel_url",
]
