"""One PostgreSQL connection on Trio: psycopg's libpq wrapper and protocol generators, driven by
Trio's own I/O waits (:mod:`._wait`).

What is used of psycopg: ``psycopg.pq`` (libpq), ``psycopg.generators`` (sending a request,
reading its results, the cancel request's connection) and ``psycopg.adapt.Transformer``
(Python values to parameters and columns to Python values). Not its connection or cursor
classes, which wait on asyncio or by blocking. Statements use PostgreSQL's own ``$1, $2``
placeholders, bound by the server (the extended query protocol): one statement per call.
A statement with parameters is prepared on the server the first time a connection runs it
(its Parse in the same round trip as its first run) and run by name after that, so the
server parses and plans it once per connection (``prepare_statements=False`` turns it off).
:meth:`PgConnection.script` runs several, without parameters (the simple protocol).

A connection runs one operation at a time, in the calling task (no background task): a
second task that uses it meanwhile gets ``RuntimeError``. Get connections from a pool
(:mod:`._pool`), which hands each to one task at a time.

Cancellation:
    Trio delivers ``Cancelled`` at every checkpoint of a cancelled scope, again and again,
    where psycopg's asyncio code expects one cancel it can clean up after. So every operation
    has two halves, and the rule is per half:

    * **Cancelled before the request was handed to libpq**: nothing happened. The connection is
      untouched, the statement never reached the server.
    * **Cancelled (or timed out) after it was handed to libpq**: the connection is *made safe*
      before ``Cancelled`` (or :class:`PostgresCommandTimeout`) propagates, shielded and
      bounded by ``recover_timeout``: the rest of the request is sent (a message cut in half
      cannot be taken back), a cancel request goes to the server if the answer is not all in,
      and everything up to the end of the answer is read and dropped. The cancel request is
      waited for to the end before the answer is drained, so it cannot land on a later
      statement (a backend ignores a cancel while it waits for a command). If any of it
      fails or takes longer, the connection is closed instead. Either way it is never left
      with an answer that belongs to nobody.

    The statement of a call cancelled after sending **may or may not have run**, as with the
    Redis client: the driver never sends it again. A cancelled ``COMMIT`` may have committed.
    Inside :meth:`PgConnection.transaction` a cancelled statement leaves the transaction
    aborted or open; leaving the block rolls it back (shielded, bounded).
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
import socket
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Final

import attrs
import psycopg
import trio
from psycopg import generators, pq
from psycopg.adapt import Transformer
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from .._errors import BrokerUnavailable, ConfigError, TransportClosed
from ._errors import (
    PostgresAuthError,
    PostgresCommandTimeout,
    PostgresError,
    unavailable,
)
from ._statements import Result, Spoiled, Statements, check, read_result
from ._statements import Send as _Send
from ._wait import drive, drive_conn, ready_now

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Sequence

    from psycopg.abc import PQGen
    from psycopg.pq.abc import PGconn, PGresult

__all__ = ["ConnectionStats", "PgConnection", "Result", "connect", "one_sync", "parse_conninfo"]

_OK: Final = pq.ConnStatus.OK
_IDLE: Final = pq.TransactionStatus.IDLE
_ACTIVE: Final = pq.TransactionStatus.ACTIVE
_INERROR: Final = pq.TransactionStatus.INERROR
_TUPLES_OK: Final = pq.ExecStatus.TUPLES_OK
_COMMAND_OK: Final = pq.ExecStatus.COMMAND_OK
_EMPTY_QUERY: Final = pq.ExecStatus.EMPTY_QUERY
_FATAL_ERROR: Final = pq.ExecStatus.FATAL_ERROR
_COPY: Final = frozenset({pq.ExecStatus.COPY_IN, pq.ExecStatus.COPY_OUT, pq.ExecStatus.COPY_BOTH})
_PIPELINE_SYNC: Final = pq.ExecStatus.PIPELINE_SYNC
_PIPELINE_ABORTED: Final = pq.ExecStatus.PIPELINE_ABORTED
_PIPELINE_OFF: Final = pq.PipelineStatus.OFF
_POLL_OK: Final = pq.PollingStatus.OK
_POLL_READING: Final = pq.PollingStatus.READING
_POLL_WRITING: Final = pq.PollingStatus.WRITING
# libpq's connection-time refusals of the credentials (the server sends them before any
# result exists, so there is no SQLSTATE to read).
_AUTH_REFUSALS: Final = (
    "password authentication failed",
    "authentication failed for user",
    "no pg_hba.conf entry",
    "role ",  # 'role "x" does not exist', 'role "x" is not permitted to log in'
    "password is required",
    "no password supplied",
)
_ISOLATION: Final = frozenset({"serializable", "repeatable read", "read committed"})


@attrs.define
class ConnectionStats:
    """Counters of one connection (for tests, benchmarks and debugging).

    Attributes:
        statements: requests handed to libpq.
        interrupted: requests cancelled or timed out after they were handed over.
        recovered: interrupted requests after which the connection was made safe and kept.
        cancel_requests: cancel requests sent to the server.
        prepared: server-side prepared statements made.
    """

    statements: int = 0
    interrupted: int = 0
    recovered: int = 0
    cancel_requests: int = 0
    prepared: int = 0


def parse_conninfo(conninfo: str) -> dict[str, Any]:
    """Parse a ``postgresql://`` URL or a ``key=value`` connection string (libpq's syntax).

    Args:
        conninfo: the URL or string.

    Returns:
        its parameters.

    Raises:
        ConfigError: libpq cannot parse it (the message never repeats the password).
    """
    try:
        return dict(conninfo_to_dict(conninfo))
    except psycopg.Error as exc:
        raise ConfigError(f"not a PostgreSQL connection URL or string: {exc}") from None


def _address(params: dict[str, Any]) -> str:
    host = str(params.get("host") or params.get("hostaddr") or "localhost")
    port = str(params.get("port") or 5432)
    dbname = str(params.get("dbname") or params.get("user") or "")
    return f"{host}:{port}/{dbname}"


async def _resolved(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with the host name resolved by Trio (``hostaddr``), so libpq does not block
    the event loop in ``getaddrinfo``. Several hosts, a Unix socket folder, an IP address or
    a given ``hostaddr`` are left to libpq (they need no lookup, or are rare)."""
    host = params.get("host")
    if not host or params.get("hostaddr") or "," in str(host) or str(host).startswith("/"):
        return params
    try:
        ipaddress.ip_address(str(host))
        return params
    except ValueError:
        pass
    port = int(str(params.get("port") or 5432).split(",")[0])
    try:
        infos = await trio.socket.getaddrinfo(str(host), port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise unavailable(f"could not resolve PostgreSQL host {host!r}: {exc}", exc) from exc
    return {**params, "hostaddr": infos[0][4][0]}


async def _open(conninfo: bytes) -> PGconn:
    """Open a libpq connection without blocking (``PQconnectStart`` / ``PQconnectPoll``)."""
    pgconn = pq.PGconn.connect_start(conninfo)
    try:
        while True:
            if pgconn.status == pq.ConnStatus.BAD:
                raise psycopg.OperationalError(pgconn.get_error_message())
            status = pgconn.connect_poll()
            if status == _POLL_OK:
                break
            # The socket may change between polls (libpq tries the next address, or again
            # without SSL), so it is read each time.
            if status == _POLL_READING:
                await trio.lowlevel.wait_readable(pgconn.socket)
            elif status == _POLL_WRITING:
                await trio.lowlevel.wait_writable(pgconn.socket)
            else:
                raise psycopg.OperationalError(pgconn.get_error_message())
        pgconn.nonblocking = 1
    except BaseException:
        pgconn.finish()
        raise
    return pgconn


async def connect(
    conninfo: str,
    *,
    connect_timeout: float = 10.0,
    command_timeout: float = 30.0,
    recover_timeout: float = 5.0,
    stats: ConnectionStats | None = None,
    prepare_statements: bool = True,
) -> PgConnection:
    """Open a connection.

    Args:
        conninfo: a ``postgresql://user:password@host:port/dbname?options`` URL or a
            ``key=value`` string (libpq's). ``client_encoding`` is always UTF-8.
        connect_timeout: seconds for the name lookup, the connection and its authentication.
        command_timeout: default seconds a statement may take before the driver cancels it
            (:class:`PostgresCommandTimeout`); ``math.inf``: no limit.
        recover_timeout: seconds allowed to make the connection safe after an interrupted
            statement before it is closed instead (see the module docs).
        stats: counters to add to (a pool's, shared by its connections); ``None``: its own.
        prepare_statements: run each statement with parameters as a server-side prepared
            statement of the connection, made on its first run (in the same round trip): the
            server parses and plans it once. ``False`` for a pooler that cannot keep them
            (PgBouncer before 1.21 in transaction mode).

    Returns:
        the connection, idle and in autocommit mode (each statement commits on its own;
        :meth:`PgConnection.transaction` opens a transaction).

    Raises:
        ConfigError: an unparsable ``conninfo``, or a non-positive timeout.
        PostgresAuthError: the server refused the credentials.
        PostgresError: the database does not exist (SQLSTATE ``3D000``).
        BrokerUnavailable: the server could not be reached in time, or refused the
            connection (not running, starting up, too many connections).

    Cancellation:
        Nothing is left open: a connection being made is closed.
    """
    for name, value in (
        ("connect_timeout", connect_timeout),
        ("command_timeout", command_timeout),
        ("recover_timeout", recover_timeout),
    ):
        if not value > 0:
            raise ConfigError(f"{name} must be positive, not {value}")
    params = parse_conninfo(conninfo)
    params["client_encoding"] = "UTF8"
    address = _address(params)
    try:
        with trio.fail_after(connect_timeout):
            params = await _resolved(params)
            pgconn = await _open(make_conninfo("", **params).encode())
    except trio.TooSlowError as exc:
        raise unavailable(
            f"could not connect to PostgreSQL at {address} within {connect_timeout:g}s", exc
        ) from exc
    except psycopg.Error as exc:
        # libpq's message is lines ("...failed: Connection refused\n\tIs the server running
        # ..."): one line, since the CLI shows control characters escaped.
        message = " ".join(str(exc).split())
        if any(refusal in message for refusal in _AUTH_REFUSALS):
            raise PostgresAuthError(
                f"PostgreSQL at {address} refused the credentials of the URL: {message} "
                "(check its user name and password, percent-encoded)",
                sqlstate="28000",
            ) from None
        if "database" in message and "does not exist" in message:
            # Waiting will not create it: a clear error of the URL, not "unavailable".
            raise PostgresError(
                f"PostgreSQL at {address}: {message} (check the database name of the URL)",
                sqlstate="3D000",
            ) from None
        raise unavailable(f"could not connect to PostgreSQL at {address}: {message}") from exc
    return PgConnection(
        pgconn,
        address,
        command_timeout=command_timeout,
        recover_timeout=recover_timeout,
        stats=stats,
        prepare_statements=prepare_statements,
    )


def one_sync(pgconn: PGconn) -> PQGen[list[PGresult]]:
    """Read one group of a pipeline's results, one per statement, up to its sync (libpq ends
    each statement's results with ``NULL``)."""
    results: list[PGresult] = []
    while True:
        result = yield from generators.fetch(pgconn)
        if result is None:
            continue
        if result.status == _PIPELINE_SYNC:
            return results
        if result.status in _COPY:
            raise psycopg.NotSupportedError("COPY in a pipeline")
        results.append(result)


def _pipeline_results(pgconn: PGconn, syncs: list[int]) -> PQGen[list[list[PGresult]]]:
    """Send a whole pipeline (already queued in libpq, a sync after each group of statements)
    and read each group's results (:func:`one_sync`). ``syncs[0]`` counts the syncs still to
    come (what :meth:`PgConnection._drain` reads after an interruption)."""
    yield from generators.send(pgconn)
    groups: list[list[PGresult]] = []
    while syncs[0]:
        groups.append((yield from one_sync(pgconn)))
        syncs[0] -= 1
    return groups


def _sql(query: str | bytes) -> bytes:
    return query.encode() if isinstance(query, str) else query


def _quote_begin(isolation: str | None, read_only: bool) -> bytes:
    parts = ["BEGIN"]
    if isolation is not None:
        if isolation.lower() not in _ISOLATION:
            raise ConfigError(f"isolation must be one of {sorted(_ISOLATION)}, not {isolation!r}")
        parts.append(f"ISOLATION LEVEL {isolation.upper()}")
    if read_only:
        parts.append("READ ONLY")
    return " ".join(parts).encode()


class PgConnection:
    """One connection to PostgreSQL (made by :func:`connect` or a pool).

    Every statement runs in autocommit mode unless inside :meth:`transaction`. Values are
    adapted by psycopg: ``int``, ``str``, ``bytes``, ``float``, ``bool``, ``None``,
    ``datetime``, ``uuid.UUID``, ``decimal.Decimal``, lists, JSON via
    ``psycopg.types.json.Jsonb``, ... and back.
    """

    def __init__(
        self,
        pgconn: PGconn,
        address: str,
        *,
        command_timeout: float,
        recover_timeout: float,
        stats: ConnectionStats | None = None,
        prepare_statements: bool = True,
    ) -> None:
        self._pgconn = pgconn
        self._fd = pgconn.socket
        self._address = address
        self._command_timeout = command_timeout
        self._recover_timeout = recover_timeout
        # One Transformer per connection: it caches dumpers and loaders; the connection runs
        # one operation at a time, so its per-result state is never shared.
        self._tx = Transformer()
        self._statements = Statements(pgconn, self._tx, enabled=prepare_statements)
        self._busy = False
        self._closed = False
        self._in_transaction = False
        # The syncs of the pipeline under way still to come (one cell, shared with its reader).
        self._syncs = [0]
        self.stats = ConnectionStats() if stats is None else stats
        # Notifications that arrive on a connection nobody listens on are dropped by psycopg
        # (no handler); the listener sets its own.
        pgconn.notify_handler = None
        # libpq hands an error that arrives while idle (the FATAL of a terminated backend)
        # to the notice handler: counted, so check_idle() can tell.
        self._notices = 0
        pgconn.notice_handler = self._on_notice

    # -- properties ---------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """``host:port/dbname`` of the server (never the credentials)."""
        return self._address

    @property
    def closed(self) -> bool:
        """True once closed (on purpose, or because it failed); it is then never used again."""
        return self._closed

    @property
    def idle(self) -> bool:
        """True if open, with no operation under way and outside any transaction."""
        return (
            not self._closed
            and not self._busy
            and self._pgconn.status == _OK
            and self._pgconn.transaction_status == _IDLE
        )

    @property
    def backend_pid(self) -> int:
        """The process id of the server's backend for this connection."""
        return self._pgconn.backend_pid

    @property
    def pgconn(self) -> PGconn:
        """psycopg's libpq connection (for the pool and the listener of this package)."""
        return self._pgconn

    # -- statements ---------------------------------------------------------------------------

    async def execute(
        self, query: str | bytes, *params: Any, command_timeout: float | None = None
    ) -> Result:
        """Run one statement and return its :class:`Result`.

        Args:
            query: one SQL statement, with ``$1``, ``$2``, ... for the parameters.
            *params: the parameters' values, in order.
            command_timeout: seconds before the driver cancels the statement (``None``: the
                connection's ``command_timeout``; ``math.inf``: no limit). The server's own
                ``statement_timeout`` may cancel it first (:class:`PostgresQueryCanceled`).

        Returns:
            the result.

        Raises:
            PostgresError: the server reported an error for the statement (of a subclass where
                the SQLSTATE says more); the connection stays usable.
            PostgresCommandTimeout: no answer within ``command_timeout`` (the statement was
                cancelled on the server; it may have run).
            BrokerUnavailable: the connection is (or went) down; it is closed.
            TransportClosed: the connection was closed.
            ValueError: a parameter psycopg cannot adapt, or a ``COPY`` statement (nothing
                sent for the former; the connection is closed for the latter).
            RuntimeError: another task is using the connection.

        Cancellation:
            See the module docs: before sending, nothing happened; after, the connection is
            made safe (or closed) and the statement may or may not have run.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        self._begin()
        try:
            sql = query.encode() if isinstance(query, str) else query
            send = self._prepare(sql, params)
            if send.results == 1:
                return self._result(await self._exchange(send.call, command_timeout))
            # Its first run: prepared and run in one pipeline, one round trip.
            (result,) = await self._pipeline([send], command_timeout)
            return result
        finally:
            self._busy = False

    async def fetch(
        self, query: str | bytes, *params: Any, command_timeout: float | None = None
    ) -> list[tuple[Any, ...]]:
        """Run one statement and return its rows (see :meth:`execute`)."""
        return (await self.execute(query, *params, command_timeout=command_timeout)).rows

    async def fetchrow(
        self, query: str | bytes, *params: Any, command_timeout: float | None = None
    ) -> tuple[Any, ...] | None:
        """Run one statement and return its first row, or ``None`` (see :meth:`execute`)."""
        rows = (await self.execute(query, *params, command_timeout=command_timeout)).rows
        return rows[0] if rows else None

    async def fetchval(
        self, query: str | bytes, *params: Any, command_timeout: float | None = None
    ) -> Any:
        """Run one statement and return the first column of its first row, or ``None``."""
        rows = (await self.execute(query, *params, command_timeout=command_timeout)).rows
        return rows[0][0] if rows else None

    async def script(self, sql: str, *, command_timeout: float | None = None) -> None:
        """Run several ``;``-separated statements without parameters (schema set-up).

        Outside :meth:`transaction` they run as one implicit transaction: the first error
        stops them and rolls back the ones before it.

        Args:
            sql: the statements.
            command_timeout: as for :meth:`execute`, for all of them.

        Raises:
            PostgresError: a statement failed (the first error is raised).
            PostgresCommandTimeout: as for :meth:`execute`.
            BrokerUnavailable: the connection is (or went) down.
            TransportClosed: the connection was closed.

        Cancellation:
            As :meth:`execute`.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        self._begin()
        try:
            data = sql.encode()
            results = await self._exchange(lambda: self._pgconn.send_query(data), command_timeout)
            for result in results:
                try:
                    check(result, self._address)
                except Spoiled as spoiled:
                    if spoiled.close or self._pgconn.status != _OK:
                        self.close()
                    raise spoiled.error from None
        finally:
            self._busy = False

    async def pipeline(
        self,
        statements: Sequence[tuple[str | bytes, Sequence[Any]]],
        *,
        command_timeout: float | None = None,
    ) -> list[Result]:
        """Run several statements in one round trip (libpq's pipeline mode) and return their
        results, in order.

        The statements form one implicit transaction (or are part of the one open on the
        connection): when one fails, the ones before it are rolled back and the ones after it
        are skipped.

        Args:
            statements: ``(query, params)`` pairs, as for :meth:`execute`.
            command_timeout: as for :meth:`execute`, for all of them.

        Returns:
            one :class:`Result` per statement (``[]`` for no statements).

        Raises:
            PostgresError: a statement failed (its ``index`` is set); nothing was committed.
            PostgresCommandTimeout: as for :meth:`execute`.
            BrokerUnavailable: the connection is (or went) down.
            TransportClosed: the connection was closed.
            ValueError: a parameter psycopg cannot adapt (nothing was sent).

        Cancellation:
            As :meth:`execute`, for the pipeline as a whole: the connection is made safe
            (every result up to the sync drained, pipeline mode left) or closed.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        self._begin()
        try:
            sends = [self._prepare(_sql(query), params) for query, params in statements]
            if not sends:
                return []
            return await self._pipeline(sends, command_timeout)
        finally:
            self._busy = False

    async def pipeline_each(
        self,
        writes: Sequence[Sequence[tuple[str | bytes, Sequence[Any]]]],
        *,
        command_timeout: float | None = None,
    ) -> list[list[Result] | Exception]:
        """Run several writes in one round trip, each its own implicit transaction (a sync
        after each): one write's failure neither rolls back nor skips the others.

        Args:
            writes: each a list of ``(query, params)`` pairs, as for :meth:`pipeline`.
            command_timeout: as for :meth:`execute`, for all of them.

        Returns:
            per write, its results (as :meth:`pipeline` returns them), or its error: a
            :class:`PostgresError` (nothing of it committed) or ``ValueError`` (a parameter
            psycopg cannot adapt; not sent).

        Raises:
            PostgresCommandTimeout, BrokerUnavailable, TransportClosed: as for
                :meth:`pipeline`, for all of them (each write may have run).

        Cancellation:
            As :meth:`pipeline`.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        self._begin()
        try:
            out: list[list[Result] | Exception] = []
            groups: list[list[_Send]] = []
            for statements in writes:
                try:
                    groups.append([self._prepare(_sql(q), p) for q, p in statements])
                    out.append([])
                except ValueError as exc:
                    out.append(exc)
            answers = iter(await self._pipeline_groups(groups, command_timeout) if groups else ())
            return [next(answers) if isinstance(one, list) else one for one in out]
        finally:
            self._busy = False

    @asynccontextmanager
    async def transaction(
        self, *, isolation: str | None = None, read_only: bool = False
    ) -> AsyncIterator[PgConnection]:
        """Run the block's statements in one transaction: committed when the block ends
        normally, rolled back when it raises or is cancelled.

        Args:
            isolation: ``"serializable"``, ``"repeatable read"`` or ``"read committed"``
                (``None``: the server's default).
            read_only: ``BEGIN READ ONLY``.

        Yields:
            this connection.

        Raises:
            PostgresError: ``COMMIT`` failed, or the transaction had been aborted by an error
                the block caught (it was rolled back, not committed).
            PostgresConflict: the server rolled it back for a conflict (run it again).
            BrokerUnavailable: the connection went down (the transaction did not commit,
                unless it was lost during ``COMMIT``: then it may have).
            RuntimeError: a transaction is already open on this connection.

        Cancellation:
            The rollback after a raising or cancelled block is shielded and bounded by
            ``recover_timeout`` (the connection is closed if it does not finish). A
            cancelled ``COMMIT`` may have committed.
        """
        if self._in_transaction:
            raise RuntimeError("a transaction is already open on this connection")
        begin = _quote_begin(isolation, read_only)
        self._in_transaction = True
        try:
            try:
                await self._command(begin)
            except BaseException:
                await self.rollback_quietly()
                raise
            try:
                yield self
            except BaseException:
                await self.rollback_quietly()
                raise
            if self._pgconn.transaction_status == _INERROR:
                await self.rollback_quietly()
                raise PostgresError(
                    f"PostgreSQL at {self._address}: the transaction was aborted by an earlier "
                    "error (caught inside the block): rolled back, not committed",
                    sqlstate="25P02",
                )
            try:
                result = await self._command(b"COMMIT")
            except BaseException:
                await self.rollback_quietly()
                raise
            if result.status == "ROLLBACK":  # the server's answer to COMMIT of an aborted one
                raise PostgresError(
                    f"PostgreSQL at {self._address}: the transaction was rolled back, "
                    "not committed",
                    sqlstate="25P02",
                )
        finally:
            self._in_transaction = False

    async def rollback_quietly(self) -> None:
        """End any transaction open on the connection with ``ROLLBACK``; close the connection if
        that fails or takes longer than ``recover_timeout``. Never raises.

        Cancellation:
            Shielded and bounded: it runs to its end (or the bound) even in a cancelled scope.
        """
        if self._closed or self._pgconn.transaction_status == _IDLE:
            return
        done = False
        with trio.move_on_after(self._recover_timeout, shield=True):
            try:
                await self._command(b"ROLLBACK")
                done = self._pgconn.transaction_status == _IDLE
            except (PostgresError, BrokerUnavailable, TransportClosed, RuntimeError):
                done = False
        if not done:
            self.close()

    def close(self) -> None:
        """Close the connection now (from any task); idempotent. A task waiting on it gets
        :class:`~durable_trio._errors.TransportClosed`."""
        if self._closed:
            return
        self._closed = True
        if self._fd >= 0:
            # Outside Trio (at interpreter exit) nobody can be waiting on it.
            with contextlib.suppress(RuntimeError):
                trio.lowlevel.notify_closing(self._fd)
        self._pgconn.finish()

    # -- the pool's view ----------------------------------------------------------------------

    def check_idle(self) -> bool:
        """Whether an idle connection is still good, without waiting: whatever the server sent
        while it was idle (a notification, a ``FATAL`` before it closed the socket, the close
        itself) is read now. A connection found dead is closed.

        Returns:
            true if it can take a statement.
        """
        if not self.idle:
            return False
        # A server that ends the connection sends a FATAL error and then closes the socket: one
        # read takes the message, the next finds the close. A few reads at most, never a wait.
        # A message (not a notification) while idle means the server is ending the session.
        notices = self._notices
        for _ in range(4):
            if not ready_now(self._fd):
                return True
            try:
                self._pgconn.consume_input()
                while self._pgconn.notifies() is not None:
                    pass
            except psycopg.Error:
                self.close()
                return False
            if self._pgconn.status != _OK or self._notices != notices:
                self.close()
                return False
        return True

    # -- internals ----------------------------------------------------------------------------

    def _on_notice(self, _result: PGresult) -> None:
        self._notices += 1

    def _begin(self) -> None:
        if self._closed:
            raise TransportClosed(f"the connection to PostgreSQL at {self._address} is closed")
        if self._busy:
            raise RuntimeError("another task is using this PostgreSQL connection")
        self._busy = True

    async def _command(self, sql: bytes) -> Result:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._begin()
        try:
            results = await self._exchange(lambda: self._pgconn.send_query(sql), None)
            return self._result(results)
        finally:
            self._busy = False

    def _prepare(self, sql: bytes, params: Sequence[Any]) -> _Send:
        """How the statement is handed to libpq (see :meth:`Statements.send`)."""
        return self._statements.send(sql, params)

    async def _pipeline(
        self, sends: Sequence[_Send], command_timeout: float | None
    ) -> list[Result]:
        """Run ``sends`` in one pipeline, one round trip, one transaction, and return one
        result each (the caller holds the connection)."""
        (answer,) = await self._pipeline_groups([sends], command_timeout)
        if isinstance(answer, PostgresError):
            raise answer
        return answer

    async def _pipeline_groups(
        self, groups: Sequence[Sequence[_Send]], command_timeout: float | None
    ) -> list[list[Result] | PostgresError]:
        """Run ``groups`` in one pipeline, a sync after each: each group's results or error."""
        pgconn = self._pgconn
        self._syncs = syncs = [len(groups)]

        def send_all() -> None:
            pgconn.enter_pipeline_mode()
            for sends in groups:
                for send in sends:
                    send.call()
                pgconn.pipeline_sync()

        answer = lambda: _pipeline_results(pgconn, syncs)  # noqa: E731
        answers: list[list[PGresult]] = await self._exchange(send_all, command_timeout, answer)
        try:
            pgconn.exit_pipeline_mode()
        except psycopg.Error as exc:
            raise self._lost(exc) from exc
        return [self._group(sends, results) for sends, results in zip(groups, answers, strict=True)]

    def _group(self, sends: Sequence[_Send], got: list[PGresult]) -> list[Result] | PostgresError:
        out: list[Result] = []
        error: PostgresError | None = None
        at = 0
        for index, send in enumerate(sends):
            group = got[at : at + send.results]
            at += send.results
            if self._statements.made(send, group):
                self.stats.prepared += 1
            live = [result for result in group if result.status != _PIPELINE_ABORTED]
            if error is not None or not live:
                continue  # skipped after an earlier failure, returned below
            try:
                out.append(self._result(live))
            except PostgresError as exc:
                exc.index = index
                error = exc
        return out if error is None else error

    async def _exchange(
        self,
        send: Callable[[], None],
        limit: float | None,
        answer: Callable[[], PQGen[Any]] | None = None,
    ) -> Any:  # (list[PGresult], or what `answer` returns)
        """Hand the request to libpq, then send it and read its results; the two halves of the
        module docs' cancellation rule meet here."""
        try:
            send()
        except psycopg.Error as exc:
            raise self._lost(exc) from exc
        self.stats.statements += 1
        if limit is None:
            limit = self._command_timeout
        gen = generators.execute(self._pgconn) if answer is None else answer()
        try:
            if limit == math.inf:
                # No timeout: no cancel scope (its entry and exit cost more than a statement's
                # own Python code); a cancellation of the caller's scopes is handled below.
                return await drive(gen, self._fd)
            with trio.move_on_after(limit):
                return await drive(gen, self._fd)
        except psycopg.Error as exc:
            raise self._lost(exc) from exc
        except trio.ClosedResourceError:
            raise TransportClosed(
                f"the connection to PostgreSQL at {self._address} was closed"
            ) from None
        except BaseException:
            gen.close()
            await self._settle()
            raise
        gen.close()
        await self._settle()
        raise PostgresCommandTimeout(
            f"PostgreSQL at {self._address} did not answer within {limit:g}s: the statement "
            "was cancelled on the server (it may have run)"
        )

    def _lost(self, exc: BaseException) -> BrokerUnavailable | TransportClosed:
        if self._closed:
            return TransportClosed(f"the connection to PostgreSQL at {self._address} was closed")
        self.close()
        message = str(exc).strip() or repr(exc)
        return unavailable(f"lost the connection to PostgreSQL at {self._address}: {message}")

    async def _settle(self) -> None:
        """Make the connection safe after an interrupted request, shielded and bounded; close it
        if that fails or takes too long (see the module docs)."""
        self.stats.interrupted += 1
        if self._closed:
            return
        settled = False
        with trio.move_on_after(self._recover_timeout, shield=True):
            try:
                settled = await self._drain()
            except (psycopg.Error, OSError, trio.ClosedResourceError, trio.BrokenResourceError):
                settled = False
        if settled:
            self.stats.recovered += 1
        else:
            self.close()

    async def _drain(self) -> bool:
        pgconn, fd = self._pgconn, self._fd
        # The rest of the request first: a message cut in half cannot be taken back.
        await drive(generators.send(pgconn), fd)
        pipelined = pgconn.pipeline_status != _PIPELINE_OFF
        cancelled = False
        nulls = 0
        while True:
            pgconn.consume_input()
            while not pgconn.is_busy():
                result = pgconn.get_result()
                if result is None:
                    nulls += 1
                    # The end of the answer; in a pipeline, NULL only ends one statement's
                    # results, and two in a row mean nothing more is coming.
                    if not pipelined or nulls > 1:
                        return self._settled()
                    continue
                nulls = 0
                if result.status in _COPY:
                    return False
                if pipelined and result.status == _PIPELINE_SYNC:
                    self._syncs[0] -= 1
                    if self._syncs[0] > 0:
                        continue  # the next write's results follow
                    pgconn.exit_pipeline_mode()
                    return self._settled()
            if not cancelled:
                cancelled = True
                await self._cancel_on_server()
                continue  # the answer may be all in by now
            await trio.lowlevel.wait_readable(fd)

    def _settled(self) -> bool:
        pgconn = self._pgconn
        return (
            pgconn.status == _OK
            and pgconn.pipeline_status == _PIPELINE_OFF
            and pgconn.transaction_status != _ACTIVE
        )

    async def _cancel_on_server(self) -> None:
        """Send the server a cancel request for the running statement and wait until it was
        delivered (so it cannot hit a later statement)."""
        self.stats.cancel_requests += 1
        if psycopg.capabilities.has_cancel_safe():
            # libpq 17+: a non-blocking cancel connection, driven like the others.
            cancel = self._pgconn.cancel_conn()
            try:
                cancel.start()
                await drive_conn(generators.cancel(cancel))
            finally:
                cancel.finish()
        else:
            # Older libpq (Debian 12's 15) has only the blocking PQcancel: one short-lived
            # thread per cancel, never per statement.
            handle = self._pgconn.get_cancel()
            await trio.to_thread.run_sync(handle.cancel, abandon_on_cancel=True)

    def _result(self, results: list[PGresult]) -> Result:
        try:
            return read_result(results, self._tx, self._address)
        except Spoiled as spoiled:
            if spoiled.close or self._pgconn.status != _OK:
                self.close()
            raise spoiled.error from None
