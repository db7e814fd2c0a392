"""A pytest fixture that runs a PRIVATE PostgreSQL server (never the machine's shared one on 5432).

Wire it in with ``from _postgres_server import *`` (in a test module). The server is made by
``initdb`` in its own temporary folder and started by ``pg_ctl`` on a free loopback port (see
``benchmarks/postgres_server.py``: the process handling, shared with the benchmarks; under root
it runs as the ``postgres`` user). It is shared by the whole session and stopped at its end.

Without ``initdb`` / ``pg_ctl`` the tests using the fixture are skipped with one line, except
under ``CI=true``, where they fail (``.ci/run`` installs Debian's postgresql package).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from typing import TYPE_CHECKING

import pytest

from benchmarks.postgres_server import PostgresServer, find_bindir, make_folder

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["PostgresServer", "postgres_schema_url", "postgres_server", "postgres_url"]


def _unavailable(reason: str) -> None:
    """Skip (or, under ``CI=true``, fail) the requesting test, with one clear line."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"cannot start a private PostgreSQL server: {reason}", pytrace=False)
    pytest.skip(f"cannot start a private PostgreSQL server: {reason}")


_server: PostgresServer | None = None
_users = 0


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """The session's private server (``.url``, ``.port``, ``.restart()``, ``.sql()``)."""
    global _server
    if _server is None:
        bindir = find_bindir()
        if bindir is None:
            _unavailable("initdb / pg_ctl not found (Debian's postgresql package has them)")
            raise AssertionError("unreachable")
        folder = make_folder()
        server = PostgresServer(folder, bindir)
        try:
            server.init()
            server.start()
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", None) or str(exc)
            shutil.rmtree(folder, ignore_errors=True)
            _unavailable(str(detail).strip().splitlines()[0] if detail else repr(exc))
        _server = server
    # conftest.py and a test module may both define this fixture (each ``import *``): two
    # session fixtures sharing one server, which the last of them to end stops.
    global _users
    _users += 1
    try:
        yield _server
    finally:
        _users -= 1
        if _users == 0:
            _server.stop("immediate")
            shutil.rmtree(_server.dir, ignore_errors=True)
            _server = None


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> str:
    """The private server's URL, with the server running."""
    postgres_server.start()
    return postgres_server.url


@pytest.fixture
def postgres_schema_url(postgres_url: str) -> str:
    """A backend URL on the private server with a fresh ``schema`` of its own (an empty store)."""
    return f"{postgres_url}?schema=t_{uuid.uuid4().hex[:12]}"
