"""What ``min_replicas=1`` costs: push and complete round trips with and without it (issue 17).

Two PRIVATE ``redis-server`` processes, a master and its replica (``REPLICAOF``): the data
nodes of a Sentinel group (the sentinels are not on a write's path, so they are left out). The
broker runs on the master's ``redis://`` URL, once plain and once with
``?min_replicas=1``, in the same run:

* one at a time: N pushes, then N pop + complete pairs, each call awaited before the next
  (a ``WAIT`` after every write: its round trip to the replica is the whole cost);
* 32 at once: N pushes from 32 concurrent tasks (their requests share the client's
  connections; each still carries its own ``WAIT``).

Measured, never asserted (timings on a shared 2-core machine are not a test's business).
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

import trio

from durable_trio.brokers import Job
from durable_trio.brokers.redis import RedisBroker

from .redis_server import RedisError, command, private_redis

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["section"]


@contextlib.contextmanager
def _master_and_replica() -> Iterator[str]:
    """A master and a replica of it, in sync; yields the master's URL."""
    with private_redis() as master, private_redis() as replica:
        command(replica.url, "REPLICAOF", "127.0.0.1", master.port)
        deadline = time.monotonic() + 30
        while b"master_link_status:up" not in command(replica.url, "INFO", "replication"):  # type: ignore[operator]
            if time.monotonic() > deadline:
                raise RedisError("the replica did not sync")
            time.sleep(0.05)
        yield master.url


async def _measure(url: str, label: str, jobs: int) -> dict[str, Any]:
    queue = f"bench-{label}"
    async with RedisBroker.from_url(url) as broker:
        began = time.perf_counter()
        for n in range(jobs):
            await broker.push_on(queue, Job(str(n), b"{}"))
        push_us = (time.perf_counter() - began) / jobs * 1e6
        claims = [claim for _ in range(jobs) if (claim := await broker.pop_from(queue))]
        began = time.perf_counter()
        for claim in claims:
            await broker.complete_job(claim.lease, queue)
        complete_us = (time.perf_counter() - began) / max(1, len(claims)) * 1e6

        async def pushes(first: int) -> None:
            for n in range(first, jobs, 32):
                await broker.push_on(queue, Job(f"c{n}", b"{}"))

        began = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for first in range(32):
                nursery.start_soon(pushes, first)
        concurrent = jobs / (time.perf_counter() - began)
    return {
        f"{label}: push round trip us, one at a time": (push_us, f"mean of {jobs}"),
        f"{label}: complete round trip us, one at a time": (complete_us, f"mean of {jobs}"),
        f"{label}: pushes/s, 32 at once": (concurrent, f"{jobs} pushes"),
    }


def section(quick: bool) -> dict[str, Any]:
    """``make bench``'s ``replicas`` section: a master and its replica, without and with
    ``min_replicas=1``, same run."""
    jobs = 500 if quick else 3_000
    try:
        with _master_and_replica() as url:
            figures = trio.run(_measure, url, "no WAIT", jobs)
            figures |= trio.run(_measure, f"{url}?min_replicas=1", "min_replicas=1", jobs)
    except RedisError as exc:
        return {"replicas section skipped": (float("nan"), str(exc)[:90])}
    for what in ("push round trip us, one at a time", "complete round trip us, one at a time"):
        plain = figures[f"no WAIT: {what}"][0]
        waited = figures[f"min_replicas=1: {what}"][0]
        figures[f"min_replicas=1 / no WAIT, {what.split(' us')[0]} (x)"] = (waited / plain, "")
    return figures
