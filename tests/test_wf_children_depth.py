"""Issue 36, item 6: child trees are bounded and their cancel is complete.

- a workflow that starts itself as a child stops at the engine's ``max_child_depth`` with
  ``ChildDepthExceeded`` (local and remote workflows);
- default child run ids stay bounded whatever the depth;
- ``engine.cancel(root)`` of a 1,000-level chain (memory, exact virtual time), also while the
  chain still grows, and the operator's ``cancel_run`` of a 400-level chain nobody drives
  (SQLite, no engine), cancel every run without ``RecursionError``; an operator's cancel
  interrupted half-way is finished by cancelling the root again.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio import App, ChildDepthExceeded, ChildFailed, WorkflowContext, open_engine
from durable_trio._engine import RunRecord, RunStatus, StepKind, StepRecord, StepState
from durable_trio._engine._children import CHILD_ID_LIMIT, child_run_id
from durable_trio._errors import BrokerError

if TYPE_CHECKING:
    from pathlib import Path

    from durable_trio._engine import RunStore


def chain_app(*, pause: float = 0.0, stop_at: int | None = None, remote: bool = False) -> App:
    """``loop``: sleeps ``pause``, then starts itself as a child (one level deeper), until
    level ``stop_at`` (``None``: never), which waits a day."""
    app = App("chain")

    @app.workflow("loop", remote=remote)
    async def loop(ctx: WorkflowContext, level: int) -> int:
        if pause:
            await ctx.sleep(pause)
        if stop_at is not None and level >= stop_at:
            await ctx.sleep(86_400)
            return level
        return int(await ctx.child("loop", level + 1))

    return app


async def all_runs(store: RunStore) -> list[RunRecord]:
    return await store.list_runs(limit=100_000)


# --------------------------------------------------------------------------- the depth limit


@pytest.mark.parametrize("remote", [False, True])
async def test_a_self_starting_workflow_stops_at_the_depth_limit(
    autojump_clock: trio.testing.MockClock, remote: bool
) -> None:
    async with dt.open_backend("memory://") as backend:
        code = chain_app(remote=remote)
        app = App("chain")
        if remote:
            app.remote_workflow("loop")
        async with (
            dt.open_worker(code, backend) if remote else contextlib.nullcontext(),
            open_engine(code if not remote else app, backend, max_child_depth=5) as engine,
        ):
            await engine.start("loop", 0, run_id="root")
            with trio.fail_after(600), pytest.raises(dt.RunFailed):
                await engine.result("root")
            runs = await all_runs(engine.store)
            deepest = max(runs, key=lambda r: r.depth)
            history = await engine.history(deepest.run_id)
    # The root and five levels below it; the sixth was refused, never created.
    assert sorted(r.depth for r in runs) == [0, 1, 2, 3, 4, 5]
    assert all(r.status is RunStatus.FAILED for r in runs)
    assert deepest.error is not None
    assert deepest.error["type"] == "ChildDepthExceeded"  # raised by its ctx.child call
    assert "max_child_depth of 5" in deepest.error["message"]
    assert [(s.kind, s.status, s.error["type"]) for s in history] == [
        (StepKind.CHILD, StepState.FAILED, "ChildDepthExceeded")
    ]


async def test_the_refusal_is_raised_at_the_call_and_can_be_caught(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = App("chain")

    @app.workflow("leaf")
    async def leaf(ctx: WorkflowContext, _: Any) -> str:
        return "leaf"

    @app.workflow("top")
    async def top(ctx: WorkflowContext, _: Any) -> Any:
        try:
            await ctx.start_child("leaf", None)  # refused at the start, not when awaited
        except ChildDepthExceeded as exc:
            return [exc.limit, exc.error["retryable"], isinstance(exc, ChildFailed)]
        return "started"

    async with dt.open_backend("memory://") as backend:
        async with open_engine(app, backend, max_child_depth=0) as engine:
            await engine.start("top", None, run_id="t")
            assert await engine.result("t") == [0, False, True]
            assert await engine.store.get_run("t/1") is None  # never created


async def test_the_default_limit_is_one_hundred_levels(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with dt.open_backend("memory://") as backend:
        async with open_engine(chain_app(), backend) as engine:
            await engine.start("loop", 0, run_id="root")
            with pytest.raises(dt.RunFailed):
                await engine.result("root")
            runs = await all_runs(engine.store)
    assert len(runs) == 101
    assert max(r.depth for r in runs) == 100
    # Each parent's ChildFailed repeats a bounded part of its child's message: the root's
    # error does not grow with the depth of the failure below it.
    assert max(len(str(r.error)) for r in runs) < 1200
    # Ids stop growing with depth: the plain form up to 64 characters, then hashed.
    assert max(len(r.run_id) for r in runs) <= CHILD_ID_LIMIT
    assert len({r.run_id for r in runs}) == 101


async def test_a_child_created_as_its_parent_is_cancelled_is_cancelled_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The parent's CHILD step was written, then a cancel walking the tree settled the parent
    and read its steps before the child existed; the child is then created: it is cancelled
    at once, not left running under a cancelled parent."""
    from durable_trio._engine._children import start_child_run

    async with dt.open_backend("memory://") as backend:
        async with open_engine(chain_app(stop_at=1), backend) as engine:
            store = engine.store
            await store.create_run(
                RunRecord("p", "loop", 0, RunStatus.RUNNING, 0.0, 0.0, owner="x", lease_until=9e9)
            )
            step = StepRecord(
                "p", "1", StepKind.CHILD, "loop", StepState.PENDING,
                input={"runId": "p/1", "input": 1, "onParentCancel": "cancel"},
            )  # fmt: skip
            await store.begin_step(step)
            assert await store.finish_run("p", RunStatus.CANCELLED)
            await start_child_run(engine._services, step)
            child = await engine.get("p/1")
    assert child.status is RunStatus.CANCELLED
    assert child.parent == "p"
    assert child.depth == 1


async def test_no_child_step_lands_in_a_parent_that_ended(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A parent settled (cancelled) in the store while its driver, not yet told, goes on to
    start a child: no CHILD step is written into its ended history, no child is created, and
    the driver is told to stop (``None``)."""
    from durable_trio._engine._children import start_child
    from durable_trio._engine._replay import History

    async with dt.open_backend("memory://") as backend:
        async with open_engine(chain_app(stop_at=1), backend) as engine:
            store = engine.store
            parent = RunRecord("p", "loop", 0, RunStatus.RUNNING, 0.0, 0.0, owner="x")
            await store.create_run(parent)
            assert await store.finish_run("p", RunStatus.CANCELLED)
            record = await start_child(
                engine._services, History("p"), parent, "1", "loop", 1, None, "cancel"
            )
            assert record is None
            assert await store.get_steps("p") == []
            assert await store.get_run("p/1") is None


def test_child_ids_are_bounded_deterministic_and_keep_their_head() -> None:
    assert child_run_id("order-1", "3") == "order-1/3"  # shallow: as before
    deep = "root" + "/12" * 40
    hashed = child_run_id(deep, "7")
    assert hashed == child_run_id(deep, "7")
    assert hashed != child_run_id(deep, "8")
    assert hashed.startswith("root/~")
    assert len(hashed) == len("root/~") + 32
    assert len(child_run_id(hashed, "1")) <= CHILD_ID_LIMIT
    # A tenant's tree stays in the tenant's scope ("{tenant}/...").
    tenant = child_run_id("acme/" + "x" * 80, "1")
    assert tenant.startswith("acme/~")


def test_a_depth_limit_is_a_non_negative_int() -> None:
    with pytest.raises(dt.ConfigError, match="max_child_depth"):
        dt.EngineOptions(max_child_depth=-1)
    with pytest.raises(dt.ConfigError, match="max_child_depth"):
        dt.EngineOptions(max_child_depth=2.5)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- cancel of a tree


async def test_engine_cancel_of_a_thousand_level_chain_cancels_every_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with dt.open_backend("memory://") as backend:
        app = chain_app(stop_at=1000)
        async with open_engine(app, backend, max_child_depth=1000) as engine:
            await engine.start("loop", 0, run_id="root")
            while len(await all_runs(engine.store)) < 1001:  # noqa: ASYNC110
                await trio.sleep(1)
            assert await engine.cancel("root") is True
            runs = await all_runs(engine.store)
    assert len(runs) == 1001
    assert {r.status for r in runs} == {RunStatus.CANCELLED}


async def test_engine_cancel_completes_while_the_chain_still_grows(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One level a second; cancelled at 50 s: every run cancelled, and the chain grows no
    more (a child is not started under a cancelled parent)."""
    async with dt.open_backend("memory://") as backend:
        async with open_engine(chain_app(pause=1.0), backend, max_child_depth=1000) as engine:
            await engine.start("loop", 0, run_id="root")
            await trio.sleep(50.5)
            assert await engine.cancel("root") is True
            after = await all_runs(engine.store)
            await trio.sleep(100)
            later = await all_runs(engine.store)
    assert 45 <= len(after) <= 52
    assert [r.run_id for r in later] == [r.run_id for r in after]
    assert {r.status for r in later} == {RunStatus.CANCELLED}


async def test_the_operators_cancel_settling_a_growing_chain_in_the_store_stops_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``runs cancel --grace 0`` settles each run in the store at once while the engine still
    drives them (it hears of it at its next lease renewal, up to 10 s later): the deepest
    run, waking meanwhile to start its child, writes no CHILD step into its cancelled run
    and starts no child under it."""
    async with dt.open_backend("memory://") as backend:
        async with (
            open_engine(chain_app(pause=1.0), backend, max_child_depth=1000) as engine,
            dt.open_operations(backend, namespace="chain") as ops,
        ):
            await engine.start("loop", 0, run_id="root")
            await trio.sleep(50.5)
            assert await ops.cancel_run("root", reason="runaway", grace=0) is True
            after = await all_runs(engine.store)
            await trio.sleep(100)
            later = await all_runs(engine.store)
    assert [r.run_id for r in later] == [r.run_id for r in after]
    assert {r.status for r in later} == {RunStatus.CANCELLED}


async def chain_nobody_drives(store: RunStore, levels: int) -> list[str]:
    """A chain of ``levels`` running runs whose engine died (its lease long expired): each
    parent holds the pending CHILD step of the next, as a live engine would have left it."""
    ids = ["root"]
    for level in range(levels):
        run_id = ids[-1]
        await store.create_run(
            RunRecord(
                run_id, "loop", level, RunStatus.RUNNING, 0.0, 0.0, owner="dead",
                lease_until=1.0, parent=ids[-2] if level else None, depth=level,
            )
        )  # fmt: skip
        if level + 1 < levels:
            child = child_run_id(run_id, "1")
            await store.begin_step(
                StepRecord(
                    run_id, "1", StepKind.CHILD, "loop", StepState.PENDING,
                    input={"runId": child, "input": level + 1, "onParentCancel": "cancel"},
                )
            )  # fmt: skip
            ids.append(child)
    return ids


async def test_engine_cancel_of_a_thousand_level_chain_nobody_drives(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Its engine died long ago (leases expired; this engine does not reconcile): each run is
    settled at once, not waited on for a grace and a lease as if a live owner drove it, and
    the walk down 1,000 levels raises no RecursionError."""
    async with dt.open_backend("memory://") as backend:
        async with open_engine(chain_app(), backend, reconcile=False) as engine:
            await trio.sleep(10)  # (the leases of the chain end at 1.0)
            ids = await chain_nobody_drives(engine.store, 1001)
            assert await engine.cancel("root", reason="runaway") is True
            runs = [await engine.store.get_run(i) for i in ids]
            assert trio.current_time() < 11  # settled, nothing waited on
    assert all(r is not None and r.status is RunStatus.CANCELLED for r in runs)


async def test_the_operators_cancel_of_a_400_level_chain_on_sqlite(tmp_path: Path) -> None:
    """No live engine, SQLite, the real clock: ``runs cancel root`` of 401 levels (it once
    raised RecursionError past ~330, leaving 74 runs running under a cancelled root). It is
    interrupted once (a broker error at the 150th settle); cancelling the root again finishes
    the walk."""
    url = f"sqlite:///{tmp_path / 'runs.db'}".replace("///", "////", 1)
    with trio.fail_after(120):
        async with dt.open_backend(url) as backend:
            async with dt.open_operations(backend, namespace="chain") as ops:
                store = ops.store
                ids = await chain_nobody_drives(store, 401)
                finish = store.finish_run
                calls = 0

                async def failing_once(*args: Any, **kw: Any) -> bool:
                    nonlocal calls
                    calls += 1
                    if calls == 150:
                        raise BrokerError("injected: the database went away")
                    return await finish(*args, **kw)

                store.finish_run = failing_once  # type: ignore[method-assign]
                with pytest.raises(BrokerError):
                    await ops.cancel_run("root", reason="runaway")
                halfway = [(await store.get_run(i)) for i in ids]
                assert await ops.cancel_run("root", reason="runaway") is False  # (ended)
                runs = [(await store.get_run(i)) for i in ids]
    assert sum(r is not None and r.status is RunStatus.CANCELLED for r in halfway) == 149
    assert all(r is not None and r.status is RunStatus.CANCELLED for r in runs)
    assert max(len(i) for i in ids) <= CHILD_ID_LIMIT
