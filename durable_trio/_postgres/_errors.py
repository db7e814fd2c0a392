"""The PostgreSQL driver's own errors, each a leaf of the project's error tree (:mod:`.._errors`).

Failures are translated at the driver's edge: a connection that cannot be made or was lost is
:class:`~durable_trio._errors.BrokerUnavailable`; an error the server reports for a statement
is a :class:`PostgresError` (a :class:`~durable_trio._errors.BrokerError`) carrying its
SQLSTATE, of a subclass where the class of the SQLSTATE says more (a transient server state is
unavailable too, a serialization failure a :class:`PostgresConflict`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._errors import AuthenticationError, BrokerError, BrokerUnavailable

if TYPE_CHECKING:
    from psycopg.pq.abc import PGresult

__all__ = [
    "PostgresAuthError",
    "PostgresCommandTimeout",
    "PostgresConflict",
    "PostgresError",
    "PostgresQueryCanceled",
    "PostgresUnavailableError",
    "server_error",
    "unavailable",
]


class PostgresError(BrokerError):
    """The server answered a statement with an error (a constraint violated, bad SQL, ...).

    The connection stays usable (inside a transaction, the transaction is aborted: only
    ``ROLLBACK`` works until it ends).

    Attributes:
        sqlstate: the five-character SQLSTATE code (``"23505"``), or ``""`` if none was given.
        detail: the server's ``DETAIL`` line, or ``None``.
        index: for an error raised out of a pipeline, the position of the failing statement;
            otherwise ``None``.
    """

    index: int | None = None

    def __init__(self, message: str, *, sqlstate: str = "", detail: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate
        self.detail = detail

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.args[0]!r}, sqlstate={self.sqlstate!r})"


class PostgresQueryCanceled(PostgresError):
    """The statement was cancelled on the server (SQLSTATE ``57014``): ``statement_timeout``
    expired, or someone sent a cancel request. The connection stays usable; the statement's
    effects were rolled back (or, inside a transaction, the transaction is aborted)."""


class PostgresConflict(PostgresError):
    """The transaction was rolled back by the server because of a conflict with another one
    (SQLSTATE class ``40``: a serialization failure, a deadlock): running it again may succeed."""


class PostgresUnavailableError(PostgresError, BrokerUnavailable):
    """An error that means the server cannot serve now rather than that the statement is wrong:
    an administrator's shutdown or ``pg_terminate_backend`` (``57P01``), a crash (``57P02``),
    starting up (``57P03``), too many connections (``53300``), a connection exception (class
    ``08``). A :class:`~durable_trio._errors.BrokerUnavailable` too, so loops back off."""


class PostgresAuthError(PostgresError, AuthenticationError):
    """The server refused the credentials (SQLSTATE class ``28``: a wrong password, an unknown
    role, no ``pg_hba.conf`` entry). An :class:`~durable_trio._errors.AuthenticationError`:
    waiting will not fix the URL. The message never contains the password."""


class PostgresCommandTimeout(BrokerUnavailable):
    """A statement got no (complete) answer within the driver's own ``timeout``.

    The driver then sent the server a cancel request and read what was left of the answer, so
    the connection is reused (or, when even that did not finish in time, closed). The statement
    may or may not have run.
    """


#: SQLSTATEs (or classes, two characters) of :class:`PostgresUnavailableError`.
_UNAVAILABLE = frozenset({"08", "53", "57P01", "57P02", "57P03", "57P04", "57P05", "58"})


def _classify(sqlstate: str) -> type[PostgresError]:
    if sqlstate == "57014":
        return PostgresQueryCanceled
    if sqlstate[:2] == "40":
        return PostgresConflict
    if sqlstate[:2] == "28":
        return PostgresAuthError
    if sqlstate in _UNAVAILABLE or sqlstate[:2] in _UNAVAILABLE:
        return PostgresUnavailableError
    return PostgresError


def server_error(result: PGresult, address: str) -> PostgresError:
    """The exception to raise for an error ``result`` of the server.

    Args:
        result: a result whose status is ``FATAL_ERROR``.
        address: ``host:port/dbname`` of the server, for the message.

    Returns:
        a :class:`PostgresError` of the subclass its SQLSTATE calls for.
    """
    from psycopg.pq import DiagnosticField

    def field(code: DiagnosticField) -> str | None:
        value = result.error_field(code)
        return None if value is None else value.decode("utf-8", "replace")

    sqlstate = field(DiagnosticField.SQLSTATE) or ""
    message = field(DiagnosticField.MESSAGE_PRIMARY)
    if message is None:
        message = result.error_message.decode("utf-8", "replace").strip() or "unknown error"
    kind = _classify(sqlstate)
    return kind(
        f"PostgreSQL at {address}: {message} (SQLSTATE {sqlstate or '?'})",
        sqlstate=sqlstate,
        detail=field(DiagnosticField.MESSAGE_DETAIL),
    )


def unavailable(message: str, cause: BaseException | None = None) -> BrokerUnavailable:
    """A :class:`~durable_trio._errors.BrokerUnavailable` for ``message``, chained to ``cause``."""
    error = BrokerUnavailable(message)
    error.__cause__ = cause
    return error
