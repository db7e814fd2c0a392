"""A thin Trio-native Redis client on hiredis's sans-IO parser.

One writer task per connection coalesces every queued command into one ``send_all``; one reader
task hands replies back in FIFO order; a small pool spreads callers over a few connections.
Failures are translated at this edge into the project's error tree: connection problems and
timeouts are :class:`~durable_trio._errors.BrokerUnavailable`, error replies are
:class:`RedisReplyError` (a :class:`~durable_trio._errors.BrokerError`), except the transient
ones (``-LOADING``, ``-BUSY``, ``-TRYAGAIN``...): :class:`RedisBusyReply`, unavailable too,
an out-of-memory refusal (``-OOM``): :class:`RedisOutOfMemory`, unavailable too, and refused
credentials (``-WRONGPASS``, ``-NOAUTH``, ``-NOPERM``): :class:`RedisAuthError`, an
:class:`~durable_trio._errors.AuthenticationError`.

:func:`open_redis_cluster` opens a Redis Cluster client with the same surface, routing each
command to the master of its keys' slot (``redis+cluster://`` URLs). :func:`open_redis` on a
``redis+sentinel://`` URL is the single-node client following the master that Redis Sentinel
names (:class:`MasterLocator`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_getattr
from ._client import RedisClient, open_redis
from ._connection import Connection, ConnectionStats, RedisArg
from ._errors import (
    RedisAuthError,
    RedisBusyReply,
    RedisCommandTimeout,
    RedisCrossSlotError,
    RedisDatabaseRefused,
    RedisOutOfMemory,
    RedisReplyError,
)
from ._kinds import is_cluster_client
from ._pubsub import Subscription
from ._script import Script
from ._url import RedisClusterURL, RedisURL, parse_redis_cluster_url, parse_redis_url

if TYPE_CHECKING:
    from ._cluster import RedisClusterClient, open_redis_cluster
    from ._cluster_nodes import ClusterStats
    from ._keyslot import key_slot
    from ._sentinel import MasterLocator
    from ._sentinel_url import SentinelURL, parse_sentinel_url
    from ._sharded import ShardedSubscription

#: The names of the Cluster and Sentinel code, imported on first use (PEP 562): a client of one
#: ``redis://`` node never loads them. Name -> its module.
_LAZY = {
    "RedisClusterClient": "_cluster",
    "open_redis_cluster": "_cluster",
    "ClusterStats": "_cluster_nodes",
    "key_slot": "_keyslot",
    "MasterLocator": "_sentinel",
    "SentinelURL": "_sentinel_url",
    "parse_sentinel_url": "_sentinel_url",
    "ShardedSubscription": "_sharded",
}


# Hidden from type checkers (as in the package's ``__init__``): with a module __getattr__ in
# sight, mypy would accept any name as an attribute of this package.
if not TYPE_CHECKING:
    __getattr__ = lazy_getattr(globals(), {name: f".{module}" for name, module in _LAZY.items()})


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


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
    "is_cluster_client",
    "key_slot",
    "open_redis",
    "open_redis_cluster",
    "parse_redis_cluster_url",
    "parse_redis_url",
    "parse_sentinel_url",
]
