"""The store's identity on PostgreSQL: a loss nobody would otherwise report, detected.

A schema dropped and created again by another process's open (its migrations make an empty
one), a database restored from nothing, another server at the same address: the runs whose
start had returned, the queued jobs and the claims are gone, and the processes see at most a
few errors, then carry on on the empty tables as if nothing had happened. So the schema carries
an identity, stamped once when its tables are created (the ``store`` part's first migration
step), and every broker checks it:

==============================  =============================================================
``<schema>.durable_trio_store``  one row: ``identity`` (``"<16 hex digits> <unix time
                                 stamped>"``, never changed) and ``alarm``: the JSON record of
                                 the first detection of a loss (``lost``, ``found``, ``at``,
                                 ``by``), kept until an operator acknowledges it (sets it NULL)
==============================  =============================================================

A broker reads the row when it is attached (its entry), then, while entered, every
``store_check_interval`` seconds (every second while an alarm waits to be recorded), whenever
its pool opens a connection (a reconnection: what a restart looks like from here) and when a
call finds its tables missing, in ONE short ``SELECT`` that writes nothing while all is well.
Three findings are a loss of the store this process knew:

* another identity: the schema was dropped and created again (or the database replaced, and
  its tables made again by a process that opened it);
* no row: the table was emptied;
* no table (or no schema): the schema was dropped, or the server replaced by an empty one,
  and nobody has created the tables again.

The broker logs a :class:`~durable_trio.StoreLost` saying which at ERROR once, hands it to
``on_error``, and records it in the row (the first detector's record stays) as soon as there is
one; it keeps the alarm (:meth:`StoreIdentity.read_loss`: health, the console) until the record
is cleared. A process that starts later finds the record and reports it the same way.

While the tables are missing, the processes do NOT create them again (that would hide the loss,
and race an operator's restore): every broker call raises a :class:`~durable_trio.StoreLost`
(so does the key store's) naming the schema instead of the driver's "relation does not
exist", and loops report it and back off. Restarting the processes (their open migrates a
new, empty schema) or ``durable-trio migrate`` brings the store back; the processes that saw
the old one then find the new identity and record the alarm in it (docs/decisions.md, "A
PostgreSQL schema dropped under running processes").
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from typing import TYPE_CHECKING, Any, Final

import orjson
import trio
from trio_util import wait_any

from ..._errors import BrokerError, StoreLost, TransportClosed
from ..._failures import report_through
from ..._logs import get_logger
from ..._postgres import NO_TABLE, Migration, PostgresError, quote_ident, tables_missing

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..._postgres import PgPool

__all__ = [
    "IDENTITY_MIGRATIONS",
    "IDENTITY_PART",
    "StoreIdentity",
    "store_lost",
]

logger = get_logger("durable_trio.postgres")

#: The part's name in ``durable_trio_schema``.
IDENTITY_PART: Final = "store"

_V1: Final = """
CREATE TABLE {schema}.durable_trio_store (
    one boolean PRIMARY KEY DEFAULT true CHECK (one),
    identity text NOT NULL,
    alarm text
);
INSERT INTO {schema}.durable_trio_store (identity) VALUES (
    substr(md5(random()::text || clock_timestamp()::text || pg_backend_pid()::text), 1, 16)
    || ' ' || floor(extract(epoch FROM clock_timestamp()))::bigint::text
);
"""

#: Seconds between two checks while an alarm could not be recorded (the tables gone).
UNRECORDED_RETRY: Final = 1.0

#: The identity's steps, oldest first (append only: a released step never changes).
IDENTITY_MIGRATIONS: Final = (Migration(1, _V1, "the store's identity and loss alarm"),)


def _who() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def store_lost(
    schema: str, lost: str, found: str | None, *, detected_at: float, detected_by: str
) -> StoreLost:
    """The :class:`StoreLost` of a loss found in ``schema``: ``lost`` gone, ``found`` (the
    identity that stands instead) or ``None`` (no identity, no tables)."""
    what = (
        f"found the identity {found!r} instead (the schema dropped and created again by "
        "another process's open, or the database replaced)"
        if found
        else "found no identity (its tables dropped or emptied, or the database restored from "
        "nothing); the processes do not create the tables again: restart them or run "
        "`durable-trio migrate`"
    )
    return StoreLost(
        f"STORE LOST: the PostgreSQL schema {schema!r} was emptied or replaced under running "
        f"processes: its identity {lost!r} is gone, {detected_by} {what} (unix time "
        f"{detected_at:.0f}); the runs, queued jobs, claims and schedules it held before are "
        'lost. Kept as an alarm until acknowledged (docs/deployment.md, "PostgreSQL")',
        lost=lost,
        found=found,
        detected_at=detected_at,
        detected_by=detected_by,
    )


def _loss(schema: str, record: str) -> StoreLost:
    """The :class:`StoreLost` of a stored alarm record (a damaged record still raises the
    alarm, with what could be read)."""
    try:
        fields: Any = orjson.loads(record)
        return store_lost(
            schema,
            str(fields["lost"]),
            str(fields["found"]) if fields.get("found") else None,
            detected_at=float(fields["at"]),
            detected_by=str(fields["by"]),
        )
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        return store_lost(
            schema,
            f"(unreadable alarm record: {record[:80]!r})",
            None,
            detected_at=0.0,
            detected_by="?",
        )


class StoreIdentity:
    """One broker's watch on the store's identity (see the module docs).

    Args:
        pool: the broker's pool (its :attr:`~durable_trio._postgres.PgPool.connected` starts
            a check at once).
        schema: the schema of the tables.
        interval: seconds between two checks.
        on_error: the broker's hook (a :class:`~durable_trio.StoreLost` is handed to it once per
            alarm).
    """

    def __init__(
        self,
        pool: PgPool,
        schema: str,
        interval: float,
        on_error: Callable[[Exception], object] | None,
    ) -> None:
        self._pool = pool
        self._schema = schema
        table = f"{quote_ident(schema)}.durable_trio_store"
        self._read = f"SELECT identity, alarm FROM {table}"
        self._record = (
            f"UPDATE {table} SET alarm = coalesce(alarm, $1) RETURNING identity, alarm"
        )
        self._restamp = (
            f"INSERT INTO {table} (identity, alarm) VALUES ($1, $2) "
            "ON CONFLICT (one) DO UPDATE SET alarm = coalesce("
            f"{table}.alarm, excluded.alarm) RETURNING identity, alarm"
        )
        self._acknowledge = f"UPDATE {table} SET alarm = NULL WHERE alarm IS NOT NULL"
        self._interval = interval
        self._on_error = on_error
        self.identity: str | None = None
        """The identity this process knows (``None``: not read yet)."""
        self._alarm: StoreLost | None = None
        self._stored = False  # the alarm is the store's record (cleared once it is cleared)
        self._scope = trio.CancelScope()
        self._poke = trio.Event()

    @property
    def alarm(self) -> StoreLost | None:
        """The loss this process knows of, until acknowledged (``None``: none)."""
        return self._alarm

    @property
    def unrecorded(self) -> StoreLost | None:
        """The alarm, if its record could not be written to the store yet (else ``None``)."""
        return None if self._stored else self._alarm

    def poke(self) -> None:
        """Check at once (a call found the tables missing)."""
        self._poke.set()

    async def check(self) -> None:
        """One check: compare, record and raise the alarm (see the module docs).

        Raises:
            BrokerError: the server did not answer, or (before any identity was read) the
                tables are missing.
        """
        known = self.identity
        try:
            row = await self._pool.fetchrow(self._read)
        except PostgresError as error:
            if error.sqlstate not in NO_TABLE or known is None:
                raise
            # The tables are gone: the alarm, not recorded (there is nowhere to record it);
            # it will be when a schema stands again.
            self._raise(self._found(known, None), stored=False)
            return
        found, stored = (str(row[0]), row[1]) if row is not None else (None, None)
        if known is not None and found != known:
            self._raise(self._found(known, found), stored=False)
        pending = self.unrecorded  # this one, or one found when there was nowhere to record it
        if found is None or (pending is not None and stored is None):
            record = None
            if pending is not None:
                record = orjson.dumps(
                    {
                        "lost": pending.lost,
                        "found": pending.found,
                        "at": pending.detected_at,
                        "by": pending.detected_by,
                    }
                ).decode()
            if found is None:  # no row: a new identity (with the alarm, if a loss)
                row = await self._pool.fetchrow(self._restamp, _stamp(), record)
            else:
                row = await self._pool.fetchrow(self._record, record)
            if row is not None:
                found, stored = str(row[0]), row[1]
        if found is not None:
            self.identity = found
        if stored is not None:
            self._raise(_loss(self._schema, str(stored)), stored=True)
        elif self._stored:
            logger.warning("the store-loss alarm was acknowledged (its record cleared)")
            self._alarm, self._stored = None, False

    def _found(self, known: str, found: str | None) -> StoreLost:
        return store_lost(
            self._schema, known, found, detected_at=round(time.time(), 3), detected_by=_who()
        )

    def _raise(self, loss: StoreLost, *, stored: bool) -> None:
        """Keep ``loss`` as the alarm; one not known yet is logged at ERROR and reported once
        (a record another process wrote of the loss this one found is not reported again)."""
        known = self._alarm
        if known is not None and not stored and not self._stored:
            return  # the loss this process found first stands, still to be recorded
        self._alarm, self._stored = loss, stored
        if known is None or (not stored and (known.lost, known.detected_by) != (
            loss.lost, loss.detected_by
        )):  # fmt: skip
            logger.error("%s", loss)
            if self._on_error is not None:
                report_through(self._on_error, loss, logger)

    async def read_loss(self) -> StoreLost | None:
        """The loss recorded in the store (or found by this watch and not recorded yet),
        ``None`` if none stands (one ``SELECT``, no write: for a health read).

        Raises:
            StoreLost: the tables are missing (and this watch had not seen them yet).
            BrokerError: the server did not answer.
        """
        try:
            row = await self._pool.fetchrow(self._read)
        except PostgresError as error:
            if error.sqlstate not in NO_TABLE:
                raise
            if self._alarm is not None:
                return self._alarm
            raise tables_missing(self._schema, error) from error
        if row is not None and row[1] is not None:
            return _loss(self._schema, str(row[1]))
        return self.unrecorded

    async def acknowledge(self) -> bool:
        """Clear the loss alarm (an operator has seen it); the running brokers clear theirs at
        their next check. ``False``: none stood.

        Raises:
            StoreLost: the tables are missing (create them first: there is no alarm to clear
                before, and this process's stays until then).
            BrokerError: the server did not answer.
        """
        try:
            result = await self._pool.execute(self._acknowledge)
        except PostgresError as error:
            if error.sqlstate not in NO_TABLE:
                raise
            raise tables_missing(self._schema, error) from error
        return bool(result.rowcount)

    def stop(self) -> None:
        """End :meth:`watch` (from any task; it does not wait)."""
        self._scope.cancel()

    async def watch(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Check every ``interval`` seconds, after every connection the pool opens and when
        poked, until :meth:`stop`. A failed check is logged at debug level (the broker's own
        calls report the outage) and tried again at the next tick."""
        with self._scope:
            task_status.started()
            first = self.identity is None  # not checked at the entry yet
            while True:
                if not first:
                    # An alarm not recorded yet (the tables gone) is tried again sooner: a
                    # process that opens the store made again must find it there.
                    pause = self._interval if self.unrecorded is None else UNRECORDED_RETRY
                    with trio.move_on_after(min(pause, self._interval)):
                        await wait_any(self._pool.connected.wait, self._poke.wait)
                    self._poke = trio.Event()
                first = False
                try:
                    await self.check()
                except BrokerError as exc:
                    logger.debug("store identity not checked: %s", exc)
                except TransportClosed:
                    return


def _stamp() -> str:
    """A new identity (as the migration stamps one)."""
    return f"{secrets.token_hex(8)} {time.time():.0f}"
