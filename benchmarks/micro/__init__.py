"""Micro-benchmarks of one part each, run on their own (not sections of ``make bench``).

* ``python -m benchmarks.micro.redis_client [URL]``: the Redis client (sequential, pipelined and
  concurrent ``GET``).
* ``python -m benchmarks.micro.redis_broker [URL]``: the Redis broker (push, pop + complete,
  latency, idle commands per second).
* ``python -m benchmarks.micro.sqlite_broker [DIRECTORY]``: the SQLite broker (round trips, idle
  cost, cross-connection wake-up).

The Redis ones start a private ``redis-server`` when no URL is given.
"""
