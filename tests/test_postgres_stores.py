"""The PostgreSQL run store's own particulars, on the session's private server (its contract is
tests/test_run_stores.py): stores on separate pools stand for separate processes, so the races
between them are real transactions, and their wakes travel by ``NOTIFY`` to a real ``LISTEN``
connection (the backend's own notify hub)."""

from __future__ import annotations

import uuid
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

import pytest
import trio

import durable_trio as dt
from durable_trio import BrokerUnavailable
from durable_trio._engine import RunRecord, RunStatus, StepKind, StepRecord
from durable_trio._engine import StepState as S
from durable_trio._engine._cancel import CANCEL_MARK, mark_in_store
from durable_trio._engine._stores._wakes import CANCELS
from durable_trio._engine._stores.postgres import (
    PostgresRunStore,
    PostgresRunStores,
    wakes_channel,
)
from durable_trio._postgres import NotifyHub, open_notify_hub, open_pool

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable


pytestmark = pytest.mark.postgres


def run(run_id: str, **kw: Any) -> RunRecord:
    return RunRecord(run_id, "order", None, kw.pop("status", RunStatus.PENDING), 0, 0, **kw)


def step(run_id: str, step_id: str) -> StepRecord:
    return StepRecord(run_id, step_id, StepKind.REMOTE, "charge", S.PENDING)


async def _processes(
    stack: AsyncExitStack, url: str, count: int, *, hubs: bool = False
) -> list[PostgresRunStore]:
    """``count`` stores of one namespace in one fresh schema, each on a pool (and a hub) of
    its own, as separate processes would be."""
    schema = f"r_{uuid.uuid4().hex[:16]}"
    stores = []
    for _ in range(count):
        pool = await stack.enter_async_context(open_pool(url, size=4))
        hub: NotifyHub | None = None
        if hubs:
            hub = await stack.enter_async_context(open_notify_hub(url))
        opener = PostgresRunStores(pool, schema, hub=hub)
        stores.append(await stack.enter_async_context(opener.open("shop")))
    return stores


async def test_a_signal_an_event_and_a_ring_wake_the_other_processes_waiters(
    postgres_url: str,
) -> None:
    async with AsyncExitStack() as stack:
        here, there = await _processes(stack, postgres_url, 2, hubs=True)
        await here.create_run(run("r1", status=RunStatus.RUNNING, owner="A", lease_until=1e12))
        changes: list[Callable[[], Awaitable[object]]] = [
            lambda: here.append_signal("r1", "go", "1"),
            lambda: here.put_event("r1", "stage", '"one"'),
        ]
        for change in changes:
            with there.wakes.watching("r1") as woken:
                await trio.sleep(0.2)  # (the hub's LISTEN is active: a real round trip)
                await change()
                with trio.fail_after(5):
                    await woken.wait()
        with there.wakes.watching(CANCELS) as woken:  # a key holding NUL travels whole
            await here.ring(CANCELS)
            with trio.fail_after(5):
                await woken.wait()
        # A signal that was not stored (the run is over) wakes nobody elsewhere.
        await here.finish_run("r1", RunStatus.COMPLETED)
        with there.wakes.watching("r1") as woken:
            assert await here.append_signal("r1", "go", "2") is None
            await trio.sleep(0.3)
            assert not woken.is_set()
        # A closed store ignores what its hub still hears (a subscription cannot be undone).
        await there.aclose()
        with there.wakes.watching("r2") as woken:
            await here.ring("r2")
            await trio.sleep(0.3)
            assert not woken.is_set()
        with pytest.raises(BrokerUnavailable):
            await there.get_run("r1")


def test_the_wakes_channel_is_a_short_identifier_per_schema_and_namespace() -> None:
    channel = wakes_channel("durable_trio", "x" * 500)
    assert len(channel) <= 63
    assert channel.isidentifier()
    assert channel != wakes_channel("durable_trio", "y")
    assert channel != wakes_channel("other", "x" * 500)


async def test_concurrent_appends_from_two_processes_number_signals_without_gaps(
    postgres_url: str,
) -> None:
    async with AsyncExitStack() as stack:
        one, two = await _processes(stack, postgres_url, 2)
        await one.create_run(run("r"))
        seqs: list[int | None] = []

        async def append(store: PostgresRunStore, n: int) -> None:
            seqs.append(await store.append_signal("r", "go", str(n)))

        async with trio.open_nursery() as nursery:
            for n in range(30):
                nursery.start_soon(append, one if n % 2 else two, n)
        assert sorted(s for s in seqs if s is not None) == list(range(1, 31))


async def test_a_cancel_racing_the_runs_end_never_leaves_a_mark_on_an_ended_run(
    postgres_url: str,
) -> None:
    """The cancel mark's guarded begin in one process, the run's end in another, at once, many
    times: whichever commits first, no completed run holds a mark (docs/engine.md, "A cancel
    racing the run's end")."""
    async with AsyncExitStack() as stack:
        ender, canceller = await _processes(stack, postgres_url, 2)
        for n in range(40):
            run_id = f"r{n}"
            await ender.create_run(run(run_id, status=RunStatus.RUNNING, owner="A"))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ender.finish_run, run_id, RunStatus.COMPLETED)
                nursery.start_soon(mark_in_store, canceller, run_id, "operator")
            assert await ender.get_step(run_id, CANCEL_MARK) is None
            ended = await ender.get_run(run_id)
            assert ended is not None
            assert ended.status is RunStatus.COMPLETED


async def test_two_processes_claim_each_orphan_once(postgres_url: str) -> None:
    async with AsyncExitStack() as stack:
        one, two = await _processes(stack, postgres_url, 2)
        for n in range(40):
            await one.create_run(run(f"r{n:02}"))
        taken: dict[str, list[str]] = {"one": [], "two": []}

        async def claim(name: str, store: PostgresRunStore) -> None:
            while claimed := await store.claim_runs(name, 30.0, limit=3):
                taken[name] += [r.run_id for r in claimed]

        async with trio.open_nursery() as nursery:
            nursery.start_soon(claim, "one", one)
            nursery.start_soon(claim, "two", two)
        assert sorted(taken["one"] + taken["two"]) == [f"r{n:02}" for n in range(40)]


async def test_a_cancelled_call_writes_nothing_before_it_is_sent_and_all_after(
    postgres_url: str,
) -> None:
    async with AsyncExitStack() as stack:
        (store,) = await _processes(stack, postgres_url, 1)
        with trio.CancelScope() as scope:
            scope.cancel()
            await store.create_run(run("never"))
        assert await store.get_run("never") is None
        for n in range(20):  # cancelled while the change is under way (or before, or after)
            with trio.move_on_after(0.0002 * n):
                await store.begin_step(step("r", str(n)))
            found = await store.get_step("r", str(n))
            assert found is None or found.name == "charge"  # nothing, or all of it
        assert store.now() > 0  # (the store was not broken by any of it)
        await store.begin_step(step("r", "last"))


async def test_namespaces_lists_those_with_runs_or_schedules(postgres_url: str) -> None:
    schema = f"r_{uuid.uuid4().hex[:16]}"
    async with open_pool(postgres_url, size=2) as pool:
        opener = PostgresRunStores(pool, schema)
        assert await opener.namespaces() == []
        async with opener.open("b") as b, opener.open("a") as a, opener.open("c"):
            await b.create_run(run("r"))
            await a.put_schedule("daily", "{}", replace=False)
        assert await opener.namespaces() == ["a", "b"]


async def test_a_text_postgresql_cannot_hold_is_a_clear_error_and_the_engine_goes_on(
    postgres_url: str,
) -> None:
    """A run id, a signal name or a local step's label with a NUL (0x00), which a PostgreSQL
    text cannot hold, is refused at the call with a :class:`~durable_trio.ConfigError` (still a
    ``ValueError``) naming the value; nothing is written and the engine serves the next call."""
    app = dt.App("nul")

    @app.workflow("w")
    async def w(ctx: dt.WorkflowContext, label: str) -> str:
        got = await ctx.run(label, lambda: 1)
        return f"{got}{await ctx.wait_signal('go', timeout=60)}"

    url = f"{postgres_url}?schema=nul_{uuid.uuid4().hex[:12]}"
    async with dt.open_backend(url) as backend, dt.open_engine(app, backend) as engine:
        with pytest.raises(dt.ConfigError, match=r"cannot store the text 'r\\x00x'"):
            await engine.start("w", "ok", run_id="r\x00x")
        run_id = await engine.start("w", "ok", run_id="r")
        with pytest.raises(dt.ConfigError, match=r"'g\\x00o'"):
            await engine.signal(run_id, "g\x00o", 1)
        await engine.signal(run_id, "go", "!")
        assert await engine.result(run_id) == "1!"
        bad = await engine.start("w", "l\x00abel")
        with pytest.raises(dt.RunFailed, match=r"'l\\x00abel'"):
            await engine.result(bad)
        again = await engine.start("w", "fine")  # and the engine goes on
        await engine.signal(again, "go", "?")
        assert await engine.result(again) == "1?"


async def test_the_longest_run_id_is_kept_and_a_longer_one_refused_as_elsewhere(
    postgres_url: str,
) -> None:
    """A run id of 512 characters, each 4 bytes in UTF-8 and none repeated (nothing for the
    server to compress), fits the runs' key index (2,704 bytes at most); 513 characters are
    refused at the call, as on every backend (a 3,000-character id was the server's
    ``index row size exceeds btree maximum``)."""
    app = dt.App("longid")

    @app.workflow("child")
    async def child(ctx: dt.WorkflowContext, n: int) -> int:
        return n + 1

    @app.workflow("w")
    async def w(ctx: dt.WorkflowContext, _: Any) -> int:
        got: int = await ctx.child("child", 1)
        signalled: int = await ctx.wait_signal("go", timeout=60)
        return got + signalled

    longest = "".join(chr(0x1F600 + (i % 80)) + chr(0x10000 + i) for i in range(256))
    assert len(longest) == 512
    assert len(longest.encode()) == 2048
    url = f"{postgres_url}?schema=longid_{uuid.uuid4().hex[:12]}"
    async with dt.open_backend(url) as backend, dt.open_engine(app, backend) as engine:
        with pytest.raises(dt.ConfigError, match="run_id is at most 512 characters, not 513"):
            await engine.start("w", None, run_id=longest + "x")
        run_id = await engine.start("w", None, run_id=longest)
        assert run_id == longest
        await engine.signal(run_id, "go", 40)
        assert await engine.result(run_id) == 42
        assert (await engine.get(longest)).status is RunStatus.COMPLETED
