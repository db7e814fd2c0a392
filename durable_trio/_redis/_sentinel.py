"""Finding (and following) a Redis master through Sentinel: the client's :class:`MasterLocator`.

A :class:`~durable_trio._redis.RedisClient` opened on a ``redis+sentinel://`` URL is the
single-node client with a locator plugged in: its pool, connections, scripts and pub/sub are
the same; only *where* a new connection goes, and whether it is kept, is the locator's:

* **discovery**: every new data connection first asks the sentinels
  (``SENTINEL get-master-addr-by-name``), each in turn from the last one that answered, each
  within ``sentinel_timeout``; so a connection made after a failover goes to the promoted
  replica, and a client never trusts an address it learnt before;
* **admission**: the new connection must answer ``ROLE`` with ``master``, or it is closed (a
  sentinel can name a master that was just demoted, or not yet promoted): a replica, or a
  demoted master, never gets a write from this client;
* **following**: a ``-READONLY`` reply (the node was demoted under an open connection), or a
  ``+switch-master`` message of the master's name on a sentinel's pub/sub (watched by a task
  in the client's nursery), drops every connection this client holds to the data nodes with
  ``BrokerUnavailable``, so the pool reconnects (and re-discovers), within its backoff.

A connection to a master that dies is dropped by the pool as any other; the next one asks the
sentinels again. Nothing here waits unbounded: a discovery takes at most
``sentinel_timeout`` per sentinel, and while no master can be found calls fail fast with
:class:`~durable_trio._errors.BrokerUnavailable` (the pool's backoff).
"""

from __future__ import annotations

import random
import weakref
from typing import TYPE_CHECKING, Final

import trio

from .._errors import BrokerError, BrokerUnavailable, TransportClosed
from ._connection import Connection, _unavailable, connect
from ._errors import RedisAuthError, RedisBusyReply, RedisReplyError
from ._pubsub import Subscription

if TYPE_CHECKING:
    from ._sentinel_url import SentinelURL
    from ._url import RedisURL

__all__ = ["MasterLocator", "parse_switch_master"]

#: The sentinels' channel announcing a failover: ``<name> <old-ip> <old-port> <new-ip> <new-port>``.
SWITCH_CHANNEL: Final = b"+switch-master"
#: Seconds of silence after which the watcher pings its sentinel (a dead one says nothing).
_WATCH_PING: Final = 5.0


def parse_switch_master(message: bytes) -> tuple[str, str, int] | None:
    """``(master name, new host, new port)`` of a ``+switch-master`` message, or ``None`` if
    it is not one (a malformed message is ignored, never fatal to the watcher).

    Args:
        message: the message as published.

    Returns:
        the name and the new address, or ``None``.
    """
    parts = message.decode("utf-8", "replace").split()
    if len(parts) != 5 or not (parts[4].isascii() and parts[4].isdigit()):
        return None
    return parts[0], parts[3], int(parts[4])


def _master_address(reply: object) -> tuple[str, int] | None:
    """``(host, port)`` of a ``get-master-addr-by-name`` reply, or ``None`` if malformed."""
    if not (isinstance(reply, list) and len(reply) == 2):
        return None
    host, port = reply
    if not (isinstance(host, bytes) and isinstance(port, bytes) and host and port.isdigit()):
        return None
    return host.decode("utf-8", "replace"), int(port)


class MasterLocator:
    """Finds the master through the sentinels, admits only master connections, follows
    failovers (see the module docs). Made by :func:`~durable_trio._redis.open_redis`.

    Attributes:
        discoveries: masters named by a sentinel (one per new data connection).
        refusals: new connections closed because the node was not a master.
        switches: times every data connection was dropped (``READONLY``, ``+switch-master``).
    """

    def __init__(
        self, url: SentinelURL, *, sentinel_timeout: float, command_timeout: float, watch: bool
    ) -> None:
        self._url = url
        self._timeout = sentinel_timeout
        self._command_timeout = command_timeout
        self._watch_enabled = watch
        self._next = 0  # the sentinel to ask first: the last one that answered
        self._sentinel: Connection | None = None  # a connection to sentinel self._next
        self._lock = trio.Lock()
        self._admitted: weakref.WeakSet[Connection] = weakref.WeakSet()
        self._nursery: trio.Nursery | None = None
        self.master: tuple[str, int] | None = None
        self.discoveries = 0
        self.refusals = 0
        self.switches = 0

    @property
    def url(self) -> SentinelURL:
        """The parsed ``redis+sentinel://`` URL."""
        return self._url

    def start(self, nursery: trio.Nursery) -> None:
        """Use ``nursery`` (the client's) for the sentinel connections and the watcher task.

        Args:
            nursery: the client's nursery; cancelling it ends everything started here.
        """
        self._nursery = nursery
        if self._watch_enabled:
            nursery.start_soon(self._watch)

    # -- discovery and admission ------------------------------------------------------------

    async def locate(self) -> RedisURL:
        """Ask the sentinels, in turn, for the master's address.

        Returns:
            the settings of a connection to the master they name.

        Raises:
            BrokerUnavailable: no sentinel answered with an address (one line says what each
                did: down, too slow, refused, or knows no master of that name).
            RedisAuthError: every sentinel refused ``sentinel_password``.
            TransportClosed: the client is closed.
        """
        async with self._lock:  # one question at a time; the answer is not cached
            host, port = await self._ask()
        self.master = (host, port)
        self.discoveries += 1
        return self._url.master_url(host, port)

    async def _ask(self) -> tuple[str, int]:
        name = self._url.master_name
        count = len(self._url.sentinels)
        problems: list[str] = []
        refusals: list[RedisAuthError] = []
        unknown = 0
        for step in range(count):
            index = (self._next + step) % count
            where = self._url.sentinel_url(index).address
            reply: object = None
            with trio.move_on_after(self._timeout) as scope:
                try:
                    sentinel = await self._sentinel_connection(index)
                    reply = await sentinel.execute("SENTINEL", "get-master-addr-by-name", name)
                except RedisAuthError as exc:
                    refusals.append(exc)
                    problems.append(f"{where} refused sentinel_password")
                    continue
                except BrokerError as exc:  # down, reset, or an error reply
                    self._drop_sentinel()
                    problems.append(str(exc) if where in str(exc) else f"{where}: {exc}")
                    continue
            if scope.cancelled_caught:
                self._drop_sentinel()
                problems.append(f"{where}: no answer within {self._timeout:g}s")
                continue
            if reply is None:
                unknown += 1
                problems.append(f"{where} knows no master named {name!r}")
                continue
            address = _master_address(reply)
            if address is None:
                problems.append(f"{where}: a malformed answer {reply!r:.60}")
                continue
            self._next = index
            return address
        if refusals and len(refusals) == count:
            raise refusals[0]
        if unknown == count:
            raise BrokerUnavailable(
                f"no sentinel knows a master named {name!r} (asked {count}; "
                "check the master name in the URL's path)"
            )
        raise BrokerUnavailable(
            f"could not find the Redis master {name!r} through {count} sentinel(s): "
            + "; ".join(problems)
        )

    async def _sentinel_connection(self, index: int) -> Connection:
        if self._sentinel is not None and self._sentinel.healthy and index == self._next:
            return self._sentinel
        self._drop_sentinel()
        if self._nursery is None:
            raise TransportClosed("the Redis client is closed (or was never entered)")
        self._sentinel = await connect(
            self._url.sentinel_url(index),
            self._nursery,
            connect_timeout=self._timeout,
            command_timeout=self._timeout,
        )
        self._next = index
        return self._sentinel

    def _drop_sentinel(self) -> None:
        sentinel, self._sentinel = self._sentinel, None
        if sentinel is not None:
            sentinel.close()

    async def admit(self, conn: Connection) -> None:
        """Keep ``conn`` only if its node says it is a master (``ROLE``); else close it.

        Args:
            conn: a new, handshaken connection to the address :meth:`locate` gave.

        Raises:
            BrokerUnavailable: the node is not a master (``conn`` is closed), or did not answer.
            RedisReplyError: ``ROLE`` was refused (the URL's user needs it; ``conn`` closed).
        """
        try:
            role = await conn.execute("ROLE", reply_timeout=self._timeout)
        except BaseException:
            conn.close()
            raise
        kind = role[0] if isinstance(role, list) and role else role
        if kind != b"master":
            conn.close()
            self.refusals += 1
            shown = kind.decode("utf-8", "replace") if isinstance(kind, bytes) else repr(kind)
            raise BrokerUnavailable(
                f"{conn.url.address}, named master of {self._url.master_name!r} by a sentinel, "
                f"says it is a {shown} (a failover under way?): not used"
            )
        self._admitted.add(conn)

    # -- following failovers ----------------------------------------------------------------

    def demoted(self, conn: Connection | None, reply: RedisReplyError) -> BrokerUnavailable:
        """A ``-READONLY`` reply: the node is no master now; drop every connection.

        Args:
            conn: the connection that got it (for the message), if known.
            reply: the error reply.

        Returns:
            the error to raise instead: a :class:`RedisBusyReply` (transient: the command did
            not run; the next call re-discovers the master).
        """
        where = conn.url.address if conn is not None else "a data node"
        self.switch(f"{where} answered READONLY (no longer the master)")
        busy = RedisBusyReply(f"{reply.reply} ({where} is no longer the master; re-discovering)")
        busy.index = reply.index
        return busy

    def switch(self, reason: str, *, keep: tuple[str, int] | None = None) -> None:
        """Fail every data connection of the client with ``BrokerUnavailable`` (idempotent
        per connection): the pool makes new ones, each of which asks the sentinels.

        Args:
            reason: why, for the connections' error message.
            keep: the new master's address: connections already made to it stay (the pool
                may have found it before the announcement arrived).
        """
        self.switches += 1
        for conn in list(self._admitted):
            if (conn.url.host, conn.url.port) != keep:
                self._admitted.discard(conn)
                conn._fail(_unavailable(f"connection to {conn.url.address} dropped: {reason}"))

    async def _watch(self) -> None:
        """Follow ``+switch-master`` on one sentinel at a time, moving on when it fails."""
        failures = 0
        index = self._next
        while True:
            try:
                await self._watch_one(index)
                failures = 0
            except BrokerError:
                failures += 1
            except TransportClosed:
                return  # the client is closing
            index = (index + 1) % len(self._url.sentinels)
            delay = min(2.0, 0.05 * 2.0 ** min(failures, 8))
            await trio.sleep(delay * random.uniform(0.5, 1.0))

    async def _watch_one(self, index: int) -> None:
        assert self._nursery is not None
        conn = await connect(
            self._url.sentinel_url(index),
            self._nursery,
            connect_timeout=self._timeout,
            command_timeout=self._command_timeout,
            push_buffer=64,
        )
        sub = Subscription(conn)
        try:
            await sub.subscribe(SWITCH_CHANNEL)
            while True:
                with trio.move_on_after(_WATCH_PING):
                    _channel, message = await sub.receive()
                    switched = parse_switch_master(message)
                    if switched is not None and switched[0] == self._url.master_name:
                        name, host, port = switched
                        self.switch(
                            f"a sentinel announced +switch-master of {name!r} to {host}:{port}",
                            keep=(host, port),
                        )
                    continue
                await sub.ping(reply_timeout=self._timeout)
        finally:
            sub.close()
