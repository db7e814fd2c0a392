"""A pytest fixture running a PRIVATE 6-node Redis Cluster (3 masters, 3 replicas).

Wire it in with ``from _redis_cluster import *`` (``conftest.py`` does). Six ``redis-server``
processes (the :class:`~_redis_server.RedisServer` of the single-server fixtures, so each has its
own directory, append-only file and restart on the same port) run with
``--cluster-enabled yes --cluster-node-timeout 1000`` on free loopback ports, each with its bus on
another free port (``--cluster-port``: the default, port + 10000, can be past 65535 for an
ephemeral port). ``redis-cli --cluster create ... --cluster-replicas 1`` joins them; the fixture
returns once every node reports ``cluster_state:ok`` and the same slot coverage.

The cluster is shared by the whole session; tests may kill and restart nodes (a failover swaps
a master and its replica: tests look the topology up, never assume it). Missing
``redis-server`` / ``redis-cli``: the tests using it are skipped with one line (failed under
``CI=true``), as for the single-server fixtures.

``redis_secure_cluster`` is a second such cluster set up as production ones are: TLS on the
clients' side, the bus and replication, ``requirepass`` and an ACL user (see its docstring).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from typing import TYPE_CHECKING

import pytest

from _redis_server import _BINARY, RedisServer, _free_port, _openssl, _unavailable

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

__all__ = [
    "ClusterNode",
    "RedisCluster",
    "redis_cluster",
    "redis_cluster_url",
    "redis_secure_cluster",
]

_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
_NODES = 6
_NODE_TIMEOUT_MS = 1000
_SETTLE_TIMEOUT = 30.0
#: The secure cluster's ``requirepass`` (a space and an ``@``: URLs must percent-encode it).
SECURE_PASSWORD = "cl@ster pw"
#: The secure cluster's ACL user (all permissions) and its password.
SECURE_ACL_USER = ("bob", "b0b-pw")


class ClusterNode(RedisServer):
    """One node of the private cluster: a :class:`RedisServer` with cluster mode on.

    Attributes:
        bus_port: its cluster bus port (``--cluster-port``).
    """

    def __init__(
        self,
        directory: Path,
        *,
        password: str | None = None,
        acl_user: tuple[str, str] | None = None,
        tls_files: tuple[Path, Path] | None = None,
    ) -> None:
        self.bus_port = _free_port()
        self._secure = (password, acl_user, tls_files)
        super().__init__(
            directory,
            password=password,
            acl_user=acl_user,
            tls_files=tls_files,
            extra_args=self._cluster_args(directory),
        )

    def _cluster_args(self, directory: Path) -> tuple[str, ...]:
        password, acl_user, tls_files = self._secure
        extra = [
            "--cluster-enabled", "yes",
            "--cluster-config-file", str(directory / "nodes.conf"),
            "--cluster-node-timeout", str(_NODE_TIMEOUT_MS),
            "--cluster-port", str(self.bus_port),
        ]  # fmt: skip
        if tls_files is not None:
            # The bus and the replication links speak TLS too; the slot map then announces
            # each node's TLS port to TLS clients (its plain port to plain ones).
            extra += ["--tls-cluster", "yes", "--tls-replication", "yes"]
        if acl_user is not None:  # replicas authenticate to their master as the ACL user
            extra += ["--masteruser", acl_user[0], "--masterauth", acl_user[1]]
        elif password is not None:
            extra += ["--masterauth", password]
        return tuple(extra)

    def _take_other_ports(self) -> None:
        """The bus port too (the collision seen was on it), and the node forgets the ports its
        failed start wrote to ``nodes.conf``."""
        super()._take_other_ports()
        self.bus_port = _free_port()
        self.extra_args = self._cluster_args(self.dir)
        (self.dir / "nodes.conf").unlink(missing_ok=True)

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT``, as the cluster names this node."""
        return f"127.0.0.1:{self.port}"

    def info(self) -> dict[str, str]:
        """``CLUSTER INFO`` as a dict (``cluster_state``, ``cluster_known_nodes``, ...)."""
        text: bytes = self.command("CLUSTER", "INFO")
        pairs = (line.partition(":") for line in text.decode().splitlines() if ":" in line)
        return {key: value.strip() for key, _, value in pairs}

    @property
    def node_id(self) -> str:
        """Its cluster node id."""
        return bytes(self.command("CLUSTER", "MYID")).decode()

    @property
    def is_master(self) -> bool:
        """Whether it serves slots as a master now (``ROLE``)."""
        return bool(self.command("ROLE")[0] == b"master")


class RedisCluster:
    """The six nodes, and helpers to find, stop and restart them.

    Attributes:
        nodes: the nodes, in the order they were created (not their roles: see :meth:`masters`).
    """

    def __init__(
        self,
        directories: list[Path],
        *,
        password: str | None = None,
        acl_user: tuple[str, str] | None = None,
        tls_files: tuple[Path, Path] | None = None,
    ) -> None:
        self.nodes = [
            ClusterNode(directory, password=password, acl_user=acl_user, tls_files=tls_files)
            for directory in directories
        ]
        self.password = password
        self.acl_user = acl_user
        self.ca_file = tls_files[0] if tls_files else None

    @property
    def url(self) -> str:
        """``redis+cluster://`` with two of the nodes as seeds (plain ports, no credentials)."""
        seeds = ",".join(node.address for node in self.nodes[:2])
        return f"redis+cluster://{seeds}"

    def tls_url(self, credentials: str = "") -> str:
        """``rediss+cluster://[CREDENTIALS@]`` two TLS ports as seeds, trusting :attr:`ca_file`.

        Args:
            credentials: ``user:password`` or ``:password`` as the URL carries them (encoded).
        """
        assert self.ca_file is not None, "not a TLS cluster"
        seeds = ",".join(f"127.0.0.1:{node.tls_port}" for node in self.nodes[:2])
        auth = f"{credentials}@" if credentials else ""
        return f"rediss+cluster://{auth}{seeds}/?ssl_ca_certs={self.ca_file}"

    def start(self) -> None:
        """Start every node and create the cluster (once; later calls restart stopped nodes).

        Raises:
            RuntimeError: a node did not start or the cluster did not form in time.
        """
        for node in self.nodes:
            node.start()
        if self.nodes[0].info().get("cluster_known_nodes") != str(_NODES):
            auth = [] if self.password is None else ["-a", self.password, "--no-auth-warning"]
            created = subprocess.run(
                [_CLI, *auth, "--cluster", "create", *(n.address for n in self.nodes),
                 "--cluster-replicas", "1", "--cluster-yes"],
                capture_output=True, timeout=60, check=False,
            )  # fmt: skip
            if created.returncode != 0:
                tail = created.stdout.decode(errors="replace").strip().splitlines()[-1:]
                raise RuntimeError(f"redis-cli --cluster create failed: {tail}")
        self.wait_ok()

    def wait_ok(self, timeout: float = _SETTLE_TIMEOUT) -> None:
        """Wait until every running node says ``cluster_state:ok``, all 16384 slots covered,
        every node knows all six, and they agree on which nodes are masters.

        Raises:
            RuntimeError: not settled within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            try:
                last = self._unsettled()
            except (OSError, RuntimeError) as exc:
                last = repr(exc)
            if not last:
                return
            time.sleep(0.05)
        raise RuntimeError(f"the cluster did not settle in {timeout:g}s: {last}")

    def _unsettled(self) -> str:
        """Why the cluster is not settled yet, or ``""``."""
        views = set()
        for node in self.nodes:
            if not node.running:
                continue
            info = node.info()
            if info.get("cluster_state") != "ok":
                return f"{node.address}: cluster_state {info.get('cluster_state')}"
            if info.get("cluster_slots_ok") != "16384":
                return f"{node.address}: slots ok {info.get('cluster_slots_ok')}"
            if info.get("cluster_known_nodes") != str(_NODES):
                return f"{node.address}: knows {info.get('cluster_known_nodes')} nodes"
            views.add(tuple(sorted(self._masters_seen_by(node))))
        if len(views) != 1:
            return f"the nodes disagree on the masters: {views}"
        return ""

    @staticmethod
    def _masters_seen_by(node: ClusterNode) -> list[str]:
        lines = bytes(node.command("CLUSTER", "NODES")).decode().splitlines()
        masters = []
        for line in lines:
            fields = line.split()
            flags = fields[2].split(",")
            # A master that serves slots (its slot ranges follow the 8 fixed fields).
            if "master" in flags and "fail" not in flags and len(fields) > 8:
                masters.append(fields[1].partition("@")[0])
        return masters

    def masters(self) -> list[ClusterNode]:
        """The running nodes that are masters now."""
        return [node for node in self.nodes if node.running and node.is_master]

    def node_at(self, address: str) -> ClusterNode:
        """The node listening at ``127.0.0.1:PORT``."""
        for node in self.nodes:
            if node.address == address:
                return node
        raise KeyError(address)

    def owner(self, slot: int) -> ClusterNode:
        """The master that serves ``slot`` now (asked of a running node)."""
        running = next(node for node in self.nodes if node.running)
        for entry in running.command("CLUSTER", "SLOTS"):
            if entry[0] <= slot <= entry[1]:
                return self.node_at(f"{entry[2][0].decode()}:{entry[2][1]}")
        raise KeyError(slot)

    def keyslot(self, key: str | bytes) -> int:
        """``CLUSTER KEYSLOT key``, as the server computes it."""
        return int(self.nodes[0].command("CLUSTER", "KEYSLOT", key))

    def wait_replicas_synced(self, timeout: float = 20.0) -> None:
        """Wait until every running replica's link to its master is up (a replica still
        syncing after a restart would not be elected in a failover).

        Raises:
            RuntimeError: not synced within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            replicas = [node for node in self.nodes if node.running and not node.is_master]
            if all(
                b"master_link_status:up" in node.command("INFO", "replication") for node in replicas
            ):
                return
            time.sleep(0.05)
        raise RuntimeError("the replicas did not sync")

    def reset(self) -> None:
        """Make it fresh for the next test: every node running, the cluster settled, every
        master's data and scripts flushed."""
        self.start()
        for node in self.masters():
            node.command("FLUSHALL")
            node.command("SCRIPT", "FLUSH")

    def stop(self) -> None:
        """Stop every node (idempotent)."""
        for node in self.nodes:
            node.stop()


_clusters: dict[str, RedisCluster] = {}


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """The private 6-node cluster (``.nodes``, ``.masters()``, ``.owner(slot)``, ``.url``)."""
    cluster = _clusters.get("cluster")
    if cluster is None:
        for binary in (_BINARY, _CLI):
            if not os.access(binary, os.X_OK):
                _unavailable(f"{binary} not found")
        cluster = RedisCluster([tmp_path_factory.mktemp(f"cluster-{i}") for i in range(_NODES)])
        try:
            cluster.start()
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            cluster.stop()
            _unavailable(f"cannot start a private Redis Cluster: {str(exc).splitlines()[0]}")
        _clusters["cluster"] = cluster
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def redis_secure_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """A second private 6-node cluster with TLS and AUTH/ACL, as a production one is set up.

    Every node has ``requirepass`` (:attr:`RedisCluster.password`), the ACL user
    :attr:`RedisCluster.acl_user` (its replicas authenticate as that user: ``masteruser``),
    a TLS port beside its plain one (``tls_port``; the certificate of ``redis_tls_server``, self
    signed for ``127.0.0.1``, is :attr:`RedisCluster.ca_file`) and ``tls-cluster`` /
    ``tls-replication`` on. :meth:`RedisCluster.tls_url` is its ``rediss+cluster://`` URL. Tests
    call :meth:`RedisCluster.reset` themselves (flushed, settled). Without ``openssl`` the tests
    using it are skipped.
    """
    cluster = _clusters.get("secure")
    if cluster is None:
        openssl = shutil.which("openssl")
        if openssl is None:
            pytest.skip("no openssl command to make a test certificate")
        for binary in (_BINARY, _CLI):
            if not os.access(binary, os.X_OK):
                _unavailable(f"{binary} not found")
        folder = tmp_path_factory.mktemp("cluster-secure")
        cert, key = folder / "cert.pem", folder / "key.pem"
        try:
            _openssl(openssl, cert, key)
        except (OSError, subprocess.SubprocessError) as exc:
            pytest.skip(f"could not make a test certificate with openssl: {exc}")
        cluster = RedisCluster(
            [tmp_path_factory.mktemp(f"cluster-secure-{i}") for i in range(_NODES)],
            password=SECURE_PASSWORD,
            acl_user=SECURE_ACL_USER,
            tls_files=(cert, key),
        )
        try:
            cluster.start()
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            cluster.stop()
            _unavailable(f"cannot start a private TLS Redis Cluster: {str(exc).splitlines()[0]}")
        _clusters["secure"] = cluster
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_cluster_url(redis_cluster: RedisCluster) -> str:
    """The cluster's URL, with every node running, the cluster settled and all data flushed."""
    redis_cluster.reset()
    return redis_cluster.url
