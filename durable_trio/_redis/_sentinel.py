"""Finding (and following) a Redis master through Sentinel: the client's :class:`MasterLocator`.

A :class:`~durable_trio._redis.RedisClient` opened on a ``redis+sentinel://`` URL is the
single-node client with a locator plugged in: its pool, connections, scripts and pub/sub are
the same; only *where* a new connection goes, and whether it is kept, is the locator's:

* **discovery**: every new data connection first asks all the sentinels at once
  (``SENTINEL MASTER``, within ``sentinel_timeout``) and goes to the master named with the
  highest configuration epoch (the newest failover any of them knows); so a connection made
  after a failover goes to the promoted replica, and a client never trusts an address it
  learnt before. While a sentinel says it is failing the master over
  (``failover_in_progress``), no master is named: calls fail fast until the failover ends;
* **admission**: the new connection must answer ``ROLE`` with ``master``, or it is closed (a
  sentinel can name a master that was just demoted, or not yet promoted): a replica, or a
  demoted master, never gets a write from this client;
* **following**: a ``-READONLY`` reply (the node was demoted under an open connection), or a
  ``+try-failover`` (a failover starts) or ``+switch-master`` (it ended) message of the
  master's name on a sentinel's pub/sub (a task per sentinel in the client's nursery) drops
  every connection this client holds to the data nodes with ``BrokerUnavailable``, so the pool
  reconnects (and re-discovers), within its backoff. Without the start announcement, a
  manual failover's old master stays a master, taking this client's writes, until the
  sentinels demote it: every one of those writes is lost (tests/test_redis_sentinel.py
  measured about a hundred in a second).

A connection to a master that dies is dropped by the pool as any other; the next one asks the
sentinels again. Nothing here waits unbounded: a discovery takes at most ``sentinel_timeout``
(a sentinel that does not answer at all makes every discovery take that long), and while no
master can be found calls fail fast with :class:`~durable_trio._errors.BrokerUnavailable`
(the pool's backoff).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Final

import attrs
import trio

from .._backoff import Backoff
from .._errors import BrokerError, BrokerUnavailable, TransportClosed
from ._connection import Connection, _unavailable, connect
from ._errors import RedisAuthError, RedisBusyReply, RedisReplyError
from ._pubsub import Subscription

if TYPE_CHECKING:
    from ._sentinel_url import SentinelURL
    from ._url import RedisURL

__all__ = ["MasterLocator", "parse_failover_start", "parse_switch_master"]

#: The delays between two attempts to reopen a lost sentinel watch: 0.05 s doubled per failure,
#: capped at 2 s, each between half and all of it.
_WATCH_BACKOFF: Final = Backoff(0.05, 2.0, jitter=0.5)

#: The sentinels' channel announcing a failover: ``<name> <old-ip> <old-port> <new-ip> <new-port>``.
SWITCH_CHANNEL: Final = b"+switch-master"
#: The channel of a failover's start (``master <name> <ip> <port>``): published by the sentinel
#: that starts it, before any replica is promoted.
FAILOVER_CHANNEL: Final = b"+try-failover"
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


def parse_failover_start(message: bytes) -> str | None:
    """The master name of a ``+try-failover`` message (``master <name> <ip> <port>``), or
    ``None`` if it is not one.

    Args:
        message: the message as published.

    Returns:
        the name, or ``None``.
    """
    parts = message.decode("utf-8", "replace").split()
    if len(parts) != 4 or parts[0] != "master":
        return None
    return parts[1]


def _master_fields(reply: object) -> tuple[str, int, int, bool] | None:
    """``(host, port, config epoch, failover in progress)`` of a ``SENTINEL MASTER`` reply (a
    flat list of field names and values), or ``None`` if it is malformed."""
    if not (isinstance(reply, list) and len(reply) % 2 == 0):
        return None
    fields = dict(zip(reply[::2], reply[1::2], strict=True))
    host, port = fields.get(b"ip"), fields.get(b"port")
    epoch = fields.get(b"config-epoch", b"0")
    if not (isinstance(host, bytes) and host and isinstance(port, bytes) and port.isdigit()):
        return None
    if not (isinstance(epoch, bytes) and epoch.isdigit()):
        return None
    flags = fields.get(b"flags", b"")
    failing_over = isinstance(flags, bytes) and b"failover_in_progress" in flags.split(b",")
    return host.decode("utf-8", "replace"), int(port), int(epoch), failing_over


@attrs.frozen
class _Outcome:
    """What one sentinel said when asked for the master.

    Attributes:
        where: the sentinel's ``host:port``.
        address: the master's ``(host, port)`` it named, or ``None``.
        epoch: the configuration epoch of that answer (the newest failover it knows of).
        problem: why it named none, for the error message.
        unknown: it knows no master of that name.
        refusal: it refused ``sentinel_password``.
        failing_over: it is running a failover of the master (flag ``failover_in_progress``).
        closed: the client was closed while asking.
    """

    where: str
    address: tuple[str, int] | None = None
    failing_over: bool = False
    epoch: int = 0
    problem: str = ""
    unknown: bool = False
    refusal: RedisAuthError | None = None
    closed: bool = False


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
        self._links: dict[int, Connection] = {}  # a connection to each sentinel, kept
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
            # Every sentinel: only the one that runs a failover announces its start.
            for index in range(len(self._url.sentinels)):
                nursery.start_soon(self._watch, index)

    # -- discovery and admission ------------------------------------------------------------

    async def locate(self) -> RedisURL:
        """Ask the sentinels for the master's address (see :meth:`_ask`).

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
        """Ask every sentinel at once; take the answer of the highest configuration epoch.

        Not the first answer: a sentinel that has not heard of a failover yet still names the
        old master, and a restarted old master says it is a master (``ROLE`` cannot tell)
        until the sentinels make it a replica; the sentinel that ran the failover names the
        promoted replica with a newer epoch (tests/test_redis_sentinel.py found this).
        """
        name = self._url.master_name
        count = len(self._url.sentinels)
        outcomes: dict[int, _Outcome] = {}
        with trio.move_on_after(self._timeout):
            async with trio.open_nursery() as nursery:
                for index in range(count):
                    nursery.start_soon(self._ask_one, index, outcomes)
        for index in range(count):
            if index not in outcomes:
                self._drop_link(index)  # it may be stuck; a fresh connection next time
                where = self._url.sentinel_url(index).address
                outcomes[index] = _Outcome(
                    where, problem=f"{where}: no answer within {self._timeout:g}s"
                )
        if any(o.closed for o in outcomes.values()):
            raise TransportClosed("the Redis client is closed")
        answers = [o for o in outcomes.values() if o.address is not None]
        if answers:
            newest = max(o.epoch for o in answers)
            # A failover of the newest configuration's master: what it takes now may be lost.
            # (An older configuration's flag is a failover that lost to the newest one.)
            failing_over = [o.where for o in answers if o.failing_over and o.epoch == newest]
            if failing_over:
                raise BrokerUnavailable(
                    f"a failover of the Redis master {name!r} is under way (sentinel "
                    f"{failing_over[0]}); calls fail until it ends"
                )
            best = next(o for o in answers if o.epoch == newest)
            assert best.address is not None
            return best.address
        refusals = [o.refusal for o in outcomes.values() if o.refusal is not None]
        if len(refusals) == count:
            refused = RedisAuthError(
                refusals[0].reply,
                address="sentinels " + ", ".join(outcomes[i].where for i in range(count)),
                sentinel=True,
            )
            refused.index = refusals[0].index
            raise refused
        if all(o.unknown for o in outcomes.values()):
            raise BrokerUnavailable(
                f"no sentinel knows a master named {name!r} (asked {count}; "
                "check the master name in the URL's path)"
            )
        raise BrokerUnavailable(
            f"could not find the Redis master {name!r} through {count} sentinel(s): "
            + "; ".join(outcomes[index].problem for index in range(count))
        )

    async def _ask_one(self, index: int, outcomes: dict[int, _Outcome]) -> None:
        name = self._url.master_name
        where = self._url.sentinel_url(index).address
        try:
            link = await self._link(index)
            reply = await link.execute("SENTINEL", "MASTER", name)
        except RedisAuthError as exc:
            problem = f"{where} refused sentinel_password"
            outcomes[index] = _Outcome(where, problem=problem, refusal=exc)
            return
        except RedisReplyError as exc:
            unknown = "no such master" in exc.reply.lower()
            problem = f"{where} knows no master named {name!r}" if unknown else f"{where}: {exc}"
            outcomes[index] = _Outcome(where, problem=problem, unknown=unknown)
            return
        except BrokerError as exc:  # down, reset
            self._drop_link(index)
            problem = str(exc) if where in str(exc) else f"{where}: {exc}"
            outcomes[index] = _Outcome(where, problem=problem)
            return
        except TransportClosed:
            outcomes[index] = _Outcome(where, problem="closed", closed=True)
            return
        found = _master_fields(reply)
        if found is None:
            outcomes[index] = _Outcome(where, problem=f"{where}: a malformed answer {reply!r:.60}")
        else:
            host, port, epoch, failing_over = found
            outcomes[index] = _Outcome(
                where, address=(host, port), epoch=epoch, failing_over=failing_over
            )

    async def _link(self, index: int) -> Connection:
        """The connection to sentinel ``index``, opened (within the timeout) if need be."""
        link = self._links.get(index)
        if link is not None and link.healthy:
            return link
        if self._nursery is None:
            raise TransportClosed("the Redis client is closed (or was never entered)")
        link = self._links[index] = await connect(
            self._url.sentinel_url(index),
            self._nursery,
            connect_timeout=self._timeout,
            command_timeout=self._timeout,
        )
        return link

    def _drop_link(self, index: int) -> None:
        link = self._links.pop(index, None)
        if link is not None:
            link.close()

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

    async def _watch(self, index: int) -> None:
        """Follow sentinel ``index``'s announcements, reconnecting (backing off) when lost."""
        failures = 0
        while True:
            try:
                await self._watch_one(index)
                failures = 0
            except BrokerError:
                failures += 1
            except TransportClosed:
                return  # the client is closing
            # (failures + 1: 0.05 s after a watch that ended without a failure)
            await trio.sleep(_WATCH_BACKOFF.delay(failures + 1))

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
        name = self._url.master_name
        try:
            await sub.subscribe(SWITCH_CHANNEL, FAILOVER_CHANNEL)
            while True:
                with trio.move_on_after(_WATCH_PING):
                    channel, message = await sub.receive()
                    if channel == FAILOVER_CHANNEL:
                        if parse_failover_start(message) == self._url.master_name:
                            # Writes from now on may go to a master about to be replaced:
                            # drop the connections; discovery refuses until it ends.
                            self.switch(f"a sentinel started a failover of {name!r}")
                        continue
                    switched = parse_switch_master(message)
                    if switched is not None and switched[0] == self._url.master_name:
                        _, host, port = switched
                        self.switch(
                            f"a sentinel announced +switch-master of {name!r} to {host}:{port}",
                            keep=(host, port),
                        )
                    continue
                await sub.ping(reply_timeout=self._timeout)
        finally:
            sub.close()
