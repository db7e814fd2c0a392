"""S1 with a fleet-wide concurrency limit against the same drain without one (issue 33, "Must
show": a limit no lower than the worker's own concurrency costs at most 10%).

The drain of ``benchmarks/redis.py``'s ``drain_as_the_peers`` (10,000 no-op jobs queued first,
one worker process at concurrency 10, timed from the worker's start to the last step body's
done signal), run back to back without a limit and with ``max_concurrency=10`` stored on the
step's queue by the worker before it serves (``set_queue_limit``, as ``open_worker`` does), on a
private redis-server and on a SQLite file. The runs alternate (plain, limited, plain, ...) so a
drift of the machine falls on both; each figure is the median.

    python -m benchmarks limits [--quick]
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

import trio

from .redis import drain_as_the_peers
from .redis_server import RedisError, flushall, private_redis, redis_version

__all__ = ["section"]

#: The worker's concurrency and the queue's limit (equal: the tightest the target speaks of).
CONCURRENCY = 10
LIMIT = 10


async def compare(
    url: str, *, jobs: int, runs: int, clean: Any = None
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """The (jobs/s, worker CPU us/job) of ``runs`` runs without a limit and of as many with
    one, alternating; ``clean()`` before each run (a Redis flush)."""
    plain: list[tuple[float, float]] = []
    limited: list[tuple[float, float]] = []
    for _ in range(runs):
        for queue_limit, into in ((None, plain), (LIMIT, limited)):
            if clean is not None:
                clean()
            into.append(
                await drain_as_the_peers(
                    url, jobs=jobs, concurrency=CONCURRENCY, queue_limit=queue_limit
                )
            )
    return plain, limited


def _figures(
    where: str, result: tuple[list[tuple[float, float]], list[tuple[float, float]]]
) -> dict[str, Any]:
    def median(runs: list[tuple[float, float]], i: int) -> float:
        return statistics.median(r[i] for r in runs)

    def spread(runs: list[tuple[float, float]]) -> str:
        return f"{min(r[0] for r in runs):,.0f}-{max(r[0] for r in runs):,.0f}"

    runs, limited_runs = result
    plain, limited = median(runs, 0), median(limited_runs, 0)
    return {
        f"limits {where}: S1 without a limit (jobs/s)": (
            plain,
            f"concurrency {CONCURRENCY}, runs {spread(runs)}; worker CPU"
            f" {median(runs, 1):,.0f} us/job",
        ),
        f"limits {where}: S1 with max_concurrency={LIMIT} (jobs/s)": (
            limited,
            f"runs {spread(limited_runs)}; worker CPU {median(limited_runs, 1):,.0f} us/job",
        ),
        f"limits {where}: limited / unlimited (ratio)": (
            limited / plain,
            "back to back, alternating runs (want >= 0.90)",
        ),
    }


def section(quick: bool) -> dict[str, Any]:
    jobs = 2_000 if quick else 10_000
    runs = 1 if quick else 5
    figures: dict[str, Any] = {}
    try:
        with private_redis() as server:
            print(f"  (private redis-server {redis_version(server.url)} on {server.url})")
            result = trio.run(
                lambda: compare(
                    server.url, jobs=jobs, runs=runs, clean=lambda: flushall(server.url)
                )
            )
            figures.update(_figures("redis", result))
    except RedisError as exc:
        figures["limits redis skipped"] = (float("nan"), f"no redis-server: {exc}")
    with tempfile.TemporaryDirectory() as folder:
        url = "sqlite:///" + str(Path(folder) / "bench.db")
        figures.update(_figures("sqlite", trio.run(lambda: compare(url, jobs=jobs, runs=runs))))
    return figures
