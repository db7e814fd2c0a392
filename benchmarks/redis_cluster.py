"""The backend on a 3-master Redis Cluster beside one redis-server, in the same run (issue 17).

Three PRIVATE ``redis-server`` processes in cluster mode (no replicas: the figures measure the
routing, not replication), joined by ``redis-cli --cluster create``, and one private single
server; each figure is measured on both:

* S1 drain: N no-op tasks drained by one worker process at concurrency 32 (as in the Redis
  race, :func:`benchmarks.redis.drain`). One step name is one queue, so one slot: the cluster
  runs it on one master, and the figure is what routing costs.
* 3-step workflows/s, many at once (:func:`benchmarks.engine._compare`): the runs spread over
  the 16 run shards, the steps' queues over the masters.

The issue asks for the cluster at 0.85x one node or better on this machine; ``make bench``
prints the ratio under ``[targets]`` (measured, never asserted in a test: timings on a shared
2-core machine are not a test's business).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from . import engine, redis_cluster_scaling
from .redis import drain
from .redis_server import RedisError, _free_port, command, private_redis

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["private_cluster", "section"]

_MASTERS = 3


@contextlib.contextmanager
def private_cluster() -> Iterator[str]:
    """Three private cluster-mode ``redis-server`` processes joined as a 3-master cluster.

    Yields:
        its ``redis+cluster://`` URL.

    Raises:
        RedisError: a server, or the cluster, could not be started.
    """
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    cli = shutil.which("redis-cli") or "/usr/bin/redis-cli"
    processes: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as folder:
        try:
            ports = [_free_port() for _ in range(_MASTERS)]
            for port in ports:
                directory = Path(folder) / str(port)
                directory.mkdir()
                processes.append(
                    subprocess.Popen(
                        [
                            binary,
                            "--port",
                            str(port),
                            "--bind",
                            "127.0.0.1",
                            "--cluster-enabled",
                            "yes",
                            "--cluster-port",
                            str(_free_port()),
                            "--cluster-config-file",
                            str(directory / "nodes.conf"),
                            "--save",
                            "",
                            "--appendonly",
                            "no",
                            "--dir",
                            str(directory),
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
            for port in ports:
                _wait(lambda port=port: command(f"redis://127.0.0.1:{port}/0", "PING") == b"PONG")
            created = subprocess.run(
                [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                 "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True, timeout=60, check=False,
            )  # fmt: skip
            if created.returncode != 0:
                raise RedisError(f"redis-cli --cluster create failed: {created.stdout[-200:]!r}")
            for port in ports:
                _wait(lambda port=port: _cluster_ok(port))
            yield "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)
        finally:
            for process in processes:
                process.kill()
                process.wait()


def _cluster_ok(port: int) -> bool:
    info = command(f"redis://127.0.0.1:{port}/0", "CLUSTER", "INFO")
    return isinstance(info, bytes) and b"cluster_state:ok" in info


def _wait(ready: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, RedisError):
            if ready():
                return
        time.sleep(0.05)
    raise RedisError("a private cluster node did not become ready")


async def _measure(url: str, label: str, quick: bool) -> dict[str, Any]:
    jobs = 2_000 if quick else 10_000
    rates = sorted([(await drain(url, jobs=jobs, concurrency=32))[0] for _ in range(3)])
    compared = await engine._compare(
        url, label, sequential=20 if quick else 100, concurrent=200 if quick else 1000
    )
    return {
        f"{label}: S1 drain, concurrency 32 (round trips/s)": (rates[1], "median of 3"),
        f"{label}: 3-step workflows/s, many at once": (
            compared[f"engine {label}: 3-step workflows/s, {200 if quick else 1000} at once"],
            "best of 3",
        ),
        f"{label}: 3-step workflow latency ms": (
            compared[f"engine {label}: 3-step workflow latency ms"],
            "one at a time, best of 3",
        ),
    }


def section(quick: bool) -> dict[str, Any]:
    """``make bench``'s ``redis-cluster`` section: one node, then the cluster, same run."""
    try:
        with private_redis() as server:
            figures = trio.run(_measure, server.url, "one node", quick)
        with private_cluster() as url:
            figures |= trio.run(_measure, url, "3-master cluster", quick)
            figures |= trio.run(redis_cluster_scaling.measure, url, quick)
    except RedisError as exc:
        return {"redis-cluster section skipped": (float("nan"), str(exc)[:90])}
    for what in ("S1 drain, concurrency 32 (round trips/s)", "3-step workflows/s, many at once"):
        one = figures[f"one node: {what}"][0]
        many = figures[f"3-master cluster: {what}"][0]
        figures[f"cluster / one node, {what.split(' (')[0]} (x)"] = (many / one, "want >= 0.85")
    return figures
