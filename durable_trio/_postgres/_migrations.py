"""Versioned schema migrations of the PostgreSQL backend's parts (issue 32, item 4).

Each part (the broker, the key store, the run store) owns an ordered list of
:class:`Migration` steps for its tables and applies it with :func:`migrate` when it opens. All
of a backend's tables live in one PostgreSQL schema (``durable_trio`` unless the URL names
another); namespaces are a column, as they are in a SQLite file (docs/decisions.md). The
versions applied are rows of ``<schema>.durable_trio_schema``, one per part.

Every step runs in its own transaction under a transaction-scoped advisory lock on the schema,
so processes that open at once apply each step exactly once and the others wait, then see it
applied. A database whose part is at a newer version than this code knows is refused with a
clear error: an older worker must not write tables it does not understand.

A part already current is seen by one read, before any lock or DDL: a role with only the rights
to use the tables (``durable-trio migrate`` run by the schema's owner beforehand) opens the
backend without ``CREATE`` on the database or the schema.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Final

import attrs

from .._errors import BrokerError, ConfigError, StoreLost
from ._errors import PostgresError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ._pool import PgPool

__all__ = [
    "NO_TABLE",
    "Migration",
    "check_schema_name",
    "migrate",
    "quote_ident",
    "schema_versions",
    "tables_missing",
]

_NAME: Final = re.compile(r"[a-z_][a-z0-9_]{0,62}")

#: SQLSTATEs of a statement on a table that is not there: no table, no schema (a read of the
#: versions table before any migration; the tables dropped under a running process).
NO_TABLE: Final = frozenset({"42P01", "3F000"})

#: The advisory lock's first key (the second is the schema name's hash): "dt" in ASCII.
_LOCK_CLASS: Final = 0x6474


@attrs.frozen
class Migration:
    """One step of a part's schema.

    Attributes:
        version: its number, from 1, consecutive within the part.
        sql: ``;``-separated statements without parameters; ``{schema}`` stands for the
            quoted schema name.
        note: what it does, in a few words (kept in the versions table).
    """

    version: int
    sql: str
    note: str = ""


def check_schema_name(name: str) -> str:
    """``name`` if it is a plain lower-case identifier (letters, digits, ``_``; at most 63).

    Raises:
        ConfigError: it is not.
    """
    if not _NAME.fullmatch(name):
        raise ConfigError(
            f"a PostgreSQL schema name is lower-case letters, digits and _ (at most 63, not "
            f"starting with a digit), not {name!r}"
        )
    return name


def quote_ident(name: str) -> str:
    """``name`` (checked by :func:`check_schema_name`) as a quoted SQL identifier."""
    return '"' + check_schema_name(name) + '"'


def tables_missing(schema: str, error: PostgresError) -> StoreLost:
    """What a call raises instead of ``error`` (SQLSTATE in :data:`NO_TABLE`) when the tables
    of ``schema`` are not there: they were dropped under this process (the store's identity
    watch raises the alarm: :mod:`durable_trio.brokers.postgres._identity`), and nobody makes
    them again behind the operator's back."""
    return StoreLost(
        f"STORE LOST: the PostgreSQL schema {schema!r} has no durable_trio tables ({error}): "
        "dropped under this process (or never created); they are not created again behind "
        "the operator's back: restart the processes or run `durable-trio migrate`, then "
        'acknowledge the alarm (docs/deployment.md, "PostgreSQL")'
    )


def _check_steps(part: str, migrations: Sequence[Migration]) -> None:
    versions = [m.version for m in migrations]
    if versions != list(range(1, len(versions) + 1)):
        raise ValueError(f"{part}: migration versions must be 1, 2, ... in order, not {versions}")


async def migrate(pool: PgPool, schema: str, part: str, migrations: Sequence[Migration]) -> int:
    """Bring ``part``'s tables in ``schema`` to the newest of ``migrations``.

    Args:
        pool: where to run them.
        schema: the PostgreSQL schema (created if missing).
        part: the part's name (``"broker"``, ``"keys"``, ``"runs"``).
        migrations: its steps, versions 1, 2, ... in order.

    Returns:
        the version now applied.

    Raises:
        BrokerError: the database holds a newer version of ``part`` than this code knows.
        PostgresError: a step failed (it was rolled back; the ones before it stay applied).
        BrokerUnavailable: the server cannot be reached.
    """
    _check_steps(part, migrations)
    quoted = quote_ident(schema)
    newest = len(migrations)
    table = f"{quoted}.durable_trio_schema"
    try:
        stored = await pool.fetchval(f"SELECT version FROM {table} WHERE part = $1", part)
    except PostgresError as error:
        if error.sqlstate not in NO_TABLE:
            raise
        stored = None
    if stored is not None and int(stored) >= newest:
        _check_not_newer(schema, part, int(stored), newest)
        return newest
    applied = 0
    while True:
        async with pool.transaction() as conn:
            await conn.execute(
                "SELECT pg_advisory_xact_lock($1, hashtext($2))", _LOCK_CLASS, schema
            )
            await conn.script(
                f"CREATE SCHEMA IF NOT EXISTS {quoted};"
                f"CREATE TABLE IF NOT EXISTS {table} ("
                " part text PRIMARY KEY, version integer NOT NULL,"
                " note text NOT NULL DEFAULT '', applied_at timestamptz NOT NULL DEFAULT now())"
            )
            stored = await conn.fetchval(f"SELECT version FROM {table} WHERE part = $1", part)
            applied = int(stored) if stored is not None else 0
            _check_not_newer(schema, part, applied, newest)
            if applied == newest:
                return applied
            step = migrations[applied]
            await conn.script(step.sql.replace("{schema}", quoted))
            await conn.execute(
                f"INSERT INTO {table} (part, version, note) VALUES ($1, $2, $3) "
                "ON CONFLICT (part) DO UPDATE SET version = $2, note = $3, applied_at = now()",
                part,
                step.version,
                step.note,
            )


def _check_not_newer(schema: str, part: str, applied: int, newest: int) -> None:
    if applied > newest:
        raise BrokerError(
            f"the PostgreSQL schema {schema!r} holds version {applied} of the {part}'s "
            f"tables, newer than this durable_trio knows ({newest}): upgrade "
            "durable_trio on this machine"
        )


async def schema_versions(pool: PgPool, schema: str) -> dict[str, int]:
    """The version of each part applied in ``schema`` (empty if none is)."""
    quoted = quote_ident(schema)
    exists = await pool.fetchval(
        "SELECT to_regclass($1) IS NOT NULL", f"{schema}.durable_trio_schema"
    )
    if not exists:
        return {}
    rows = await pool.fetch(f"SELECT part, version FROM {quoted}.durable_trio_schema")
    return {str(part): int(version) for part, version in rows}
