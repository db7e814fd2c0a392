"""The Redis client: a small pool of shared connections, dedicated connections, scripts, pub/sub.

::

    async with open_redis("redis://127.0.0.1:6379/0") as client:
        await client.execute("SET", "k", "v")
        value = await client.execute("GET", "k")              # b"v"
        replies = await client.pipeline([("INCR", "n"), ("GET", "n")])
        bump = client.script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
        await bump(keys=["n"], args=[5])
        async with client.dedicated() as conn:                # blocking commands
            await conn.execute("BLPOP", "q", 1, reply_timeout=3)
        async with client.subscribe("doorbell") as sub:       # pub/sub
            async for channel, message in sub:
                ...

Every task the client starts (each connection's reader and writer, background pool growth) runs
in the nursery the client owns for the duration of its ``async with``.
"""

from __future__ import annotations

import contextlib
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any

import trio
from trio_util import RepeatedEvent

from .._arguments import check_backoff_range, check_positive
from .._backoff import Backoff
from .._errors import BrokerError, BrokerUnavailable, ConfigError, TransportClosed
from .._redact import url_scheme
from ._connection import Connection, RedisArg, connect
from ._errors import RedisAuthError, RedisDatabaseRefused, RedisReplyError, refused_again
from ._pubsub import Subscription
from ._script import Script
from ._url import SENTINEL_SCHEMES, RedisURL, parse_redis_url

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterable, Sequence
    from types import TracebackType

    from ._sentinel import MasterLocator

__all__ = ["OwnedNursery", "RedisClient", "open_redis", "pool_options"]


def open_redis(
    url: str,
    *,
    pool_size: int = 1,
    connect_timeout: float = 5.0,
    command_timeout: float = 10.0,
    backoff_initial: float = 0.05,
    backoff_max: float = 2.0,
    sentinel_timeout: float = 2.0,
    watch_sentinels: bool = True,
) -> RedisClient:
    """Make a client for ``url``; use it as ``async with open_redis(url) as client:``.

    Connections are opened lazily (the first command opens the first one) and replaced when they
    die, so the server need not be up when the client starts.

    Args:
        url: ``redis://[[user]:password@]host[:port][/db][?client_name=...]`` or ``rediss://``
            (TLS; add ``ssl_cert_reqs=none`` to skip certificate checks, ``ssl_ca_certs=PATH`` to
            trust a private CA). See :func:`parse_redis_url`. Or a master found through Redis
            Sentinel: ``redis+sentinel://[[user]:password@]s1:26379,s2:26379/MASTER[/db]``
            (``rediss+sentinel://``: TLS to the data nodes), see
            :func:`~durable_trio._redis._sentinel_url.parse_sentinel_url` and
            :class:`~durable_trio._redis._sentinel.MasterLocator`.
        pool_size: how many shared connections at most (commands go to the least loaded one).
            One by default, as ioredis and node-redis: the commands of concurrent callers
            share its writes and reads (auto-pipelining), which costs less per command than
            spreading them; more helps where one connection's big replies would hold up the
            others' (the Redis backend's broker uses two: docs/decisions.md).
        connect_timeout: seconds for connect + TLS + ``AUTH``/``SELECT``/``CLIENT SETNAME``.
        command_timeout: default seconds a command waits for its reply before its connection is
            discarded (override per call with ``reply_timeout=``).
        backoff_initial: after a failed connect, seconds before the next attempt (doubled per
            consecutive failure, jittered down to half, capped at ``backoff_max``). Calls made
            meanwhile fail fast with ``BrokerUnavailable``.
        backoff_max: the cap of that delay.
        sentinel_timeout: ``redis+sentinel://`` only: seconds for the sentinels to answer
            (connect included), and for a new data connection's ``ROLE``.
        watch_sentinels: ``redis+sentinel://`` only: follow the sentinels' ``+try-failover``
            and ``+switch-master`` announcements (a task and a connection per sentinel).

    Returns:
        the (not yet entered) client.

    Raises:
        ConfigError: a bad URL or option.
    """
    if (url_scheme(url) or "").endswith("+cluster"):
        # The one switch between the two clients: each call site says which it wants, so a
        # caller typed for one node (the broker, the run stores) never gets a cluster client.
        raise ConfigError("a redis+cluster:// URL is opened with open_redis_cluster()")
    locator: MasterLocator | None = None
    if url_scheme(url) in SENTINEL_SCHEMES:
        from ._sentinel import MasterLocator  # only for a Sentinel URL
        from ._sentinel_url import parse_sentinel_url

        located = parse_sentinel_url(url)
        if not sentinel_timeout > 0:
            raise ConfigError(f"sentinel_timeout must be positive, not {sentinel_timeout}")
        parsed = located.data
        locator = MasterLocator(
            located,
            sentinel_timeout=sentinel_timeout,
            command_timeout=command_timeout,
            watch=watch_sentinels,
        )
    else:
        parsed = parse_redis_url(url)
    return RedisClient(
        parsed,
        locator=locator,
        **pool_options(
            pool_size=pool_size,
            connect_timeout=connect_timeout,
            command_timeout=command_timeout,
            backoff_initial=backoff_initial,
            backoff_max=backoff_max,
        ),
    )


def pool_options(
    *,
    pool_size: int,
    connect_timeout: float,
    command_timeout: float,
    backoff_initial: float,
    backoff_max: float,
) -> dict[str, Any]:
    """The options of a pool (see :func:`open_redis`), checked.

    Returns:
        them, as keyword arguments of :class:`RedisClient`.

    Raises:
        ConfigError: one of them cannot work.
    """
    if pool_size < 1:
        raise ConfigError(f"pool_size must be at least 1, not {pool_size}")
    check_positive(
        connect_timeout=connect_timeout,
        command_timeout=command_timeout,
        backoff_max=backoff_max,
    )
    check_backoff_range(backoff_initial, backoff_max)
    return {
        "pool_size": pool_size,
        "connect_timeout": connect_timeout,
        "command_timeout": command_timeout,
        "backoff_initial": backoff_initial,
        "backoff_max": backoff_max,
    }


class OwnedNursery:
    """The nursery a client owns for the duration of its ``async with``: opened on entry,
    cancelled and waited for on exit. The body's exception is deliberately not passed in, so it
    propagates unchanged (not wrapped in an exception group).

    Args:
        owner: the owner's class name, for the message of a second entry.
    """

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._stack: AsyncExitStack | None = None
        self._nursery: trio.Nursery | None = None
        self._entered = False

    async def open(self, *, refuse: bool = False) -> trio.Nursery:
        """Open the nursery (once).

        Args:
            refuse: refuse anyway (the owner was closed before it was entered).

        Raises:
            RuntimeError: it was opened before, or ``refuse``.
        """
        if self._entered or refuse:
            raise RuntimeError(f"a {self._owner} can be entered only once")
        self._entered = True
        self._stack = AsyncExitStack()
        self._nursery = await self._stack.enter_async_context(trio.open_nursery())
        return self._nursery

    def cancel(self) -> None:
        """Cancel every task in the nursery (from any task; idempotent)."""
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    async def close(self) -> None:
        """Cancel the nursery and wait for its tasks to end (idempotent)."""
        self.cancel()
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()


class RedisClient:
    """A Trio-native Redis client (made by :func:`open_redis`); an async context manager.

    Leaving the ``async with`` closes every connection; calls still waiting then raise
    :class:`~durable_trio._errors.TransportClosed`, as does any later call. An exception raised
    in the body propagates unchanged (not wrapped in an exception group).
    """

    def __init__(
        self,
        url: RedisURL,
        *,
        pool_size: int,
        connect_timeout: float,
        command_timeout: float,
        backoff_initial: float,
        backoff_max: float,
        locator: MasterLocator | None = None,
    ) -> None:
        self._url = url
        self._locator = locator
        self._pool_size = pool_size
        self._connect_timeout = connect_timeout
        self._command_timeout = command_timeout
        # (jitter 0.5: each delay between half and all of it, so clients that lost the
        # server together do not reconnect in lockstep)
        self._backoff = Backoff(backoff_initial, backoff_max, jitter=0.5)
        self._conns: list[Connection] = []
        self._connect_lock = trio.Lock()
        self._growing = False
        self._failures = 0
        self._retry_at = 0.0
        self._last_error = ""
        # The last connect failed on the credentials or the database number.
        self._refusal: RedisAuthError | RedisDatabaseRefused | None = None
        self._scripts: dict[str, bytes] = {}
        self._lifetime = OwnedNursery("RedisClient")
        self._nursery: trio.Nursery | None = None
        self._closed = False
        self.connected = RepeatedEvent()
        """Set whenever a pooled connection is opened: a reconnection after a restart looks
        like one (the broker re-checks the store's identity then)."""

    # -- lifetime ---------------------------------------------------------------------------

    async def __aenter__(self) -> RedisClient:
        self._nursery = await self._lifetime.open(refuse=self._closed)
        if self._locator is not None:
            self._locator.start(self._nursery)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
        await self._lifetime.close()  # waits for the connection tasks to end

    def close(self) -> None:
        """Close the client now, from any task; idempotent.

        Every connection is closed; every waiting call and every later call raises
        ``TransportClosed``. Leaving the ``async with`` does this too, and then waits for the
        connection tasks to end.
        """
        self._closed = True
        for conn in self._conns:
            conn.close()
        self._lifetime.cancel()

    # -- properties -------------------------------------------------------------------------

    @property
    def url(self) -> RedisURL:
        """The parsed URL (its ``repr`` hides the password); for a ``redis+sentinel://`` URL
        the data nodes' settings, with a stand-in address (see :attr:`sentinel`)."""
        return self._url

    @property
    def sentinel(self) -> MasterLocator | None:
        """How a ``redis+sentinel://`` client finds its master (its counters, the last
        master it found); ``None`` for a single server."""
        return self._locator

    @property
    def connections(self) -> tuple[Connection, ...]:
        """The pool's connections that are currently healthy."""
        return tuple(c for c in self._conns if c.healthy)

    # -- commands ---------------------------------------------------------------------------

    async def execute(self, *args: RedisArg, reply_timeout: float | None = None) -> Any:
        """Run one command on the least loaded pooled connection and return its reply.

        Concurrent callers share connections: their commands are coalesced into shared writes and
        their replies handed back in order. Commands are never retried on another connection
        (they may have run); a dead connection's callers get ``BrokerUnavailable`` and the next
        call reconnects.

        Args:
            *args: the command, e.g. ``"HSET", "h", "f", b"v"``.
            reply_timeout: seconds to wait for the reply before the connection is deemed stuck and
                discarded (``None``: the client's ``command_timeout``; ``math.inf``: forever).
                Blocking commands belong on :meth:`dedicated`. To just give up waiting, cancel
                the call (``trio.move_on_after``) instead: that keeps the connection.

        Returns:
            the reply: ``bytes``, ``int``, ``None``, or a ``list`` of those.

        Raises:
            RedisAuthError: the credentials or the ACL were refused (also while backing off
                after such a refusal: never reported as unavailable).
            RedisReplyError: an error reply.
            RedisCommandTimeout: no reply in time (that connection is discarded).
            BrokerUnavailable: Redis cannot be reached (or is being reconnected to after a
                failure: calls fail fast until the backoff delay passed).
            TransportClosed: the client is closed.
        """
        conn = self._ready() or await self._acquire()
        try:
            return await conn._command(args, reply_timeout)
        except RedisReplyError as exc:
            if self._locator is not None and exc.code == "READONLY":
                raise self._locator.demoted(conn, exc) from exc
            raise

    async def pipeline(
        self,
        commands: Iterable[Sequence[RedisArg]],
        *,
        raise_on_error: bool = True,
        reply_timeout: float | None = None,
    ) -> list[Any]:
        """Run many commands in one write on one pooled connection (see ``Connection.pipeline``).

        Args:
            commands: e.g. ``[("SET", "a", "1"), ("GET", "a")]``.
            raise_on_error: raise the first error reply once all replies are read (default), or
                return error replies as :class:`RedisReplyError` objects in their slots.
            reply_timeout: seconds for the whole pipeline (``None``: the client's).

        Returns:
            the replies, in order.

        Raises:
            RedisReplyError: ``raise_on_error`` and a command failed (its ``index`` is set).
            RedisCommandTimeout: no complete answer in time.
            BrokerUnavailable: Redis cannot be reached.
            TransportClosed: the client is closed.
        """
        conn = self._ready() or await self._acquire()
        try:
            replies = await conn.pipeline(
                commands, raise_on_error=raise_on_error, reply_timeout=reply_timeout
            )
        except RedisReplyError as exc:
            if self._locator is not None and exc.code == "READONLY":
                raise self._locator.demoted(conn, exc) from exc
            raise
        if self._locator is not None and not raise_on_error:
            for reply in replies:
                if isinstance(reply, RedisReplyError) and reply.code == "READONLY":
                    raise self._locator.demoted(conn, reply)
        return replies

    def script(self, source: str | bytes) -> Script:
        """Register a Lua script (no round trip) and return its callable handle.

        Args:
            source: the Lua source.

        Returns:
            a :class:`Script`: ``await script(keys=[...], args=[...])``, or
            ``script.command(keys, args)`` for a pipeline.
        """
        script = Script(self, source)
        self._scripts[script.sha] = script.source
        return script

    @asynccontextmanager
    async def dedicated(
        self, *, discard_on_cancel: bool = True, command_timeout: float | None = None
    ) -> AsyncIterator[Connection]:
        """A connection of its own (blocking commands, ``MULTI``/``WATCH``), closed on exit.

        It is not reconnected: once it fails, its calls raise ``BrokerUnavailable``; open another.

        Args:
            discard_on_cancel: if true (the default), a caller cancelled while waiting for a
                reply discards the connection (so a cancelled ``BLPOP`` cannot pop an item nobody
                will read); if false, the reply is drained and dropped instead.
            command_timeout: its default per-command timeout (``None``: the client's).

        Yields:
            the connection.

        Raises:
            BrokerUnavailable: could not connect.
            TransportClosed: the client is closed.
        """
        conn = await self._connect(
            discard_on_cancel=discard_on_cancel, command_timeout=command_timeout
        )
        try:
            yield conn
        finally:
            conn.close()

    @asynccontextmanager
    async def subscribe(
        self, *channels: str | bytes, patterns: Sequence[str | bytes] = (), buffer: int = 1024
    ) -> AsyncIterator[Subscription]:
        """Subscribe on a dedicated connection; iterate the result for ``(channel, message)``.

        Args:
            *channels: channels to subscribe to before yielding (more can be added later).
            patterns: glob-style patterns to subscribe to (``PSUBSCRIBE``).
            buffer: messages buffered before the connection stops reading.

        Yields:
            the :class:`Subscription`, already confirmed by Redis.

        Raises:
            BrokerUnavailable: could not connect.
            TransportClosed: the client is closed.
        """
        conn = await self._connect(discard_on_cancel=False, push_buffer=buffer)
        sub = Subscription(conn)
        try:
            await sub.subscribe(*channels)
            await sub.psubscribe(*patterns)
            yield sub
        finally:
            sub.close()

    # -- the pool ---------------------------------------------------------------------------

    async def _connect(
        self,
        *,
        discard_on_cancel: bool,
        command_timeout: float | None = None,
        push_buffer: int | None = None,
    ) -> Connection:
        if self._closed or self._nursery is None:
            raise TransportClosed("the Redis client is closed (or was never entered)")
        # A Sentinel client asks where the master is for every new connection, and keeps the
        # connection only if the node says it is the master.
        url = self._url if self._locator is None else await self._locator.locate()
        conn = await connect(
            url,
            self._nursery,
            connect_timeout=self._connect_timeout,
            command_timeout=self._command_timeout if command_timeout is None else command_timeout,
            discard_on_cancel=discard_on_cancel,
            scripts=self._scripts,
            push_buffer=push_buffer,
        )
        if self._locator is not None:
            await self._locator.admit(conn)
        return conn

    def _pick(self) -> Connection | None:
        """The least loaded healthy pooled connection (dropping dead ones from the list)."""
        best: Connection | None = None
        dead = False
        for conn in self._conns:  # (``healthy`` and ``load``, read directly)
            if conn._error is not None:
                dead = True
            elif best is None or conn._outstanding < best._outstanding:
                best = conn
        if dead:
            self._conns = [c for c in self._conns if c.healthy]
        return best

    def _backing_off(self) -> bool:
        return self._failures > 0 and trio.current_time() < self._retry_at

    def _ready(self) -> Connection | None:
        """The connection for the next command when one is open (no await), else ``None``.

        Raises:
            TransportClosed: the client is closed.
        """
        if self._closed or self._nursery is None:
            raise TransportClosed("the Redis client is closed (or was never entered)")
        best: Connection | None = None
        for conn in self._conns:  # _pick, inlined (once a command) while none is dead
            if conn._error is not None:
                best = self._pick()
                break
            if best is None or conn._outstanding < best._outstanding:
                best = conn
        if (
            best is not None
            and best._outstanding
            and not self._growing
            and len(self._conns) < self._pool_size
            and not self._backing_off()
        ):
            # Everyone is busy and the pool may grow: connect in the background and use the
            # least loaded connection meanwhile.
            self._growing = True
            self._nursery.start_soon(self._grow)
        return best

    async def _acquire(self) -> Connection:
        """:meth:`_ready`'s connection, or a new one (one connect at a time)."""
        best = self._ready()
        if best is not None:
            return best
        async with self._connect_lock:  # one connect at a time; the others wait for it
            best = self._pick()
            if best is not None:
                return best
            if self._backing_off():
                if self._refusal is not None:
                    # Refused credentials (or database number) stay that error while backing
                    # off, never "unavailable" (waiting alone would not fix them).
                    raise refused_again(self._refusal)
                wait = self._retry_at - trio.current_time()
                raise BrokerUnavailable(
                    f"Redis at {self._url.address} is unavailable ({self._last_error}); "
                    f"next connect attempt in {wait:.2f}s"
                )
            return await self._connect_pooled()

    async def _connect_pooled(self) -> Connection:
        try:
            conn = await self._connect(discard_on_cancel=False)
        except BrokerError as exc:
            self._failures += 1
            self._retry_at = trio.current_time() + self._backoff.delay(self._failures)
            self._last_error = str(exc)
            self._refusal = (
                exc if isinstance(exc, RedisAuthError | RedisDatabaseRefused) else None
            )
            raise
        self._failures = 0
        self._refusal = None
        self._conns.append(conn)
        self.connected.set()
        return conn

    async def _grow(self) -> None:
        try:
            # A failure is recorded (backoff) by _connect_pooled; a foreground call reports it.
            with contextlib.suppress(Exception):
                async with self._connect_lock:
                    if (
                        not self._closed
                        and len(self.connections) < self._pool_size
                        and not self._backing_off()
                    ):
                        await self._connect_pooled()
        finally:
            self._growing = False
