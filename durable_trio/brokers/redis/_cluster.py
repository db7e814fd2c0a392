"""The Redis broker on a Redis Cluster: every queue in one slot, the doorbells sharded.

Open one on a :class:`~durable_trio._redis.RedisClusterClient` (or let
:func:`~durable_trio.open_backend` do it for a ``redis+cluster://`` URL)::

    async with open_redis_cluster(url) as client, RedisClusterBroker(client) as broker:
        await broker.push_on("q", Job("1", b"{}"))

The same parts as the single-node broker (see :mod:`durable_trio.brokers.redis`): its key
layout, scripts, reply parsers, repair and identity watch, and what they do with damaged data,
with the sharded doorbell (:class:`~durable_trio.brokers.redis._doorbell.ShardedDoorbell`)
for the pub/sub one. Every key of queue ``Q`` carries the hash tag ``{Q}``, so each queue
lives in one slot, on one master, and each script touches that slot only.
Different queues spread over the masters. What differs:

- **Doorbells** are sharded channels: the scripts ring with ``SPUBLISH`` on ``{Q}:doorbell@0``
  (in ``Q``'s slot, so a script may publish it), and a waiting broker holds one
  ``SSUBSCRIBE`` per waited queue, on that queue's master, which follows the slot through a
  failover (a resubscription rings the queue: its waiters re-check).
- **Checks that span queues** (the doorbell's safety check of every idle queue, the sweep hint
  of which queues hold claims) are one pipeline of ``GET``\\ s per master, the masters
  concurrently: one round trip per master instead of one ``MGET``.
- **Listings** (``waiting_queues``, ``known_queues``) ``SCAN`` every master.
- **No atomic fail-and-push** (:class:`~durable_trio.brokers.SupportsFailAndPush`): the two
  queues are two slots. The transport then fails the poison job first and publishes its result
  after, republishing it until it lands (see ``_leases.py``).
- **Push-and-complete in two round trips** (a worker's results and its tasks' acknowledgements,
  :meth:`~durable_trio.brokers.redis.RedisBrokerBase.push_and_complete_many` and
  ``finish_and_claim``): the results queue and the task queue are two slots, so the results
  are pushed first and the tasks completed only once that push has landed. A push refused (a
  master out of memory, unreachable) leaves the tasks claimed, with nothing lost; a failure
  after the push leaves them claimed with their results published, so a result may arrive
  twice (the engine applies one and counts the other as a duplicate), never not at all. The
  single-server broker does both in one script.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, ClassVar

from ..._redis import RedisClusterClient, open_redis_cluster
from ._broker import RedisBrokerBase
from ._doorbell import Doorbell, ShardedDoorbell

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from ._repair import Scanner

__all__ = ["RedisClusterBroker"]


class RedisClusterBroker(RedisBrokerBase):
    """A :class:`~durable_trio.brokers.QueueBroker` on a Redis Cluster (see the module docs).

    Args:
        client: an entered :class:`~durable_trio._redis.RedisClusterClient` (not closed by the
            broker).
        **options: as :class:`~durable_trio.brokers.redis.RedisBrokerBase`
            (``safety_poll_interval``, ``failed_retention`` ...).

    Raises:
        ConfigError: an option out of range.
    """

    _PUBLISH: ClassVar[str] = "SPUBLISH"
    _DOORBELL: ClassVar[type[Doorbell]] = ShardedDoorbell
    _client: RedisClusterClient

    def __init__(self, client: RedisClusterClient, **options: Any) -> None:
        super().__init__(client, **options)

    @classmethod
    @asynccontextmanager
    async def from_url(cls, url: str, **options: Any) -> AsyncIterator[RedisClusterBroker]:
        """Open a Cluster client on ``url`` (``redis+cluster://h1:p1,h2:p2``) and a broker on
        it; close both on leaving the block.

        Yields:
            the entered broker.
        """
        async with open_redis_cluster(url) as client, cls(client, **options) as broker:
            yield broker

    async def _read_flags(self, keys: list[str]) -> list[bool]:
        """Which of ``keys`` exist: one pipeline of ``GET``\\ s per master (the keys are in the
        slots of many queues: no ``MGET`` spans them)."""
        values = await self._client.pipeline([("GET", key) for key in keys])
        return [value is not None for value in values]

    async def _scan_targets(self) -> list[Scanner]:
        """Every master's pool (the slot map read first if it has not been yet)."""
        if not self._client.slot_map.masters:
            await self._client.execute("PING")  # (any command reads the map first)
        return [await self._client.pool(node.address) for node in self._client.slot_map.masters]
