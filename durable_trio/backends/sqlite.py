"""``sqlite:///file.db``: embedded and durable; broker, key store and run stores in one file.

The key store and the run stores share the broker's connection thread (one writer per file).
"""

from __future__ import annotations

import os
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import SplitResult, urlsplit

import attrs
import trio

from .._errors import ConfigError
from .._redact import redact_url
from ..brokers.sqlite import SqliteBroker
from ..keys.sqlite import SqliteKeyStore
from ._backend import Backend

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from .._engine._stores._contract import RunStore

__all__ = ["SqliteRunStores", "open_sqlite_backend"]


def _sqlite_file(url: str, *, existing: bool = False) -> Path:
    """The database file a ``sqlite:///`` URL names, its folder created if missing (with
    ``existing``: the file must already exist, and nothing is created).

    Raises:
        ConfigError: the URL is not of that form, or the file cannot be made there (a parent
            is a file, the folder is not writable, the path is a folder).
    """
    parts: SplitResult | None
    try:
        parts = urlsplit(url)
    except ValueError:
        parts = None  # urllib's message quotes the URL: not passed on
    if parts is None or parts.netloc or not parts.path.startswith("/") or parts.path == "/":
        raise ConfigError(
            f"a SQLite URL is sqlite:///rel.db or sqlite:////abs.db, not {redact_url(url)!r}"
        )
    file = Path(parts.path[1:])
    if existing and not file.is_file():
        raise ConfigError(
            f"no SQLite database at {str(file)!r}"
            + (" (a folder is there)" if file.is_dir() else "")
            + ": check the path (the workers and engines given this URL make the file)"
        )
    problem: str | None
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        problem = "a parent of it is a file, not a folder"
    except OSError as exc:
        problem = f"its folder cannot be created ({exc.strerror or type(exc).__name__})"
    else:
        problem = None
    if problem is None and file.is_dir():
        problem = "it is a folder"
    if problem is None and not os.access(file if file.exists() else file.parent, os.W_OK):
        problem = "it is not writable" if file.exists() else "its folder is not writable"
    if problem is not None:
        # Raised outside the except blocks: the OS error is said in words, not chained.
        raise ConfigError(f"cannot use {str(file)!r} as the SQLite database file: {problem}")
    return file


@attrs.frozen
class SqliteRunStores:
    """Run stores on the broker's connection thread, their tables in the broker's file."""

    broker: SqliteBroker

    @asynccontextmanager
    async def open(self, namespace: str) -> AsyncIterator[RunStore]:
        """Attach a store for ``namespace`` to the broker's connection; detach it on leaving.

        Raises:
            BrokerUnavailable: the broker is closed.
            BrokerError: the tables could not be created.
        """
        # imported here: a worker's backend opens no run store (and loads none)
        from .._engine._stores.sqlite import SqliteRunStore

        store = await SqliteRunStore.attach(self.broker, namespace)
        try:
            yield store
        finally:
            with trio.CancelScope(shield=True):
                await store.aclose()

    async def namespaces(self) -> list[str]:
        """The namespaces with a run or a schedule in the file."""
        from .._engine._stores.sqlite import stored_namespaces

        return await stored_namespaces(self.broker)


@asynccontextmanager
async def open_sqlite_backend(url: str, *, existing: bool = False) -> AsyncIterator[Backend]:
    """``sqlite:///relative/file.db`` or ``sqlite:////absolute/file.db`` (SQLAlchemy's form).

    Args:
        existing: open only a database file that exists (see
            :func:`~durable_trio.open_backend`).

    Raises:
        ConfigError: a malformed URL, a file that cannot be made there (or, with
            ``existing``, a file that does not exist).
        BrokerUnavailable: the file cannot be opened or stays locked.
    """
    broker = await SqliteBroker.open(_sqlite_file(url, existing=existing))
    try:
        keys = await SqliteKeyStore.attach(broker)
    except BaseException:
        with trio.CancelScope(shield=True):
            await broker.aclose()
        raise
    backend = Backend(
        url=redact_url(url), broker=broker, keys=keys, run_stores=SqliteRunStores(broker)
    )
    try:
        yield backend
    finally:
        await backend.aclose()
