"""Pytest fixtures that run PRIVATE ``redis-server`` processes (never the shared one on 6379).

Wire them in with ``from _redis_server import *`` (in ``conftest.py`` or a test module). Each
server runs on a free loopback port in its own temporary directory, with ``--appendonly yes`` so
its data survives :meth:`RedisServer.stop` / :meth:`RedisServer.start`. Servers are shared by the
whole session (one process per kind, even if the fixtures are imported in several places).

If ``redis-server`` cannot be started the tests using it are skipped with one line, except under
``CI=true``, where they fail.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from typing import TYPE_CHECKING, Any, cast

import hiredis
import pytest

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence
    from pathlib import Path

__all__ = [
    "RedisServer",
    "redis_auth_server",
    "redis_evicting_server",
    "redis_server",
    "redis_tls_server",
    "redis_url",
]

_BINARY = (
    "/usr/bin/redis-server"
    if os.path.exists("/usr/bin/redis-server")
    else shutil.which("redis-server") or "/usr/bin/redis-server"
)
_SHARED_PORT = 6379  # the machine's shared server: never used here
_READY_TIMEOUT = 10.0
_pack = cast("Callable[[tuple[Any, ...]], bytes]", hiredis.pack_command)


def _unavailable(reason: str) -> None:
    """Skip (or, under ``CI=true``, fail) the requesting test, with one clear line."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"cannot start a private redis-server: {reason}", pytrace=False)
    pytest.skip(f"cannot start a private redis-server: {reason}")


def _free_port() -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port != _SHARED_PORT:
            return port


class RedisServer:
    """One private ``redis-server`` process (restartable on the same port).

    Attributes:
        dir: its working directory (AOF files, ``redis.log``, certificates).
        port: its plain TCP port on 127.0.0.1.
        password: the ``requirepass`` password, or ``None``.
        acl_user: an extra ACL user (``(name, password)``, all permissions), or ``None``.
        tls_port: its TLS port, or ``None``.
        ca_file: the self-signed certificate clients should trust (TLS servers), or ``None``.
        extra_args: more ``redis-server`` options (``("--maxmemory", "2mb")``).
    """

    def __init__(
        self,
        directory: Path,
        *,
        password: str | None = None,
        acl_user: tuple[str, str] | None = None,
        tls_files: tuple[Path, Path] | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.dir = directory
        self.extra_args = tuple(extra_args)
        self.password = password
        self.acl_user = acl_user
        self._tls_files = tls_files
        self.ca_file = tls_files[0] if tls_files else None
        self.port = _free_port()
        self.tls_port = _free_port() if tls_files else None
        self._process: subprocess.Popen[bytes] | None = None
        self._started = False

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0`` (no credentials)."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def tls_url(self) -> str:
        """``rediss://127.0.0.1:TLS_PORT/0`` (no options: add ``ssl_ca_certs`` or the like)."""
        assert self.tls_port is not None, "not a TLS server"
        return f"rediss://127.0.0.1:{self.tls_port}/0"

    @property
    def running(self) -> bool:
        """Whether the process is alive."""
        return self._process is not None and self._process.poll() is None

    def _args(self) -> list[str]:
        args = [
            _BINARY,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--logfile", str(self.dir / "redis.log"),
            "--daemonize", "no",
            "--appendonly", "yes",
            "--save", "",
            "--enable-debug-command", "local",
        ]  # fmt: skip
        args += self.extra_args
        if self.password is not None:
            args += ["--requirepass", self.password]
        if self.acl_user is not None:
            name, secret = self.acl_user
            args += ["--user", name, "on", f">{secret}", "~*", "&*", "+@all"]
        if self._tls_files is not None:
            cert, key = self._tls_files
            args += [
                "--tls-port", str(self.tls_port),
                "--tls-cert-file", str(cert),
                "--tls-key-file", str(key),
                "--tls-ca-cert-file", str(cert),
                "--tls-auth-clients", "no",
            ]  # fmt: skip
        return args

    def start(self) -> None:
        """Start (or restart, on the same ports) the server; return once it answers ``PING``.

        Raises:
            RuntimeError: it did not come up (the message has the end of its log).
        """
        if self.running:
            return
        for _attempt in range(20):
            with (self.dir / "stderr.log").open("ab") as stderr:
                self._process = subprocess.Popen(
                    self._args(), cwd=self.dir, stdin=subprocess.DEVNULL,
                    stdout=stderr, stderr=stderr,
                )  # fmt: skip
            if self._wait_ready():
                self._started = True
                return
            self.stop(kill=True)
            if not self._started:  # a port was taken meanwhile: take others
                self._take_other_ports()
            time.sleep(0.05)  # a just-freed port may need a moment
        raise RuntimeError(f"redis-server did not start; log ends: {self._log_tail()}")

    def _take_other_ports(self) -> None:
        """Before a first start is tried again: another process (another pytest-xdist worker's
        servers, say) took a port between ``_free_port`` and the bind."""
        self.port = _free_port()
        self.tls_port = _free_port() if self._tls_files else None

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + _READY_TIMEOUT
        while time.monotonic() < deadline:
            if not self.running:
                return False
            try:
                reply = self._raw(("PING",), authenticate=False, timeout=1.0)
            except OSError:
                time.sleep(0.01)
                continue
            if reply == b"PONG" or (
                isinstance(reply, hiredis.ReplyError) and str(reply).startswith("NOAUTH")
            ):
                return True
            time.sleep(0.01)  # -LOADING (replaying the AOF)
        return False

    def stop(self, *, kill: bool = False) -> None:
        """Stop it (``SIGTERM`` flushes the AOF; ``kill=True`` sends ``SIGKILL``); idempotent."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def _log_tail(self) -> str:
        lines: list[str] = []
        for name in ("stderr.log", "redis.log"):
            with contextlib.suppress(OSError):
                lines += (self.dir / name).read_text(errors="replace").splitlines()
        return " | ".join(lines[-3:]) or "(no log)"

    def _raw(self, command: Sequence[Any], *, authenticate: bool, timeout: float) -> Any:
        commands: list[tuple[Any, ...]] = []
        if authenticate and self.password is not None:
            commands.append(("AUTH", self.password))
        commands.append(tuple(command))
        reader = hiredis.Reader()
        replies: list[Any] = []
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as sock:
            sock.sendall(b"".join(_pack(c) for c in commands))
            while len(replies) < len(commands):
                data = sock.recv(65536)
                if not data:
                    raise ConnectionResetError("redis-server closed the connection")
                reader.feed(data)
                while (reply := reader.gets()) is not False:
                    replies.append(reply)
        return replies[-1]

    def command(self, *args: str | bytes | int | float) -> Any:
        """Run one command over a fresh raw socket (authenticated if needed) and return its reply.

        Raises:
            RuntimeError: the server answered with an error.
        """
        reply = self._raw(args, authenticate=True, timeout=10.0)
        if isinstance(reply, hiredis.ReplyError):
            raise RuntimeError(f"{args[0]!r} failed: {reply}")
        return reply

    def reset(self) -> None:
        """Make it fresh for the next test: running, unpaused, every database and script flushed."""
        self.start()
        self.command("CLIENT", "UNPAUSE")
        self.command("FLUSHALL")
        self.command("SCRIPT", "FLUSH")


_servers: dict[str, RedisServer] = {}


def _server(
    kind: str, factory: pytest.TempPathFactory, make: Callable[[Path], RedisServer]
) -> RedisServer:
    server = _servers.get(kind)
    if server is None:
        if not os.access(_BINARY, os.X_OK):
            _unavailable(f"{_BINARY} not found")
        server = make(factory.mktemp(f"redis-{kind}"))
        try:
            server.start()
        except (OSError, RuntimeError) as exc:
            _unavailable(str(exc).splitlines()[0] if str(exc) else repr(exc))
        _servers[kind] = server
    return server


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """The private plain server (``.port``, ``.url``, ``.dir``, ``.stop()``, ``.start()``)."""
    server = _server("plain", tmp_path_factory, RedisServer)
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The plain server's URL, with the server running and every database empty."""
    redis_server.reset()
    return redis_server.url


@pytest.fixture(scope="session")
def redis_auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A second private server with ``requirepass`` and an ACL user ``.acl_user``."""
    server = _server(
        "auth",
        tmp_path_factory,
        lambda d: RedisServer(d, password="s3cret pass", acl_user=("alice", "al1ce-pw")),
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_evicting_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A private server that evicts keys: ``--maxmemory 2mb --maxmemory-policy allkeys-lru``
    (what the broker warns about; see docs/deployment.md)."""
    server = _server(
        "evicting",
        tmp_path_factory,
        lambda d: RedisServer(
            d, extra_args=("--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")
        ),
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A private server that also listens with TLS (``.tls_port``, ``.tls_url``, ``.ca_file``).

    The certificate is self-signed for ``127.0.0.1`` / ``localhost``, made with the ``openssl``
    command; without it the tests using this fixture are skipped.
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl command to make a test certificate")

    def make(directory: Path) -> RedisServer:
        cert, key = directory / "cert.pem", directory / "key.pem"
        try:
            _openssl(openssl, cert, key)
        except (OSError, subprocess.SubprocessError) as exc:
            pytest.skip(f"could not make a test certificate with openssl: {exc}")
        return RedisServer(directory, tls_files=(cert, key))

    server = _server("tls", tmp_path_factory, make)
    yield server
    server.stop()


def _openssl(openssl: str, cert: Path, key: Path) -> None:
    subprocess.run(
        [
            openssl, "req", "-x509", "-newkey", "ec",
            "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
            "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
