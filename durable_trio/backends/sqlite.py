"""``sqlite:///file.db``: embedded and durable; broker, key store and run stores in one file.

The key store and the run stores share the broker's connection thread (one writer per file).
"""

from __future__ import annotations

import os
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Literal
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
    from .._sqlite import ReadOnly

#: ``open_backend``'s ``read_only``: never, always, or when this process cannot write the file.
ReadOnlyOption = bool | Literal["if_needed"]

__all__ = ["SqliteRunStores", "open_sqlite_backend"]


def _sqlite_file(
    url: str, *, existing: bool = False, read_only: ReadOnlyOption = False
) -> tuple[Path, ReadOnly]:
    """The database file a ``sqlite:///`` URL names, its folder created if missing (with
    ``existing``: the file must already exist, and nothing is created), and how to open it
    (see :func:`_read_only_mode`).

    Raises:
        ConfigError: the URL is not of that form, or the file cannot be made there (a parent
            is a file, the folder is not writable, the path is a folder), or cannot be read
            read-only.
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
    if read_only is True or (read_only == "if_needed" and file.is_file() and _unwritable(file)):
        return file, _read_only_mode(file)
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
    if problem is None and file.exists() and _unwritable(file):
        problem = "its folder is not writable (SQLite makes its -wal and -shm files there)"
    if problem is not None:
        if existing and file.is_file():
            problem += " (the commands that only read, such as runs list, open it read-only)"
        # Raised outside the except blocks: the OS error is said in words, not chained.
        raise ConfigError(f"cannot use {str(file)!r} as the SQLite database file: {problem}")
    return file, None


def _unwritable(file: Path) -> bool:
    """Whether this process cannot open ``file`` to write: the file is not writable, or its
    folder is not and a ``-wal`` or ``-shm`` file SQLite would make there is missing."""
    if not os.access(file, os.W_OK):
        return True
    sidecars = (Path(f"{file}-wal"), Path(f"{file}-shm"))
    return not os.access(file.parent, os.W_OK) and not all(p.exists() for p in sidecars)


def _read_only_mode(file: Path) -> ReadOnly:
    """How to read ``file`` without writing it (docs/decisions.md, "Read-only SQLite files").

    SQLite's ``mode=ro`` reads a live file (it sees each commit) but, in WAL mode, needs the
    ``-shm`` file, which it makes if the folder lets it. In a folder it cannot write, a file
    with neither ``-wal`` nor ``-shm`` beside it is open in no process (SQLite removes both when
    the last connection closes) and all its data is in the file: it is read ``immutable``
    (no lock, no ``-shm``). A ``-wal`` left without its ``-shm`` holds commits not yet in the
    file, which neither mode can read from there: refused in words.

    Raises:
        ConfigError: the file cannot be read read-only from where it is.
    """
    wal, shm = Path(f"{file}-wal"), Path(f"{file}-shm")
    if os.access(file.parent, os.W_OK) or shm.exists():
        return "ro"
    if not wal.exists():
        return "immutable"
    raise ConfigError(
        f"cannot read {str(file)!r} read-only: its write-ahead log {str(wal)!r} holds commits "
        "not yet in the file, and SQLite cannot make the -shm file it needs to read them in a "
        "folder this process cannot write; copy the file with its -wal to a writable folder"
    )


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
async def open_sqlite_backend(
    url: str, *, existing: bool = False, read_only: ReadOnlyOption = False
) -> AsyncIterator[Backend]:
    """``sqlite:///relative/file.db`` or ``sqlite:////absolute/file.db`` (SQLAlchemy's form).

    Args:
        existing: open only a database file that exists (see
            :func:`~durable_trio.open_backend`).
        read_only: ``True``: read the file as it is, creating and changing nothing (every
            change raises :class:`~durable_trio.BrokerError`); ``"if_needed"``: so only when
            this process cannot write the file (see :func:`~durable_trio.open_backend`).

    Raises:
        ConfigError: a malformed URL, a file that cannot be made there (or, with
            ``existing``, a file that does not exist).
        BrokerUnavailable: the file cannot be opened or stays locked.
    """
    file, mode = _sqlite_file(url, existing=existing, read_only=read_only)
    broker = await SqliteBroker.open(file, read_only=mode)
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
