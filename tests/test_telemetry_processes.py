"""MUST SHOW of docs/observability.md: one 3-step run across an engine process and a worker
process (real processes, SQLite) is one trace — 1 run span, 3 step spans, each step's parent
the run's span, across the process boundary. Each process exports its spans to its own
JSON-lines file (tests/_otel_process.py); the test joins them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

pytest.importorskip("opentelemetry.sdk")

SCRIPT = Path(__file__).with_name("_otel_process.py")


@pytest.mark.chaos
def test_one_run_across_an_engine_and_a_worker_process_is_one_trace(tmp_path: Path) -> None:
    url = "sqlite:///" + str(tmp_path / "traced.db")
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parent.parent)}
    worker_spans, engine_spans = tmp_path / "worker.jsonl", tmp_path / "engine.jsonl"
    worker = subprocess.Popen(
        [sys.executable, str(SCRIPT), "worker", url, str(worker_spans)],
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert worker.stdout is not None
        assert worker.stdout.readline().strip() == b"ready"
        engine = subprocess.run(
            [sys.executable, str(SCRIPT), "engine", url, str(engine_spans)],
            capture_output=True,
            env=env,
            timeout=60,
            check=False,
        )
        assert engine.returncode == 0, engine.stderr.decode()
        assert orjson.loads(engine.stdout) == {
            "reserved": "reserved 7",
            "charged": 5,
            "shipped": "shipped",
        }
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        if worker.stdout is not None:
            worker.stdout.close()
    from_engine = [orjson.loads(line) for line in engine_spans.read_text().splitlines()]
    from_worker = [orjson.loads(line) for line in worker_spans.read_text().splitlines()]
    spans = from_engine + from_worker
    runs = [s for s in spans if s["name"].startswith("run ")]
    steps = [s for s in spans if s["name"].startswith("step ")]
    assert len(runs) == 1
    (run,) = runs
    assert run in from_engine
    (start,) = [s for s in spans if s["name"].startswith("start ")]
    assert start in from_engine
    assert start["parent"] is None
    assert run["parent"] == start["span"]
    assert run["attributes"]["durable_trio.run_id"] == "traced-1"
    assert run["attributes"]["durable_trio.outcome"] == "completed"
    assert [s["name"] for s in steps] == ["step reserve", "step charge", "step ship"]
    assert all(s in from_worker for s in steps)
    assert {s["pid"] for s in steps} == {worker.pid} != {run["pid"]}
    for step in steps:
        assert step["trace"] == run["trace"]
        assert step["parent"] == run["span"]
        assert step["remoteParent"]
        assert step["attributes"]["durable_trio.run_id"] == "traced-1"
        assert step["attributes"]["durable_trio.attempt"] == 1
        assert step["attributes"]["durable_trio.outcome"] == "completed"
    assert [s["attributes"]["durable_trio.step_id"] for s in steps] == ["1", "2", "3"]
    # every span of the run, in both processes, is in the one trace
    assert {s["trace"] for s in spans} == {run["trace"]}
