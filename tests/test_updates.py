"""Updates (issue 34, item 6): ``ctx.on_update`` handlers run inside the workflow and return a
value to ``await engine.update(run_id, name, payload)``; rejections raise in the caller. Exact
virtual-time tests on every run store (tests/_every_store.py)."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from _every_store import open_store
from durable_trio._engine import App, WorkflowContext, open_engine
from durable_trio._engine._context import UPDATE_DONE, UPDATE_LOG


def cart_app(name: str) -> App:
    app = App(name)

    @app.workflow("cart")
    async def cart(ctx: WorkflowContext, _: Any) -> list[Any]:
        items: list[Any] = []

        def check(item: Any) -> None:
            if not isinstance(item, str):
                raise ValueError("an item is a name")

        def add(item: str) -> int:
            items.append(item)
            return len(items)

        ctx.on_update("add", add, validate=check)

        def boom(_: Any) -> None:
            items.append("half")
            raise RuntimeError("no")

        ctx.on_update("boom", boom)

        await ctx.sleep(5)
        items.append("slept")
        await ctx.wait_signal("checkout")
        return items

    return app


async def test_updates_return_values_and_rejections_raise_in_the_caller(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    app = cart_app("upd-exact")
    async with open_store(every_store, app.name) as (backend, store):
        async with (
            open_engine(app, backend, store=store, engine_id="a") as engine,
            open_engine(app, backend, store=store, engine_id="b", reconcile=False) as caller,
        ):
            start = trio.current_time()
            run_id = await engine.start("cart", None)
            assert await caller.update(run_id, "add", "apple") == 1  # another engine: the ring
            assert trio.current_time() - start == 0
            with pytest.raises(dt.UpdateRejected, match="an item is a name"):
                await engine.update(run_id, "add", 3)
            with pytest.raises(dt.UpdateRejected, match="no update 'nope'"):
                await engine.update(run_id, "nope")
            with pytest.raises(dt.UpdateFailed, match="RuntimeError: no") as failed:
                await engine.update(run_id, "boom")
            assert failed.value.error_type == "RuntimeError"
            await trio.sleep(7)
            assert await caller.update(run_id, "add", "pear", update_id="u1") == 4
            assert await caller.update(run_id, "add", "pear", update_id="u1") == 4  # once
            assert trio.current_time() - start == 7
            with pytest.raises(dt.UpdateTimeout):
                await caller.update(run_id, "add", "late", update_id="u2", timeout=0)
            # u2 stays in the run's log past its caller's timeout: a call again gets its
            # outcome. (Awaited before the signal: an update and a signal sent one after the
            # other are not ordered, the workflow may see the signal first; docs/engine.md.)
            assert await caller.update(run_id, "add", "late", update_id="u2") == 5
            await engine.signal(run_id, "checkout")
            assert await engine.result(run_id) == ["apple", "half", "slept", "pear", "late"]
            assert trio.current_time() - start == 7
            assert await caller.update(run_id, "add", "late", update_id="u2") == 5  # recorded
            with pytest.raises(dt.UpdateRejected, match="completed"):
                await caller.update(run_id, "add", "after")
            with pytest.raises(dt.RunNotFound):
                await caller.update("no-such-run", "add", "x")
            # Nothing in the workflow's history: its timer and its signal only.
            kinds = [record.kind.value for record in await engine.history(run_id)]
            assert kinds == ["timer", "signal"]
            with pytest.raises(dt.ConfigError, match="reserved"):
                await engine.signal(run_id, UPDATE_LOG)
            assert await store.read_signal(run_id, UPDATE_DONE, 8) is None


async def test_a_run_started_here_reads_its_requests_only_when_rung(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    """Issue 32: a run started by this engine has its wakes watched since before its create (a
    request is appended only to a run that exists, and its append rings), so its request log
    is not read at its start; an update still lands at once, from here or from another
    engine. A run taken over (its history replayed) still reads its log first."""
    app = cart_app("upd-fresh")
    async with open_store(every_store, app.name) as (backend, store):
        reads: list[tuple[str, int]] = []
        read = store.read_signal

        async def counted(run_id: str, name: str, seq: int) -> str | None:
            if name == UPDATE_LOG:
                reads.append((run_id, seq))
            text: str | None = await read(run_id, name, seq)
            return text

        store.read_signal = counted
        everyone = 0  # a (re)subscription to the store's wakes wakes every waiter: they read
        wake = store.wakes.wake

        def counted_wake(keys: Any) -> None:
            nonlocal everyone
            everyone += keys is None
            wake(keys)

        store.wakes.wake = counted_wake
        start = trio.current_time()
        async with (
            open_engine(app, backend, store=store, engine_id="a") as engine,
            open_engine(app, backend, store=store, engine_id="b", reconcile=False) as caller,
        ):
            first = await engine.start("cart", None)
            second = await engine.start("cart", None, run_id="chosen")
            assert await engine.start("cart", None, run_id="chosen") == "chosen"  # no 2nd watch
            await trio.sleep(0.5)
            assert everyone or [r for r in reads if r[1] == 1] == []
            assert await caller.update(second, "add", "apple") == 1
            assert await engine.update(first, "add", "pear") == 1
            assert trio.current_time() - start == 0.5
        reads.clear()
        async with open_engine(app, backend, store=store, engine_id="c") as engine:
            await trio.sleep(0.5)
            assert {run for run, seq in reads if seq == 1} >= {first, second}
            assert await engine.update(first, "add", "fig") == 2


async def test_a_restarted_engine_replays_the_updates_once(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    app = cart_app("upd-replay")
    async with open_store(every_store, app.name) as (backend, store):
        start = trio.current_time()
        async with open_engine(app, backend, store=store, engine_id="a") as engine:
            run_id = await engine.start("cart", None)
            assert await engine.update(run_id, "add", "apple") == 1
            await trio.sleep(6)  # past the timer: waits on the signal
            assert await engine.update(run_id, "add", "pear") == 3
        # Engine "a" is gone; "b" takes the run over and replays both updates where they were
        # applied (before the timer, before the signal), running the handlers once each.
        async with open_engine(app, backend, store=store, engine_id="b") as engine:
            await trio.sleep(1)
            assert await engine.update(run_id, "add", "fig", update_id="f") == 4
            await engine.signal(run_id, "checkout")
            assert await engine.result(run_id) == ["apple", "slept", "pear", "fig"]
            assert trio.current_time() - start == 7


async def test_handlers_must_be_plain_functions() -> None:
    app = App("upd-async")
    seen: list[str] = []

    @app.workflow("w")
    async def w(ctx: WorkflowContext, _: Any) -> None:
        async def handler(_: Any) -> None:
            pass

        try:
            ctx.on_update("x", handler)
        except TypeError as exc:
            seen.append(str(exc))

    async with dt.open_backend("memory://") as backend, open_engine(app, backend) as engine:
        await engine.result(await engine.start("w", None))
    assert seen == ["ctx.on_update: handler must be a plain (non-async) function"]


async def test_an_update_to_a_remote_workflow_is_rejected_in_the_caller(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A remote workflow's context has no ``ctx.on_update``: the caller is refused at once
    (it would otherwise wait for an outcome no driver records)."""
    app = App("upd-remote")

    @app.workflow("far", remote=True)
    async def far(ctx: WorkflowContext, _: Any) -> None:
        await ctx.sleep(5)

    async with (
        dt.open_backend("memory://") as backend,
        open_engine(app, backend) as engine,
    ):
        run_id = await engine.start("far", None)
        start = trio.current_time()
        with pytest.raises(dt.UpdateRejected, match="remote workflow 'far'"):
            await engine.update(run_id, "add", "x")
        assert trio.current_time() == start


def looping_app(name: str) -> App:
    """A loop that continues as new after each signal; its updates add to its input."""
    app = App(name)

    @app.workflow("loop")
    async def loop(ctx: WorkflowContext, total: int) -> int:
        state = {"total": total}

        def add(n: int) -> int:
            state["total"] += n
            return state["total"]

        ctx.on_update("add", add)
        await ctx.wait_signal("next")
        if ctx.generation < 2:
            ctx.continue_as_new(state["total"])
        return state["total"]

    return app


async def test_updates_follow_a_run_that_continues_as_new(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    """Each generation registers its own handlers and counts its calls from its own start: an
    engine that takes the run over in a later generation replays that generation's updates
    only (the earlier ones are in the input it continued with)."""
    app = looping_app("upd-continue")
    async with open_store(every_store, app.name) as (backend, store):
        start = trio.current_time()
        async with open_engine(app, backend, store=store, engine_id="a") as engine:
            run_id = await engine.start("loop", 1)
            assert await engine.update(run_id, "add", 10) == 11  # generation 0
            await engine.signal(run_id, "next")
            await trio.sleep(1)
            assert await engine.update(run_id, "add", 100) == 111  # generation 1
        async with open_engine(app, backend, store=store, engine_id="b") as engine:
            await trio.sleep(1)
            assert await engine.update(run_id, "add", 1000) == 1111  # still generation 1
            await engine.signal(run_id, "next")
            await trio.sleep(1)
            assert await engine.update(run_id, "add", 5) == 1116  # generation 2
            await engine.signal(run_id, "next")
            assert await engine.result(run_id) == 1116
            assert trio.current_time() - start == 3


async def test_a_finished_run_leaves_no_cycle_for_the_garbage_collector(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A run's driver and its update servant free by reference counting when the run ends: a
    cycle between them would hold every finished run's state until a full collection (a burst
    of runs spent a third of its time in the collector, issue 6's figures)."""
    import gc

    app = App("upd-garbage")

    @app.step("noop")
    async def noop(value: Any) -> Any:
        return value

    @app.workflow("two")
    async def two(ctx: WorkflowContext, value: int) -> int:
        await ctx.step("noop", value)
        await ctx.sleep(1)
        return int(await ctx.step("noop", value + 1))

    async with dt.open_backend("memory://") as backend:
        async with (
            dt.open_worker(app, backend, namespace="garbage"),
            open_engine(app, backend, namespace="garbage") as engine,
        ):
            assert await engine.result(await engine.start("two", 1)) == 2  # (warm)
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                for n in range(5):
                    assert await engine.result(await engine.start("two", n)) == n + 1
                gc.collect()
                kinds = {type(found).__name__ for found in gc.garbage}
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
    assert not kinds & {"RunDriver", "UpdateServant", "History", "RunRecord"}, kinds


async def test_a_run_started_here_serves_its_updates_only_once_a_request_may_have_come(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The engine's update desk (``_update_desk``): a run started here gets no serving task and
    reads no request log until a ring of its key, or its first safety-net read
    (``UPDATE_POLL`` seconds in), when a ring was lost: a burst of short runs costs nothing for
    updates, and a request whose ring was lost is still answered, at that read."""
    from durable_trio._engine._updates import UPDATE_POLL

    app = cart_app("upd-desk")

    @app.workflow("quick")
    async def quick(ctx: WorkflowContext, _: Any) -> str:
        await ctx.sleep(UPDATE_POLL / 2)
        return "done"

    @app.workflow("long")
    async def long(ctx: WorkflowContext, _: Any) -> str:
        await ctx.sleep(8 * UPDATE_POLL)
        return "done"

    async with open_store("memory://", app.name) as (backend, store):
        reads: list[str] = []
        read_at: list[float] = []
        read = store.read_signal

        async def counted(run_id: str, name: str, seq: int) -> str | None:
            if name == UPDATE_LOG:
                reads.append(run_id)
                read_at.append(trio.current_time())
            text: str | None = await read(run_id, name, seq)
            return text

        store.read_signal = counted
        async with open_engine(app, backend, store=store, engine_id="a") as engine:
            desk = engine._update_desk
            # A run that takes none: the desk's safety-net reads, on the serving's schedule
            # (1 s in, then twice as long each time), and no serving.
            start = trio.current_time()
            long_run = await engine.start("long", None)
            await trio.sleep(5 * UPDATE_POLL)
            assert desk.dormant == 1  # (read twice, served never)
            assert await engine.result(long_run) == "done"
            assert [t - start for t in read_at] == [1.0, 3.0, 7.0]
            reads.clear()
            ids = [await engine.start("quick", None) for _ in range(20)]
            await trio.sleep(0.01)
            assert desk.dormant == 20
            for run_id in ids:
                assert await engine.result(run_id) == "done"
            assert reads == []
            assert desk.dormant == 0

            # A request whose ring is lost: answered at the run's first safety-net read.
            wake = store.wakes.wake
            lost: list[Any] = []

            def losing(keys: Any) -> None:
                if keys is not None and run_id in keys and not lost:
                    lost.append(keys)  # (the request's ring: the first of the run's key)
                    return
                wake(keys)

            start = trio.current_time()
            run_id = await engine.start("cart", None)
            store.wakes.wake = losing
            await trio.sleep(0.25)
            assert await engine.update(run_id, "add", "kiwi") == 1
            assert trio.current_time() - start == UPDATE_POLL
            assert lost
            assert set(reads) == {run_id}  # (none before: its first read answered it)
            store.wakes.wake = wake
            await engine.cancel(run_id)


async def test_what_the_serving_raises_ends_its_run_s_driver_with_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The serving runs in the engine's runs nursery (``_update_desk``), not beside its driver:
    a failure of its own (not the store's transient errors, which it retries) still stops the
    run's driver where it waits and comes out of it, as it did from a nursery beside it."""
    app = cart_app("upd-fails")
    async with open_store("memory://", app.name) as (backend, store):
        read = store.read_signal

        async def broken(run_id: str, name: str, seq: int) -> str | None:
            if name == UPDATE_LOG:
                raise RuntimeError("the request log cannot be read")
            text: str | None = await read(run_id, name, seq)
            return text

        store.read_signal = broken
        caught: list[BaseException] = []
        try:
            async with open_engine(app, backend, store=store, engine_id="a") as engine:
                run_id = await engine.start("cart", None)
                request = '{"id": "u1", "name": "add", "payload": "fig"}'
                assert await store.append_signal(run_id, UPDATE_LOG, request) == 1  # (rings)
                await trio.sleep_forever()  # (the engine's failure ends the block)
        except BaseException as exc:  # (what the block ended with, looked at below)
            caught.append(exc)
        assert caught
        found = caught[0]
        while isinstance(found, BaseExceptionGroup) and len(found.exceptions) == 1:
            found = found.exceptions[0]
        assert isinstance(found, RuntimeError)
        assert "cannot be read" in str(found)
