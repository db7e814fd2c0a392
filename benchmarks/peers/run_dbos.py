# mypy: ignore-errors
"""DBOS Transact on PostgreSQL, run with DBOS's own venv python (issue 32's workflow peer).

Standard library + dbos only. One JSON line out. On a fresh database (DBOS's system database),
the same workflow as ``benchmarks/engine.py``: three no-op steps in sequence, each a
``@DBOS.step``, in a ``@DBOS.workflow``; DBOS runs steps in the workflow's own process (there
is no separate worker), with its defaults:

* ``sequential``: one workflow at a time (``start_workflow(...).get_result()``): ms per workflow;
* ``concurrent``: ``--concurrent`` workflows started at once, then every result awaited:
  workflows/s, start of the first to the last result.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from typing import Any


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--postgres", required=True, help="an admin URL (a database is made)")
    parser.add_argument("--sequential", type=int, default=100)
    parser.add_argument("--concurrent", type=int, default=300)
    return parser.parse_args()


def _with_database(url: str, name: str) -> str:
    base, _, _ = url.rpartition("/")
    return f"{base}/{name}"


def _measure(args: argparse.Namespace, database: str) -> list[dict[str, Any]]:
    from dbos import DBOS

    DBOS(
        config={
            "name": "bench-dbos",
            "system_database_url": _with_database(args.postgres, database),
            "run_admin_server": False,
        }
    )

    @DBOS.step()
    def noop(value: int) -> int:
        return value

    @DBOS.workflow()
    def three(value: int) -> int:
        for _ in range(3):
            value = noop(value)
        return value

    DBOS.launch()
    try:
        assert DBOS.start_workflow(three, -1).get_result() == -1  # warm
        start = time.perf_counter()
        for n in range(args.sequential):
            assert DBOS.start_workflow(three, n).get_result() == n
        per_one = (time.perf_counter() - start) / args.sequential
        start = time.perf_counter()
        handles = [DBOS.start_workflow(three, n) for n in range(args.concurrent)]
        for n, handle in enumerate(handles):
            assert handle.get_result() == n
        per_many = (time.perf_counter() - start) / args.concurrent
    finally:
        DBOS.destroy()
    return [
        {"metric": "sequential", "value": per_one * 1000, "unit": "ms",
         "note": "one 3-step workflow at a time"},
        {"metric": "concurrent", "value": 1 / per_many, "unit": "workflows/s",
         "note": f"{args.concurrent} started at once"},
    ]  # fmt: skip


def main() -> None:
    args = _args()
    from importlib.metadata import version

    import psycopg

    out: dict[str, Any] = {"peer": "dbos", "version": version("dbos")}
    database = f"dbos_{uuid.uuid4().hex[:10]}"
    try:
        with psycopg.connect(args.postgres, autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{database}"'.encode())
        try:
            out["results"] = _measure(args, database)
        finally:
            with psycopg.connect(args.postgres, autocommit=True) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'.encode())
    except Exception as exc:  # one JSON line whatever happens
        out["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
