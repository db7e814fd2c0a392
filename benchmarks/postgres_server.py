"""A PRIVATE PostgreSQL server for the tests and the benchmarks (never the machine's shared one
on 5432).

:class:`PostgresServer` makes a cluster with ``initdb`` in a folder of its own and runs it with
``pg_ctl`` on a free loopback port, its Unix socket in that folder, ``listen_addresses=127.0.0.1``,
``trust`` authentication and ``fsync=off`` (test data need not survive a power cut), unless made
with ``durable=True`` (a crash test that counts on every acknowledged commit).
:func:`private_postgres` is the same as a context manager (the benchmarks'); the tests' fixture
is ``tests/_postgres_server.py``.

PostgreSQL refuses to run as root: under root (CI, this machine) the cluster belongs to the
``postgres`` user that Debian's packages create (``nobody`` if there is none) and every
``initdb`` / ``pg_ctl`` runs as that user. The binaries are found on ``PATH`` or in Debian's
``/usr/lib/postgresql/<version>/bin`` (:func:`find_bindir`). Standard library only.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["PostgresServer", "find_bindir", "make_folder", "private_postgres"]

_SHARED_PORT = 5432  # the machine's shared server: never used here
_TIMEOUT = 60.0


def find_bindir() -> Path | None:
    """The folder holding ``initdb`` and ``pg_ctl``: on ``PATH``, else Debian's newest
    ``/usr/lib/postgresql/<version>/bin``; ``None`` if there is none."""
    initdb, pg_ctl = shutil.which("initdb"), shutil.which("pg_ctl")
    if initdb and pg_ctl:
        return Path(os.path.realpath(initdb)).parent
    candidates = glob.glob("/usr/lib/postgresql/*/bin/initdb")

    def version(path: str) -> float:
        try:
            return float(Path(path).parent.parent.name)
        except ValueError:
            return 0.0

    for path in sorted(candidates, key=version, reverse=True):
        if os.access(path, os.X_OK) and os.access(Path(path).parent / "pg_ctl", os.X_OK):
            return Path(path).parent
    return None


def make_folder() -> Path:
    """A new temporary folder for a server. Under root it is made in ``/tmp`` (whatever
    ``TMPDIR`` says), so the ``postgres`` user can reach it through every parent folder."""
    where = "/tmp" if os.geteuid() == 0 and os.path.isdir("/tmp") else None
    return Path(tempfile.mkdtemp(prefix="durable-trio-pg-", dir=where))


def _free_port() -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port != _SHARED_PORT:
            return port


def _run_as() -> pwd.struct_passwd | None:
    """The user the server runs as when we are root (``None``: run as ourselves)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise RuntimeError("running as root and there is no postgres or nobody user")


class PostgresServer:
    """One private PostgreSQL server (restartable on the same port).

    Attributes:
        dir: its folder (``data/``, ``server.log``, the Unix socket).
        port: its TCP port on 127.0.0.1.
        bindir: where ``initdb`` / ``pg_ctl`` were found.
        durable: ``fsync``, ``synchronous_commit`` and ``full_page_writes`` on (PostgreSQL's
            defaults): a commit acknowledged survives ``pg_ctl stop -m immediate``. Off by
            default, for speed (an immediate stop may then lose the last commits).
    """

    def __init__(self, directory: Path, bindir: Path, *, durable: bool = False) -> None:
        self.dir = directory
        self.bindir = bindir
        self.durable = durable
        self.port = _free_port()
        self._user = _run_as()

    @property
    def url(self) -> str:
        """``postgresql://postgres@127.0.0.1:PORT/postgres`` (trust authentication)."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def data(self) -> Path:
        """The data folder."""
        return self.dir / "data"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        kwargs: dict[str, Any] = {}
        if self._user is not None:
            kwargs = {"user": self._user.pw_uid, "group": self._user.pw_gid, "extra_groups": []}
        return subprocess.run(
            [str(self.bindir / args[0]), *args[1:]],
            cwd=self.dir, stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=_TIMEOUT, check=check, env={**os.environ, "LC_ALL": "C"}, **kwargs,
        )  # fmt: skip

    def init(self) -> None:
        """Run ``initdb`` (once)."""
        if self._user is not None:
            os.chown(self.dir, self._user.pw_uid, self._user.pw_gid)
        self._run(
            "initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8",
            "--no-sync", "--locale=C",
        )  # fmt: skip

    def _options(self) -> str:
        return " ".join(
            [
                f"-p {self.port}",
                f"-k {self.dir}",
                "-c listen_addresses=127.0.0.1",
                *(
                    ["-c fsync=on", "-c synchronous_commit=on", "-c full_page_writes=on"]
                    if self.durable
                    else ["-c fsync=off", "-c synchronous_commit=off", "-c full_page_writes=off"]
                ),
                "-c max_connections=200",
                "-c shared_buffers=32MB",  # several servers (xdist workers) on one machine
                # A queue's hot table is vacuumed within seconds, as docs/deployment.md asks
                # of a server holding durable_trio's tables (the default naptime is 1 min).
                "-c autovacuum_naptime=5s",
            ]
        )

    def start(self) -> None:
        """Start it (if it is not running) and wait until it takes connections.

        Raises:
            RuntimeError: it did not start (the message has the end of its log).
        """
        if self.running:
            return
        done = self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.dir / "server.log"), "-w",
            "-t", "30", "-o", self._options(), "start",
            check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"pg_ctl start failed: {done.stderr.strip()} | {self.log_tail()}")

    def stop(self, mode: str = "fast") -> None:
        """Stop it (``mode``: ``smart``, ``fast`` or ``immediate``); idempotent."""
        if self.running:
            self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop", check=False)

    def restart(self, mode: str = "immediate") -> None:
        """Stop it with ``mode`` (``immediate``: like a crash) and start it again, same port."""
        self.stop(mode)
        self.start()

    @property
    def running(self) -> bool:
        """Whether ``pg_ctl status`` finds it running."""
        if not (self.data / "postmaster.pid").exists():
            return False
        return self._run("pg_ctl", "-D", str(self.data), "status", check=False).returncode == 0

    def log_tail(self) -> str:
        """The last lines of its log."""
        with contextlib.suppress(OSError):
            lines = (self.dir / "server.log").read_text(errors="replace").splitlines()
            return " | ".join(lines[-3:])
        return "(no log)"

    def sql(self, query: str) -> list[tuple[Any, ...]]:
        """Run one statement over a fresh blocking psycopg connection and return its rows
        (for set-up and checks outside Trio)."""
        import psycopg

        with psycopg.connect(self.url, autocommit=True, connect_timeout=10) as conn:
            cursor = conn.execute(query.encode())
            return list(cursor.fetchall()) if cursor.description else []


@contextlib.contextmanager
def private_postgres(*, durable: bool = False) -> Iterator[PostgresServer]:
    """A running private server (``durable``: see :class:`PostgresServer`), stopped and
    deleted on exit.

    Raises:
        RuntimeError: no ``initdb`` / ``pg_ctl``, or the server did not start.
    """
    bindir = find_bindir()
    if bindir is None:
        raise RuntimeError("initdb / pg_ctl not found (Debian's postgresql package has them)")
    server = PostgresServer(make_folder(), bindir, durable=durable)
    try:
        server.init()
        server.start()
        yield server
    finally:
        server.stop("immediate")
        shutil.rmtree(server.dir, ignore_errors=True)
