"""Operations: run paging on every store, retry of a failed run (API and CLI), failed-job
repair, queue and worker views, the operator's CLI commands and their errors."""

from __future__ import annotations

import builtins
import json
import re
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trio

import durable_trio as dt
from durable_trio._engine._stores.memory import MemoryRunStore
from durable_trio._engine._stores.sqlite import SqliteRunStore
from durable_trio.brokers import Job
from durable_trio.brokers.memory import MemoryBroker
from durable_trio.brokers.sqlite import SqliteBroker
from durable_trio.cli._main import main
from helpers import made_sqlite_url, serve_until_done, set_aside_by_stalls

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


# -- paging on every store --------------------------------------------------------------------


@asynccontextmanager
async def _store(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    if kind == "memory":
        yield MemoryRunStore()
    elif kind == "sqlite":
        store = await SqliteRunStore.open(tmp_path / "runs.db", "shop")
        try:
            yield store
        finally:
            await store.aclose()
    elif kind == "redis-cluster":  # runs spread over the cluster's run shards
        from durable_trio._engine._stores.redis import RedisRunStore
        from durable_trio._redis import open_redis_cluster
        from durable_trio.backends.redis import CLUSTER_RUN_SHARDS

        async with open_redis_cluster(request.getfixturevalue("redis_cluster_url")) as cluster:
            yield RedisRunStore(cluster, "shop", shards=CLUSTER_RUN_SHARDS)
    elif kind == "postgres":  # a fresh schema on the private server
        import uuid

        from durable_trio._engine._stores.postgres import PostgresRunStore
        from durable_trio._postgres import open_pool

        async with open_pool(request.getfixturevalue("postgres_url"), size=2) as pool:
            schema = f"o_{uuid.uuid4().hex[:16]}"
            yield await PostgresRunStore.open(pool, schema, "shop")
    else:
        from durable_trio._engine._stores.redis import RedisRunStore
        from durable_trio._redis import open_redis

        async with open_redis(request.getfixturevalue("redis_url")) as client:
            yield RedisRunStore(client, "shop")


#: The run stores these operations run on (Redis Cluster's shards added where it matters).
STORE_KINDS = ["memory", "sqlite", "redis", pytest.param("postgres", marks=pytest.mark.postgres)]


def _record(run_id: str, workflow: str, status: dt.RunStatus = dt.RunStatus.PENDING) -> Any:
    return dt.RunRecord(run_id, workflow, None, status, 0.0, 0.0)


@pytest.mark.parametrize("kind", [*STORE_KINDS, "redis-cluster"])
async def test_pages_are_stable_newest_first_and_filtered(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    async with _store(kind, tmp_path, request) as store:
        for n in range(7):
            await store.create_run(_record(f"r{n}", "order" if n % 2 else "refund"))
        await store.create_run(_record("acme/r7", "order"))
        await store.finish_run("r1", dt.RunStatus.FAILED, error={"type": "X"})
        first = await store.page_runs(limit=3)
        assert [r.run_id for r in first.runs] == ["acme/r7", "r6", "r5"]
        assert first.next_cursor is not None
        await store.create_run(_record("late", "order"))  # arrives while someone pages
        second = await store.page_runs(limit=3, cursor=first.next_cursor)
        assert [r.run_id for r in second.runs] == ["r4", "r3", "r2"]
        third = await store.page_runs(limit=3, cursor=second.next_cursor)
        assert [r.run_id for r in third.runs] == ["r1", "r0"]
        assert third.next_cursor is None
        orders = await store.page_runs(workflow="order", limit=10)
        assert [r.run_id for r in orders.runs] == ["late", "acme/r7", "r5", "r3", "r1"]
        failed = await store.page_runs(status=dt.RunStatus.FAILED)
        assert [r.run_id for r in failed.runs] == ["r1"]
        tenant = await store.page_runs(tenant="acme")
        assert [r.run_id for r in tenant.runs] == ["acme/r7"]
        everything = await store.page_runs(since=0.0, limit=100)
        assert len(everything.runs) == 9
        assert (await store.page_runs(until=-1.0)).runs == []
        with pytest.raises(dt.ConfigError, match="cursor"):
            await store.page_runs(cursor="garbage")
        with pytest.raises(dt.ConfigError, match="limit"):
            await store.page_runs(limit=0)


@pytest.mark.parametrize("kind", [*STORE_KINDS[1:], "redis-cluster"])
async def test_a_deep_page_over_many_runs(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    async with _store(kind, tmp_path, request) as store:
        for n in range(600):
            await store.create_run(_record(f"r{n:04}", "order"))
        cursor = None
        seen: list[str] = []
        while True:
            page = await store.page_runs(limit=50, cursor=cursor)
            seen += [r.run_id for r in page.runs]
            cursor = page.next_cursor
            if cursor is None:
                break
        assert seen == [f"r{n:04}" for n in reversed(range(600))]


# -- retry ------------------------------------------------------------------------------------


def _app(counts: dict[str, int], failing: dict[str, bool]) -> dt.App:
    app = dt.App("shop")

    @app.step("reserve")
    async def reserve(x: int) -> int:
        counts["reserve"] += 1
        return x + 1

    @app.step("charge", retry=dt.Retry(max_attempts=2, initial=0.01, jitter=0))
    async def charge(x: int) -> int:
        counts["charge"] += 1
        if failing["charge"]:
            raise RuntimeError("card declined")
        return x * 10

    @app.workflow("order")
    async def order(ctx: dt.WorkflowContext, x: int) -> int:
        y = await ctx.step("reserve", x)

        def note() -> int:
            counts["note"] += 1
            return counts["note"]

        await ctx.run("note", note)
        await ctx.sleep(0.01)
        return int(await ctx.step("charge", y))

    return app


async def test_engine_retry_resumes_from_the_failed_step(autojump_clock: object) -> None:
    counts = {"reserve": 0, "charge": 0, "note": 0}
    failing = {"charge": True}
    app = _app(counts, failing)
    async with (
        dt.open_backend("memory://") as backend,
        dt.open_worker(app, backend),
        dt.open_engine(app, backend) as engine,
    ):
        run_id = await engine.start("order", 1)
        with pytest.raises(dt.RunFailed):
            await engine.result(run_id)
        assert counts == {"reserve": 1, "charge": 2, "note": 1}
        async with dt.open_operations(backend, namespace="shop") as ops:
            details = await ops.show_run(run_id)
            charge = details.steps[-1]
            assert charge.name == "charge"
            assert [a.attempt for a in charge.attempts] == [1, 2]
            assert charge.attempts[-1].error is not None
            assert len(details.timers) == 1
            assert details.timers[0].fired
            failing["charge"] = False
            await engine.retry(run_id)
            assert await engine.result(run_id) == 20
            # completed steps replayed, never re-run; the failed one ran once more
            assert counts == {"reserve": 1, "charge": 3, "note": 1}
            with pytest.raises(dt.RunNotRetryable, match="completed"):
                await ops.retry_run(run_id)
            with pytest.raises(dt.RunNotFound):
                await ops.retry_run("nope")
            with pytest.raises(dt.RunNotFound):
                await ops.show_run("nope")


async def test_a_retried_step_gets_a_fresh_budget_of_attempts(autojump_clock: object) -> None:
    counts = {"reserve": 0, "charge": 0, "note": 0}
    app = _app(counts, {"charge": True})
    async with (
        dt.open_backend("memory://") as backend,
        dt.open_worker(app, backend),
        dt.open_engine(app, backend) as engine,
    ):
        run_id = await engine.start("order", 1)
        with pytest.raises(dt.RunFailed):
            await engine.result(run_id)
        await engine.retry(run_id)
        with pytest.raises(dt.RunFailed, match="after 4 attempts"):
            await engine.result(run_id)
        assert counts["charge"] == 4  # 2, then 2 more


async def test_a_retried_step_starts_its_backoff_over(autojump_clock: object) -> None:
    """After an operator's retry the new attempts wait as the first ones did (initial, then
    initial * multiplier, ...), not as attempts 4, 5, ... of one long backoff would."""
    app = dt.App("shop")
    ran: list[float] = []

    @app.step("charge", retry=dt.Retry(max_attempts=3, initial=1, multiplier=10, jitter=0))
    async def charge(x: int) -> int:
        ran.append(trio.current_time())
        raise RuntimeError("card declined")

    @app.workflow("order")
    async def order(ctx: dt.WorkflowContext, x: int) -> int:
        return int(await ctx.step("charge", x))

    async with (
        dt.open_backend("memory://") as backend,
        dt.open_worker(app, backend),
        dt.open_engine(app, backend) as engine,
        dt.open_operations(backend, namespace="shop") as ops,
    ):
        start = trio.current_time()
        run_id = await engine.start("order", 1)
        with pytest.raises(dt.RunFailed, match="after 3 attempts"):
            await engine.result(run_id)
        assert [t - start for t in ran] == [0, 1, 11]
        await trio.sleep(100)
        retried = trio.current_time()
        await ops.retry_run(run_id)
        with pytest.raises(dt.RunFailed, match="after 6 attempts"):
            await engine.result(run_id)
        assert [t - retried for t in ran[3:]] == [0, 1, 11]  # (not 100 and 1,000 s later)


async def test_a_timed_out_run_is_retried_with_its_timeout_afresh(autojump_clock: object) -> None:
    app = dt.App("shop")
    gate = trio.Event()

    @app.step("slow")
    async def slow(x: int) -> int:
        await gate.wait()
        return x

    @app.workflow("waits")
    async def waits(ctx: dt.WorkflowContext, x: int) -> int:
        return int(await ctx.step("slow", x))

    async with (
        dt.open_backend("memory://") as backend,
        dt.open_worker(app, backend),
        dt.open_engine(app, backend) as engine,
    ):
        run_id = await engine.start("waits", 7, timeout=5.0)
        with pytest.raises(dt.RunTimedOut):
            await engine.result(run_id)
        gate.set()
        start = trio.current_time()
        reopened = await engine.retry(run_id)
        assert reopened.status is dt.RunStatus.PENDING
        assert reopened.deadline is not None
        assert reopened.deadline >= start + 5.0
        assert await engine.result(run_id) == 7


async def _failed_run_then_cli_retry(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    counts = {"reserve": 0, "charge": 0, "note": 0}
    failing = {"charge": True}
    app = _app(counts, failing)
    async with (
        dt.open_backend(url) as backend,
        dt.open_worker(app, backend),
        dt.open_engine(app, backend, reconcile_interval=0.05) as engine,
    ):
        run_id = await engine.start("order", 1)
        with pytest.raises(dt.RunFailed):
            await engine.result(run_id)
        assert counts == {"reserve": 1, "charge": 2, "note": 1}
        failing["charge"] = False
        argv = ["runs", "retry", run_id, "--backend", url, "--namespace", "shop"]
        # the CLI in a thread of its own: its own trio.run and its own backend connection
        assert await trio.to_thread.run_sync(main, argv) == 0
        assert "reopened" in capsys.readouterr().out
        with trio.fail_after(20):
            assert await engine.result(run_id) == 20
        assert counts == {"reserve": 1, "charge": 3, "note": 1}


async def test_cli_retry_on_sqlite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    await _failed_run_then_cli_retry(f"sqlite:///{tmp_path / 'ops.db'}", capsys)


async def test_cli_retry_on_redis(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    await _failed_run_then_cli_retry(redis_url, capsys)


@pytest.mark.postgres
async def test_cli_retry_on_postgres(
    postgres_schema_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await _failed_run_then_cli_retry(postgres_schema_url, capsys)


# -- failed jobs, queues, workers ---------------------------------------------------------------


async def _set_aside(broker: Any, queue: str, job_id: str) -> None:
    await broker.push_on(queue, Job(job_id, b'{"id": "x", "kind": "task", "payload": 1}'))
    claimed = await broker.pop_from(queue, worker="w1")
    assert claimed is not None
    assert await broker.retry_job(claimed.lease, queue)  # one counted attempt
    claimed = await broker.pop_from(queue, worker="w1")
    assert await broker.fail_job(claimed.lease, queue, "poison")


@pytest.mark.parametrize("kind", [*STORE_KINDS, "redis-cluster"])
async def test_failed_jobs_requeue_and_delete(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    async with _broker(kind, tmp_path, request) as broker:
        await _check_repair(broker)


@asynccontextmanager
async def _broker(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    if kind == "redis":
        from durable_trio.brokers.redis import RedisBroker

        async with RedisBroker.from_url(request.getfixturevalue("redis_url")) as redis:
            yield redis
        return
    if kind == "redis-cluster":
        from durable_trio.brokers.redis import RedisClusterBroker

        url = request.getfixturevalue("redis_cluster_url")
        async with RedisClusterBroker.from_url(url) as cluster:
            yield cluster
        return
    if kind == "postgres":  # a fresh schema on the private server
        import uuid

        from durable_trio.brokers.postgres import PostgresBroker

        url, schema = request.getfixturevalue("postgres_url"), f"o_{uuid.uuid4().hex[:16]}"
        async with PostgresBroker.open(url, schema=schema, pool_size=2) as pg:
            yield pg
        return
    broker: Any = MemoryBroker() if kind == "memory" else await SqliteBroker.open(tmp_path / "b.db")
    try:
        yield broker
    finally:
        await broker.aclose()


async def _check_repair(broker: Any) -> None:
    backend = dt.Backend("test://", broker)
    await _set_aside(broker, "shop:tasks:charge", "j1")
    await _set_aside(broker, "shop:tasks:mail", "j2")
    await broker.push_on("shop:tasks:mail", Job("j3", b"{}"))
    async with dt.open_operations(backend, namespace="shop") as ops:
        failed = await ops.failed_jobs()
        assert {(f.queue, f.job.id) for f in failed} == {
            ("shop:tasks:charge", "j1"),
            ("shop:tasks:mail", "j2"),
        }
        assert failed[0].job.attempts == 1
        assert failed[0].to_json()["kind"] == "task"
        queues = {q.queue: q for q in await ops.queues()}
        assert (queues["shop:tasks:mail"].ready, queues["shop:tasks:mail"].failed) == (1, 1)
        assert await ops.requeue_job("shop:tasks:charge", "j1")
        assert not await ops.requeue_job("shop:tasks:charge", "j1")
        again = await broker.pop_from("shop:tasks:charge")
        assert again is not None
        assert again.id == "j1"
        assert again.attempts == 0
        assert await ops.delete_job("shop:tasks:mail", "j2")
        assert not await ops.delete_job("shop:tasks:mail", "j2")
        assert await ops.failed_jobs("shop:tasks:mail") == []
        assert await ops.workers() == []


CHARGE = "shop:tasks:charge"


@pytest.mark.parametrize("kind", STORE_KINDS)
async def test_a_set_aside_job_requeued_runs_to_completion_and_a_deleted_one_is_gone(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Requeue of a REAL set-aside job: pending again with its attempts, stalls and stall
    history reset and its priority kept, and a worker runs it to completion; delete removes
    the other for good."""
    async with _broker(kind, tmp_path, request) as broker:
        backend = dt.Backend("test://", broker)
        async with (
            dt.open_queue_transport(backend, namespace="shop") as producer,
            dt.open_operations(backend, namespace="shop") as ops,
        ):
            kept = await set_aside_by_stalls(broker, producer, "charge", "kept")
            dropped = await set_aside_by_stalls(broker, producer, "charge", "dropped")
            failed = {f.job.id: f.job for f in await ops.failed_jobs(CHARGE)}
            assert set(failed) == {kept, dropped}
            evidence = failed[kept]
            assert (evidence.attempts, evidence.stalled_count) == (1, 2)
            assert [s.worker for s in evidence.stalls] == ["w-dead", "w-dead"]
            assert evidence.error == "stalled 2 times (max 1)"
            (view,) = [q for q in await ops.queues() if q.queue == CHARGE]
            assert (view.ready, view.claimed, view.failed, view.oldest_ready_age) == (0, 0, 2, None)

            assert await ops.requeue_job(CHARGE, kept)
            assert not await ops.requeue_job(CHARGE, kept)  # it is pending now, not failed
            (view,) = [q for q in await ops.queues() if q.queue == CHARGE]
            assert (view.ready, view.failed) == (1, 1)
            assert view.oldest_ready_age is not None
            assert 0 <= view.oldest_ready_age < 1  # pushed again, now
            again = await broker.pop_from(CHARGE, worker="look")
            assert (again.id, again.priority) == (kept, 7)
            assert (again.attempts, again.stalled_count, again.stalls) == (0, 0, ())
            assert await broker.retry_job(again.lease, CHARGE, count_attempt=False)

            assert await ops.delete_job(CHARGE, dropped)
            assert not await ops.delete_job(CHARGE, dropped)
            assert not await ops.requeue_job(CHARGE, dropped)

            assert await serve_until_done(backend, "charge", "charged") == ["kept"]
            assert await ops.failed_jobs(CHARGE) == []
            stats = await broker.queue_stats(CHARGE)
            assert (stats.ready, stats.delayed, stats.claimed, stats.failed) == (0, 0, 0, 0)
            result = await broker.pop_from("shop:results")  # its result, published
            assert result is not None
            assert b'"charged"' in result.data


async def test_workers_are_listed_once_whatever_their_groups(autojump_clock: object) -> None:
    app = _app({"reserve": 0, "charge": 0, "note": 0}, {"charge": False})
    async with dt.open_backend("memory://") as backend, dt.open_worker(app, backend):
        await trio.sleep(0.1)
        async with dt.open_operations(backend, namespace="shop") as ops:
            (worker,) = await ops.workers()
            assert set(worker.groups) == {"reserve", "charge"}
            assert worker.limit == 8
            assert worker.in_flight == 0
            views = {q.queue: q for q in await ops.queues()}
            assert views["shop:tasks:reserve"].live_workers == 1


# -- the CLI -----------------------------------------------------------------------------------


async def _populate(url: str) -> str:
    counts = {"reserve": 0, "charge": 0, "note": 0}
    app = _app(counts, {"charge": True})
    async with dt.open_backend(url) as backend:
        # reconcile=False: the detached runs stay pending (a reconciling engine takes a
        # detached start over at once).
        async with dt.open_worker(app, backend), dt.open_engine(
            app, backend, reconcile=False
        ) as engine:
            for n in range(3):
                await engine.start("order", n, run_id=f"done{n}", detach=True)
            run_id = await engine.start("order", 1, run_id="bad")
            with pytest.raises(dt.RunFailed):
                await engine.result(run_id)
        # once the worker has closed: a worker serving "charge" would take the job it pops
        await _set_aside(backend.broker, "shop:tasks:charge", "j1")
    return run_id


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


async def test_every_ops_command_on_sqlite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await _every_ops_command(f"sqlite:///{tmp_path / 'cli.db'}", capsys)


@pytest.mark.redis
async def test_every_ops_command_on_a_redis_cluster(
    redis_cluster_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI on a Cluster: runs paged across the run shards, failed jobs and queues listed
    from every master."""
    await _every_ops_command(redis_cluster_url, capsys)


@pytest.mark.postgres
async def test_every_ops_command_on_postgres(
    postgres_schema_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await _every_ops_command(postgres_schema_url, capsys)


async def _every_ops_command(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    await _populate(url)
    common = ["--backend", url, "--namespace", "shop"]

    def cli(*argv: str) -> tuple[int, str, str]:
        return _cli(capsys, *argv)

    async def run(*argv: str) -> tuple[int, str, str]:
        return await trio.to_thread.run_sync(lambda: cli(*argv))

    status, out, _ = await run("runs", "list", *common)
    assert status == 0
    assert out.splitlines()[1].startswith("bad ")
    status, out, _ = await run("runs", "list", "--limit", "2", "--json", *common)
    page = json.loads(out)
    assert [r["runId"] for r in page["runs"]] == ["bad", "done2"]
    status, out, _ = await run("runs", "list", "--cursor", page["nextCursor"], "--json", *common)
    assert [r["runId"] for r in json.loads(out)["runs"]] == ["done1", "done0"]
    status, out, _ = await run("runs", "list", "--status", "failed", "--json", *common)
    assert [r["runId"] for r in json.loads(out)["runs"]] == ["bad"]
    status, out, _ = await run("runs", "list", "--since", "2000-01-01", "--json", *common)
    assert len(json.loads(out)["runs"]) == 4
    status, out, _ = await run("runs", "show", "bad", *common)
    assert status == 0
    assert "charge" in out
    assert "card declined" in out
    status, out, _ = await run("runs", "show", "bad", "--json", *common)
    assert json.loads(out)["steps"][0]["name"] == "reserve"
    status, out, err = await run("runs", "show", "nope", *common)
    assert status == 2
    assert err == "error: no run 'nope' in the run store\n"
    status, out, _ = await run("runs", "cancel", "done0", *common)
    assert status == 0
    assert "cancelled" in out
    status, out, _ = await run("runs", "cancel", "done0", *common)
    assert status == 1
    assert "already ended" in out
    status, out, err = await run("runs", "retry", "done1", *common)
    assert status == 2
    assert "not failed" in err
    status, out, _ = await run("runs", "retry", "bad", "--json", *common)
    assert json.loads(out) == {"runId": "bad", "status": "pending"}
    status, out, _ = await run("jobs", "failed", *common)
    assert status == 0
    assert "j1" in out
    assert "poison" in out
    status, out, _ = await run("jobs", "failed", "--queue", "shop:tasks:charge", "--json", *common)
    assert [j["id"] for j in json.loads(out)] == ["j1"]
    status, out, _ = await run("queues", *common)
    assert status == 0
    assert "shop:tasks:charge" in out
    status, out, _ = await run("queues", "--json", *common)
    assert {q["queue"]: q["failed"] for q in json.loads(out)}["shop:tasks:charge"] == 1
    status, out, _ = await run("jobs", "requeue", "shop:tasks:charge", "j1", *common)
    assert status == 0
    assert "requeued" in out
    status, out, _ = await run("jobs", "delete", "shop:tasks:charge", "j1", *common)
    assert status == 1
    assert "is not failed" in out


async def test_cli_requeue_and_delete_of_real_set_aside_jobs_on_sqlite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``durable-trio jobs requeue | delete`` on jobs a stalled worker left set aside: the
    requeued one shows as ready with an age in ``queues`` and a worker runs it; the deleted
    one is gone from ``jobs failed``."""
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    common = ["--backend", url, "--namespace", "shop"]

    async def run(*argv: str) -> tuple[int, str, str]:
        return await trio.to_thread.run_sync(lambda: _cli(capsys, *argv, *common))

    async with dt.open_backend(url) as backend:
        async with dt.open_queue_transport(backend, namespace="shop") as producer:
            kept = await set_aside_by_stalls(backend.broker, producer, "charge", "kept")
            dropped = await set_aside_by_stalls(backend.broker, producer, "charge", "dropped")
        status, out, _ = await run("jobs", "failed", "--queue", CHARGE, "--json")
        assert status == 0
        listed = {j["id"]: j for j in json.loads(out)}
        assert set(listed) == {kept, dropped}
        assert [s["worker"] for s in listed[kept]["stalls"]] == ["w-dead", "w-dead"]
        status, out, _ = await run("queues", "--json")
        (row,) = [q for q in json.loads(out) if q["queue"] == CHARGE]
        assert (row["ready"], row["failed"], row["oldestReadyAge"]) == (0, 2, None)

        status, out, _ = await run("jobs", "requeue", CHARGE, kept)
        assert (status, out) == (0, f"job {kept} requeued\n")
        status, out, _ = await run("jobs", "delete", CHARGE, dropped)
        assert (status, out) == (0, f"job {dropped} deleted\n")
        status, out, _ = await run("jobs", "delete", CHARGE, dropped)
        assert (status, out) == (1, f"job {dropped} is not failed on {CHARGE}\n")
        status, out, _ = await run("queues", "--json")
        (row,) = [q for q in json.loads(out) if q["queue"] == CHARGE]
        assert (row["ready"], row["failed"]) == (1, 0)
        assert 0 <= row["oldestReadyAge"] < 5
        status, out, _ = await run("queues")
        (line,) = [x for x in out.splitlines() if x.startswith(CHARGE)]
        assert re.search(r" \d+\.\d{3} s$", line), line  # the age, in seconds

        assert await serve_until_done(backend, "charge", "charged") == ["kept"]
        status, out, _ = await run("jobs", "failed", "--queue", CHARGE, "--json")
        assert json.loads(out) == []


def test_ops_commands_refuse_memory(capsys: pytest.CaptureFixture[str]) -> None:
    """A memory:// store in the command's own process is empty: refused, not "no runs"
    (docs/decisions.md, "The operator's commands refuse memory://")."""
    for argv in (["runs", "list"], ["jobs", "failed"], ["queues"]):
        status, out, err = _cli(capsys, *argv, "--backend", "memory://")
        assert (status, out) == (2, "")
        assert err.startswith(f"error: {' '.join(argv)}: memory:// is a store of one process")


def _empty_store(tmp_path: Path) -> str:
    """The URL of an existing SQLite store holding nothing (what memory:// read as before)."""
    return made_sqlite_url(tmp_path / "empty.db")


# -- errors a person can act on -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["runs", "list", "--backend", "nope://x"], "unknown backend URL scheme"),
        (["runs", "list", "--backend", "memory://", "--status", "odd"], "unknown run status"),
        (["runs", "list", "--backend", "memory://", "--cursor", "x"], "not a run list cursor"),
        (["runs", "list", "--backend", "memory://", "--since", "yesterday"], "not a time"),
        (["queues", "--backend", "memory://", "--app", "no_such_module_x:app"], "cannot import"),
        (["health", "--backend", "memory://", "--app", "json:dumps"], "not a durable_trio App"),
    ],
)
def test_user_errors_are_one_line(
    argv: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = _empty_store(tmp_path)
    status, _, err = _cli(capsys, *[url if arg == "memory://" else arg for arg in argv])
    assert status == 2
    assert expected in err
    assert len(err.strip().splitlines()) == 1


def test_a_missing_sqlite_folder_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    status, _, err = _cli(capsys, "runs", "list", "--backend", f"sqlite:///{blocker}/sub/x.db")
    assert status == 2
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("error: ")


@pytest.mark.parametrize(
    "argv",
    [
        ("runs", "list"),
        ("runs", "show", "r-1"),
        ("jobs", "failed"),
        ("queues",),
        ("health",),
        ("console",),
    ],
    ids=" ".join,
)
def test_a_command_that_reads_makes_no_database_at_a_mistyped_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]
) -> None:
    # A typo in the path is said: no new empty database (nor its folder) that then reads as
    # "no runs" or "no live workers".
    typo = tmp_path / "var" / "lib" / "shop" / "durabel.db"
    status, out, err = _cli(capsys, *argv, "--backend", f"sqlite:///{typo}")
    assert (status, out) == (2, "")
    assert err == (
        f"error: no SQLite database at '{typo}': check the path (the workers and engines given"
        " this URL make the file)\n"
    )
    assert not (tmp_path / "var").exists()


async def test_existing_opens_a_database_that_is_there_and_refuses_a_folder(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'shop.db'}"
    with pytest.raises(dt.ConfigError, match="no SQLite database at"):
        async with dt.open_backend(url, existing=True):
            pass
    async with dt.open_backend(url):  # what a worker or an engine does: makes it
        pass
    async with dt.open_operations(url, existing=True) as ops:
        assert list((await ops.list_runs()).runs) == []
    (tmp_path / "folder.db").mkdir()
    with pytest.raises(dt.ConfigError, match=r"folder\.db' \(a folder is there\)"):
        async with dt.open_backend(f"sqlite:///{tmp_path / 'folder.db'}", existing=True):
            pass
    async with dt.open_backend("memory://", existing=True):  # no file: nothing to check
        pass


def test_health_watch_without_rich_honours_iterations(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = _empty_store(tmp_path)
    real_import = builtins.__import__

    def no_rich(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("rich"):
            raise ImportError("no rich here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_rich)
    argv = ["health", "--backend", url, "--watch", "--interval", "0.01"]
    status, out, _ = _cli(capsys, *argv, "--iterations", "2")
    assert status == 0
    assert out.count("no live workers") == 2


def test_health_takes_the_namespace_of_the_app(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "ops_app_mod.py").write_text("import durable_trio as dt\napp = dt.App('shop')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    url = _empty_store(tmp_path)
    status, out, _ = _cli(capsys, "health", "--backend", url, "--app", "ops_app_mod:app")
    assert status == 0
    assert "'shop'" in out
    monkeypatch.setenv("DURABLE_TRIO_NAMESPACE", "billing")
    status, out, _ = _cli(capsys, "health", "--backend", url)
    assert status == 0
    assert "'billing'" in out


async def test_prometheus_has_queues_set_aside_jobs_and_runs(autojump_clock: object) -> None:
    from durable_trio.cli._health import HealthReader, _scrape

    counts = {"reserve": 0, "charge": 0, "note": 0}
    app = _app(counts, {"charge": True})
    async with (
        dt.open_backend("memory://") as backend,
        dt.open_worker(app, backend),
        dt.open_engine(app, backend) as engine,
    ):
        run_id = await engine.start("order", 1)
        with pytest.raises(dt.RunFailed):
            await engine.result(run_id)
        await _set_aside(backend.broker, "shop:tasks:charge", "j1")
        async with dt.open_operations(backend, namespace="shop") as ops:
            text = (await _scrape(HealthReader(backend, "shop", ops))).decode()
    assert 'durable_trio_runs{status="failed"} 1' in text
    assert 'durable_trio_runs{status="completed"} 0' in text
    assert 'durable_trio_queue_jobs{queue="shop:tasks:charge",state="failed"} 1' in text
    assert 'durable_trio_queue_jobs{queue="shop:tasks:reserve",state="ready"} 0' in text
    assert text.count('durable_trio_worker_limit{instance="') == 1  # once, for two groups


def test_the_python_block_of_docs_operations_runs() -> None:
    page = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.DOTALL)
    assert len(blocks) == 3  # "From Python", "Generations", "Updates": each a whole program
    for block in blocks:
        exec(compile(block, "docs/operations.md", "exec"), {"__name__": "__main__"})


def test_engine_commands_name_a_missing_attribute_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "ops_app_two.py").write_text("import durable_trio as dt\napp = dt.App('shop')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for command in ("worker", "engine"):
        status, _, err = _cli(capsys, command, "ops_app_two:missing", "--backend", "memory://")
        assert status == 2
        assert err == "error: module 'ops_app_two' has no attribute 'missing' (say MODULE:app)\n"
    status, _, err = _cli(capsys, "worker", "no_such_module_y:app", "--backend", "memory://")
    assert status == 2
    assert err.startswith("error: cannot import 'no_such_module_y'")


def test_redis_without_hiredis_says_which_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    for name in list(sys.modules):
        if name == "hiredis" or name.startswith(
            ("durable_trio.backends.redis", "durable_trio._redis", "durable_trio.brokers.redis")
        ):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "hiredis", None)  # an import of it fails
    status, _, err = _cli(capsys, "queues", "--backend", "redis://127.0.0.1:1/0")
    assert status == 2
    assert "pip install 'durable_trio[redis]'" in err


def test_an_unreachable_server_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = _cli(capsys, "runs", "list", "--backend", "redis://127.0.0.1:1/0")
    assert status == 2
    assert err.startswith("error: ")
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("kind", STORE_KINDS)
async def test_reopen_and_count_on_every_store(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    async with _store(kind, tmp_path, request) as store:
        await store.create_run(_record("a", "order"))
        await store.create_run(_record("b", "order"))
        step = dt.StepRecord("a", "1", dt.StepKind.REMOTE, "charge", dt.StepState.PENDING)
        await store.begin_step(step)
        failed = dt.StepRecord(
            "a", "1", dt.StepKind.REMOTE, "charge", dt.StepState.FAILED, error={"m": "x"}
        )
        assert await store.update_step(failed, expect_attempt=1) is dt.Applied.APPLIED
        await store.finish_run("a", dt.RunStatus.FAILED, error={"type": "StepFailed"})
        assert await store.count_runs() == {dt.RunStatus.FAILED: 1, dt.RunStatus.PENDING: 1}
        assert not await store.reopen_run("b", [], run_timeout=None)  # not failed
        again = dt.StepRecord(
            "a", "1", dt.StepKind.REMOTE, "charge", dt.StepState.PENDING, attempt=2
        )
        assert await store.reopen_run("a", [again], run_timeout=30.0)
        run = await store.get_run("a")
        assert run is not None
        assert (run.status, run.error, run.owner, run.timeout) == (
            dt.RunStatus.PENDING, None, None, 30.0
        )  # fmt: skip
        (stored,) = await store.get_steps("a")
        assert (stored.status, stored.attempt) == (dt.StepState.PENDING, 2)
        assert {r.run_id for r in await store.claim_runs("e1", 30.0)} == {"a", "b"}
        assert await store.count_runs() == {dt.RunStatus.RUNNING: 2}


def test_a_job_set_aside_after_its_run_ended_is_labelled_with_the_runs_status(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The broker gave up on a task whose run had completed already (another claim answered
    while the first one's worker was blocked): ``jobs failed`` used to list it like a live
    failure. It now names its run and the run's status, from the run store."""
    url = f"sqlite:///{tmp_path / 'ops.db'}"

    async def setup() -> None:
        async with (
            dt.open_backend(url) as backend,
            dt.open_queue_transport(backend, namespace="shop") as producer,
            dt.open_operations(backend, namespace="shop", existing=False) as ops,
        ):
            now = ops.store.now()
            run = dt.RunRecord("r", "order", 1, dt.RunStatus.PENDING, now, now)
            await ops.store.create_run(run)
            assert await ops.store.finish_run("r", dt.RunStatus.COMPLETED, output=2)
            await set_aside_by_stalls(backend.broker, producer, "charge", "1")
            (view,) = await ops.failed_jobs()
            assert (view.run_id, view.run_status) == ("r", "completed")
            assert view.to_json()["runStatus"] == "completed"

    trio.run(setup)
    assert main(["jobs", "failed", "--backend", url, "--namespace", "shop"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[-1] == "run"
    assert out.splitlines()[1].endswith("r (completed)")


@pytest.mark.postgres
@pytest.mark.parametrize(
    "argv", [("runs", "list"), ("queues",), ("health",), ("jobs", "failed")], ids=" ".join
)
def test_a_command_that_reads_makes_no_tables_in_a_mistyped_postgres_schema(
    postgres_url: str, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]
) -> None:
    # As for a SQLite path: a typo in the schema is said, not answered "no runs" from a new,
    # empty schema the read made.
    typo = f"shpo_{uuid.uuid4().hex[:8]}"
    status, out, err = _cli(capsys, *argv, "--backend", f"{postgres_url}?schema={typo}")
    assert (status, out) == (2, "")
    assert err.startswith(f"error: no durable_trio tables in the schema '{typo}' of ")
    assert "check the URL's database and schema=" in err
    assert err.count("\n") == 1


@pytest.mark.postgres
async def test_existing_opens_a_postgres_schema_that_holds_the_tables(postgres_url: str) -> None:
    url = f"{postgres_url}?schema=e_{uuid.uuid4().hex[:10]}"
    with pytest.raises(dt.ConfigError, match="no durable_trio tables in the schema"):
        async with dt.open_backend(url, existing=True):
            pass
    async with dt.open_backend(url):  # what a worker or an engine does: makes them
        pass
    async with dt.open_backend(url, existing=True) as backend:
        assert await backend.run_stores.namespaces() == []
