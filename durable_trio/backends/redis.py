"""``redis://`` / ``rediss://`` / ``redis+sentinel://`` (and ``redis+cluster://`` /
``rediss+cluster://``, a Redis Cluster): one client, the Redis broker, key store and run stores
on it (on the master, for a Sentinel URL).

Imported lazily by :func:`~durable_trio.open_backend`: ``hiredis`` is an optional dependency.
"""

from __future__ import annotations

from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .._attrs_shared import shared_eq, shared_hash, shared_repr
from .._redact import redact_url, url_scheme
from .._redis import RedisClient, is_cluster_client, open_redis
from ..brokers.redis import RedisBroker
from ..keys.redis import RedisKeyStore
from ._backend import Backend

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from .._engine._stores._contract import RunStore

    # (RedisRunStores is never structured by cattrs: its annotations are never resolved)
    from .._redis import RedisClusterClient  # noqa: TC004
    from ..brokers.redis import RedisClusterBroker

__all__ = ["CLUSTER_RUN_SHARDS", "CLUSTER_SCHEMES", "RedisRunStores", "open_redis_backend"]

#: The schemes of a Redis Cluster URL.
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")

#: Run shards per namespace on a Cluster: a run and its steps share one shard's hash tag, the
#: shards' tags spread over the masters. Fixed: a store opened with another count would look for
#: runs in the wrong shards (docs/decisions.md, "Run shards on a Redis Cluster").
CLUSTER_RUN_SHARDS = 16


@attrs.frozen(repr=False, eq=False)
class RedisRunStores:
    """Run stores on the backend's own client (the one its broker and key store use)."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    client: RedisClient | RedisClusterClient
    shards: int = 1
    """Run shards per namespace (1: one hash tag, today's layout; a Cluster's: many, spread
    over its masters by run id)."""

    @asynccontextmanager
    async def open(self, namespace: str) -> AsyncIterator[RunStore]:
        """A store for ``namespace`` on the client; closed on leaving (the client is not)."""
        # imported here: a worker's backend opens no run store (and loads none)
        from .._engine._stores.redis import RedisRunStore

        store = RedisRunStore(self.client, namespace, shards=self.shards)
        try:
            async with trio.open_nursery() as nursery:
                store.serve_wakes(nursery)  # (its listener starts once a waiter watches)
                yield store
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await store.aclose()

    async def namespaces(self) -> list[str]:
        """The namespaces with a run index or a schedule hash, found by ``SCAN`` on every
        master (an operator's command, not a hot path: it reads key names only)."""
        if is_cluster_client(self.client):
            await self.client.execute("PING")  # the slot map, read on the first command
            masters = self.client.slot_map.masters
            clients = [await self.client.pool(node.address) for node in masters]
        else:
            clients = [self.client]
        found: set[str] = set()
        for client in clients:
            for suffix in ("all", "schedules"):
                cursor = b"0"
                while True:
                    reply = await client.execute(
                        "SCAN", cursor, "MATCH", f"{{{_RUNS_TAG}*}}:{suffix}", "COUNT", 1000
                    )
                    cursor = reply[0]
                    found.update(_namespace_of(key, self.shards) for key in reply[1])
                    if cursor in (b"0", "0", 0):
                        break
        found.discard("")
        return sorted(found)


_RUNS_TAG = "dt-runs:"


def _namespace_of(key: bytes | str, shards: int) -> str:
    """``NS`` of ``{dt-runs:NS}:...`` (``{dt-runs:NS:K}:...`` with shards); ``""`` if not one."""
    text = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
    end = text.rfind("}:")
    if not text.startswith("{" + _RUNS_TAG) or end < 0:
        return ""
    inner = text[len(_RUNS_TAG) + 1 : end]
    return inner.rsplit(":", 1)[0] if shards > 1 else inner


@asynccontextmanager
async def open_redis_backend(
    url: str, *, key_tag: str = "durable-keys", pool_size: int = 2, **broker_options: Any
) -> AsyncIterator[Backend]:
    """Open a Redis client on ``url`` with a :class:`RedisBroker`, a :class:`RedisKeyStore`
    and :class:`RedisRunStores`, all on that client.

    Everything is closed on leaving the block (the backend first, bounded, then the client).

    Args:
        url: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://...`` or
            ``redis+sentinel://[[user]:password@]s1:port,s2:port/MASTER[/db]`` (see
            :func:`~durable_trio._redis.open_redis`); a Cluster:
            ``redis+cluster://host1:port1,host2:port2`` (a :class:`RedisClusterBroker`).
        key_tag: the key store's hash tag (see :class:`RedisKeyStore`).
        pool_size: shared connections of the client (plus one for the doorbell subscription).
        **broker_options: :class:`RedisBroker` options (``failed_retention`` ...).

    Yields:
        the backend.

    Raises:
        ConfigError: a bad URL or option.
        AuthenticationError: the server refused the credentials, or the user's ACL denies
            ``PING`` (raised once: a refusal is not retried).
        BrokerUnavailable: the server cannot be reached.
    """
    # The client's and the broker's tasks (connection readers and writers, the doorbell) run in
    # a task of their own under a shield that only leaving this block lifts: a cancel around the
    # block stops the body at once, yet a transport closing inside it still hands its claims
    # back over live connections, and the backend closes last, as the nesting says.
    # What the opening or the body raises leaves bare, not wrapped in the nursery's group.
    error: BaseException | None = None
    async with trio.open_nursery() as services:
        try:
            backend, client, lift = await services.start(
                _serve, url, key_tag, pool_size, broker_options
            )
        except BaseException as exc:
            error = exc
        else:
            try:
                # One round trip before anything uses the backend (outside the shield, so a
                # cancel stops it), so a wrong password or an unreachable server fails the
                # open, once, instead of every loop of every transport reporting it and
                # backing off (and a worker announcing it serves meanwhile).
                await client.execute("PING")
                yield backend
            except BaseException as exc:
                error = exc
            finally:
                try:
                    await backend.aclose()  # shielded and bounded
                finally:
                    lift.cancel()
    if error is not None:
        raise error


async def _serve(
    url: str,
    key_tag: str,
    pool_size: int,
    broker_options: dict[str, Any],
    *,
    task_status: trio.TaskStatus[
        tuple[Backend, RedisClient | RedisClusterClient, trio.CancelScope]
    ] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Hold the client and the broker open until the returned scope is cancelled.

    Cancellation:
        Shielded until :func:`open_redis_backend` cancels the scope on its way out, which it
        always does (in a ``finally``): the shield is bounded by the block around it.
    """
    with trio.CancelScope(shield=True) as lift:
        client: RedisClient | RedisClusterClient
        broker: RedisBroker | RedisClusterBroker
        async with AsyncExitStack() as stack:
            cluster = url_scheme(url) in CLUSTER_SCHEMES
            if cluster:
                # The Cluster code only for a Cluster URL: a one-node worker never loads it.
                from .._redis import open_redis_cluster
                from ..brokers.redis import RedisClusterBroker

                client = await stack.enter_async_context(
                    open_redis_cluster(url, pool_size=pool_size)
                )
                broker = await stack.enter_async_context(
                    RedisClusterBroker(client, **broker_options)
                )
            else:
                client = await stack.enter_async_context(open_redis(url, pool_size=pool_size))
                broker = await stack.enter_async_context(RedisBroker(client, **broker_options))
            backend = Backend(
                url=redact_url(url),
                broker=broker,
                keys=RedisKeyStore(client, tag=key_tag),
                run_stores=RedisRunStores(client, shards=CLUSTER_RUN_SHARDS if cluster else 1),
            )
            task_status.started((backend, client, lift))
            await trio.sleep_forever()
