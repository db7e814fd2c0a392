"""Per-attempt step history (issue 16, item 1): every ended attempt of a step is logged on its
checkpoint (start, end, outcome, error, worker, last beat) and ``runs show`` / ``show_run``
shows it, on every store; an old or damaged log still shows what it can, and the run still
runs."""

from __future__ import annotations

import json
import sqlite3
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import pytest
import trio

import durable_trio as dt
from durable_trio._engine._records import ATTEMPT_LOG_LIMIT, ended_attempt, error_to_json
from durable_trio._engine._results import result_worker
from durable_trio._ops_attempts import attempt_views
from durable_trio._redis import open_redis
from durable_trio.cli._main import main

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

WORKER = "worker-a"


def flaky_app(
    calls: list[int], *, pause: float, delay: float, gate: trio.Event | None = None
) -> dt.App:
    """``flaky`` fails its first two attempts (beating once each) and completes the third;
    with ``gate``, the second attempt waits for it first."""
    app = dt.App("shop")

    @app.step("flaky", retry=dt.Retry(max_attempts=3, initial=delay, multiplier=2, jitter=0))
    async def flaky(x: int) -> int:
        calls.append(x)
        n = len(calls)
        dt.step_info().heartbeat({"n": n})
        if gate is not None and n == 2:
            await gate.wait()
        await trio.sleep(pause)
        if n < 3:
            raise RuntimeError(f"boom {n}")
        return x * 10

    @app.workflow("order")
    async def order(ctx: dt.WorkflowContext, x: int) -> int:
        return int(await ctx.step("flaky", x))

    return app


@asynccontextmanager
async def running(app: dt.App, url: str) -> AsyncIterator[tuple[dt.Engine, dt.Operations]]:
    async with (
        dt.open_backend(url) as backend,
        dt.open_worker(app, backend, instance_id=WORKER),
        dt.open_engine(app, backend) as engine,
        dt.open_operations(backend, namespace="shop") as ops,
    ):
        yield engine, ops


def assert_three_attempts(step: dt.StepView, pause: float) -> None:
    """Two failed attempts then a completed one, each with its worker, error and beat, in
    order and without overlap."""
    assert [(a.attempt, a.status, a.worker) for a in step.attempts] == [
        (1, "failed", WORKER),
        (2, "failed", WORKER),
        (3, "completed", WORKER),
    ]
    errors = [a.error for a in step.attempts]
    assert errors[:2] == [
        {"message": "RuntimeError: boom 1", "code": "RuntimeError", "retryable": True},
        {"message": "RuntimeError: boom 2", "code": "RuntimeError", "retryable": True},
    ]
    assert errors[2] is None
    assert all(isinstance(a.heartbeat, dict) and "at" in a.heartbeat for a in step.attempts)
    for attempt in step.attempts:
        assert attempt.duration is not None
        assert attempt.duration >= pause * 0.9
    for before, after in zip(step.attempts, step.attempts[1:], strict=False):
        assert before.ended_at is not None
        assert after.started_at is not None
        assert before.ended_at <= after.started_at
    assert step.notes == ()


async def test_three_attempts_with_exact_times_on_memory(autojump_clock: object) -> None:
    calls: list[int] = []
    async with running(flaky_app(calls, pause=0.5, delay=1.0), "memory://") as (engine, ops):
        start = trio.current_time()
        run_id = await engine.start("order", 4)
        assert await engine.result(run_id) == 40
        details = await ops.show_run(run_id)
    (step,) = details.steps
    assert_three_attempts(step, 0.5)
    # dispatched at once; each retry due 1 s, then 2 s, after the failure was applied
    assert [(a.started_at, a.ended_at) for a in step.attempts] == [
        (start, start + 0.5),
        (start + 1.5, start + 2.0),
        (start + 4.0, start + 4.5),
    ]
    assert [a.duration for a in step.attempts] == [0.5, 0.5, 0.5]
    assert [a.heartbeat["at"] for a in step.attempts] == [start, start + 1.5, start + 4.0]
    as_json = details.to_json()["steps"][0]
    assert [a["worker"] for a in as_json["attempts"]] == [WORKER] * 3
    assert as_json["attempts"][0]["endedAt"] == start + 0.5
    assert as_json["notes"] == []


async def test_three_attempts_on_sqlite(tmp_path: Path) -> None:
    calls: list[int] = []
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    async with running(flaky_app(calls, pause=0.05, delay=0.05), url) as (engine, ops):
        run_id = await engine.start("order", 4)
        assert await engine.result(run_id) == 40
        (step,) = (await ops.show_run(run_id)).steps
    assert_three_attempts(step, 0.05)


async def test_three_attempts_on_redis(redis_url: str) -> None:
    calls: list[int] = []
    async with running(flaky_app(calls, pause=0.05, delay=0.05), redis_url) as (engine, ops):
        run_id = await engine.start("order", 4)
        assert await engine.result(run_id) == 40
        (step,) = (await ops.show_run(run_id)).steps
    assert_three_attempts(step, 0.05)


@pytest.mark.postgres
async def test_three_attempts_on_postgres(postgres_schema_url: str) -> None:
    calls: list[int] = []
    app = flaky_app(calls, pause=0.05, delay=0.05)
    async with running(app, postgres_schema_url) as (engine, ops):
        run_id = await engine.start("order", 4)
        assert await engine.result(run_id) == 40
        (step,) = (await ops.show_run(run_id)).steps
    assert_three_attempts(step, 0.05)


async def test_an_operator_retry_keeps_the_log_of_the_attempts_before_it(
    autojump_clock: object,
) -> None:
    calls: list[int] = []
    app = dt.App("shop")
    failing = [True]

    @app.step("charge", retry=dt.Retry(max_attempts=2, initial=1.0, jitter=0))
    async def charge(x: int) -> int:
        calls.append(x)
        if failing[0]:
            raise RuntimeError("card declined")
        return x

    @app.workflow("order")
    async def order(ctx: dt.WorkflowContext, x: int) -> int:
        return int(await ctx.step("charge", x))

    async with running(app, "memory://") as (engine, ops):
        run_id = await engine.start("order", 7)
        with pytest.raises(dt.RunFailed):
            await engine.result(run_id)
        await trio.sleep(10.0)
        retried_at = trio.current_time()
        failing[0] = False
        await ops.retry_run(run_id)
        assert await engine.result(run_id) == 7
        (step,) = (await ops.show_run(run_id)).steps
    assert [(a.attempt, a.status, a.worker) for a in step.attempts] == [
        (1, "failed", WORKER),
        (2, "failed", WORKER),
        (3, "completed", WORKER),
    ]
    assert step.attempts[2].started_at == retried_at
    assert step.attempts[1].error == {
        "message": "RuntimeError: card declined", "code": "RuntimeError", "retryable": True
    }


# -- the CLI and its --json -------------------------------------------------------------------


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    status = main(list(argv))
    return status, capsys.readouterr().out


async def test_runs_show_prints_every_attempt_with_its_worker_and_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    async with running(flaky_app([], pause=0.01, delay=0.01), url) as (engine, _):
        run_id = await engine.start("order", 4, run_id="r-1")
        await engine.result(run_id)
    common = ["--backend", url, "--namespace", "shop"]
    status, out = await trio.to_thread.run_sync(
        lambda: _cli(capsys, "runs", "show", "r-1", *common)
    )
    assert status == 0
    lines = [line for line in out.splitlines() if line.startswith("1 ")]
    assert len(lines) == 3
    assert "worker" in out.splitlines()[out.splitlines().index("") + 1]  # the table's header
    assert all(WORKER in line for line in lines)
    assert "RuntimeError: boom 1" in lines[0]
    assert "RuntimeError: boom 2" in lines[1]
    assert "completed" in lines[2]
    status, out = await trio.to_thread.run_sync(
        lambda: _cli(capsys, "runs", "show", "r-1", "--json", *common)
    )
    attempts = json.loads(out)["steps"][0]["attempts"]
    assert [(a["attempt"], a["status"], a["worker"]) for a in attempts] == [
        (1, "failed", WORKER),
        (2, "failed", WORKER),
        (3, "completed", WORKER),
    ]
    assert all(a["duration"] >= 0.01 * 0.9 for a in attempts)


# -- damaged or old logs ----------------------------------------------------------------------


def _sqlite_damage(path: Path) -> Any:
    async def damage(run_id: str, step_id: str, raw: bytes) -> None:
        def write() -> None:
            db = sqlite3.connect(path, timeout=10)
            db.execute(
                "UPDATE dt_steps SET attempts = ? WHERE run_id = ? AND step_id = ?",
                (raw.decode(), run_id, step_id),
            )
            db.commit()
            db.close()

        await trio.to_thread.run_sync(write)

    return damage


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
@pytest.mark.parametrize(
    ("raw", "note"),
    [
        (b"{not json", "attempt log damaged: the stored attempt log is not JSON"),
        (b'{"a": 1}', "attempt log damaged: the stored attempt log is a dict, not a list"),
        (b'[1, {"attempt": "x"}]', "attempt log entry damaged, skipped: 1"),
    ],
)
async def test_a_damaged_log_still_runs_and_shows_what_it_can(
    kind: str, raw: bytes, note: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The log is written by hand while no engine drives the run (its step's second attempt
    running): ``runs show`` shows the current attempt with a note, and the next engine takes
    the run over, logs the attempts that follow after the damage and completes it."""
    gate = trio.Event()
    calls: list[int] = []
    app = flaky_app(calls, pause=0.01, delay=0.01, gate=gate)
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / 'runs.db'}"
        damage = _sqlite_damage(tmp_path / "runs.db")
    else:
        url = request.getfixturevalue("redis_url")

        async def damage(run_id: str, step_id: str, raw: bytes) -> None:
            async with open_redis(url) as client:
                key = f"{{dt-runs:shop}}:step:{len(run_id)}:{run_id}:{step_id}"
                await client.execute("HSET", key, "attempts", raw)

    async with (
        dt.open_backend(url) as backend,
        dt.open_worker(app, backend, instance_id=WORKER),
        dt.open_operations(backend, namespace="shop") as ops,
    ):
        async with dt.open_engine(app, backend) as engine:
            await engine.start("order", 4, run_id="r")
            with trio.fail_after(10):
                while True:  # the second attempt runs and beat: the first one is logged
                    steps = (await ops.show_run("r")).steps
                    last = steps[0].attempts[-1] if steps else None
                    if last is not None and last.attempt == 2 and last.heartbeat:
                        break
                    await trio.sleep(0.01)
            assert steps[0].attempts[0].status == "failed"
        await damage("r", "1", raw)
        (damaged,) = (await ops.show_run("r")).steps
        assert damaged.notes[0].startswith(note)
        assert [(a.attempt, a.status, a.worker) for a in damaged.attempts] == [
            (1, "failed", None),  # nothing readable logged: known by its number only
            (2, "running", WORKER),
        ]
        async with dt.open_engine(app, backend, reconcile_interval=0.05) as engine:
            gate.set()
            with trio.fail_after(10):
                assert await engine.result("r") == 40
        (step,) = (await ops.show_run("r")).steps
    assert step.notes[0].startswith(note)
    assert [(a.attempt, a.status, a.worker) for a in step.attempts] == [
        (2, "failed", WORKER),
        (3, "completed", WORKER),
    ]
    assert step.notes[-1].startswith("attempts 1 to 1 are not in the log")


def test_a_log_is_bounded_and_says_which_attempts_it_lost() -> None:
    step = dt.StepRecord("r", "1", dt.StepKind.REMOTE, "flaky", dt.StepState.PENDING)
    last = ATTEMPT_LOG_LIMIT + 30
    for n in range(1, last):  # attempts 1 to last - 1 fail; attempt ``last`` runs
        ended = ended_attempt(step, ended_at=float(n), error={"message": "x" * 5000})
        step = attrs.evolve(step, attempt=n + 1, attempts=ended)
    assert len(step.attempts) == ATTEMPT_LOG_LIMIT
    assert step.attempts[0]["attempt"] == 30
    assert len(step.attempts[0]["error"]["message"]) == 1000
    views, notes = attempt_views(step, now=0.0)
    assert [v.attempt for v in views] == list(range(30, last + 1))
    assert views[-1].status == "running"
    assert notes == (
        f"attempts 1 to 29 are not in the log (it keeps the last {ATTEMPT_LOG_LIMIT}, or they "
        "ended before it was kept)",
    )


def test_a_checkpoint_from_before_logs_lists_its_attempts_by_number() -> None:
    step = dt.StepRecord(
        "r", "1", dt.StepKind.REMOTE, "flaky", dt.StepState.COMPLETED, attempt=3,
        created_at=1.0, updated_at=9.0, wake_at=5.0,
    )  # fmt: skip
    views, notes = attempt_views(step)
    assert [(v.attempt, v.status, v.started_at, v.ended_at) for v in views] == [
        (1, "failed", None, None),
        (2, "failed", None, None),
        (3, "completed", 5.0, 9.0),
    ]
    assert notes == ()


def test_a_retry_in_its_backoff_is_waiting_then_running_with_the_worker_that_beat() -> None:
    logged = {"attempt": 1, "outcome": "timed_out", "startedAt": 1.0, "endedAt": 4.0,
              "error": {"message": "no heartbeat", "code": "heartbeat_timeout"}}  # fmt: skip
    step = dt.StepRecord(
        "r", "1", dt.StepKind.REMOTE, "flaky", dt.StepState.PENDING, attempt=2, wake_at=10.0,
        created_at=1.0, attempts=(logged,),
    )  # fmt: skip
    views, _ = attempt_views(step, now=5.0)
    assert [(v.attempt, v.status, v.started_at) for v in views] == [
        (1, "timed_out", 1.0),
        (2, "waiting", 10.0),
    ]
    beat = {"attempt": 2, "at": 11.0, "sentAt": 1.7e9, "worker": "w-2"}
    views, _ = attempt_views(attrs.evolve(step, heartbeat=beat), now=12.0)
    assert (views[1].status, views[1].worker, views[1].heartbeat) == ("running", "w-2", beat)
    assert views[0].duration == 3.0


def test_a_stalled_attempt_is_logged_as_stalled_with_the_worker_whose_lease_was_lost() -> None:
    error = dt.StepError(
        "stalled more than 1 time(s)", code="stalled",
        details={"stalls": [{"at": 1.0, "worker": "w-1"}, {"at": 2.0, "worker": "w-9"}]},
    )  # fmt: skip
    result = dt.StepResult("r", "1", 1, dt.StepStatus.FAILED, error=error)
    assert result_worker(result) == "w-9"
    delivered = attrs.evolve(result, delivery={"worker": "w-3", "job": "j"})
    assert result_worker(delivered) == "w-3"
    step = dt.StepRecord("r", "1", dt.StepKind.REMOTE, "flaky", dt.StepState.PENDING)
    (entry,) = ended_attempt(
        step, ended_at=3.0, error=error_to_json(error), worker=result_worker(result)
    )
    assert (entry["outcome"], entry["worker"]) == ("stalled", "w-9")
    assert entry["error"] == {"message": "stalled more than 1 time(s)", "code": "stalled",
                              "retryable": True}  # fmt: skip
