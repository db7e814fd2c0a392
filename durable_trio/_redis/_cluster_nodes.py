"""The nodes of a Redis Cluster as the cluster client sees them: one small pool per node, and
the slot map, refreshed one refresh at a time.

Each node's pool is a :class:`~durable_trio._redis.RedisClient` (the single-node client, its
pool, backoff and ``NOSCRIPT`` fallback), entered by a task of the cluster client's nursery and
closed when the cluster client closes or the node leaves the map.
"""

from __future__ import annotations

import contextlib
import random
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .._errors import BrokerError, BrokerUnavailable, TransportClosed
from ._client import RedisClient
from ._errors import RedisAuthError, RedisClusterTLSMismatch, RedisReplyError
from ._keyslot import SLOTS
from ._topology import Node, SlotMap, parse_shards, parse_slots

if TYPE_CHECKING:
    from collections.abc import Sequence

    from trio_util import RepeatedEvent

    from ._connection import Connection, RedisArg
    from ._url import RedisClusterURL

__all__ = ["ClusterNodes", "ClusterStats", "NodeUnreachable"]


class NodeUnreachable(BrokerUnavailable):
    """No connection to a node could be had: the command was not sent (safe to send again)."""


@attrs.define
class ClusterStats:
    """Counters of a cluster client (for tests, benchmarks and debugging).

    Attributes:
        refreshes: slot maps read (``CLUSTER SHARDS`` / ``SLOTS`` answered and installed).
        moved: ``MOVED`` redirects followed.
        asked: ``ASK`` redirects followed.
        retries: commands sent again after a refusal that ran nothing (an unreachable node,
            ``TRYAGAIN``, ``CLUSTERDOWN``, ...).
    """

    refreshes: int = 0
    moved: int = 0
    asked: int = 0
    retries: int = 0


@attrs.define
class _Pool:
    client: RedisClient
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    ready: trio.Event = attrs.field(factory=trio.Event)


class ClusterNodes:
    """The node pools and the slot map of one cluster client (made when it is entered).

    Args:
        url: the seeds and the settings of every node.
        nursery: the cluster client's nursery (every pool's tasks run in it).
        scripts: ``sha1 -> source`` of the client's scripts, shared by every pool (a
            ``NOSCRIPT`` is answered on the node that said it).
        options: ``pool_size``, ``connect_timeout``, ... of each node's pool.
    """

    def __init__(
        self,
        url: RedisClusterURL,
        nursery: trio.Nursery,
        scripts: dict[str, bytes],
        options: dict[str, Any],
    ) -> None:
        self._url = url
        self._nursery = nursery
        self._scripts = scripts
        self._options = options
        self._pools: dict[Node, _Pool] = {}
        self._map = SlotMap(owners=(None,) * SLOTS)
        self._owners: list[Node | None] = [None] * SLOTS
        self._refreshing: trio.Event | None = None
        self._closed = False
        self.generation = 0
        self.stats = ClusterStats()
        self.connected: RepeatedEvent | None = None
        """Shared by every node's pool (set on each new connection), when given."""

    # -- the map ----------------------------------------------------------------------------

    @property
    def slot_map(self) -> SlotMap:
        """The slot map last read (``MOVED`` redirects since then are in :meth:`owner`)."""
        return self._map

    def owner(self, slot: int) -> Node | None:
        """The master serving ``slot`` as far as this client knows, or ``None``."""
        return self._owners[slot]

    def any_master(self) -> Node | None:
        """A master picked at random (load spreading for keyless commands), or ``None``."""
        masters = self._map.masters
        return random.choice(masters) if masters else None

    def moved(self, slot: int, node: Node) -> None:
        """Record a ``MOVED`` answer at once, and read the whole map again in the background
        (one slot moved usually means a resharding or a failover moved many)."""
        self._owners[slot] = node
        self.stats.moved += 1
        self.refresh_soon(self.generation)

    def refresh_soon(self, seen: int) -> None:
        """Start :meth:`refresh` in the background unless one is running or the map is newer."""
        if self._closed or self._refreshing is not None or self.generation != seen:
            return
        with contextlib.suppress(RuntimeError):  # the nursery is closing: nothing to refresh
            self._nursery.start_soon(self._refresh_quietly, seen)

    async def _refresh_quietly(self, seen: int) -> None:
        # A failure is met again by the next command, which refreshes and reports it; the
        # client closing under it (TransportClosed) ends it quietly too.
        with contextlib.suppress(BrokerError, TransportClosed):
            await self.refresh(seen)

    async def refresh(self, seen: int) -> None:
        """Read the slot map again, unless it changed since the caller's generation ``seen``.

        One refresh runs at a time: callers arriving meanwhile wait for it instead of starting
        another. The nodes are asked in turn (masters, then the other known nodes, then the
        seeds), each within ``connect_timeout``; the first answer wins.

        Raises:
            NodeUnreachable: no node answered (a BrokerUnavailable).
            RedisAuthError: a node refused the credentials (final: not retried).
            TransportClosed: the client is closed.
        """
        if self.generation != seen:
            await trio.lowlevel.checkpoint()
            return
        if self._refreshing is not None:
            await self._refreshing.wait()
            return
        self._refreshing = done = trio.Event()
        try:
            self._install(await self._read_map())
        finally:
            self._refreshing = None
            done.set()

    async def _read_map(self) -> SlotMap:
        known = list(self._map.masters)
        random.shuffle(known)  # spread the refreshes of many clients over the masters
        for followers in self._map.replicas.values():
            known.extend(followers)
        known.extend(Node(seed.host, seed.port) for seed in self._url.seeds)
        failures = []
        for node in dict.fromkeys(known):
            try:
                return await self._ask_map(node)
            except (RedisAuthError, RedisClusterTLSMismatch):
                raise  # every node has the same credentials and settings: the next would not help
            except BrokerError as exc:
                if self._closed:
                    raise
                failures.append(f"{node.address}: {exc}")
        raise NodeUnreachable(
            "no node of the Redis Cluster answered for its slot map ("
            + "; ".join(failures[-3:])
            + ")"
        )

    async def _ask_map(self, node: Node) -> SlotMap:
        conn = await self.connection(node)
        timeout = self._options["connect_timeout"]
        try:
            reply = await conn.execute("CLUSTER", "SHARDS", reply_timeout=timeout)
        except RedisReplyError as exc:
            if "unknown" not in exc.reply.lower():
                raise
            # Before Redis 7 there is no CLUSTER SHARDS.
            reply = await conn.execute("CLUSTER", "SLOTS", reply_timeout=timeout)
            return parse_slots(reply, asked=node.host)
        tls = self._url.seeds[0].tls
        return parse_shards(reply, asked=node.host, tls=tls, asked_port=node.port if tls else None)

    def _install(self, slot_map: SlotMap) -> None:
        if not slot_map.masters:
            raise NodeUnreachable("the Redis Cluster serves no slot (is it set up?)")
        self._map = slot_map
        self._owners = list(slot_map.owners)
        self.generation += 1
        self.stats.refreshes += 1
        # Nodes gone from the cluster (not seeds: they are where the next refresh starts).
        keep = {Node(seed.host, seed.port) for seed in self._url.seeds}
        keep.update(slot_map.masters)
        for followers in slot_map.replicas.values():
            keep.update(followers)
        for node in [node for node in self._pools if node not in keep]:
            self._drop(node)

    # -- the pools --------------------------------------------------------------------------

    async def pool(self, node: Node) -> RedisClient:
        """The pool of ``node`` (made, entered in the client's nursery, on first use).

        Raises:
            TransportClosed: the client is closed.
        """
        entry = self._pools.get(node)
        if entry is None:
            if self._closed:
                raise TransportClosed("the Redis Cluster client is closed")
            client = RedisClient(self._url.node(node.host, node.port), **self._options)
            client._scripts = self._scripts  # one registry: every node can answer NOSCRIPT
            if self.connected is not None:
                client.connected = self.connected  # (a node restarted: see RedisClient)
            entry = self._pools[node] = _Pool(client)
            try:
                self._nursery.start_soon(self._serve, entry)
            except RuntimeError as exc:  # "Nursery is closed to new arrivals"
                self._drop(node)
                raise TransportClosed("the Redis Cluster client is closed") from exc
        await entry.ready.wait()
        return entry.client

    def ready_pool(self, node: Node) -> RedisClient | None:
        """The pool of ``node`` if it is open already (found without a checkpoint), else
        ``None``."""
        entry = self._pools.get(node)
        return entry.client if entry is not None and entry.ready.is_set() else None

    async def _serve(self, entry: _Pool) -> None:
        if entry.scope.cancel_called:  # dropped before it started: its client is closed
            return
        with entry.scope:
            async with entry.client:
                entry.ready.set()
                await trio.sleep_forever()

    async def connection(self, node: Node) -> Connection:
        """A pooled connection to ``node``, for one command or pipeline.

        Raises:
            NodeUnreachable: no connection could be had (nothing was sent).
            RedisAuthError: the node refused the credentials.
            TransportClosed: the client is closed.
        """
        client = await self.pool(node)
        try:
            return await client._acquire()
        except TransportClosed as exc:
            if self._closed:
                raise
            raise NodeUnreachable(f"{node.address} left the cluster") from exc
        except BrokerUnavailable as exc:
            raise NodeUnreachable(str(exc)) from exc

    async def send(
        self,
        batch: Sequence[tuple[RedisArg, ...]],
        groups: dict[Node, list[tuple[int, bool]]],
        reply_timeout: float | None,
    ) -> dict[Node, list[Any] | Exception]:
        """Send each node its commands as one pipeline, the nodes concurrently.

        Args:
            batch: the commands.
            groups: ``node -> [(index in batch, ASKING first?), ...]``.
            reply_timeout: seconds for each node's pipeline.

        Returns:
            per node, its replies (error replies as values) or the error that stopped it
            (:class:`NodeUnreachable`: nothing was sent to it).
        """
        outcomes: dict[Node, list[Any] | Exception] = {}

        async def one(node: Node, entries: list[tuple[int, bool]]) -> None:
            commands = [batch[index] for index, _ in entries]
            try:
                outcomes[node] = await self._pipeline(
                    node, commands, [ask for _, ask in entries], reply_timeout
                )
            except BrokerError as exc:
                outcomes[node] = exc
            except TransportClosed as exc:
                if self._closed:
                    outcomes[node] = exc
                else:  # its pool was dropped (the node left the cluster) while it waited
                    lost = BrokerUnavailable(f"{node.address} left the cluster: {exc}")
                    lost.__cause__ = exc
                    outcomes[node] = lost

        if len(groups) == 1:
            await one(*next(iter(groups.items())))
        else:
            async with trio.open_nursery() as nursery:
                for node, entries in groups.items():
                    nursery.start_soon(one, node, entries)
        return outcomes

    async def _pipeline(
        self,
        node: Node,
        commands: list[tuple[RedisArg, ...]],
        asking: list[bool],
        reply_timeout: float | None,
    ) -> list[Any]:
        conn = await self.connection(node)
        if not any(asking):
            return await conn.pipeline(commands, raise_on_error=False, reply_timeout=reply_timeout)
        sent: list[tuple[RedisArg, ...]] = []
        for command, ask in zip(commands, asking, strict=True):
            if ask:
                sent.append(("ASKING",))
                # EVAL rather than EVALSHA: a NOSCRIPT retry would go without its ASKING.
                sent.append(conn._eval_instead(command) or command)
            else:
                sent.append(command)
        replies = iter(await conn.pipeline(sent, raise_on_error=False, reply_timeout=reply_timeout))
        kept = []
        for ask in asking:
            if ask:
                next(replies)  # ASKING's OK
            kept.append(next(replies))
        return kept

    def _drop(self, node: Node) -> None:
        entry = self._pools.pop(node)
        entry.client.close()
        entry.scope.cancel()
        entry.ready.set()  # callers waiting for it now meet the closed client

    def close(self) -> None:
        """Close every pool (idempotent; their tasks end with the client's nursery)."""
        self._closed = True
        for node in list(self._pools):
            self._drop(node)
