"""``postgresql://``: the broker, the key store and the run stores in one PostgreSQL schema.

One pool of connections serves all three, and one dedicated ``LISTEN`` connection (the notify
hub) carries every wake-up: a queue's pushes for its waiters, a run's wakes for its owner. The
tables are versioned per part and migrated at open (docs/deployment.md, "PostgreSQL").

The URL is libpq's, plus two options of ours, taken out before it reaches libpq:

* ``schema`` (default ``durable_trio``): the PostgreSQL schema of the tables; several
  deployments can share a database, each in its own schema;
* ``pool_size`` (default 8): the most connections the pool opens.
"""

from __future__ import annotations

from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import attrs
import trio

from .._engine._stores._pg_tables import RUNS_MIGRATIONS
from .._engine._stores.postgres import PostgresRunStores
from .._errors import ConfigError
from .._failures import one_exception, raise_bare
from .._postgres import open_pool
from .._postgres._hub import open_notify_hub
from .._postgres._migrations import check_schema_name, migrate, schema_versions
from .._redact import redact_url
from ..brokers.postgres import PostgresBroker
from ..brokers.postgres._identity import IDENTITY_MIGRATIONS, IDENTITY_PART
from ..brokers.postgres._schema import MIGRATIONS as BROKER_MIGRATIONS
from ..keys.postgres import KEYS_MIGRATIONS, PostgresKeyStore
from ._backend import Backend

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from .._postgres import Migration

__all__ = [
    "PostgresOptions",
    "SchemaState",
    "open_postgres_backend",
    "postgres_options",
    "postgres_schema",
]

#: The default PostgreSQL schema of the tables.
DEFAULT_SCHEMA = "durable_trio"
#: The default size of the backend's pool.
DEFAULT_POOL_SIZE = 8

#: Every part's schema steps, by the part's name in ``<schema>.durable_trio_schema``.
PARTS: Final[dict[str, Sequence[Migration]]] = {
    "broker": BROKER_MIGRATIONS,
    "keys": KEYS_MIGRATIONS,
    "runs": RUNS_MIGRATIONS,
    IDENTITY_PART: IDENTITY_MIGRATIONS,
}


@attrs.frozen
class PostgresOptions:
    """What a ``postgresql://`` URL names: libpq's part, and our two options.

    Attributes:
        conninfo: the URL without ``schema`` and ``pool_size`` (what libpq reads).
        schema: the PostgreSQL schema of the tables.
        pool_size: the most connections the pool opens.
    """

    conninfo: str
    schema: str
    pool_size: int


def postgres_options(url: str) -> PostgresOptions:
    """Split ``url`` into libpq's connection string and our options.

    Raises:
        ConfigError: a malformed URL, a schema name that is not a plain lower-case
            identifier, or a ``pool_size`` that is not a positive integer.
    """
    try:
        parts = urlsplit(url)
        query = parse_qsl(parts.query, keep_blank_values=True)
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("postgresql", "postgres"):
        raise ConfigError(
            f"a PostgreSQL URL is postgresql://user:password@host:port/database, not "
            f"{redact_url(url)!r}"
        )
    schema, pool_size = DEFAULT_SCHEMA, DEFAULT_POOL_SIZE
    kept: list[tuple[str, str]] = []
    for key, value in query:
        if key == "schema":
            schema = check_schema_name(value)
        elif key == "pool_size":
            try:
                pool_size = int(value)
            except ValueError:
                pool_size = 0
            if pool_size < 1:
                raise ConfigError(f"pool_size must be a positive integer, not {value!r}")
        else:
            kept.append((key, value))
    # quote, not urlencode's default quote_plus: libpq reads "+" as a plus, not a space
    # ("options=-c%20statement_timeout%3D5s" must reach it with its space)
    query_text = urlencode(kept, quote_via=quote)
    conninfo = urlunsplit(parts._replace(scheme="postgresql", query=query_text))
    return PostgresOptions(conninfo, schema, pool_size)


@asynccontextmanager
async def open_postgres_backend(
    url: str, *, existing: bool = False, **broker_options: Any
) -> AsyncIterator[Backend]:
    """``postgresql://user:password@host:port/database[?schema=S&pool_size=N&sslmode=...]``.

    Opens the pool and the notify hub, applies each part's migrations (in one transaction
    per step, under an advisory lock: processes that open at once apply each step once),
    checks the store's identity (and watches it while open: a schema dropped under the
    processes raises the alarm, see :mod:`durable_trio.brokers.postgres`), and yields the
    backend; on leaving, closes the stores, the broker, the hub and the pool, each
    bounded.

    Args:
        existing: the schema must hold durable_trio's tables already: nothing is created, and
            a mistyped schema (or database) is a :class:`~durable_trio.ConfigError`, not a new
            empty one (what the commands that only read or repair pass, as for a SQLite file).
        **broker_options: :class:`~durable_trio.brokers.postgres.PostgresBroker` options
            (``store_check_interval``, ``on_error`` ...).

    Raises:
        ConfigError: a malformed URL or option; with ``existing``, no durable_trio tables in
            the schema.
        AuthenticationError: the server refused the credentials.
        BrokerUnavailable: the server cannot be reached.
        BrokerError: the schema holds newer tables than this durable_trio knows.
    """
    options = postgres_options(url)
    try:
        async with (
            open_pool(options.conninfo, size=options.pool_size) as pool,
            open_notify_hub(options.conninfo) as hub,
            AsyncExitStack() as stack,
        ):
            if existing and not await schema_versions(pool, options.schema):
                raise ConfigError(
                    f"no durable_trio tables in the schema {options.schema!r} of "
                    f"{redact_url(options.conninfo)}: check the URL's database and schema= (the "
                    "workers and engines given this URL create them, or durable-trio migrate)"
                )
            broker = await PostgresBroker.attach(pool, options.schema, hub, **broker_options)
            await stack.enter_async_context(broker)  # its watch on the store's identity
            try:
                keys = await PostgresKeyStore.open(pool, options.schema)
            except BaseException:
                with trio.CancelScope(shield=True):
                    await broker.aclose()
                raise
            backend = Backend(
                url=redact_url(url),
                broker=broker,
                keys=keys,
                run_stores=PostgresRunStores(pool, options.schema, hub=hub),
            )
            try:
                yield backend
            finally:
                await backend.aclose()
    except BaseExceptionGroup as group:
        # The hub's nurseries wrap what reaches them (a failed connect at open, the caller's
        # own exception): the caller gets the one exception, as from the other backends.
        error = one_exception(None, [group], owner="the PostgreSQL backend")
        assert error is not None
        raise_bare(error)


@attrs.frozen
class SchemaState:
    """The versions of each part's tables in a schema (:func:`postgres_schema`).

    Attributes:
        schema: the PostgreSQL schema.
        applied: the version applied, by part (0: none).
        newest: the newest this durable_trio knows, by part.
    """

    schema: str
    applied: dict[str, int]
    newest: dict[str, int]

    @property
    def current(self) -> bool:
        """Whether every part is at the newest version."""
        return self.applied == self.newest


async def postgres_schema(url: str, *, apply: bool) -> SchemaState:
    """The versions of the tables of the backend ``url`` names; with ``apply``, after applying
    every part's missing steps (each in its own transaction, under the migrations' advisory
    lock, as an open does). Needs ``CREATE`` on the database for a new schema, and the
    schema's ownership to change its tables.

    Raises:
        ConfigError: a malformed URL or option.
        AuthenticationError: the server refused the credentials.
        BrokerUnavailable: the server cannot be reached.
        BrokerError: a part is newer than this durable_trio knows (with ``apply``), or a step
            failed (it was rolled back; the steps before it stay applied).
    """
    options = postgres_options(url)
    newest = {part: len(steps) for part, steps in PARTS.items()}
    async with open_pool(options.conninfo, size=1) as pool:
        if apply:
            for part, steps in PARTS.items():
                await migrate(pool, options.schema, part, steps)
        found = await schema_versions(pool, options.schema)
    applied = {part: found.get(part, 0) for part in PARTS}
    return SchemaState(options.schema, applied, newest)
