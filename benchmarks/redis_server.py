"""A PRIVATE ``redis-server`` for the benchmarks, and a tiny synchronous client for it.

Standard library only (the peer runners load this file from their own virtualenvs too).

* :func:`private_redis` starts ``redis-server`` on a free loopback port in a temporary directory
  (``--save "" --appendonly no``: nothing is written to disk) and stops it on exit::

      with private_redis() as server:
          print(server.url)          # redis://127.0.0.1:PORT/0
          server.flushall()          # between peers: the server is ours alone
          commandstats_total(server.url)

* :func:`command`, :func:`flushall`, :func:`commandstats` and :func:`commandstats_total` talk
  RESP over a fresh socket; they refuse port 6379 (the machine's shared server) outright.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = [
    "SHARED_PORT",
    "RedisError",
    "RedisServer",
    "command",
    "commandstats",
    "commandstats_total",
    "flushall",
    "private_redis",
    "redis_version",
]

SHARED_PORT = 6379  # the machine's shared server: never started, never talked to
_BINARY_DEFAULT = "/usr/bin/redis-server"
_READY_TIMEOUT = 10.0

Reply = bytes | int | list["Reply"] | None


class RedisError(RuntimeError):
    """An error reply (``-ERR ...``) or a server that could not be started."""


def _binary() -> str:
    if os.access(_BINARY_DEFAULT, os.X_OK):
        return _BINARY_DEFAULT
    return shutil.which("redis-server") or _BINARY_DEFAULT


def _free_port() -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port != SHARED_PORT:
            return port


def _address(url: str) -> tuple[str, int, int]:
    """``(host, port, db)`` of a ``redis://`` URL; port 6379 is refused."""
    parts = urlsplit(url)
    if parts.scheme != "redis":
        raise ValueError(f"only plain redis:// URLs are supported here, not {url!r}")
    port = parts.port or SHARED_PORT
    if port == SHARED_PORT:
        raise ValueError("port 6379 is the machine's shared Redis: the benchmarks never touch it")
    db = int(parts.path.strip("/") or 0)
    return parts.hostname or "127.0.0.1", port, db


def _encode(args: tuple[str | bytes | int | float, ...]) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def _read_reply(stream: BinaryIO) -> Reply:
    line = stream.readline()
    if not line.endswith(b"\r\n"):
        raise ConnectionResetError("redis-server closed the connection")
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest
    if kind == b"-":
        raise RedisError(rest.decode(errors="replace"))
    if kind == b":":
        return int(rest)
    if kind == b"$":
        size = int(rest)
        if size < 0:
            return None
        data = stream.read(size + 2)
        return data[:-2]
    if kind == b"*":
        count = int(rest)
        if count < 0:
            return None
        return [_read_reply(stream) for _ in range(count)]
    raise RedisError(f"unexpected reply line {line!r}")


def command(url: str, *args: str | bytes | int | float, timeout: float = 10.0) -> Reply:
    """Run one command over a fresh connection (``SELECT``-ing the URL's db first)."""
    host, port, db = _address(url)
    with socket.create_connection((host, port), timeout=timeout) as sock:
        payload = (_encode(("SELECT", db)) if db else b"") + _encode(args)
        sock.sendall(payload)
        with sock.makefile("rb") as stream:
            if db:
                _read_reply(stream)
            return _read_reply(stream)


def flushall(url: str) -> None:
    """``FLUSHALL`` + ``SCRIPT FLUSH``: only ever on a private server."""
    command(url, "FLUSHALL")
    command(url, "SCRIPT", "FLUSH")


def redis_version(url: str) -> str:
    """The server's ``redis_version``."""
    return _info_fields(url, "server").get("redis_version", "?")


def _info_fields(url: str, section: str) -> dict[str, str]:
    reply = command(url, "INFO", section)
    if not isinstance(reply, bytes):
        raise RedisError(f"unexpected INFO reply {reply!r}")
    fields: dict[str, str] = {}
    for line in reply.decode().splitlines():
        if ":" in line and not line.startswith("#"):
            key, _, value = line.partition(":")
            fields[key] = value
    return fields


def commandstats(url: str) -> dict[str, int]:
    """Calls per command so far, from ``INFO commandstats`` (``{"get": 12, "blpop": 3, ...}``).

    Sub-commands are keyed as Redis names them (``"client|setinfo"``). The ``INFO`` that reads
    them is not in its own answer: it shows up in the next one.
    """
    calls: dict[str, int] = {}
    for key, value in _info_fields(url, "commandstats").items():
        if not key.startswith("cmdstat_"):
            continue
        for item in value.split(","):
            name, _, number = item.partition("=")
            if name == "calls":
                calls[key.removeprefix("cmdstat_")] = int(number)
    return calls


def commandstats_total(url: str) -> int:
    """All calls so far, less the ``INFO`` commands (ours: one per snapshot)."""
    return sum(n for name, n in commandstats(url).items() if name != "info")


class RedisServer:
    """One private ``redis-server`` process on ``127.0.0.1:port`` (see :func:`private_redis`)."""

    def __init__(self, directory: Path, *, binary: str | None = None) -> None:
        self.dir = directory
        self.binary = binary or _binary()
        self.port = _free_port()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start it; return once it answers ``PING`` (a taken port is retried with another)."""
        if not os.access(self.binary, os.X_OK):
            raise RedisError(f"{self.binary} not found")
        for _attempt in range(20):
            args = [
                self.binary,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--dir", str(self.dir),
                "--logfile", str(self.dir / "redis.log"),
                "--daemonize", "no",
                "--save", "",
                "--appendonly", "no",
                "--protected-mode", "yes",
            ]  # fmt: skip
            with (self.dir / "stderr.log").open("ab") as log:
                self._process = subprocess.Popen(
                    args, cwd=self.dir, stdin=subprocess.DEVNULL, stdout=log, stderr=log
                )
            if self._wait_ready():
                return
            self.stop()
            self.port = _free_port()
            time.sleep(0.05)
        raise RedisError(f"redis-server did not start; log ends: {self._log_tail()}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + _READY_TIMEOUT
        while time.monotonic() < deadline:
            if not self.running:
                return False
            try:
                if command(self.url, "PING", timeout=1.0) == b"PONG":
                    return True
            except (OSError, RedisError):
                pass
            time.sleep(0.01)
        return False

    def stop(self) -> None:
        """``SIGTERM`` (then ``SIGKILL`` after 10 s); idempotent."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def flushall(self) -> None:
        flushall(self.url)

    def _log_tail(self) -> str:
        lines: list[str] = []
        for name in ("stderr.log", "redis.log"):
            with contextlib.suppress(OSError):
                lines += (self.dir / name).read_text(errors="replace").splitlines()
        return " | ".join(lines[-3:]) or "(no log)"


@contextlib.contextmanager
def private_redis(*, binary: str | None = None) -> Iterator[RedisServer]:
    """A fresh private ``redis-server`` in a temporary directory, stopped and removed on exit.

    Raises:
        RedisError: it could not be started (no binary, or it never answered ``PING``).
    """
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as directory:
        server = RedisServer(Path(directory), binary=binary)
        try:
            server.start()
            yield server
        finally:
            server.stop()
