"""Streaming (issue 34, item 7): ``await dt.step_info().emit(v)`` and ``await ctx.emit(v)``
publish partial results; ``engine.stream(run_id)`` reads them as they come, from any process.
Exact virtual-time tests on every run store (tests/_every_store.py)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from _every_store import open_store
from durable_trio._engine import App, WorkflowContext, _stream, open_engine, open_worker
from durable_trio._engine._stream import STREAM_LOG, append_entry, emitter_of, fixed_store


def streaming_app(name: str) -> App:
    app = App(name)

    @app.step("produce")
    async def produce(n: int) -> int:
        for i in range(n):
            if i:
                await trio.sleep(1)
            await dt.step_info().emit({"part": i})
        return n

    @app.workflow("report")
    async def report(ctx: WorkflowContext, n: int) -> str:
        await ctx.step("produce", n)
        await ctx.emit("done")
        await ctx.sleep(4.5)  # the run ends at 6.5 s: between two polls of a reader
        return "ok"

    return app


async def read_all(engine: dt.Engine, run_id: str, start: float, after: int = 0) -> list[Any]:
    return [
        (e.seq, e.value, trio.current_time() - start)
        async for e in engine.stream(run_id, after=after)
    ]


async def test_a_step_and_a_workflow_stream_read_as_they_come_from_another_engine(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    app = streaming_app("stream-exact")
    async with open_store(every_store, app.name) as (backend, store):
        async with (
            open_worker(app, backend),
            open_engine(app, backend, store=store, engine_id="a") as engine,
            open_engine(app, backend, store=store, engine_id="b", reconcile=False) as reader,
        ):
            start = trio.current_time()
            run_id = await engine.start("report", 3)
            got = await read_all(reader, run_id, start)  # the store's ring, not the driver's
            # The reader ends at its first poll after the run's end (6.5 s): 7 s.
            assert trio.current_time() - start == 7
            assert await engine.result(run_id) == "ok"
            # Read again after the run ended: the whole stream at once, then the end.
            again = await read_all(reader, run_id, start)
            assert trio.current_time() - start == 7
            rest = await read_all(reader, run_id, start, after=2)
            async with dt.open_operations(backend, namespace=app.name) as ops:  # its own store
                by_ops = [(e.seq, e.value) async for e in ops.stream(run_id, after=3)]
                assert trio.current_time() - start == 7
    assert got == [(1, {"part": 0}, 0), (2, {"part": 1}, 1), (3, {"part": 2}, 2), (4, "done", 2)]
    assert again == [(s, v, 7) for s, v, _ in got]
    assert rest == [(s, v, 7) for s, v, _ in got[2:]]
    assert by_ops == [(4, "done")]


async def test_a_replay_after_an_engine_restart_and_a_redelivery_do_not_duplicate(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    app = App("stream-replay")

    @app.workflow("twice")
    async def twice(ctx: WorkflowContext, _: Any) -> None:
        await ctx.emit("a")
        await ctx.sleep(10)
        await ctx.emit("b")

    async with open_store(every_store, app.name) as (backend, store):
        start = trio.current_time()
        async with open_engine(app, backend, store=store, engine_id="a") as engine:
            run_id = await engine.start("twice", None)
            await trio.sleep(1)
        # Engine "a" is gone; "b" takes the run over and replays ``ctx.emit("a")``.
        async with open_engine(app, backend, store=store, engine_id="b") as engine:
            await engine.result(run_id)
            assert trio.current_time() - start == 10
            got = [(e.seq, e.value) async for e in engine.stream(run_id)]
        # The replay appended nothing: "b" is the log's second entry.
        assert got == [(1, "a"), (2, "b")]

        # An append delivered twice (a crash between a workflow's append and its checkpoint,
        # a step attempt redelivered after a worker died) is one value to a reader.
        async with open_engine(app, backend, store=store, engine_id="c") as engine:
            run_id = await engine.start("twice", None)
            await trio.sleep(1)
            assert await append_entry(store, run_id, "w:1", "a") == 2  # the replayed emit
            first = emitter_of(lambda: fixed_store(store), run_id, "s", 1)
            redelivered = emitter_of(lambda: fixed_store(store), run_id, "s", 1)
            retry = emitter_of(lambda: fixed_store(store), run_id, "s", 2)
            for emit in (first, redelivered):
                await emit("x")
                await emit("y")
            await retry("x")
            await engine.result(run_id)
            got = [(e.seq, e.value) async for e in engine.stream(run_id)]
    assert got == [(1, "a"), (3, "x"), (4, "y"), (7, "x"), (8, "b")]


async def test_the_bound_and_prune_on_every_store(
    every_store: str, store_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_stream, "MAX_STREAM_ENTRIES", 3)
    app = App("stream-bound")
    refused: list[str] = []

    @app.step("many")
    async def many(_: Any) -> None:
        for i in range(3):
            await dt.step_info().emit(i)
        try:
            await dt.step_info().emit(3)
        except dt.StreamFull as exc:
            refused.append(str(exc))
        try:
            await dt.step_info().emit("x" * (_stream.MAX_STREAM_VALUE_BYTES + 1))
        except dt.StreamValueTooLarge as exc:
            refused.append(type(exc).__name__)

    @app.workflow("bounded")
    async def bounded(ctx: WorkflowContext, _: Any) -> None:
        await ctx.step("many", None)

    async with open_store(every_store, app.name) as (backend, store):
        async with open_worker(app, backend), open_engine(app, backend, store=store) as engine:
            start = trio.current_time()
            run_id = await engine.start("bounded", None)
            await engine.result(run_id)
            got = [(e.seq, e.value) async for e in engine.stream(run_id)]
            assert trio.current_time() - start == 0
            # Kept after the run ended, until retention deletes the run: then gone with it.
            assert await store.read_signal(run_id, STREAM_LOG, 1) is not None
            assert await store.prune_finished(store.now() + 1) == [run_id]
            assert await store.read_signal(run_id, STREAM_LOG, 1) is None
            with pytest.raises(dt.RunNotFound):
                async for _ in engine.stream(run_id):
                    pass  # pragma: no cover
            with pytest.raises(dt.StreamError, match="unknown or has finished"):
                await append_entry(store, run_id, "w:9", 1)
    assert got == [(1, 0), (2, 1), (3, 2)]
    assert refused == [f"the stream of run {run_id!r} holds 3 entries: no further value is kept",
                       "StreamValueTooLarge"]  # fmt: skip


async def test_emit_outside_a_streaming_step_and_bad_values(
    autojump_clock: trio.testing.MockClock,
) -> None:
    info = dt.StepInfo("r", "1", 1, "s", "remote")
    with pytest.raises(dt.StreamError, match="cannot emit"):
        await info.emit(1)
    with pytest.raises(dt.PayloadError):
        await info.emit(object())
    app = App("stream-local")

    @app.workflow("local")
    async def local(ctx: WorkflowContext, _: Any) -> None:
        async def part() -> None:
            await dt.step_info().emit("from a local step")

        await ctx.run("part", part)
        with pytest.raises(dt.PayloadError):
            ctx.emit(object())

    async with dt.open_backend("memory://") as backend, open_engine(app, backend) as engine:
        run_id = await engine.start("local", None)
        await engine.result(run_id)
        assert [e.value async for e in engine.stream(run_id)] == ["from a local step"]
        with pytest.raises(dt.RunNotFound):
            async for _ in engine.stream("nope"):
                pass  # pragma: no cover
        # The stream's log name is reserved: no signal nor event of that name.
        with pytest.raises(dt.ConfigError, match="reserved"):
            await engine.signal(run_id, "durable_trio.stream", 1)
        async with dt.open_operations(backend, namespace=app.name) as ops:
            with pytest.raises(dt.ConfigError, match="reserved"):
                await ops.signal_run(run_id, "durable_trio.stream", 1)

    @app.workflow("reserved")
    async def reserved(ctx: WorkflowContext, _: Any) -> None:
        with pytest.raises(dt.ConfigError, match="reserved"):
            ctx.set_event("durable_trio.stream", 1)
        with pytest.raises(dt.ConfigError, match="reserved"):
            ctx.wait_signal("durable_trio.stream")

    async with dt.open_backend("memory://") as backend, open_engine(app, backend) as engine:
        await engine.result(await engine.start("reserved", None))


@pytest.mark.redis
async def test_streams_on_a_redis_cluster_each_beside_its_run(redis_cluster_url: str) -> None:
    from durable_trio._engine._stores.redis import RedisRunStore
    from durable_trio._redis import open_redis_cluster
    from durable_trio.backends.redis import CLUSTER_RUN_SHARDS

    async with open_redis_cluster(redis_cluster_url) as client:
        namespace = f"stream-{uuid.uuid4().hex[:8]}"
        store = RedisRunStore(client, namespace, shards=CLUSTER_RUN_SHARDS)
        ids = [f"r{n}" for n in range(8)]  # spread over the run shards, so over the masters
        for run_id in ids:
            await store.create_run(dt.RunRecord(run_id, "w", None, dt.RunStatus.RUNNING, 0, 0))
            for value in (run_id, 1, run_id):
                await append_entry(store, run_id, f"w:{value}", value)
            await store.finish_run(run_id, dt.RunStatus.COMPLETED)
        for run_id in ids:
            got = [(e.seq, e.value) async for e in _stream.read_stream(store, run_id)]
            assert got == [(1, run_id), (2, 1)]
        assert sorted(await store.prune_finished(store.now() + 1, limit=100)) == ids
        for run_id in ids:
            assert await store.read_signal(run_id, STREAM_LOG, 1) is None


async def test_a_remote_workflow_emits_once_per_call_and_past_the_bound_drops(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_stream, "MAX_STREAM_ENTRIES", 2)
    app = App("stream-remote")

    @app.step("one")
    async def one(_: Any) -> int:
        return 1

    @app.workflow("far", remote=True)
    async def far(ctx: WorkflowContext, _: Any) -> int:
        await ctx.emit("start")
        n = await ctx.step("one", None)  # a second turn replays the first emit
        await ctx.emit(n)
        await ctx.emit("dropped")
        return int(n)

    async with (
        dt.open_backend("memory://") as backend,
        open_worker(app, backend),
        open_engine(app, backend) as engine,
    ):
        run_id = await engine.start("far", None)
        assert await engine.result(run_id) == 1
        assert [(e.seq, e.value) async for e in engine.stream(run_id)] == [(1, "start"), (2, 1)]
        assert engine.statistics().stream_values_dropped == 1


async def test_a_plain_def_step_in_a_thread_emits_through_trio(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = App("stream-thread")

    @app.step("sync")
    def sync(n: int) -> int:
        for i in range(n):
            trio.from_thread.run(dt.step_info().emit, i)
        return n

    @app.workflow("w")
    async def w(ctx: WorkflowContext, n: int) -> int:
        return int(await ctx.step("sync", n))

    async with (
        dt.open_backend("memory://") as backend,
        open_worker(app, backend),
        open_engine(app, backend) as engine,
    ):
        run_id = await engine.start("w", 2)
        assert await engine.result(run_id) == 2
        assert [e.value async for e in engine.stream(run_id)] == [0, 1]


async def test_a_worker_without_a_run_store_refuses_emits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    lazy = _stream.LazyStore(None)  # a tenant pod's worker
    async with _stream.serving(lazy):
        with pytest.raises(dt.StreamError, match="no run store"):
            await lazy.get()
    with pytest.raises(dt.StreamError, match="not serving"):
        await _stream.LazyStore(None).get()
