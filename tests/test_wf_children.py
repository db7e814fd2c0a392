"""Child workflows (issue 18, item 3): ``ctx.child`` / ``ctx.start_child``.

Memory: exact virtual time. SQLite (a real file) and Redis (a private server): the same
scenarios on the wall clock, bounded (real I/O does not run under the mock clock).
"""

from __future__ import annotations

import json
from collections import Counter
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from _redis_server import *  # noqa: F403  (the private redis-server fixtures)
from durable_trio import App, ChildFailed, WorkflowContext, open_engine, open_worker, step_info
from durable_trio._engine import RunStatus, StepKind, StepState
from helpers import wait_status

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path


def shop() -> tuple[App, Counter[str]]:
    """An order that ships parcels as child workflows; steps count their executions."""
    app = App("children")
    runs: Counter[str] = Counter()

    @app.step("ship")
    async def ship(parcel: dict[str, Any]) -> str:
        runs[step_info().idempotency_key] += 1
        await trio.sleep(parcel.get("seconds", 1))
        if parcel.get("lost"):
            raise RuntimeError(f"parcel {parcel['id']} lost")
        return f"shipped {parcel['id']}"

    @app.step("refund")
    async def refund(parcel: dict[str, Any]) -> str:
        runs[step_info().idempotency_key] += 1
        return f"refunded {parcel['id']}"

    @app.workflow("shipment")
    async def shipment(ctx: WorkflowContext, parcel: dict[str, Any]) -> str:
        return str(await ctx.step("ship", parcel))

    @app.workflow("order")
    async def order(ctx: WorkflowContext, parcel: dict[str, Any]) -> str:
        return str(await ctx.child("shipment", parcel))

    @app.workflow("order-compensating")
    async def order_compensating(ctx: WorkflowContext, parcel: dict[str, Any]) -> str:
        try:
            return str(await ctx.child("shipment", parcel))
        except ChildFailed as exc:
            refunded = await ctx.step("refund", parcel)
            return f"{refunded} ({exc.child_run_id}, cancelled={exc.cancelled})"

    @app.workflow("fan-out")
    async def fan_out(ctx: WorkflowContext, parcels: list[dict[str, Any]]) -> list[str]:
        handles = [await ctx.start_child("shipment", p) for p in parcels]
        return list(await ctx.gather(*handles))

    @app.workflow("nested")
    async def nested(ctx: WorkflowContext, parcel: dict[str, Any]) -> str:
        return str(await ctx.child("order", parcel, on_parent_cancel=parcel.get("mode", "cancel")))

    return app, runs


@asynccontextmanager
async def running(app: App, url: str, **options: Any) -> AsyncIterator[dt.Engine]:
    async with dt.open_backend(url) as backend:
        async with open_worker(app, backend), open_engine(app, backend, **options) as engine:
            yield engine


# --------------------------------------------------------------------------- memory, exact time


async def test_a_child_completes_and_the_parent_gets_its_result(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, runs = shop()
    async with running(app, "memory://") as engine:
        await engine.start("order", {"id": "p1", "seconds": 3}, run_id="o1")
        assert await engine.result("o1") == "shipped p1"
        child = await engine.get("o1/1")
        history = await engine.history("o1")
    assert trio.current_time() == 3.0
    assert child.workflow == "shipment"
    assert child.parent == "o1"
    assert child.status is RunStatus.COMPLETED
    assert [(s.kind, s.name, s.status, s.output) for s in history] == [
        (StepKind.CHILD, "shipment", StepState.COMPLETED, "shipped p1")
    ]
    assert history[0].input == {
        "runId": "o1/1",
        "input": {"id": "p1", "seconds": 3},
        "onParentCancel": "cancel",
    }
    assert runs == {"o1/1:1": 1}


async def test_a_failed_child_raises_child_failed_which_the_parent_compensates(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, runs = shop()
    async with running(app, "memory://", default_retry=dt.Retry(max_attempts=1)) as engine:
        await engine.start("order-compensating", {"id": "p2", "lost": True}, run_id="o2")
        assert await engine.result("o2") == "refunded p2 (o2/1, cancelled=False)"
        child = await engine.get("o2/1")
        history = await engine.history("o2")
    assert trio.current_time() == 1.0
    assert child.status is RunStatus.FAILED
    assert [(s.kind, s.status) for s in history] == [
        (StepKind.CHILD, StepState.FAILED),
        (StepKind.REMOTE, StepState.COMPLETED),
    ]
    assert runs == {"o2/1:1": 1, "o2:2": 1}


async def test_an_uncaught_child_failure_fails_the_parent_with_child_failed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, _ = shop()
    async with running(app, "memory://", default_retry=dt.Retry(max_attempts=1)) as engine:
        await engine.start("order", {"id": "p", "lost": True}, run_id="o")
        with pytest.raises(dt.RunFailed) as failed:
            await engine.result("o")
    assert failed.value.error_type == "ChildFailed"
    assert "child run 'o/1' of workflow 'shipment' failed" in str(failed.value)


async def test_start_child_and_gather_of_three(autojump_clock: trio.testing.MockClock) -> None:
    app, runs = shop()
    parcels = [{"id": f"p{n}", "seconds": n} for n in (3, 1, 2)]
    async with running(app, "memory://") as engine:
        await engine.start("fan-out", parcels, run_id="f")
        assert await engine.result("f") == ["shipped p3", "shipped p1", "shipped p2"]
        children = [await engine.get(f"f/{n}") for n in (1, 2, 3)]
    assert trio.current_time() == 3.0  # in parallel
    assert [c.status for c in children] == [RunStatus.COMPLETED] * 3
    assert runs == {"f/1:1": 1, "f/2:1": 1, "f/3:1": 1}


async def test_cancelling_the_parent_cancels_its_children_recursively(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, _ = shop()
    async with running(app, "memory://") as engine:
        await engine.start("nested", {"id": "p", "seconds": 100}, run_id="n")
        await trio.sleep(5)
        assert await engine.cancel("n")
        statuses = [(await engine.get(r)).status for r in ("n", "n/1", "n/1/1")]
        with pytest.raises(dt.RunCancelled):
            await engine.result("n/1/1")
    assert statuses == [RunStatus.CANCELLED] * 3


async def test_an_abandoned_child_goes_on_and_completes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, _ = shop()
    async with running(app, "memory://") as engine:
        await engine.start("nested", {"id": "p", "seconds": 100, "mode": "abandon"}, run_id="a")
        await trio.sleep(5)
        assert await engine.cancel("a")
        assert await engine.result("a/1") == "shipped p"
        assert (await engine.get("a/1/1")).status is RunStatus.COMPLETED
    assert trio.current_time() == 100.0


async def test_a_cancelled_child_raises_child_failed_saying_so(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, _ = shop()
    async with running(app, "memory://") as engine:
        await engine.start("order", {"id": "p", "seconds": 100}, run_id="c")
        await trio.sleep(5)
        await engine.cancel("c/1")
        with pytest.raises(dt.RunFailed) as failed:
            await engine.result("c")
    assert failed.value.error_type == "ChildFailed"
    assert "child run 'c/1' of workflow 'shipment' was cancelled" in str(failed.value)


async def test_child_ids_are_deterministic_across_a_restart(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The engine stops while the parent waits; the next engine replays the CHILD step (same
    child id, ``create_run`` idempotent) and both end, one child only."""
    app, runs = shop()
    async with dt.open_backend("memory://") as backend:
        async with open_worker(app, backend):
            async with open_engine(app, backend, engine_id="first", release_on_close=False) as e1:
                await e1.start("fan-out", [{"id": "x", "seconds": 10}] * 2, run_id="r")
                await trio.sleep(2)
            async with open_engine(app, backend, engine_id="second", run_lease=30.0) as e2:
                assert await e2.result("r") == ["shipped x", "shipped x"]
                listed = sorted(r.run_id for r in await e2.list())
    assert listed == ["r", "r/1", "r/2"]
    assert runs == {"r/1:1": 1, "r/2:1": 1}


async def test_a_child_may_run_on_another_engine(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two engines share one store: the parent's engine learns of the end of a child the other
    engine drives (a store read every ``watch_interval``)."""
    app, _ = shop()
    async with dt.open_backend("memory://") as backend:
        async with (
            open_worker(app, backend),
            open_engine(app, backend, engine_id="one") as one,
            open_engine(app, backend, engine_id="two") as two,
        ):
            await two.start("shipment", {"id": "pre", "seconds": 4}, run_id="p/1")
            await one.start("order", {"id": "pre"}, run_id="p")
            assert await one.result("p") == "shipped pre"
            child, parent = await one.get("p/1"), await one.get("p")
            child_steps = await one.history("p/1")
    assert child_steps[0].attempts[0]["worker"] is not None
    # The child's step ends 4 s after it was dispatched (its run settled by engine two, at
    # once or at its next result read); the parent's engine, reading the child's run every
    # second (watch_interval) on virtual time, sees the end at its next whole second.
    assert child_steps[0].attempts[0]["endedAt"] == 4.0
    assert child.updated_at in (4.0, 5.0)
    assert parent.updated_at == child.updated_at + 1.0


async def test_bad_arguments_fail_at_once(autojump_clock: trio.testing.MockClock) -> None:
    app, _ = shop()

    @app.workflow("bad")
    async def bad(ctx: WorkflowContext, how: str) -> None:
        if how == "mode":
            ctx.child("shipment", {}, on_parent_cancel="maybe")  # type: ignore[arg-type]
        elif how == "unknown":
            await ctx.child("nope", {})

    async with running(app, "memory://") as engine:
        for how, expected in (("mode", "on_parent_cancel"), ("unknown", "no workflow 'nope'")):
            await engine.start("bad", how, run_id=how)
            with pytest.raises(dt.RunFailed) as failed:
                await engine.result(how)
            assert expected in str(failed.value)


# --------------------------------------------------------------------------- SQLite and Redis


async def _scenarios(url: str) -> None:
    app, runs = shop()
    async with running(app, url, default_retry=dt.Retry(max_attempts=1)) as engine:
        with trio.fail_after(30):
            await engine.start("order", {"id": "p1", "seconds": 0.05}, run_id="o1")
            assert await engine.result("o1") == "shipped p1"
            await engine.start(
                "order-compensating", {"id": "p2", "lost": True, "seconds": 0}, run_id="o2"
            )
            assert await engine.result("o2") == "refunded p2 (o2/1, cancelled=False)"
            parcels = [{"id": f"p{n}", "seconds": 0.01 * n} for n in (3, 1, 2)]
            await engine.start("fan-out", parcels, run_id="f")
            assert await engine.result("f") == ["shipped p3", "shipped p1", "shipped p2"]
            await engine.start("nested", {"id": "p", "seconds": 60}, run_id="n")
            await engine.start("nested", {"id": "q", "seconds": 0.2, "mode": "abandon"}, run_id="a")
            while (await engine.store.get_run("n/1/1")) is None or (  # noqa: ASYNC110
                await engine.store.get_run("a/1/1")
            ) is None:
                await trio.sleep(0.01)
            await engine.cancel("n")
            await engine.cancel("a")
            assert (await engine.get("n/1/1")).parent == "n/1"
            assert [(await engine.get(r)).status for r in ("n", "n/1", "n/1/1")] == [
                RunStatus.CANCELLED
            ] * 3
            assert await engine.result("a/1") == "shipped q"
    assert runs["o1/1:1"] == 1
    assert runs["o2:2"] == 1
    assert [runs[f"f/{n}:1"] for n in (1, 2, 3)] == [1, 1, 1]


async def test_children_on_sqlite(tmp_path: Path) -> None:
    await _scenarios(f"sqlite:///{tmp_path / 'runs.db'}")


async def test_children_on_redis(redis_url: str) -> None:
    await _scenarios(redis_url)


@pytest.mark.postgres
async def test_children_on_postgres(postgres_schema_url: str) -> None:
    await _scenarios(postgres_schema_url)


@pytest.mark.redis
async def test_children_on_a_redis_cluster(redis_cluster_url: str) -> None:
    """Parent and children in different run shards of the private 3-master cluster."""
    await _scenarios(redis_cluster_url)


# --------------------------------------------------------------------------- ending with the parent


async def test_a_child_never_awaited_ends_with_its_parent_unless_abandoned(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """No orphan: a parent that returns without awaiting a started child cancels it; an
    abandoned one goes on."""
    app, _ = shop()

    @app.workflow("forgetful")
    async def forgetful(ctx: WorkflowContext, _: Any) -> str:
        await ctx.start_child("shipment", {"id": "kept", "seconds": 50})
        await ctx.start_child("shipment", {"id": "left", "seconds": 50}, on_parent_cancel="abandon")
        return "done"

    async with running(app, "memory://") as engine:
        await engine.start("forgetful", None, run_id="g")
        assert await engine.result("g") == "done"
        cancelled = await engine.get("g/1")
        assert await engine.result("g/2") == "shipped left"
    assert cancelled.status is RunStatus.CANCELLED
    assert cancelled.error == {
        "type": "RunCancelled",
        "message": "parent run 'g' ended (completed)",
        "cut": False,
    }
    assert trio.current_time() == 50.0


# --------------------------------------------------------------------------- remote workflows


async def test_a_remote_workflow_as_a_child(autojump_clock: trio.testing.MockClock) -> None:
    """The child is a remote workflow (its code on a workflow worker, run in turns)."""
    from test_remote_engine import ORDER, engine_app, worker_app

    executions: Counter[str] = Counter()
    app = engine_app()

    @app.workflow("parent")
    async def parent(ctx: WorkflowContext, order: dict[str, Any]) -> Any:
        return await ctx.child("order", order)

    async with (
        dt.open_backend("memory://") as backend,
        open_worker(worker_app(executions), backend),
        open_engine(app, backend) as engine,
    ):
        await engine.start("parent", ORDER, run_id="rp")
        output = await engine.result("rp")
        child = await engine.get("rp/1")
    assert output == {
        "receipt": "receipt-1",
        "items": ["reserved-a", "reserved-b"],
        "stamp": "stamp-1",
    }
    assert child.status is RunStatus.COMPLETED
    assert trio.current_time() == 10.0  # the remote child's durable timer
    assert executions["charge:1"] == 1


async def test_a_remote_workflow_starts_children(autojump_clock: trio.testing.MockClock) -> None:
    """A remote workflow (its code on a workflow worker, in turns) starts a local child and a
    remote one: each a ``child`` command the engine checkpoints and starts."""
    from test_remote_engine import ORDER, engine_app, worker_app

    executions: Counter[str] = Counter()
    worker = worker_app(executions)
    app = engine_app()

    @worker.workflow("spawner", remote=True)
    async def spawner(ctx: WorkflowContext, _: Any) -> Any:
        first = await ctx.start_child("order", ORDER)
        try:
            await ctx.child("explodes", None)
        except ChildFailed as failed:
            exploded = failed.error["message"]
        return [await first, exploded]

    app.remote_workflow("spawner")
    async with (
        dt.open_backend("memory://") as backend,
        open_worker(worker, backend),
        open_engine(app, backend) as engine,
    ):
        await engine.start("spawner", None, run_id="s")
        output = await engine.result("s")
        children = [await engine.get(r) for r in ("s/1", "s/2")]
        history = await engine.history("s")
    assert output == [
        {"receipt": "receipt-1", "items": ["reserved-a", "reserved-b"], "stamp": "stamp-1"},
        "boom in the workflow",
    ]
    assert [(c.workflow, c.status, c.parent) for c in children] == [
        ("order", RunStatus.COMPLETED, "s"),
        ("explodes", RunStatus.FAILED, "s"),
    ]
    assert [(s.kind, s.status) for s in history] == [
        (StepKind.CHILD, StepState.COMPLETED),
        (StepKind.CHILD, StepState.FAILED),
    ]
    assert executions["charge:1"] == 1


# --------------------------------------------------------------------------- stored parent link


async def test_sqlite_adds_the_parent_column_to_a_file_written_before_it(tmp_path: Path) -> None:
    import sqlite3

    from durable_trio._engine import RunRecord
    from durable_trio._engine._stores.sqlite import SqliteRunStore

    def record(run_id: str, parent: str | None) -> RunRecord:
        return RunRecord(run_id=run_id, workflow="w", input=None, status=RunStatus.PENDING,
                         created_at=0.0, updated_at=0.0, parent=parent)  # fmt: skip

    path = tmp_path / "old.db"
    store = await SqliteRunStore.open(path, "shop")
    await store.create_run(record("old", None))
    await store.aclose()
    db = sqlite3.connect(path)
    db.execute("ALTER TABLE dt_runs DROP COLUMN parent")
    db.commit()
    db.close()
    for n in range(2):  # and opening it again changes nothing
        store = await SqliteRunStore.open(path, "shop")
        try:
            old = await store.get_run("old")
            assert old is not None
            assert old.parent is None
            await store.create_run(record(f"old/{n}", "old"))
            child = await store.get_run(f"old/{n}")
            assert child is not None
            assert child.parent == "old"
        finally:
            await store.aclose()


@pytest.mark.parametrize("kind", ["redis", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_the_parent_link_on_a_server(kind: str, request: pytest.FixtureRequest) -> None:
    url = str(request.getfixturevalue("redis_url" if kind == "redis" else "postgres_schema_url"))
    async with dt.open_backend(url) as backend, dt.open_run_store(backend, "links") as store:
        from durable_trio._engine import RunRecord

        for run_id, parent in (("top", None), ("top/1", "top")):
            await store.create_run(
                RunRecord(
                    run_id=run_id,
                    workflow="w",
                    input=None,
                    status=RunStatus.PENDING,
                    created_at=0.0,
                    updated_at=0.0,
                    parent=parent,
                )
            )
        top, child = await store.get_run("top"), await store.get_run("top/1")
    assert top is not None
    assert child is not None
    assert (top.parent, child.parent) == (None, "top")


# --------------------------------------------------------------------------- the CLI


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_runs_show_names_parent_and_children_and_runs_cancel_cancels_the_children(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest
) -> None:
    """``runs show`` prints a child's parent and a parent's children; ``runs cancel`` (the
    operator's cancel, straight on the store) cancels the children too, recursively."""
    from durable_trio.cli._main import main

    url = f"sqlite:///{tmp_path / 'cli.db'}"
    if kind == "postgres":
        url = str(request.getfixturevalue("postgres_schema_url"))
    app, _ = shop()
    async with running(app, url) as engine:  # namespace: the app's name
        with trio.fail_after(30):
            await engine.start("order", {"id": "p1", "seconds": 0}, run_id="o1")
            await engine.result("o1")
            await engine.start("nested", {"id": "p", "seconds": 60}, run_id="n")
            while (await engine.store.get_run("n/1/1")) is None:  # noqa: ASYNC110
                await trio.sleep(0.01)

    def cli(*argv: str) -> tuple[int, str]:
        status = main([*argv, "--backend", url, "--namespace", "children"])
        return status, capsys.readouterr().out

    status, out = await trio.to_thread.run_sync(lambda: cli("runs", "show", "o1"))
    assert status == 0
    assert "children o1/1" in out
    status, out = await trio.to_thread.run_sync(lambda: cli("runs", "show", "o1/1", "--json"))
    assert json.loads(out)["parent"] == "o1"
    status, out = await trio.to_thread.run_sync(lambda: cli("runs", "cancel", "n"))
    assert status == 0
    async with dt.open_backend(url) as backend, dt.open_run_store(backend, "children") as store:
        runs = [await store.get_run(r) for r in ("n", "n/1", "n/1/1")]
    assert [r.status for r in runs if r is not None] == [RunStatus.CANCELLED] * 3


async def test_a_remote_parent_ending_cancels_a_child_it_never_awaited(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from test_remote_engine import engine_app, worker_app

    worker = worker_app(Counter())
    app = engine_app()

    @worker.workflow("forgetful", remote=True)
    async def forgetful(ctx: WorkflowContext, _: Any) -> str:
        await ctx.start_child("order", {"id": 9, "items": [], "wait": 100})
        await ctx.start_child(
            "order", {"id": 8, "items": [], "wait": 100}, on_parent_cancel="abandon"
        )
        return "done"

    app.remote_workflow("forgetful")
    async with (
        dt.open_backend("memory://") as backend,
        open_worker(worker, backend),
        open_engine(app, backend) as engine,
    ):
        await engine.start("forgetful", None, run_id="rf")
        assert await engine.result("rf") == "done"
        # A remote child's cancel is delivered inside it (its next turn raises RunCancelled):
        # it ends cancelled a moment after its parent.
        ended = trio.current_time()
        with trio.fail_after(60):
            cancelled = await wait_status(engine, "rf/1", RunStatus.CANCELLED)
        # Within a poll of the parent's end, not after the child's own 100 s wait: the cancel
        # woke the child's driver while its turn was in flight, and that wake is kept.
        assert trio.current_time() - ended < 1
        left = await engine.result("rf/2")
    assert cancelled.status is RunStatus.CANCELLED
    assert cancelled.error == {
        "type": "RunCancelled",
        "message": "parent run 'rf' ended",
        "cut": False,
    }
    assert left["receipt"] == "receipt-8"


# --------------------------------------------------------------------------- retry of a parent


def flaky_shop(broken: dict[str, bool]) -> App:
    """A parent whose child's step fails while ``broken["now"]`` (no retries)."""
    app = App("children")

    @app.step("ship")
    async def ship(parcel: str) -> str:
        await trio.sleep(1)
        if broken["now"]:
            raise RuntimeError("the depot is closed")
        return f"shipped {parcel}"

    @app.workflow("shipment")
    async def shipment(ctx: WorkflowContext, parcel: str) -> str:
        return str(await ctx.step("ship", parcel, retry=dt.Retry(max_attempts=1)))

    @app.workflow("order")
    async def order(ctx: WorkflowContext, parcel: str) -> str:
        return str(await ctx.child("shipment", parcel))

    return app


async def test_retrying_a_parent_failed_by_its_child_retries_the_child_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broken = {"now": True}
    async with running(flaky_shop(broken), "memory://") as engine:
        await engine.start("order", "p", run_id="o")
        with pytest.raises(dt.RunFailed):
            await engine.result("o")
        failed = await engine.get("o")
        assert failed.error["type"] == "ChildFailed"
        assert (failed.error["stepId"], failed.error["childRunId"]) == ("1", "o/1")
        assert trio.current_time() == 1.0
        broken["now"] = False
        await trio.sleep(9)
        reopened = await engine.retry("o")
        assert reopened.status is RunStatus.PENDING
        assert await engine.result("o") == "shipped p"
        assert trio.current_time() == 11.0  # the child's step once more, at once
        child = await engine.get("o/1")
        child_history = await engine.history("o/1")
        history = await engine.history("o")
    assert child.status is RunStatus.COMPLETED
    assert [(s.name, s.attempt, s.status) for s in child_history] == [
        ("ship", 2, StepState.COMPLETED)
    ]
    assert [(s.kind, s.attempt, s.status, s.output) for s in history] == [
        (StepKind.CHILD, 2, StepState.COMPLETED, "shipped p")
    ]


async def test_runs_retry_of_a_remote_parent_retries_its_failed_child(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The parent is a remote workflow (its code on a workflow worker); the child a local one
    of the engine, retried through ``Operations.retry_run`` (the CLI's ``runs retry``)."""
    broken = {"now": True}
    app = flaky_shop(broken)
    worker = App("children")  # the workflow worker's app: the parent's code

    @worker.workflow("remote-order", remote=True)
    async def remote_order(ctx: WorkflowContext, parcel: str) -> str:
        return str(await ctx.child("shipment", parcel))

    app.remote_workflow("remote-order")
    async with (
        dt.open_backend("memory://") as backend,
        open_worker(worker, backend),
        open_worker(app, backend),
        open_engine(app, backend, reconcile_interval=1) as engine,
        dt.open_operations(backend, namespace="children") as ops,
    ):
        await engine.start("remote-order", "q", run_id="r")
        with pytest.raises(dt.RunFailed), trio.fail_after(30):
            await engine.result("r")
        failed = await engine.get("r")
        assert (failed.error["stepId"], failed.error["childRunId"]) == ("1", "r/1")
        broken["now"] = False
        await ops.retry_run("r")
        assert (await engine.get("r/1")).status is RunStatus.PENDING
        with trio.fail_after(30):
            assert await engine.result("r") == "shipped q"
        assert (await engine.get("r/1")).status is RunStatus.COMPLETED


# --------------------------------------------------------------------------- a parent timed out


def _child_of(steps: list[Any]) -> str:
    [child] = [s.input["runId"] for s in steps if s.kind is StepKind.CHILD]
    return str(child)


async def test_a_parent_failed_by_its_run_timeout_cancels_its_child(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app, _ = shop()
    async with running(app, "memory://") as engine:
        await engine.start("order", {"id": "p", "seconds": 100}, run_id="t", timeout=10)
        with pytest.raises(dt.RunFailed) as failed:
            await engine.result("t")
        assert failed.value.error_type == "RunTimedOut"
        child = await engine.get(_child_of(await engine.history("t")))
        assert trio.current_time() == 10.0
    assert child.status is RunStatus.CANCELLED
    assert child.error is not None
    assert child.error["message"] == "parent run 't' timed out"


async def test_a_parent_found_past_its_timeout_after_a_restart_cancels_its_child(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The engine driving the parent stops before the deadline; the next one, opened after
    it, fails the parent at once and its child with it (no orphan across restarts)."""
    app, _ = shop()
    async with dt.open_backend("memory://") as backend:
        async with open_worker(app, backend):
            async with open_engine(app, backend, engine_id="first", release_on_close=False) as e1:
                await e1.start("order", {"id": "p", "seconds": 100}, run_id="t", timeout=10)
                await trio.sleep(2)
            await trio.sleep(30)  # past the deadline, and past the first engine's run lease
            async with open_engine(app, backend, engine_id="second") as e2:
                with pytest.raises(dt.RunFailed):
                    await e2.result("t")
                child = _child_of(await e2.history("t"))
                with pytest.raises(dt.RunCancelled):
                    await e2.result(child)
                assert (await e2.get(child)).status is RunStatus.CANCELLED
