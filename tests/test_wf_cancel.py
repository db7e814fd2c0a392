"""Cancellation inside a workflow (issue 18, item 6): ``RunCancelled`` raised at the await,
compensation steps run shielded from the cancel and bounded by ``cancel_grace``, the run ends
cancelled. Memory at exact virtual times, a real SQLite file and a private Redis."""

from __future__ import annotations

from collections import Counter
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio._engine import (
    App,
    RunCancelled,
    RunStatus,
    StepKind,
    WorkflowContext,
    open_engine,
    open_worker,
)
from durable_trio._engine._cancel import CANCEL_MARK, mark_in_store

if TYPE_CHECKING:
    from pathlib import Path


def saga_app(
    ran: Counter[str], *, undo_takes: float = 1.0, swallow: bool = False, remote: bool = False
) -> App:
    """Book a flight, wait for a long hotel step; cancelled meanwhile, undo the flight."""
    app = App("saga")

    @app.step("book")
    async def book(what: str) -> str:
        ran[f"book:{what}"] += 1
        return f"booked-{what}"

    @app.step("hotel")
    async def hotel(_: Any) -> str:
        ran["hotel"] += 1
        await trio.sleep(100)
        return "hotel"

    @app.step("undo")
    async def undo(what: str) -> str:
        await trio.sleep(undo_takes)
        ran[f"undo:{what}"] += 1
        return f"undone-{what}"

    @app.workflow("trip", remote=remote)
    async def trip(ctx: WorkflowContext, _: Any) -> Any:
        flight = await ctx.step("book", "flight")
        try:
            await ctx.step("hotel")
        except RunCancelled:
            await ctx.step("undo", "flight")
            await ctx.sleep(1)  # a timer in the compensation works too
            if swallow:
                return "swallowed"
            raise
        return flight

    return app


def declared() -> App:
    app = App("saga")
    app.remote_workflow("trip")
    return app


async def run_saga(
    url: str, ran: Counter[str], *, grace: float = 30.0, remote: bool = False, **kw: Any
) -> tuple[Any, float, float]:
    async with AsyncExitStack() as stack:
        backend = await stack.enter_async_context(dt.open_backend(url))
        app = saga_app(ran, remote=remote, **kw)
        await stack.enter_async_context(open_worker(app, backend))
        engine = await stack.enter_async_context(
            open_engine(declared() if remote else app, backend, cancel_grace=grace)
        )
        await engine.start("trip", run_id="t")
        await trio.sleep(5)
        start = trio.current_time()
        assert await engine.cancel("t", reason="customer changed plans") is True
        returned = trio.current_time() - start
        record = await engine.get("t")
        with pytest.raises(RunCancelled):
            await engine.result("t")
        history = [(r.step_id, r.kind, r.name) for r in await engine.history("t")]
        assert record.status is RunStatus.CANCELLED
        assert await engine.cancel("t") is False  # already over
        return (record, history), returned, record.updated_at


async def test_cancel_raises_inside_and_compensation_runs_on_memory(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ran: Counter[str] = Counter()
    (record, history), returned, ended = await run_saga("memory://", ran)
    assert record.error == {
        "type": "RunCancelled",
        "message": "customer changed plans",
        "cut": False,
    }
    assert ran == Counter({"book:flight": 1, "hotel": 1, "undo:flight": 1})
    assert sorted(history) == [
        ("1", StepKind.REMOTE, "book"),
        ("2", StepKind.REMOTE, "hotel"),
        ("3", StepKind.REMOTE, "undo"),
        ("4", StepKind.TIMER, "sleep"),
        ("cancel:run", StepKind.CANCEL, "cancel"),
    ]
    # Cancelled at 5; undo takes 1 s and the timer 1 s: settled at 7, when cancel returned.
    assert (returned, ended) == (2.0, 7.0)


async def test_a_swallowed_cancel_still_ends_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ran: Counter[str] = Counter()
    (record, _), _, ended = await run_saga("memory://", ran, swallow=True)
    assert record.status is RunStatus.CANCELLED
    assert record.output is None
    assert ran["undo:flight"] == 1
    assert ended == 7.0


async def test_compensation_is_cut_at_the_grace_bound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ran: Counter[str] = Counter()
    (record, _), returned, ended = await run_saga("memory://", ran, grace=3.0, undo_takes=50)
    assert record.error["cut"] is True
    assert ran["undo:flight"] == 0  # cut mid-undo
    assert (returned, ended) == (3.0, 8.0)  # cancelled at 5, grace 3


async def test_a_run_resumed_with_the_cancel_mark_settles_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Its engine died mid-compensation: the next engine settles it cancelled at once,
    without running the workflow again (compensation never runs twice)."""
    ran: Counter[str] = Counter()
    async with dt.open_backend("memory://") as backend:
        app = saga_app(ran, undo_takes=50)
        async with open_worker(app, backend, close_timeout=0.0):
            async with open_engine(app, backend) as first:
                await first.start("trip", run_id="t")
                await trio.sleep(5)
                with trio.move_on_after(2):  # the engine goes away mid-undo
                    await first.cancel("t")
            async with open_engine(app, backend) as second:
                with pytest.raises(RunCancelled):
                    await second.result("t")
                record = await second.get("t")
    assert record.error["cut"] is True
    assert record.updated_at == 7.0
    assert ran["book:flight"] == 1


@pytest.fixture(params=["sqlite", "redis", pytest.param("postgres", marks=pytest.mark.postgres)])
def real_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return "sqlite:///" + str(tmp_path / "cancel.db")
    if request.param == "postgres":
        return str(request.getfixturevalue("postgres_schema_url"))
    return str(request.getfixturevalue("redis_url"))


async def test_cancel_inside_on_the_real_stores(real_url: str) -> None:
    """Real time (real I/O): the same saga, with short steps."""
    ran: Counter[str] = Counter()
    with trio.fail_after(30):
        (record, history), _, _ = await run_saga(real_url, ran, undo_takes=0.1)
    assert record.error["cut"] is False
    assert ran == Counter({"book:flight": 1, "hotel": 1, "undo:flight": 1})
    assert ("cancel:run", StepKind.CANCEL, "cancel") in history


async def test_remote_workflow_cancel_raises_in_its_turn_and_compensates(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A remote workflow: the mark names the steps pending at the cancel; the next turn raises
    RunCancelled where the workflow waits on one, and its compensation runs in later turns."""
    ran: Counter[str] = Counter()
    (record, history), returned, ended = await run_saga("memory://", ran, remote=True)
    assert record.error == {
        "type": "RunCancelled",
        "message": "customer changed plans",
        "cut": False,
    }
    assert ran == Counter({"book:flight": 1, "hotel": 1, "undo:flight": 1})
    assert sorted(history) == [
        ("1", StepKind.REMOTE, "book"),
        ("2", StepKind.REMOTE, "hotel"),
        ("3", StepKind.REMOTE, "undo"),
        ("4", StepKind.TIMER, "sleep"),
        ("cancel:run", StepKind.CANCEL, "cancel"),
    ]
    assert (returned, ended) == (2.0, 7.0)


async def test_remote_compensation_is_cut_at_the_grace_bound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ran: Counter[str] = Counter()
    (record, _), returned, ended = await run_saga(
        "memory://", ran, remote=True, grace=3.0, undo_takes=50
    )
    assert record.error["cut"] is True
    assert ran["undo:flight"] == 0
    assert (returned, ended) == (3.0, 8.0)


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
async def test_a_cancel_from_another_engine_reaches_the_owner_which_compensates(
    autojump_clock: trio.testing.MockClock, remote: bool
) -> None:
    """Engine B cancels a run engine A drives: B writes the mark and rings the store's wakes,
    and A delivers it at once (without the ring, at its next look, every run_lease / 3)."""
    ran: Counter[str] = Counter()
    async with AsyncExitStack() as stack:
        backend = await stack.enter_async_context(dt.open_backend("memory://"))
        app = saga_app(ran, remote=remote)
        await stack.enter_async_context(open_worker(app, backend))
        code = declared() if remote else app
        owner = await stack.enter_async_context(open_engine(code, backend, engine_id="a"))
        other = await stack.enter_async_context(
            open_engine(code, backend, engine_id="b", reconcile=False)
        )
        await owner.start("trip", run_id="t")
        await trio.sleep(5)
        assert (await other.get("t")).owner == "a"
        assert await other.cancel("t", reason="from b") is True
        record = await other.get("t")
        history = {r.step_id for r in await other.history("t")}
    assert record.status is RunStatus.CANCELLED
    assert record.error == {"type": "RunCancelled", "message": "from b", "cut": False}
    assert ran == Counter({"book:flight": 1, "hotel": 1, "undo:flight": 1})
    assert {"3", "4", "cancel:run"} <= history
    # B's mark rings the store's wakes: A delivers it at once (5 s), then undo (1 s) and the
    # timer (1 s). (The undo's result may be applied by B: it rings A, which re-reads it at
    # once; before that ring, A learnt it at its next watch tick, a second later.)
    assert record.updated_at == 7.0


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
async def test_the_operators_cancel_reaches_the_owner_which_compensates(
    autojump_clock: trio.testing.MockClock, remote: bool
) -> None:
    """``Operations.cancel_run`` (the CLI's ``runs cancel``, the console's button) of a run an
    engine drives writes the mark like another engine's cancel: the owner delivers it at its
    next lease tick (10 s), compensates, and the call returns once the run ended."""
    ran: Counter[str] = Counter()
    async with AsyncExitStack() as stack:
        backend = await stack.enter_async_context(dt.open_backend("memory://"))
        app = saga_app(ran, remote=remote)
        await stack.enter_async_context(open_worker(app, backend))
        code = declared() if remote else app
        owner = await stack.enter_async_context(open_engine(code, backend, engine_id="a"))
        ops = await stack.enter_async_context(dt.open_operations(backend, namespace="saga"))
        await owner.start("trip", run_id="t")
        await trio.sleep(5)
        assert await ops.cancel_run("t", reason="from the operator") is True
        returned = trio.current_time()
        record = await owner.get("t")
    assert record.status is RunStatus.CANCELLED
    assert record.error == {"type": "RunCancelled", "message": "from the operator", "cut": False}
    assert ran == Counter({"book:flight": 1, "hotel": 1, "undo:flight": 1})
    assert record.updated_at == 7.0  # as from another engine (see above)
    assert record.updated_at <= returned <= record.updated_at + 0.5  # its poll of the store


# ---------------------------------------------------------------- issue 36: cancel vs end race


def racing_app(attempts: Counter[str], store_of: list[Any]) -> App:
    """A workflow whose local step writes the operator's cancel mark into its own run, then
    fails for good in the same breath: the run ends failed before the owner can deliver it."""
    app = App("race")

    @app.workflow("flaky")
    async def flaky(ctx: WorkflowContext, _: Any) -> str:
        async def charge() -> str:
            attempts["charge"] += 1
            if attempts["charge"] == 1:
                assert await mark_in_store(store_of[0], ctx.run_id, "operator")
                raise ValueError("card declined")
            return "charged"

        return str(await ctx.run("charge", charge, retry=dt.Retry(max_attempts=1)))

    return app


async def test_a_cancel_landing_just_before_the_failure_leaves_no_mark_and_retry_reruns(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Issue 36, item 2: the mark landed while the run was unfinished, the run then failed
    before the cancel reached the workflow: it ended failed (the end wins), its history holds
    no mark, and ``retry`` re-runs the failed step to completion instead of ending cancelled."""
    attempts: Counter[str] = Counter()
    store_of: list[Any] = []
    async with dt.open_backend("memory://") as backend:
        async with open_engine(racing_app(attempts, store_of), backend) as engine:
            store_of.append(engine.store)
            await engine.start("flaky", run_id="r")
            with pytest.raises(dt.RunFailed):
                await engine.result("r")
            assert (await engine.get("r")).status is RunStatus.FAILED  # not cancelled
            assert await engine.store.get_step("r", CANCEL_MARK) is None
            assert await engine.cancel("r") is False  # already ended (failed)
            await engine.retry("r")
            assert await engine.result("r") == "charged"
    assert attempts["charge"] == 2


async def test_a_cancel_of_a_run_settled_elsewhere_writes_no_mark(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Issue 36, item 2: the owner's ``engine.cancel`` of a run its driver still drives, but
    which another engine settled meanwhile (a split brain): no mark lands in the ended run."""
    ran: Counter[str] = Counter()
    async with dt.open_backend("memory://") as backend:
        app = saga_app(ran)
        async with open_worker(app, backend), open_engine(app, backend) as engine:
            await engine.start("trip", run_id="t")
            await trio.sleep(5)
            assert await engine.store.finish_run("t", RunStatus.FAILED, error={"type": "X"})
            with trio.fail_after(60):
                assert await engine.cancel("t") is False
            assert await engine.store.get_step("t", CANCEL_MARK) is None
