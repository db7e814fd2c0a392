"""How one connection hands its statements to libpq and reads their answers.

:class:`Statements` is a connection's statement cache: a statement with parameters is prepared
on the server the first time the connection runs it (in the same round trip: Parse, then the
run by its new name) and run by name after that, so the server parses and plans it once per
connection; at most :data:`MAX_PREPARED` of them, later ones run unprepared.
:func:`read_result` turns libpq's results into a :class:`~._connection.Result` or the error
they report.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import attrs
import psycopg
from psycopg import pq
from psycopg.adapt import PyFormat

from .._errors import ConfigError
from ._errors import server_error, unavailable

if TYPE_CHECKING:
    from collections.abc import Sequence

    from psycopg.abc import Transformer
    from psycopg.pq.abc import PGconn, PGresult


__all__ = ["MAX_PREPARED", "Result", "Send", "Spoiled", "Statements", "check", "read_result"]

#: Server-side prepared statements one connection makes at most (later ones run unprepared).
MAX_PREPARED: Final = 256

_TUPLES_OK: Final = pq.ExecStatus.TUPLES_OK
_COMMAND_OK: Final = pq.ExecStatus.COMMAND_OK
_EMPTY_QUERY: Final = pq.ExecStatus.EMPTY_QUERY
_FATAL_ERROR: Final = pq.ExecStatus.FATAL_ERROR
_COPY: Final = frozenset({pq.ExecStatus.COPY_IN, pq.ExecStatus.COPY_OUT, pq.ExecStatus.COPY_BOTH})


@attrs.frozen
class Result:
    """What one statement answered.

    Attributes:
        rows: the rows, each a tuple of Python values (``[]`` for a command without rows).
        columns: the column names (``()`` for a command without rows).
        rowcount: rows returned, or rows affected by ``INSERT`` / ``UPDATE`` / ``DELETE``
            (``-1`` when the command does not say).
        status: the command tag, e.g. ``"INSERT 0 1"``, ``"SELECT 3"``.
    """

    rows: list[tuple[Any, ...]]
    columns: tuple[str, ...]
    rowcount: int
    status: str


@attrs.frozen
class Send:
    """One statement, ready to be handed to libpq."""

    call: Callable[[], None]
    """Hands it over (queues it, in a pipeline)."""
    results: int = 1
    """The results it produces: 2 when it is prepared first (the Parse's, then its own)."""
    prepared: tuple[tuple[bytes, Any, Any], bytes] | None = None
    """(its key, the name it is prepared under) when it is prepared first."""


#: The element types of a list sent in binary (see :func:`_format`).
_BINARY_ELEMENTS: Final = frozenset({bytes, str, int, float})


def _format(param: Any) -> PyFormat:
    """How psycopg sends ``param`` (a list :func:`pack_array` did not pack: one of mixed
    types, say): a list of ``bytes``, ``str`` or numbers in binary, where its text form runs
    a regular expression over every element for the quotes and backslashes to escape (about
    1.7x the cost for a finish-and-claim's lists); everything else as psycopg prefers."""
    if type(param) is list and param and type(param[0]) in _BINARY_ELEMENTS:
        return PyFormat.BINARY
    return PyFormat.AUTO


_BINARY: Final = pq.Format.BINARY
_ARRAY_HEAD: Final = struct.Struct("!iiIii")  # dimensions, has nulls, element oid, size, from
_LENGTH: Final = struct.Struct("!i")
_INT8: Final = struct.Struct("!iq")  # (its length, 8, then the value)
_FLOAT8: Final = struct.Struct("!id")
_NULL: Final = _LENGTH.pack(-1)  # an element's length -1: NULL, no bytes follow
_INT8_RANGE: Final = range(-(2**63), 2**63)
#: element type -> (element oid, array oid): bytea, text, int8, float8.
_ARRAY_OIDS: Final = {bytes: (17, 1001), str: (25, 1009), int: (20, 1016), float: (701, 1022)}


def refused(params: Sequence[Any], exc: Exception | None = None) -> ConfigError:
    """The error for a parameter PostgreSQL cannot hold (nothing was sent), naming the value
    when it is a text with a NUL or a lone surrogate (a run id, a signal name, a label ...),
    so a caller sees what to change; ``exc``, the adapter's own error, if there was one. A
    :class:`ConfigError`, so a ``ValueError`` still."""
    detail = "" if exc is None else f" ({exc})"
    odd = next((p for p in params if isinstance(p, str) and _unstorable(p)), None)
    if odd is None:
        return ConfigError(f"cannot send a parameter to PostgreSQL{detail}")
    shown = repr(odd[:60]) + ("..." if len(odd) > 60 else "")
    return ConfigError(
        f"PostgreSQL cannot store the text {shown}: a text holds no NUL (0x00) and no lone "
        f"surrogate{detail}"
    )


def _unstorable(text: str) -> bool:
    if "\x00" in text:
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return True
    return False


def pack_array(items: list[Any]) -> tuple[bytes, int] | None:
    """A non-empty list of ``bytes``, ``str``, ``int`` or ``float`` (``None`` among them for
    NULLs) in PostgreSQL's binary array format, and the array's type oid (``bytea[]``,
    ``text[]``, ``bigint[]``, ``float8[]``); ``None`` for any other list (psycopg sends it).

    psycopg's binary dumper does the same element by element in Python (a finish-and-claim
    sends six such lists: ~3x this cost, the worker's largest single item on PostgreSQL).

    Raises:
        ConfigError: a ``str`` PostgreSQL cannot hold (a NUL; a lone surrogate): nothing is
            sent (an ``int`` outside ``bigint`` is left to psycopg).
    """
    present = [item for item in items if item is not None]
    if not present:
        return None
    kind = type(present[0])
    oids = _ARRAY_OIDS.get(kind)
    if oids is None or any(type(item) is not kind for item in present):
        return None
    elements: list[Any] = items
    if kind is str:
        if any("\x00" in item for item in present):
            raise refused(present)
        try:
            elements = [None if item is None else item.encode() for item in items]
        except UnicodeEncodeError as exc:
            raise refused(present, exc) from None
    if kind is int and any(item not in _INT8_RANGE for item in present):
        return None  # (psycopg sends it as numeric[], or says why not)
    if kind is bytes or kind is str:
        length = _LENGTH.pack
        body = [_NULL if e is None else length(len(e)) + e for e in elements]
    else:
        pack = (_INT8 if kind is int else _FLOAT8).pack
        body = [_NULL if e is None else pack(8, e) for e in elements]
    head = _ARRAY_HEAD.pack(1, len(present) != len(items), oids[0], len(items), 1)
    return head + b"".join(body), oids[1]


class Statements:
    """One connection's prepared statements (see the module docstring).

    Args:
        pgconn: the connection's libpq connection.
        tx: its transformer (dumps the parameters).
        enabled: prepare statements at all (``False``: for a pooler that cannot keep them).
    """

    def __init__(self, pgconn: PGconn, tx: Transformer, *, enabled: bool) -> None:
        self._pgconn = pgconn
        self._tx = tx
        self.enabled = enabled
        self._prepared: dict[tuple[bytes, Any, Any], bytes] = {}
        """(text, parameter types, formats) -> the name of its prepared statement."""
        self._names = 0

    def send(self, sql: bytes, params: Sequence[Any]) -> Send:
        """How the statement is handed to libpq (nothing is sent before its call is made): as
        the server-side prepared statement made for its text and parameter types on this
        connection, or, the first time, prepared then run (two results, in a pipeline). One
        without parameters, and new ones past :data:`MAX_PREPARED`, run unprepared.

        Raises:
            ConfigError: a parameter psycopg cannot adapt (nothing is sent; a ValueError).
        """
        pgconn = self._pgconn
        if not params:
            # (LISTEN, DDL, BEGIN ...: one-offs whose text changes, never worth preparing)
            return Send(lambda: pgconn.send_query_params(sql, None))
        tx = self._tx
        packed: dict[int, tuple[bytes, int]] | None = None
        # (Most statements have no list: one check in C, not a call per parameter.)
        if list in map(type, params):
            plain = list(params)
            packed = {}
            for i, param in enumerate(params):
                if type(param) is list and param:
                    array = pack_array(param)
                    if array is not None:
                        packed[i] = array
                        plain[i] = None  # (dumped by psycopg as a NULL, then replaced)
            params = plain
            wanted = [_format(param) for param in params]
        else:
            wanted = [PyFormat.AUTO] * len(params)
        try:
            values = tx.dump_sequence(params, wanted)
        except psycopg.Error as exc:
            raise refused(params, exc) from None
        types, formats = tx.types, tx.formats or []
        if packed:
            values, type_list, formats = list(values), list(types or ()), list(formats)
            for i, (data, oid) in packed.items():
                values[i], type_list[i], formats[i] = data, oid, _BINARY
            types = tuple(type_list)
        key = (sql, types, tuple(formats))
        name = self._prepared.get(key)
        if name is not None:
            return Send(lambda: pgconn.send_query_prepared(name, values, param_formats=formats))
        if not self.enabled or len(self._prepared) >= MAX_PREPARED:
            return Send(
                lambda: pgconn.send_query_params(
                    sql, values, param_types=types, param_formats=formats
                )
            )
        # A name never used before on this connection: a Parse whose outcome is unknown (an
        # interrupted request) cannot collide with a later one.
        self._names += 1
        new = b"_dt%d" % self._names

        def prepare_and_run() -> None:
            pgconn.send_prepare(new, sql, param_types=types)
            pgconn.send_query_prepared(new, values, param_formats=formats)

        return Send(prepare_and_run, results=2, prepared=(key, new))

    def made(self, send: Send, results: Sequence[PGresult]) -> bool:
        """Record the statement ``send`` prepared if its Parse succeeded (``results``: its
        results), whatever became of the rest: a prepared statement is not undone by a
        rollback. Whether one was made."""
        if send.prepared is None or not results or results[0].status != _COMMAND_OK:
            return False
        self._prepared[send.prepared[0]] = send.prepared[1]
        return True


class Spoiled(Exception):
    """:func:`read_result` met an answer after which the connection may be unusable.

    Attributes:
        error: what to raise to the caller.
        close: close the connection whatever its state (``False``: only if libpq says it
            is no longer ``OK``).
    """

    def __init__(self, error: Exception, *, close: bool) -> None:
        super().__init__(error)
        self.error = error
        self.close = close


def check(result: PGresult, address: str) -> None:
    """Raise what ``result`` reports, if it is not a plain answer.

    Raises:
        Spoiled: an error from the server (``close=False``), a ``COPY`` (not supported) or an
            unexpected status (both ``close=True``).
    """
    status = result.status
    if status == _FATAL_ERROR:
        raise Spoiled(server_error(result, address), close=False)
    if status in _COPY:
        raise Spoiled(
            ValueError("COPY is not supported by this driver (the connection was closed)"),
            close=True,
        )
    if status not in (_TUPLES_OK, _COMMAND_OK, _EMPTY_QUERY):
        raise Spoiled(
            unavailable(
                f"PostgreSQL at {address} answered with an unexpected result "
                f"({pq.ExecStatus(status).name}); the connection was closed"
            ),
            close=True,
        )


def read_result(results: list[PGresult], tx: Transformer, address: str) -> Result:
    """The :class:`Result` of one statement's ``results`` (its last one holds
    the rows).

    Raises:
        Spoiled: see :func:`check`; no result at all (``close=True``).
    """
    if not results:
        raise Spoiled(unavailable(f"PostgreSQL at {address} gave no result"), close=True)
    for result in results:
        check(result, address)
    result = results[-1]
    tag = (result.command_status or b"").decode()
    if result.status != _TUPLES_OK:
        count = result.command_tuples
        return Result([], (), -1 if count is None else count, tag)
    tx.set_pgresult(result)
    try:
        rows: list[tuple[Any, ...]] = tx.load_rows(0, result.ntuples, tuple)
    finally:
        tx.set_pgresult(None)
    columns = tuple((result.fname(i) or b"").decode() for i in range(result.nfields))
    return Result(rows, columns, result.ntuples, tag)
