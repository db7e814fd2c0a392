"""The Redis Cluster client: the single-node client's surface, routed by key slot.

::

    async with open_redis_cluster("redis+cluster://10.0.0.1:7000,10.0.0.2:7000") as client:
        await client.execute("SET", "{queue}:a", "v")       # to the master of its slot
        replies = await client.pipeline([("GET", "a"), ("GET", "b")])   # per node, concurrently
        bump = client.script("return redis.call('INCR', KEYS[1])")
        await bump(keys=["n"])                               # EVALSHA on n's node
        async with client.dedicated(key="{queue}:ready") as conn:   # blocking commands
            await conn.execute("BLPOP", "{queue}:ready", 1, reply_timeout=3)
        async with client.ssubscribe("doorbell") as sub:     # sharded pub/sub
            async for channel, message in sub:
                ...

**Routing.** A command's keys (see :mod:`._keyslot`) must share one slot: otherwise it is
refused before anything is sent (:class:`RedisCrossSlotError`). Keyless commands go to a master
picked at random, or to ``node=``. The slot map is read from the cluster (``CLUSTER SHARDS``) on
the first command and again whenever a node says ``MOVED``, cannot be reached, or says the
cluster is down; one refresh runs at a time.

**What is sent again, and what never is.** A command is sent again only when it certainly did
not run: after ``MOVED`` / ``ASK`` (to the node named, ``ASKING`` first for ``ASK``), after a
refusal that runs nothing (``TRYAGAIN``, ``CLUSTERDOWN``, ``LOADING``, ...), or when no
connection to its node could be had. Those retries are bounded (``retries`` with exponential
backoff, then :class:`~durable_trio._errors.BrokerUnavailable`; ``max_redirects``). A command
whose connection died after it was sent may have run: like the single-node client, this client
never sends it again (the caller gets ``BrokerUnavailable`` and decides); the map is refreshed
in the background so the next call goes to the right node.
"""

from __future__ import annotations

from contextlib import asynccontextmanager, suppress
from typing import TYPE_CHECKING, Any, TypeVar

import trio
from trio_util import RepeatedEvent

from .._backoff import Backoff
from .._errors import BrokerError, BrokerUnavailable, ConfigError, TransportClosed
from ._client import OwnedNursery, pool_options
from ._cluster_nodes import ClusterNodes, ClusterStats, NodeUnreachable
from ._commands import check as _check
from ._errors import TRANSIENT_CODES, RedisCrossSlotError, RedisReplyError, raisable
from ._keyslot import SLOTS, command_keys, key_slot, to_bytes
from ._pubsub import Subscription
from ._script import Script
from ._sharded import ShardedSubscription
from ._topology import Node, SlotMap
from ._url import RedisClusterURL, parse_redis_cluster_url

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
    from types import TracebackType

    from ._client import RedisClient
    from ._connection import Connection, RedisArg

__all__ = ["RedisClusterClient", "open_redis_cluster"]

T = TypeVar("T")
#: :meth:`RedisClusterClient._fast` could not run the command in one hop (nothing ran).
_SLOW: Any = object()
_Command = tuple["RedisArg", ...]


def open_redis_cluster(
    url: str,
    *,
    pool_size: int = 2,
    connect_timeout: float = 5.0,
    command_timeout: float = 10.0,
    backoff_initial: float = 0.05,
    backoff_max: float = 2.0,
    retries: int = 5,
    max_redirects: int = 5,
) -> RedisClusterClient:
    """Make a Cluster client for ``url``; use it as ``async with open_redis_cluster(url) as c:``.

    Nothing is connected until the first command (which reads the slot map from a seed).

    Args:
        url: ``redis+cluster://[[user]:password@]host1:port1,host2:port2[/][?client_name=...]``
            or ``rediss+cluster://`` (TLS). See :func:`parse_redis_cluster_url`.
        pool_size: shared connections per node, at most.
        connect_timeout: seconds for a connection's connect and handshake (and for each node
            asked for the slot map).
        command_timeout: default seconds a command waits for its reply (see
            :meth:`RedisClient.execute`).
        backoff_initial: seconds before the first retry of a command that did not run (doubled
            per retry, jittered down to half, capped at ``backoff_max``); also each node pool's
            reconnect backoff.
        backoff_max: the cap of those delays.
        retries: how many times one call is sent again after refusals that ran nothing
            (unreachable node, ``TRYAGAIN``, ``CLUSTERDOWN``) before ``BrokerUnavailable``.
        max_redirects: how many ``MOVED`` / ``ASK`` redirects one call follows at most.

    Returns:
        the (not yet entered) client.

    Raises:
        ConfigError: a bad URL or option.
    """
    parsed = parse_redis_cluster_url(url)
    options = pool_options(
        pool_size=pool_size,
        connect_timeout=connect_timeout,
        command_timeout=command_timeout,
        backoff_initial=backoff_initial,
        backoff_max=backoff_max,
    )
    if retries < 0 or max_redirects < 1:
        raise ConfigError("retries must be at least 0 and max_redirects at least 1")
    return RedisClusterClient(parsed, options, retries=retries, max_redirects=max_redirects)


def _redirect(reply: RedisReplyError, here: Node) -> tuple[bool, int, Node] | None:
    """``(ask, slot, node)`` of a ``MOVED`` / ``ASK`` reply, else ``None``."""
    if reply.code not in ("MOVED", "ASK"):
        return None
    try:
        _, slot, address = reply.reply.split()
        host, _, port = address.rpartition(":")
        # A node that does not know its endpoint answers ":port": the node that said so.
        node = Node(host.strip("[]") or here.host, int(port))
        return reply.code == "ASK", int(slot), node
    except ValueError:
        return None  # not a redirect this client understands: raised as the error it is


class RedisClusterClient:
    """A Trio-native Redis Cluster client (made by :func:`open_redis_cluster`).

    The same surface as :class:`~durable_trio._redis.RedisClient` (``execute``, ``pipeline``,
    ``script``, ``dedicated``, ``close``), plus ``ssubscribe`` / ``spublish`` for sharded
    pub/sub. Every task it starts (each node pool's connections, map refreshes, sharded
    subscriptions) runs in the nursery it owns for the duration of its ``async with``.
    """

    def __init__(
        self, url: RedisClusterURL, options: dict[str, Any], *, retries: int, max_redirects: int
    ) -> None:
        self._url = url
        self._options = options
        # (jitter 0.5: each delay between half and all of it)
        self._backoff = Backoff(options["backoff_initial"], options["backoff_max"], jitter=0.5)
        self._retries = retries
        self._max_redirects = max_redirects
        self._scripts: dict[str, bytes] = {}
        self._nodes: ClusterNodes | None = None
        self._nursery: trio.Nursery | None = None
        self._lifetime = OwnedNursery("RedisClusterClient")
        self._closed = False
        self.connected = RepeatedEvent()
        """Set whenever a connection to any node is opened (as :attr:`RedisClient.connected`)."""

    # -- lifetime ---------------------------------------------------------------------------

    async def __aenter__(self) -> RedisClusterClient:
        self._nursery = await self._lifetime.open(refuse=self._closed)
        self._nodes = ClusterNodes(self._url, self._nursery, self._scripts, self._options)
        self._nodes.connected = self.connected
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
        await self._lifetime.close()  # waits for every node pool's tasks to end

    def close(self) -> None:
        """Close the client now, from any task; idempotent: every node pool and subscription is
        closed, waiting and later calls raise ``TransportClosed``."""
        self._closed = True
        if self._nodes is not None:
            self._nodes.close()
        self._lifetime.cancel()

    # -- properties -------------------------------------------------------------------------

    @property
    def url(self) -> RedisClusterURL:
        """The parsed URL (its ``repr`` hides the password)."""
        return self._url

    @property
    def slot_map(self) -> SlotMap:
        """The slot map last read (empty before the first command)."""
        return SlotMap(owners=(None,) * SLOTS) if self._nodes is None else self._nodes.slot_map

    @property
    def stats(self) -> ClusterStats:
        """Counters: map refreshes, redirects followed, retries (readable after close too)."""
        return ClusterStats() if self._nodes is None else self._nodes.stats

    def node_for(self, key: RedisArg) -> str | None:
        """``host:port`` of the master serving ``key``'s slot as far as the client knows."""
        node = None if self._nodes is None else self._nodes.owner(key_slot(key))
        return None if node is None else node.address

    async def pool(self, node: str) -> RedisClient:
        """The connection pool of one node (``host:port``), e.g. to run a command on each.

        Raises:
            TransportClosed: the client is closed.
        """
        return await self._cluster().pool(self._node(node))

    # -- commands ---------------------------------------------------------------------------

    async def execute(
        self, *args: RedisArg, reply_timeout: float | None = None, node: str | None = None
    ) -> Any:
        """Run one command on the master of its keys' slot and return its reply.

        Args:
            *args: the command, e.g. ``"HSET", "{q}:h", "f", b"v"``.
            reply_timeout: as :meth:`RedisClient.execute`.
            node: ``host:port`` to send a keyless command to (default: any master).

        Returns:
            the reply.

        Raises:
            RedisCrossSlotError: the keys are in more than one slot (nothing was sent).
            RedisReplyError: an error reply (after redirects were followed).
            BrokerUnavailable: the cluster cannot be reached (after ``retries``), or the
                connection was lost after the command was sent (it may have run).
            TransportClosed: the client is closed.
        """
        _check(args)
        slot = await self._slot(args)
        if node is None and slot is not None:
            reply = await self._fast(args, slot, reply_timeout)
            if reply is not _SLOW:
                return reply
        (reply,) = await self._run([args], [slot], node, reply_timeout)
        if isinstance(reply, RedisReplyError):
            raise reply
        return reply

    async def _fast(self, args: _Command, slot: int, reply_timeout: float | None) -> Any:
        """The common case in one hop, as the single-node client runs it: the slot's master
        known, its pool open, a connection at hand, an answer that is no redirect and no
        refusal. Anything else before the command ran: ``_SLOW``, and :meth:`_run` takes it
        from the start (a redirect or a refusal ran nothing). (The general path costs about
        40 us of Python per command; most commands of a settled cluster need none of it.)"""
        nodes = self._nodes
        here = None if nodes is None else nodes.owner(slot)
        if nodes is None or here is None:
            return _SLOW
        pool = nodes.ready_pool(here)
        if pool is None:
            return _SLOW
        try:
            conn = await pool._acquire()
        except (BrokerError, TransportClosed):
            return _SLOW  # nothing was sent: the general path retries it or reports it
        seen = nodes.generation
        try:
            return await conn._command(args, reply_timeout)
        except RedisReplyError as reply:
            if reply.code in ("MOVED", "ASK") or reply.code in TRANSIENT_CODES:
                return _SLOW
            raise
        except BrokerUnavailable:
            nodes.refresh_soon(seen)  # it may have run: not sent again
            raise
        except TransportClosed as exc:
            if self._closed:
                raise
            nodes.refresh_soon(seen)  # its pool was dropped (the node left) while it waited
            raise BrokerUnavailable(f"{here.address} left the cluster: {exc}") from exc

    async def pipeline(
        self,
        commands: Iterable[Sequence[RedisArg]],
        *,
        raise_on_error: bool = True,
        reply_timeout: float | None = None,
    ) -> list[Any]:
        """Run many commands: one pipeline per node, the nodes concurrently.

        Each command's keys must share one slot (different commands may be on different
        slots). Replies come back in the caller's order; commands of one slot run in the
        caller's order. A redirected command (and only it) is sent again to the node named.

        Args:
            commands: e.g. ``[("SET", "a", "1"), ("GET", "b")]``.
            raise_on_error: raise the first error reply once all replies are in (default), or
                return error replies as :class:`RedisReplyError` objects in their slots.
            reply_timeout: seconds for each node's pipeline (``None``: the client's).

        Returns:
            the replies, in order.

        Raises:
            RedisCrossSlotError: a command's keys are in more than one slot (nothing was sent).
            RedisReplyError: ``raise_on_error`` and a command failed (its ``index`` is set).
            BrokerUnavailable: as :meth:`execute` (a lost node fails the whole call, after the
                other nodes answered: their commands ran).
            TransportClosed: the client is closed.
        """
        batch = [tuple(command) for command in commands]
        for command in batch:
            _check(command)
        slots = [await self._slot(command) for command in batch]
        replies = await self._run(batch, slots, None, reply_timeout)
        if raise_on_error:
            for index, reply in enumerate(replies):
                if isinstance(reply, RedisReplyError):
                    reply.index = index
                    raise reply
        return replies

    def script(self, source: str | bytes) -> Script:
        """Register a Lua script (no round trip) and return its callable handle.

        ``EVALSHA`` goes to its keys' node; a node that answers ``NOSCRIPT`` gets ``EVAL``
        (which caches it there) and the call goes on.

        Args:
            source: the Lua source.

        Returns:
            a :class:`Script`.
        """
        script = Script(self, source)
        self._scripts[script.sha] = script.source
        return script

    async def spublish(self, channel: str | bytes, message: RedisArg) -> int:
        """Publish on a sharded channel (``SPUBLISH``, on the master of its slot).

        Returns:
            how many subscribers (of that shard) received it.
        """
        return int(await self.execute("SPUBLISH", channel, message))

    @asynccontextmanager
    async def ssubscribe(
        self, *channels: str | bytes, buffer: int = 1024
    ) -> AsyncIterator[ShardedSubscription]:
        """Subscribe to sharded channels (``SSUBSCRIBE``) on the master of their slot.

        The subscription follows its slot: when the slot moves or its master fails over, it
        subscribes again on the new master (messages published meanwhile are lost: re-check
        the state you wait on when :attr:`ShardedSubscription.resubscribed` grows).

        Args:
            *channels: channels that share one slot (give them one ``{hash tag}``).
            buffer: messages buffered before the subscription stops reading.

        Yields:
            the subscription, confirmed by the node.

        Raises:
            RedisCrossSlotError: the channels are in more than one slot.
            BrokerUnavailable: the first subscription failed (after ``retries``).
            TransportClosed: the client is closed.
        """
        if not channels:
            raise ValueError("ssubscribe needs at least one channel")
        slot = self._one_slot("SSUBSCRIBE", list(channels))
        names = tuple(to_bytes(channel) for channel in channels)

        async def open_on(pool: RedisClient) -> Subscription:
            conn = await pool._connect(discard_on_cancel=False, push_buffer=buffer)
            subscription = Subscription(conn)
            try:
                await subscription.ssubscribe(*names)
            except BaseException:
                subscription.close()
                raise
            return subscription

        async def open_subscription() -> Subscription:
            return await self._open_on(slot, None, open_on)

        subscription = ShardedSubscription(
            names,
            nodes=self._cluster(),
            open_subscription=open_subscription,
            retry_delay=self._delay,
            buffer=buffer,
        )
        try:
            scope = await self._nursery_or_closed().start(subscription.run)
        except BaseException:
            subscription.close()
            raise
        try:
            yield subscription
        finally:
            scope.cancel()
            subscription.close()

    @asynccontextmanager
    async def dedicated(
        self,
        key: RedisArg | None = None,
        *,
        node: str | None = None,
        discard_on_cancel: bool = True,
        command_timeout: float | None = None,
    ) -> AsyncIterator[Connection]:
        """A connection of its own to the master of ``key``'s slot (or ``node``, or any
        master), closed on exit: for blocking commands (``BLPOP``) and ``MULTI`` / ``WATCH``.

        It does not follow the slot: a command on it after the slot moved gets ``MOVED`` (a
        :class:`RedisReplyError`); open another.

        Args:
            key: the key whose node to connect to.
            node: ``host:port`` instead of a key.
            discard_on_cancel: as :meth:`RedisClient.dedicated`.
            command_timeout: its default per-command timeout (``None``: the client's).

        Yields:
            the connection.

        Raises:
            BrokerUnavailable: could not connect (after ``retries``).
            TransportClosed: the client is closed.
        """
        slot = None if key is None else key_slot(key)
        target = None if node is None else self._node(node)

        async def open_on(pool: RedisClient) -> Connection:
            return await pool._connect(
                discard_on_cancel=discard_on_cancel, command_timeout=command_timeout
            )

        conn = await self._open_on(slot, target, open_on)
        try:
            yield conn
        finally:
            conn.close()

    # -- routing ----------------------------------------------------------------------------

    def _cluster(self) -> ClusterNodes:
        if self._closed or self._nodes is None:
            raise TransportClosed("the Redis Cluster client is closed (or was never entered)")
        return self._nodes

    def _nursery_or_closed(self) -> trio.Nursery:
        self._cluster()
        assert self._nursery is not None
        return self._nursery

    @staticmethod
    def _node(address: str) -> Node:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError("a node is named host:port")
        return Node(host.strip("[]"), int(port))

    def _one_slot(self, name: RedisArg, keys: Sequence[RedisArg]) -> int | None:
        """The one slot of ``keys`` (``None`` for none).

        Raises:
            RedisCrossSlotError: they are in more than one.
        """
        if not keys:
            return None
        first = key_slot(keys[0])
        if all(key_slot(key) == first for key in keys[1:]):
            return first
        shown = to_bytes(name).decode("ascii", "replace").upper()
        raise RedisCrossSlotError(shown, sorted({key_slot(key) for key in keys}))

    async def _slot(self, command: _Command) -> int | None:
        """The slot of ``command``'s keys (``None``: keyless), asking the server
        (``COMMAND GETKEYS``) about commands the client's table does not know."""
        keys = command_keys(command)
        if keys is None:
            (reply,) = await self._run([("COMMAND", "GETKEYS", *command)], [None], None, None)
            # An error: no keys, or arguments the server refuses (it says so when it runs).
            keys = [] if isinstance(reply, RedisReplyError) else list(reply)
        return self._one_slot(command[0], keys)

    def _delay(self, failures: int) -> float:
        return self._backoff.delay(failures)

    async def _failed(self, failures: int, error: BrokerError) -> None:
        """Back off before retry number ``failures``, or give up after ``retries``."""
        if failures > self._retries:
            raise BrokerUnavailable(
                f"the Redis Cluster did not serve the call after {failures} attempts: {error}"
            ) from error
        self._cluster().stats.retries += 1
        await trio.sleep(self._delay(failures))

    async def _target(self, slot: int | None, node: Node | None) -> Node:
        nodes = self._cluster()
        if nodes.generation == 0:
            await nodes.refresh(0)
        if node is not None:
            return node
        here = nodes.any_master() if slot is None else nodes.owner(slot)
        if here is None:
            raise NodeUnreachable(f"slot {slot} is served by no node of the Redis Cluster")
        return here

    async def _open_on(
        self,
        slot: int | None,
        node: Node | None,
        opener: Callable[[RedisClient], Awaitable[T]],
    ) -> T:
        """``opener(pool)`` on the pool of ``slot``'s master (or ``node``), retried with a
        fresh map while no connection can be had (for dedicated connections and
        subscriptions: opening one runs no command).

        Raises:
            BrokerUnavailable: no connection after ``retries``.
            TransportClosed: the client is closed.
        """
        nodes = self._cluster()
        failures = 0
        while True:
            seen = nodes.generation
            here: Node | None = None
            try:
                here = await self._target(slot, node)
                return await opener(await nodes.pool(here))
            except BrokerUnavailable as exc:
                error: BrokerError = exc
            except RedisReplyError as exc:
                # SSUBSCRIBE on a node that gave the slot away: MOVED (the map was stale).
                redirect = None if here is None else _redirect(exc, here)
                if redirect is None or slot is None:
                    raise
                nodes.moved(slot, redirect[2])
                error = exc
            failures += 1
            await self._failed(failures, error)
            await self._refresh_after_failure(seen)

    async def _refresh_after_failure(self, seen: int) -> None:
        # A failure here is met (and counted) by the next attempt, through _target/refresh.
        with suppress(NodeUnreachable):
            await self._cluster().refresh(seen)

    async def _run(
        self,
        batch: list[_Command],
        slots: list[int | None],
        node: str | None,
        reply_timeout: float | None,
    ) -> list[Any]:
        """Send ``batch`` (each command to its slot's master), following redirects and retrying
        what did not run; the replies in order, error replies as values."""
        nodes = self._cluster()
        explicit = None if node is None else self._node(node)
        replies: list[Any] = [None] * len(batch)
        todo: dict[int, tuple[Node | None, bool]] = dict.fromkeys(range(len(batch)), (None, False))
        failures = redirects = 0
        while todo:
            seen = nodes.generation
            again: dict[int, tuple[Node | None, bool]] = {}
            error: BrokerError | None = None
            redirected = False
            try:
                groups: dict[Node, list[tuple[int, bool]]] = {}
                for index, (target, asking) in todo.items():
                    here = target or await self._target(slots[index], explicit)
                    groups.setdefault(here, []).append((index, asking))
            except NodeUnreachable as exc:  # no map, or a slot nobody serves: nothing sent
                groups, again, error = {}, todo, exc
            for here, outcome in (await nodes.send(batch, groups, reply_timeout)).items():
                if isinstance(outcome, NodeUnreachable):
                    again.update(dict.fromkeys((i for i, _ in groups[here]), (None, False)))
                    error = outcome
                    continue
                if isinstance(outcome, Exception):
                    nodes.refresh_soon(seen)  # it may have run: not sent again
                    raise outcome
                for (index, _), reply in zip(groups[here], outcome, strict=True):
                    if not isinstance(reply, RedisReplyError):
                        replies[index] = reply
                    elif (redirect := _redirect(reply, here)) is not None:
                        ask, slot, target = redirect
                        again[index] = (target, ask)
                        redirected = True
                        if ask:
                            nodes.stats.asked += 1
                        else:
                            nodes.moved(slot, target)
                    elif reply.code in TRANSIENT_CODES:
                        again[index] = (None, False)
                        error = raisable(reply, here.address)
                    else:
                        replies[index] = raisable(reply, here.address)
            todo = again
            redirects += redirected
            if redirects > self._max_redirects:
                raise BrokerError(f"more than {self._max_redirects} Cluster redirects in one call")
            if error is not None:
                failures += 1
                await self._failed(failures, error)
                await self._refresh_after_failure(seen)
        return replies
