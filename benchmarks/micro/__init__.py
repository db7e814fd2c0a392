"""Micro-benchmarks of one part each, run on their own (not sections of ``make bench``).

* ``python -m benchmarks.micro.redis_client [URL]``: the Redis client (sequential, pipelined and
  concurrent ``GET``).
* ``python -m benchmarks.micro.redis_broker [URL]``: the Redis broker (push, pop + complete,
  latency, idle commands per second).
* ``python -m benchmarks.micro.sqlite_broker [DIRECTORY]``: the SQLite broker (round trips, idle
  cost, cross-connection wake-up).

The Redis ones start a private ``redis-server`` when no URL is given.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import trio

from ..redis_server import private_redis

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

__all__ = ["measure_on_redis"]


def measure_on_redis(
    module: str, measure: Callable[[str], Awaitable[dict[str, float]]]
) -> dict[str, float]:
    """``measure`` on the Redis URL given as the first argument, or on a private server."""
    if len(sys.argv) > 2:
        sys.exit(f"usage: python -m benchmarks.micro.{module} [redis://HOST:PORT/DB]")
    if len(sys.argv) == 2:
        return trio.run(measure, sys.argv[1])
    with private_redis() as server:
        return trio.run(measure, server.url)
