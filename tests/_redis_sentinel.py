"""A PRIVATE Redis Sentinel group for the tests: 1 master, 1 replica, 3 sentinels.

Wire it in with ``from _redis_sentinel import *`` (``conftest.py`` does). Every process runs
on a free loopback port (never 6379 or 26379) in its own temporary directory. The data nodes
read a config file of their own, so the ``REPLICAOF`` / ``CONFIG REWRITE`` a sentinel sends
during a failover survive a restart, as they do in a real deployment: a SIGKILLed master that
is restarted comes back as a master, and the sentinels turn it into a replica.

Sentinels judge a master down after ``DOWN_AFTER_MS`` and may fail over again after twice
``FAILOVER_TIMEOUT_MS``: small, so a failover takes a few seconds of wall clock.

If ``redis-server`` cannot be started the tests using the group are skipped with one line,
except under ``CI=true``, where they fail (as the fixtures of ``_redis_server.py``).

``redis_sentinel_auth`` is a second group with passwords on the data nodes and on the sentinels.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import pytest

from _redis_server import _BINARY, RedisServer, _free_port, _unavailable

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

__all__ = ["SentinelGroup", "redis_sentinel", "redis_sentinel_auth", "redis_sentinel_url"]

MASTER_NAME = "durable"
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 2000
#: The data nodes' password in :func:`redis_sentinel_auth` (a space: URLs must encode it).
AUTH_PASSWORD = "data pw"
#: The sentinels' own password in :func:`redis_sentinel_auth`.
AUTH_SENTINEL_PASSWORD = "sentinel-pw"
#: Ports the machine's shared services use: never one of ours.
_SHARED_PORTS = frozenset({6379, 26379})


def _private_port() -> int:
    while (port := _free_port()) in _SHARED_PORTS:
        pass
    return port


def _fields(flat: list[Any]) -> dict[str, str]:
    """A sentinel's ``[name, value, name, value...]`` reply as a dict of strings."""
    return {flat[i].decode(): flat[i + 1].decode() for i in range(0, len(flat) - 1, 2)}


class DataNode(RedisServer):
    """A master or replica of the group, reading ``node.conf`` (which sentinels rewrite).

    Attributes:
        name: ``"a"`` or ``"b"``, for messages.
    """

    def __init__(
        self,
        directory: Path,
        name: str,
        *,
        replica_of: int | None = None,
        password: str | None = None,
    ) -> None:
        # a replica (and a demoted master) authenticates to its master with the same password
        extra = () if password is None else ("--masterauth", password)
        super().__init__(directory, password=password, extra_args=extra)
        self.name = name
        self.port = _private_port()
        conf = directory / "node.conf"
        conf.write_text("" if replica_of is None else f"replicaof 127.0.0.1 {replica_of}\n")
        self._conf = conf

    def _args(self) -> list[str]:
        binary, *rest = super()._args()
        # The file first: the role lives there only (the arguments would override a rewrite).
        return [binary, str(self._conf), *rest]

    def role(self) -> str:
        """``"master"`` or ``"slave"`` (its ``ROLE``), or ``"down"``."""
        if not self.running:
            return "down"
        try:
            return str(self.command("ROLE")[0].decode())
        except (OSError, RuntimeError):
            return "down"


class SentinelProcess(RedisServer):
    """One ``redis-server --sentinel`` process watching the group's master."""

    def __init__(
        self,
        directory: Path,
        master_port: int,
        *,
        data_password: str | None = None,
        password: str | None = None,
    ) -> None:
        super().__init__(directory, password=password)
        self.port = _private_port()
        conf = directory / "sentinel.conf"
        lines = [
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} 2",
            f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}",
            f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}",
            f"sentinel parallel-syncs {MASTER_NAME} 1",
        ]
        if data_password is not None:  # how it logs in to the master and the replicas
            lines.append(f'sentinel auth-pass {MASTER_NAME} "{data_password}"')
        if password is not None:  # its own password, and how it logs in to the other sentinels
            lines += [f'requirepass "{password}"', f'sentinel sentinel-pass "{password}"']
        conf.write_text("\n".join(lines) + "\n")
        self._conf = conf

    def _args(self) -> list[str]:
        return [
            _BINARY, str(self._conf), "--sentinel",
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--logfile", str(self.dir / "sentinel.log"),
            "--daemonize", "no",
        ]  # fmt: skip

    def master_port(self) -> int | None:
        """The master's port as this sentinel names it, or ``None`` (down, or no answer)."""
        try:
            reply = self.command("SENTINEL", "get-master-addr-by-name", MASTER_NAME)
        except (OSError, RuntimeError):
            return None
        return None if reply is None else int(reply[1])


class SentinelGroup:
    """The group: ``nodes`` (two data nodes) and ``sentinels`` (three), all private.

    Attributes:
        nodes: the data nodes; which one is the master changes with failovers.
        sentinels: the sentinel processes.
    """

    def __init__(
        self,
        directory: Path,
        *,
        password: str | None = None,
        sentinel_password: str | None = None,
    ) -> None:
        (directory / "a").mkdir()
        (directory / "b").mkdir()
        first = DataNode(directory / "a", "a", password=password)
        second = DataNode(directory / "b", "b", replica_of=first.port, password=password)
        self.nodes = (first, second)
        self.password = password
        self.sentinel_password = sentinel_password
        self.sentinels: list[SentinelProcess] = []
        for i in range(3):
            (directory / f"s{i}").mkdir()
            self.sentinels.append(
                SentinelProcess(
                    directory / f"s{i}",
                    first.port,
                    data_password=password,
                    password=sentinel_password,
                )
            )

    def start(self) -> None:
        """Start every process that is not running (data nodes first)."""
        for process in (*self.nodes, *self.sentinels):
            process.start()

    def stop(self) -> None:
        """Stop every process (``SIGTERM``)."""
        for process in (*self.sentinels, *self.nodes):
            process.stop()

    def url(self, *, db: int = 0, query: str = "") -> str:
        """``redis+sentinel://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3/durable/DB[?query]``."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{MASTER_NAME}/{db}" + (f"?{query}" if query else "")

    @property
    def master_name(self) -> str:
        """The name the sentinels monitor the master under."""
        return MASTER_NAME

    def master(self) -> DataNode:
        """The node the running sentinels name as master (the majority's answer).

        Raises:
            RuntimeError: no sentinel answers.
        """
        ports = [p for s in self.sentinels if s.running and (p := s.master_port()) is not None]
        if not ports:
            raise RuntimeError("no sentinel names a master")
        port = max(set(ports), key=ports.count)
        return next(node for node in self.nodes if node.port == port)

    def replica(self) -> DataNode:
        """The node that is not :meth:`master`."""
        master = self.master()
        return next(node for node in self.nodes if node is not master)

    def kill(self, node: RedisServer) -> None:
        """``SIGKILL`` a node or a sentinel (no AOF flush, no goodbye)."""
        node.stop(kill=True)

    def restart(self, node: RedisServer) -> None:
        """Start a stopped node or sentinel again on its port (a data node reads its config
        file: the role it last had, not the one a sentinel may give it next)."""
        node.start()

    def _stable_problem(self) -> str | None:
        """What keeps the group from being ready for the next failover, or ``None``."""
        if not all(p.running for p in (*self.nodes, *self.sentinels)):
            return "a process is down"
        ports = {s.master_port() for s in self.sentinels}
        if len(ports) != 1 or None in ports:
            return f"the sentinels disagree on the master: {ports}"
        master = self.master()
        replica = self.replica()
        if master.role() != "master" or replica.role() != "slave":
            return f"roles: {master.name}={master.role()} {replica.name}={replica.role()}"
        info = replica.command("INFO", "replication").decode()
        if "master_link_status:up" not in info or f"master_port:{master.port}" not in info:
            return f"replica {replica.name} is not in sync with {master.name}"
        for sentinel in self.sentinels:
            seen = _fields(sentinel.command("SENTINEL", "master", MASTER_NAME))
            if seen.get("flags") != "master" or seen.get("num-other-sentinels") != "2":
                return f"sentinel {sentinel.port} sees the master as {seen.get('flags')}"
            replicas = [_fields(r) for r in sentinel.command("SENTINEL", "replicas", MASTER_NAME)]
            good = [
                r
                for r in replicas
                if r.get("flags") == "slave"
                and r.get("port") == str(replica.port)
                and r.get("master-link-status") == "ok"
            ]
            if not good:
                return f"sentinel {sentinel.port} does not see a healthy replica yet"
        return None

    def wait_stable(self, timeout: float = 90.0) -> float:
        """Start whatever is down and wait until a failover could happen again: the sentinels
        agree on a master, know each other, and see the other node as a healthy replica.

        Returns:
            the seconds it took.

        Raises:
            RuntimeError: not stable within ``timeout`` (the message says what is missing).
        """
        began = time.monotonic()
        self.start()
        problem: str | None = "not checked"
        while time.monotonic() - began < timeout:
            try:
                problem = self._stable_problem()
            except (OSError, RuntimeError) as exc:
                problem = repr(exc)
            if problem is None:
                return time.monotonic() - began
            time.sleep(0.1)
        raise RuntimeError(f"the sentinel group is not stable after {timeout:g}s: {problem}")

    def reset(self) -> None:
        """Make it fresh for the next test: stable, every database and script flushed."""
        self.wait_stable()
        master = self.master()
        master.command("FLUSHALL")
        master.command("SCRIPT", "FLUSH")


_groups: dict[str, SentinelGroup] = {}


@pytest.fixture(scope="session")
def redis_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelGroup]:
    """The private sentinel group (``.url()``, ``.master()``, ``.kill()``, ``.restart()``...)."""
    group = _groups.get("group")
    if group is None:
        if not os.access(_BINARY, os.X_OK):
            _unavailable(f"{_BINARY} not found")
        group = SentinelGroup(tmp_path_factory.mktemp("redis-sentinel"))
        try:
            group.start()
        except (OSError, RuntimeError) as exc:
            group.stop()
            _unavailable(str(exc).splitlines()[0] if str(exc) else repr(exc))
        _groups["group"] = group
        group.wait_stable()
    yield group
    group.stop()


@pytest.fixture(scope="session")
def redis_sentinel_auth(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelGroup]:
    """A second private group with passwords everywhere: ``requirepass`` (and ``masterauth``)
    :data:`AUTH_PASSWORD` on the data nodes, ``requirepass`` :data:`AUTH_SENTINEL_PASSWORD` on
    the sentinels (which log in to the data nodes with ``sentinel auth-pass`` and to each other
    with ``sentinel sentinel-pass``). Tests call :meth:`SentinelGroup.reset` themselves."""
    group = _groups.get("auth")
    if group is None:
        if not os.access(_BINARY, os.X_OK):
            _unavailable(f"{_BINARY} not found")
        group = SentinelGroup(
            tmp_path_factory.mktemp("redis-sentinel-auth"),
            password=AUTH_PASSWORD,
            sentinel_password=AUTH_SENTINEL_PASSWORD,
        )
        try:
            group.start()
        except (OSError, RuntimeError) as exc:
            group.stop()
            _unavailable(str(exc).splitlines()[0] if str(exc) else repr(exc))
        _groups["auth"] = group
        group.wait_stable()
    yield group
    group.stop()


@pytest.fixture
def redis_sentinel_url(redis_sentinel: SentinelGroup) -> str:
    """The group's ``redis+sentinel://`` URL, with the group stable and every database empty."""
    redis_sentinel.reset()
    return redis_sentinel.url()
