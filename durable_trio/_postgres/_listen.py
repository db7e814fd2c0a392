"""One dedicated PostgreSQL connection for ``LISTEN``, reconnected by itself.

::

    async with open_listener(url) as listener:
        await listener.listen("jobs")
        async for event in listener:
            if isinstance(event, NotificationsMissed):
                ...  # wake every waiting queue once: notifications may have been lost
            else:
                ...  # event.channel, event.payload

One task (in the listener's own nursery) owns the connection: it waits until the socket is
readable, reads what came (``consume_input``) and queues the notifications; it also runs the
``LISTEN`` / ``UNLISTEN`` that :meth:`PgListener.listen` and :meth:`PgListener.unlisten` ask
for, and a ``SELECT 1`` after ``ping_interval`` of silence (a half-open connection is found).
Channels are kept as the set wanted; after a lost connection the task reconnects (backing off),
``LISTEN`` s every wanted channel again, and only *then* queues one
:class:`NotificationsMissed`: whatever the caller re-reads on it happened before the new
``LISTEN`` or will be notified. A caller that falls more than ``buffer`` notifications behind
gets one :class:`NotificationsMissed` in their place too. So the rule for the caller is
simple: on :class:`NotificationsMissed`, wake everything that waits once.

Cancellation:
    :meth:`PgListener.listen` cancelled before the channel is active leaves it wanted (it is
    ``LISTEN`` ed soon after anyway; :meth:`PgListener.unlisten` undoes it). Cancelling a
    receive loses nothing. Leaving the ``async with`` closes the connection.
"""

from __future__ import annotations

from collections import deque
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Final

import attrs
import psycopg
import trio

from .._arguments import check_backoff_range, check_positive
from .._backoff import Backoff
from .._errors import BrokerError, BrokerUnavailable, ConfigError, TransportClosed
from .._logs import get_logger
from ._connection import PgConnection, connect, parse_conninfo

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType

    from psycopg.pq import PGnotify

__all__ = ["Notification", "NotificationsMissed", "PgListener", "open_listener"]

log = get_logger("durable_trio.postgres")

_MAX_CHANNEL: Final = 63  # PostgreSQL's identifier limit (NAMEDATALEN - 1), in bytes


@attrs.frozen
class Notification:
    """One ``NOTIFY`` received.

    Attributes:
        channel: the channel.
        payload: the payload (``""`` when none was given).
        pid: the process id of the notifying backend.
    """

    channel: str
    payload: str
    pid: int


@attrs.frozen
class NotificationsMissed:
    """Notifications may have been lost: wake every waiter once, and re-read.

    Attributes:
        reason: ``"reconnected"`` (the connection was lost and is back, listening again) or
            ``"overflow"`` (the caller fell more than ``buffer`` notifications behind; the
            queued ones were dropped).
    """

    reason: str


def _quote(channel: str) -> str:
    if not channel or "\x00" in channel or len(channel.encode()) > _MAX_CHANNEL:
        raise ConfigError(
            f"a channel name must be 1 to {_MAX_CHANNEL} bytes without NUL, not {channel!r}"
        )
    return '"' + channel.replace('"', '""') + '"'


def open_listener(
    conninfo: str,
    *,
    connect_timeout: float = 10.0,
    command_timeout: float = 10.0,
    ping_interval: float = 30.0,
    backoff_initial: float = 0.05,
    backoff_max: float = 2.0,
    buffer: int = 10_000,
) -> PgListener:
    """Make a listener for ``conninfo``; use it as ``async with open_listener(url) as l:``.

    Args:
        conninfo: a ``postgresql://`` URL or a ``key=value`` string (libpq's).
        connect_timeout: seconds to open the connection.
        command_timeout: seconds for a ``LISTEN`` / ``UNLISTEN`` / ping; also how long
            :meth:`PgListener.listen` waits for its channel to be active.
        ping_interval: seconds of silence after which the connection is checked.
        backoff_initial: first delay between reconnect attempts (doubled per consecutive
            failure, jittered down to half, capped at ``backoff_max``).
        backoff_max: the cap of that delay.
        buffer: notifications queued for a slow caller before they are replaced by one
            :class:`NotificationsMissed`.

    Returns:
        the (not yet entered) listener.

    Raises:
        ConfigError: a bad URL or option.
    """
    parse_conninfo(conninfo)
    check_positive(
        connect_timeout=connect_timeout,
        command_timeout=command_timeout,
        ping_interval=ping_interval,
        backoff_max=backoff_max,
    )
    check_backoff_range(backoff_initial, backoff_max)
    if buffer < 1:
        raise ConfigError(f"buffer must be at least 1, not {buffer}")
    return PgListener(
        conninfo,
        connect_timeout=connect_timeout,
        command_timeout=command_timeout,
        ping_interval=ping_interval,
        backoff_initial=backoff_initial,
        backoff_max=backoff_max,
        buffer=buffer,
    )


class PgListener:
    """The dedicated ``LISTEN`` connection (made by :func:`open_listener`); an async context
    manager and an async iterator of :class:`Notification` and :class:`NotificationsMissed`.

    Attributes:
        reconnects: connections made after a lost one (for tests and debugging).
    """

    def __init__(
        self,
        conninfo: str,
        *,
        connect_timeout: float,
        command_timeout: float,
        ping_interval: float,
        backoff_initial: float,
        backoff_max: float,
        buffer: int,
    ) -> None:
        self._conninfo = conninfo
        self._connect_timeout = connect_timeout
        self._command_timeout = command_timeout
        self._ping_interval = ping_interval
        self._backoff = Backoff(backoff_initial, backoff_max, jitter=0.5)
        self._buffer = buffer
        self._wanted: set[str] = set()
        self._active: set[str] = set()
        self._conn: PgConnection | None = None
        self._queue: deque[Notification] = deque()
        self._missed: str | None = None
        self._arrivals = trio.lowlevel.ParkingLot()  # receivers wait here
        self._changes = trio.lowlevel.ParkingLot()  # listen()/unlisten() callers wait here
        self._wake_scope: trio.CancelScope | None = None
        self._stack: AsyncExitStack | None = None
        self._nursery: trio.Nursery | None = None
        self._closed = False
        self._entered = False
        self.reconnects = 0

    # -- lifetime -----------------------------------------------------------------------------

    async def __aenter__(self) -> PgListener:
        if self._entered:
            raise RuntimeError("a PgListener can be entered only once")
        self._entered = True
        self._stack = AsyncExitStack()
        self._nursery = await self._stack.enter_async_context(trio.open_nursery())
        self._nursery.start_soon(self._run)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()  # the task ends at once: its nursery was cancelled

    def close(self) -> None:
        """Stop listening and close the connection, from any task; idempotent. Waiting
        receivers get :class:`~durable_trio._errors.TransportClosed`."""
        self._closed = True
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()
        if self._conn is not None:
            self._conn.close()
        self._arrivals.unpark_all()
        self._changes.unpark_all()

    # -- the caller's side --------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Whether the connection is up and every wanted channel is being listened to."""
        return self._conn is not None and not self._conn.closed and self._wanted <= self._active

    @property
    def channels(self) -> frozenset[str]:
        """The channels wanted."""
        return frozenset(self._wanted)

    async def listen(self, channel: str) -> None:
        """Listen to ``channel`` (now, and again after every reconnect).

        Args:
            channel: the channel's name (case-sensitive: it is quoted).

        Raises:
            BrokerUnavailable: it is not active within ``command_timeout`` (the connection is
                down); it stays wanted, and is listened to once the connection is back (a
                :class:`NotificationsMissed` follows).
            ConfigError: not a valid channel name.
            TransportClosed: the listener is closed.

        Cancellation:
            The channel stays wanted (see the module docs).
        """
        _quote(channel)
        self._wanted.add(channel)
        await self._until(lambda: channel in self._active, f"LISTEN {channel!r}")

    async def unlisten(self, channel: str) -> None:
        """Stop listening to ``channel`` (notifications already queued are still delivered).

        Raises:
            BrokerUnavailable: not done within ``command_timeout`` (it is not wanted any more,
                and a reconnect will not listen to it again).
            TransportClosed: the listener is closed.
        """
        self._wanted.discard(channel)
        await self._until(lambda: channel not in self._active, f"UNLISTEN {channel!r}")

    async def receive(self) -> Notification | NotificationsMissed:
        """The next event: a notification, or :class:`NotificationsMissed`.

        Raises:
            TransportClosed: the listener is closed.

        Cancellation:
            Nothing is lost: an event is taken only when it is returned.
        """
        while True:
            if self._missed is not None:
                reason, self._missed = self._missed, None
                await trio.lowlevel.cancel_shielded_checkpoint()
                return NotificationsMissed(reason)
            if self._queue:
                await trio.lowlevel.cancel_shielded_checkpoint()
                return self._queue.popleft()
            if self._closed:
                raise TransportClosed("the PostgreSQL listener is closed")
            await self._arrivals.park()

    def __aiter__(self) -> PgListener:
        return self

    async def __anext__(self) -> Notification | NotificationsMissed:
        try:
            return await self.receive()
        except TransportClosed:
            raise StopAsyncIteration from None

    async def _until(self, done: Callable[[], bool], what: str) -> None:
        if self._closed:
            raise TransportClosed("the PostgreSQL listener is closed")
        self._kick()
        with trio.move_on_after(self._command_timeout):
            while not done():
                await self._changes.park()
                if self._closed:
                    raise TransportClosed("the PostgreSQL listener is closed")
            return
        raise BrokerUnavailable(
            f"{what} not active within {self._command_timeout:g}s (the PostgreSQL connection "
            "is down); it will be once the connection is back"
        )

    def _kick(self) -> None:
        """Wake the connection's task to apply the wanted channels."""
        if self._wake_scope is not None:
            self._wake_scope.cancel()

    def _push(self, notify: PGnotify) -> None:
        """psycopg's notify handler: queue one notification (or overflow into a miss)."""
        if self._missed == "overflow":
            return
        if len(self._queue) >= self._buffer:
            self._queue.clear()
            self._missed = "overflow"
        else:
            self._queue.append(
                Notification(
                    notify.relname.decode("utf-8", "replace"),
                    notify.extra.decode("utf-8", "replace"),
                    notify.be_pid,
                )
            )
        self._arrivals.unpark_all()

    # -- the connection's task ----------------------------------------------------------------

    async def _run(self) -> None:
        failures = 0
        first = True
        while not self._closed:
            try:
                conn = await connect(
                    self._conninfo,
                    connect_timeout=self._connect_timeout,
                    command_timeout=self._command_timeout,
                    recover_timeout=self._command_timeout,
                )
            except BrokerError as exc:
                failures += 1
                # failures + 1: the listener's waits have always run one doubling ahead of the
                # pool's (the first is twice backoff_initial); kept, so no delay changes
                delay = self._backoff.delay(failures + 1)
                log.debug("PostgreSQL listener: connect failed (%s); again in %.2fs", exc, delay)
                await trio.sleep(delay)
                continue
            failures = 0
            if not first:
                self.reconnects += 1
            self._conn = conn
            try:
                await self._serve(conn, missed=not first)
            except (BrokerError, TransportClosed, psycopg.Error, trio.ClosedResourceError) as exc:
                log.info("PostgreSQL listener: lost the connection (%s); reconnecting", exc)
            finally:
                conn.close()
                self._conn = None
                self._active.clear()
            first = False

    async def _serve(self, conn: PgConnection, *, missed: bool) -> None:
        pgconn = conn.pgconn
        pgconn.notify_handler = self._push
        await self._apply(conn)
        if missed:
            # Only now: the channels are listened to again, so what the caller re-reads on
            # this event is either before the new LISTEN or will be notified.
            self._missed = "reconnected"
            self._arrivals.unpark_all()
        fd = pgconn.socket
        while True:
            with trio.move_on_after(self._ping_interval) as quiet:
                self._wake_scope = quiet
                if self._wanted == self._active:
                    await trio.lowlevel.wait_readable(fd)
            self._wake_scope = None
            if self._closed:
                return
            pgconn.consume_input()  # raises OperationalError when the server closed it
            while (notify := pgconn.notifies()) is not None:
                self._push(notify)
            if pgconn.status != psycopg.pq.ConnStatus.OK:
                raise BrokerUnavailable("the PostgreSQL listener's connection went bad")
            await self._apply(conn)
            silent = quiet.cancelled_caught and trio.current_time() >= quiet.deadline
            if silent and self._wanted == self._active:
                await conn.execute("SELECT 1")  # silence for ping_interval: still there?

    async def _apply(self, conn: PgConnection) -> None:
        """``LISTEN`` / ``UNLISTEN`` until the active channels are the wanted ones."""
        while self._wanted != self._active:
            added = sorted(self._wanted - self._active)
            if added:
                await conn.execute(f"LISTEN {_quote(added[0])}")
                self._active.add(added[0])
            else:
                removed = sorted(self._active - self._wanted)[0]
                await conn.execute(f"UNLISTEN {_quote(removed)}")
                self._active.discard(removed)
            self._changes.unpark_all()
        self._changes.unpark_all()
