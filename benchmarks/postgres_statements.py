"""The statements a 3-step workflow costs on PostgreSQL (issue 32): an objective count, where
workflows/s on a shared machine are noise.

A private server (``postgres_server.py``) restarted with ``pg_stat_statements``; the engine
benchmark's workflow (``postgres_queue._engine``: ``benchmarks/engine.py``'s app, engine and
worker in one process) runs ``concurrent`` at once on a fresh schema; then every statement the
clients sent (top level: a function's own statements are not counted) is listed per workflow,
with the server's execution time of each.

Run: ``python -m benchmarks.postgres_statements [workflows]`` (default 300).
"""

from __future__ import annotations

import sys

import trio

import durable_trio as dt

from .postgres_queue import _engine, _url
from .postgres_server import private_postgres

_QUERY = r"""
    SELECT calls, total_exec_time, regexp_replace(query, '\s+', ' ', 'g')
    FROM pg_stat_statements
    WHERE query NOT LIKE '%pg_stat_statements%' AND query NOT LIKE '%CREATE %'
      AND query NOT LIKE '%durable_trio_schema%'
    ORDER BY calls DESC, total_exec_time DESC
"""


def count(concurrent: int) -> list[str]:
    """The report's lines: statements per workflow, then each statement's share."""
    with private_postgres() as server:
        server.sql("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
        server.restart("fast")
        server.sql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        url = _url(server)

        async def run() -> None:
            async with dt.open_backend(url):
                pass  # the tables first: their migrations are not the workflows' statements
            server.sql("SELECT pg_stat_statements_reset()")
            await _engine(url, sequential=1, concurrent=concurrent)

        trio.run(run)
        rows = server.sql(_QUERY)
    workflows = concurrent + 2  # (the engine benchmark's warm-up and one at a time)
    total = sum(int(calls) for calls, _, _ in rows)
    lines = [f"statements per 3-step workflow: {total / workflows:.2f} ({workflows} workflows)"]
    for calls, exec_ms, query in rows:
        if calls / workflows >= 0.01:
            lines.append(
                f"  {calls / workflows:5.2f}/wf  {exec_ms / max(calls, 1) * 1000:7.1f} us"
                f"  {query[:100]}"
            )
    return lines


if __name__ == "__main__":
    print("\n".join(count(int(sys.argv[1]) if len(sys.argv) > 1 else 300)))
