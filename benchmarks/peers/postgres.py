"""The PostgreSQL peers (issue 32): pgqueuer and DBOS Transact, on the caller's private server.

Each runs in its own venv (``venv.py``'s ``POSTGRES_PEERS``), in a subprocess that makes its own
database on the server, measures, drops it and prints one JSON line (``run_pgqueuer.py``,
``run_dbos.py``). :func:`run_postgres_peers` returns rows as :func:`benchmarks.peers.run_peers`
does: ``{"peer", "scenario", "metric", "value", "unit", "note"}``, ``value`` the median of the
runs (``None`` with the reason in the note when a peer could not be installed or failed).

Run alone: ``python -m benchmarks.peers.postgres [--quick]`` (a private server of its own).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from .venv import ensure_envs

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["run_postgres_peers"]

#: Seconds a runner may take before it is killed (its figure is then ``None``).
_TIMEOUT = 600.0


def _run(command: list[str], env: dict[str, str], args: list[str]) -> dict[str, Any]:
    try:
        done = subprocess.run(
            [*command, *args], capture_output=True, text=True, timeout=_TIMEOUT,
            stdin=subprocess.DEVNULL, env={**__import__("os").environ, **env}, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {_TIMEOUT:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exited {done.returncode}: {tail[:200]}"}
    answer: dict[str, Any] = json.loads(lines[-1])
    return answer


def _rows(peer: str, scenario: str, answers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    errors = [a["error"] for a in answers if "error" in a]
    if errors:
        return [{"peer": peer, "scenario": scenario, "metric": "-", "value": None, "unit": "",
                 "note": f"failed: {errors[0]}"}]  # fmt: skip
    rows = []
    for i, result in enumerate(answers[0]["results"]):
        values = [a["results"][i]["value"] for a in answers]
        rows.append({
            "peer": peer, "scenario": scenario, "metric": result["metric"],
            "value": statistics.median(values), "unit": result["unit"],
            "note": f"{answers[0].get('version', '?')}; runs "
            + " / ".join(f"{v:,.2f}" for v in values),
        })  # fmt: skip
    return rows


def run_postgres_peers(
    admin_url: str,
    *,
    quick: bool,
    quiet: Callable[[], AbstractContextManager[None]] | None = None,
) -> list[dict[str, Any]]:
    """pgqueuer's S1 (10,000 jobs, concurrency 10, spawn -> last body), S3 (p50/p99) and S4
    (an idle worker's transactions/s), and DBOS's 3-step workflows, on ``admin_url``'s server
    (a superuser URL: each run makes and drops its own database). ``quiet``: what to hold
    around S4 so that only the idle worker's transactions count (autovacuum off)."""
    envs = ensure_envs(["pgqueuer", "dbos"])
    runs = 1 if quick else 3
    rows: list[dict[str, Any]] = []
    pgq = envs["pgqueuer"]
    if pgq.command is None:
        rows.append({"peer": "pgqueuer", "scenario": "*", "metric": "-", "value": None,
                     "unit": "", "note": f"unavailable: {pgq.reason}"})  # fmt: skip
    else:
        jobs = "2000" if quick else "10000"
        window = "5" if quick else "30"
        for scenario in ("S1", "S3", "S4"):
            args = ["--postgres", admin_url, "--scenario", scenario, "--jobs", jobs,
                    "--samples", "100" if quick else "300", "--window", window]  # fmt: skip
            times = runs if scenario != "S4" else 1
            held = quiet() if scenario == "S4" and quiet is not None else nullcontext()
            with held:
                answers = [_run(pgq.command, pgq.env, args) for _ in range(times)]
            rows += _rows("pgqueuer", scenario, answers)
    dbos = envs["dbos"]
    if dbos.command is None:
        rows.append({"peer": "dbos", "scenario": "workflows", "metric": "-", "value": None,
                     "unit": "", "note": f"unavailable: {dbos.reason}"})  # fmt: skip
    else:
        args = ["--postgres", admin_url, "--sequential", "30" if quick else "100",
                "--concurrent", "100" if quick else "300"]  # fmt: skip
        answers = [_run(dbos.command, dbos.env, args) for _ in range(runs)]
        rows += _rows("dbos", "workflows", answers)
    return rows


def _main() -> None:
    from ..postgres_server import private_postgres

    quick = "--quick" in sys.argv
    with private_postgres() as server:
        for row in run_postgres_peers(server.url, quick=quick):
            value = "-" if row["value"] is None else f"{row['value']:,.2f}"
            print(f"  {row['peer']:<9} {row['scenario']:<9} {row['metric']:<11} "
                  f"{value:>10} {row['unit']:<12} {row['note']}")  # fmt: skip


if __name__ == "__main__":
    _main()
