"""Run-store wakes (issue 18): a signal, an event or a cancel stored by any process wakes its
waiter at once, on memory (exact virtual time), SQLite (datagrams in ``<file>.wakes/``),
Redis (``PUBLISH`` on ``{dt-runs:NS}:wakes``) and PostgreSQL (``pg_notify`` on the namespace's
channel); with the wake lost, the poll still delivers.

On SQLite, Redis and PostgreSQL the other process is ``durable-trio runs signal`` / ``runs
cancel`` run in a thread (its own ``trio.run``, backend and run store, as a shell's would be),
and the waiter's poll is set to a minute: a run that ends within the bound was woken by the
ring.
"""

from __future__ import annotations

import itertools
import shutil
import time
from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio._engine import App, RunStatus, WorkflowContext, _signals, open_engine
from durable_trio._engine._stores._wakes import CANCELS, RunWakes, SupportsRunWakes
from durable_trio.cli._main import main

if TYPE_CHECKING:
    from pathlib import Path


def approvals() -> App:
    app = App("wakes")

    @app.workflow("approve")
    async def approve(ctx: WorkflowContext, _: Any) -> Any:
        await ctx.set_event("stage", "waiting")
        return await ctx.wait_signal("ok")

    return app


async def test_a_signal_through_another_engine_wakes_the_run_at_once_on_memory(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = approvals()
    async with dt.open_backend("memory://") as backend:
        async with (
            open_engine(app, backend, engine_id="a") as owner,
            open_engine(app, backend, engine_id="b", reconcile=False) as other,
        ):
            run_id = await owner.start("approve", None)
            assert await other.get_event(run_id, "stage", timeout=5) == "waiting"
            await trio.sleep(3.25)
            assert (await other.get(run_id)).owner == "a"
            await other.signal(run_id, "ok", "yes")  # not through the engine driving it
            assert await owner.result(run_id) == "yes"
            assert trio.current_time() == 3.25  # before: at the driver's next poll, 4.0


async def test_get_event_wakes_when_the_event_is_set(
    autojump_clock: trio.testing.MockClock,
) -> None:
    app = App("wakes")

    @app.workflow("slow")
    async def slow(ctx: WorkflowContext, _: Any) -> None:
        await ctx.sleep(2.5)
        await ctx.set_event("stage", "late")

    async with dt.open_backend("memory://") as backend, open_engine(app, backend) as engine:
        run_id = await engine.start("slow", None)
        assert await engine.get_event(run_id, "stage", timeout=10) == "late"
        assert trio.current_time() == 2.5  # before: at its next look (every 0.1 s)


async def test_wakes_entries_go_with_their_last_waiter() -> None:
    wakes = RunWakes()
    with wakes.watching("r1") as first, wakes.watching("r1") as second:
        assert first is second
        assert wakes.waiting == 1
    assert wakes.waiting == 0
    with wakes.watching("r1") as event, wakes.watching(CANCELS) as cancels:
        wakes.wake(["r1"])
        assert event.is_set()
        assert not cancels.is_set()
        wakes.wake(None)
        assert cancels.is_set()
    assert wakes.waiting == 0


def _sqlite(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'w.db'}".replace("///", "////", 1)


@pytest.fixture(
    params=[
        "sqlite",
        "redis",
        "redis-cluster",
        pytest.param("postgres", marks=pytest.mark.postgres),
    ]
)
def shared_url(request: pytest.FixtureRequest, short_tmp: Path) -> str:
    if request.param == "sqlite":
        return _sqlite(short_tmp)
    if request.param == "postgres":
        return str(request.getfixturevalue("postgres_schema_url"))
    if request.param == "redis":
        return str(request.getfixturevalue("redis_url"))
    return str(request.getfixturevalue("redis_cluster_url"))  # SPUBLISH / SSUBSCRIBE


@pytest.fixture
def short_tmp() -> Any:
    """A short folder: a Unix socket's path holds 107 bytes (pytest's tmp_path may not leave
    enough under xdist)."""
    import tempfile
    from pathlib import Path

    folder = tempfile.mkdtemp(prefix="dtw-", dir="/tmp")
    yield Path(folder)
    shutil.rmtree(folder, ignore_errors=True)


def _cli(url: str, *argv: str) -> int:
    return main([*argv, "--backend", url, "--namespace", "wakes"])


async def test_a_signal_from_another_process_wakes_the_run(
    shared_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_signals, "SIGNAL_POLL", 60.0)  # only a ring ends it in time
    app = approvals()
    async with dt.open_backend(shared_url) as backend, open_engine(app, backend) as engine:
        assert isinstance(engine.store, SupportsRunWakes)
        run_id = await engine.start("approve", None)
        with trio.fail_after(10):
            assert await engine.get_event(run_id, "stage", timeout=10) == "waiting"
        await trio.sleep(0.2)  # the run waits on its signal now
        sent = trio.current_time()
        with trio.fail_after(20):
            code = await trio.to_thread.run_sync(
                _cli, shared_url, "runs", "signal", run_id, "ok", '"yes"'
            )
            assert code == 0
            assert await engine.result(run_id) == "yes"
        assert trio.current_time() - sent < 20
        assert engine.store.wakes.woken >= 1


async def test_an_operators_cancel_from_another_process_is_delivered_at_once(
    shared_url: str,
) -> None:
    app = App("wakes")
    undone: list[str] = []

    @app.workflow("wait")
    async def wait(ctx: WorkflowContext, _: Any) -> None:
        try:
            await ctx.wait_signal("never")
        except dt.RunCancelled:
            undone.append("undo")
            raise

    # The engine's own look for marks is every run_lease / 3 = 100 s: only a ring is in time.
    async with (
        dt.open_backend(shared_url) as backend,
        open_engine(app, backend, run_lease=300) as engine,
    ):
        run_id = await engine.start("wait", None)
        await trio.sleep(0.3)
        with trio.fail_after(30):
            code = await trio.to_thread.run_sync(_cli, shared_url, "runs", "cancel", run_id)
        assert code == 0
        record = await engine.get(run_id)
    assert record.status is RunStatus.CANCELLED
    assert record.error == {
        "type": "RunCancelled",
        "message": "cancelled by an operator",
        "cut": False,
    }
    assert undone == ["undo"]


async def test_with_the_wakes_folder_gone_the_poll_still_delivers(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_signals, "SIGNAL_POLL", 0.2)
    url = _sqlite(short_tmp)
    app = approvals()
    async with dt.open_backend(url) as backend, open_engine(app, backend) as engine:
        run_id = await engine.start("approve", None)
        with trio.fail_after(10):
            await engine.get_event(run_id, "stage", timeout=10)
        await trio.sleep(0.2)
        folder = short_tmp / "w.db.wakes"
        assert folder.is_dir()
        shutil.rmtree(folder)  # the socket and its folder removed by a person
        with trio.fail_after(20):
            assert (
                await trio.to_thread.run_sync(_cli, url, "runs", "signal", run_id, "ok", "1") == 0
            )
            assert await engine.result(run_id) == 1


async def test_a_result_applied_by_another_engine_reaches_the_owner_at_once(
    shared_url: str,
) -> None:
    """Two engines, each with its own backend (as two processes): the other one applies the
    step's result and rings; the owner, whose watch ticks only every minute here, settles the
    run at once."""
    app = App("wakes")

    @app.workflow("wf")
    async def wf(ctx: WorkflowContext, _: Any) -> Any:
        return await ctx.step("served-elsewhere", 1)

    async with (
        dt.open_backend(shared_url) as mine,
        dt.open_backend(shared_url) as theirs,
        open_engine(app, mine, engine_id="o", watch_interval=60) as owner,
        open_engine(app, theirs, engine_id="x", reconcile=False, watch_interval=60) as other,
    ):
        await owner.start("wf", None, run_id="r")
        await trio.sleep(0.3)
        done = dt.StepResult("r", "1", 1, dt.StepStatus.COMPLETED, output="from x")
        await other._results.on_result(done)
        with trio.fail_after(10):
            assert await owner.result("r") == "from x"


async def test_remote_runs_with_two_engines_end_at_their_exact_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Remote workflows (turns), two engines taking results and decisions alike: a decision or
    a result applied by the engine that does not drive the run rings the one that does, so
    every run ends at its timer's exact time (before: 10 to 13 s, a watch tick per hop)."""
    from collections import Counter

    from test_remote_engine import ORDER, engine_app, worker_app

    async with dt.open_backend("memory://") as backend:
        async with (
            dt.open_worker(worker_app(Counter()), backend),
            open_engine(engine_app(), backend, engine_id="a") as owner,
            open_engine(engine_app(), backend, engine_id="b", reconcile=False) as other,
        ):
            run_ids = [await owner.start("order", {**ORDER, "id": n}) for n in range(8)]
            for run_id in run_ids:
                await owner.result(run_id)
            assert trio.current_time() == 10.0  # the workflow's durable timer, and nothing else
            applied = owner.statistics().results_applied + other.statistics().results_applied
            assert applied == 24


# -- issue 30, item 1: a detached start from another process ----------------------------------


def one_step() -> App:
    app = App("wakes")

    @app.step("double")
    async def double(n: int) -> int:
        return 2 * n

    @app.workflow("once")
    async def once(ctx: WorkflowContext, n: int) -> Any:
        return await ctx.step("double", n)

    return app


async def test_a_detached_start_through_another_engine_is_taken_over_at_once_on_memory(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The starter (reconcile=False, as a web handler's) rings; the owner reconciles now, not
    at its tick (t=5), and the starter's ``result`` returns on the owner's ring, not at its
    next poll."""
    app = one_step()
    async with dt.open_backend("memory://") as backend:
        async with (
            dt.open_worker(app, backend),
            open_engine(app, backend, engine_id="owner", reconcile_interval=5) as owner,
            open_engine(
                app, backend, engine_id="web", reconcile=False, watch_interval=60
            ) as starter,
        ):
            await trio.sleep(1.25)
            began = trio.current_time()
            run_id = await starter.start("once", 21, detach=True)
            assert await starter.result(run_id) == 42
            assert trio.current_time() == began  # before: the reconcile at t=5
            assert (await owner.get(run_id)).status is RunStatus.COMPLETED
            assert owner.statistics().runs_resumed == 1


def _start_and_wait(url: str, n: int) -> tuple[Any, float]:
    """Another process's start (its own ``trio.run``, backend and engine): start detached, wait
    for the result; returns it and the seconds it took."""

    async def main() -> tuple[Any, float]:
        async with (
            dt.open_backend(url) as backend,
            # Its poll for the result every minute: only the owner's ring returns in time.
            open_engine(one_step(), backend, reconcile=False, watch_interval=60) as starter,
        ):
            began = trio.current_time()
            run_id = await starter.start("once", n, detach=True)
            with trio.fail_after(30):
                output = await starter.result(run_id)
            return output, trio.current_time() - began

    return trio.run(main)


async def test_a_detached_start_from_another_process_is_taken_over_by_its_wake(
    shared_url: str,
) -> None:
    """SQLite, Redis and PostgreSQL: the owner's reconcile runs every 10 minutes here and the
    starter polls every minute; a run that ends within the bound was taken over through the
    store's wake (its ``STARTS`` ring) and its result returned on the owner's ring."""
    app = one_step()
    async with (
        dt.open_backend(shared_url) as backend,
        dt.open_worker(app, backend),
        open_engine(app, backend, reconcile_interval=600, watch_interval=600) as owner,
    ):
        await trio.sleep(0.3)  # the owner's initial reconcile is done
        for n in range(3):
            with trio.fail_after(25):
                output, took = await trio.to_thread.run_sync(_start_and_wait, shared_url, n)
            assert output == 2 * n
            assert took < 25
        assert owner.statistics().runs_resumed == 3


# -- a run an operator retried, or an engine released: taken over at once ----------------------


def flaky_once() -> tuple[App, dict[str, bool]]:
    """A step that fails while ``declined["card"]`` (one attempt, so the run fails)."""
    app = App("wakes-retry")
    declined = {"card": True}

    @app.step("charge", retry=dt.Retry(max_attempts=1))
    async def charge(n: int) -> int:
        if declined["card"]:
            raise RuntimeError("card declined")
        return n

    @app.workflow("order")
    async def order(ctx: WorkflowContext, n: int) -> Any:
        return await ctx.step("charge", n)

    return app, declined


async def test_a_run_an_operator_retried_is_taken_over_at_once_on_memory(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``ops.retry_run`` (the CLI's, the console's) rings ``STARTS``: the owner resumes the run
    now, not at its next reconcile (t=5 after its start here)."""
    app, declined = flaky_once()
    async with dt.open_backend("memory://") as backend:
        async with (
            dt.open_worker(app, backend),
            open_engine(app, backend, reconcile_interval=5) as owner,
            dt.open_operations(backend, namespace=app.name) as ops,
        ):
            run_id = await owner.start("order", 7)
            with pytest.raises(dt.RunFailed):
                await owner.result(run_id)
            await trio.sleep(0.5)
            declined["card"] = False
            began = trio.current_time()
            await ops.retry_run(run_id)
            assert await owner.result(run_id) == 7
            assert trio.current_time() == began  # not at the owner's next reconcile


def _retry_elsewhere(url: str, run_id: str) -> None:
    """Another process's ``durable-trio runs retry RUN_ID``."""

    async def main() -> None:
        async with dt.open_operations(url, namespace="wakes-retry") as ops:
            await ops.retry_run(run_id)

    trio.run(main)


async def test_a_run_retried_from_another_process_is_taken_over_by_its_wake(
    shared_url: str,
) -> None:
    """SQLite, Redis and PostgreSQL: the owner reconciles every 10 minutes; the run retried
    from another process ends within the bound, so the owner took it through the ring."""
    app, declined = flaky_once()
    async with (
        dt.open_backend(shared_url) as backend,
        dt.open_worker(app, backend),
        open_engine(app, backend, reconcile_interval=600, watch_interval=0.2) as owner,
    ):
        run_id = await owner.start("order", 7)
        with pytest.raises(dt.RunFailed):
            await owner.result(run_id)
        declined["card"] = False
        await trio.to_thread.run_sync(_retry_elsewhere, shared_url, run_id)
        with trio.fail_after(25):
            assert await owner.result(run_id) == 7


async def test_the_runs_a_closing_engine_releases_are_taken_over_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A closing engine releases its runs and rings ``STARTS``: the other engine takes them now,
    not at its next reconcile (t=600)."""
    app = App("wakes-release")

    @app.workflow("nap")
    async def nap(ctx: WorkflowContext, _: Any) -> str:
        await ctx.sleep(10)
        return "rested"

    async with dt.open_backend("memory://") as backend:
        async with open_engine(app, backend, engine_id="heir", reconcile_interval=600) as heir:
            await trio.sleep(0.5)  # its first reconcile is done
            async with open_engine(app, backend, engine_id="leaver", reconcile_interval=600) as a:
                run_id = await a.start("nap")
                await trio.sleep(1)
            released = trio.current_time()
            await trio.testing.wait_all_tasks_blocked()
            record = await heir.get(run_id)
            assert record.owner == "heir", record
            assert trio.current_time() == released
            assert await heir.result(run_id) == "rested"
            assert trio.current_time() == released - 1 + 10  # its timer as it was set


# -- a schedule added from another process: read at once -----------------------------------


def ticking() -> App:
    app = App("wakes-sched")

    @app.workflow("tick")
    async def tick(ctx: WorkflowContext, _: Any) -> str:
        return "ticked"

    return app


async def test_a_schedule_added_through_the_store_is_read_at_once_on_memory(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The engine re-reads its schedules every 600 s here; one added by an operator's call (not
    through this engine) at t=0.5 starts its first tick's run at exactly t=60."""
    from durable_trio._engine._schedules import Schedules, schedule_run_id
    from durable_trio.testing import virtual_wall_clock

    app = ticking()
    wall = virtual_wall_clock()
    async with dt.open_backend("memory://") as backend:
        async with (
            open_engine(app, backend, schedule_recheck=600) as engine,
            dt.open_operations(backend, namespace=app.name) as ops,
        ):
            await trio.sleep(0.5)
            await Schedules(ops.store, wall).add("minutely", "tick", every=60)
            await trio.sleep(60 - trio.current_time())
            await trio.testing.wait_all_tasks_blocked()
            run = await engine.get(schedule_run_id("minutely", wall()))
            assert run.created_at == trio.current_time() == 60  # (not at a re-read, t=600)


def _add_schedule_elsewhere(url: str) -> None:
    """Another process's ``durable-trio schedules add``."""
    from durable_trio._engine._schedules import Schedules

    async def main() -> None:
        async with dt.open_operations(url, namespace="wakes-sched") as ops:
            await Schedules(ops.store, time.time).add("each-second", "tick", every=1)

    trio.run(main)


async def test_a_schedule_added_from_another_process_is_read_at_once(shared_url: str) -> None:
    """SQLite, Redis and PostgreSQL: the engine re-reads its schedules every 600 s; a schedule
    added by another process ticks within seconds (the store's SCHEDULES ring)."""
    app = ticking()
    async with (
        dt.open_backend(shared_url) as backend,
        open_engine(app, backend, schedule_recheck=600) as engine,
    ):
        await trio.sleep(0.3)
        await trio.to_thread.run_sync(_add_schedule_elsewhere, shared_url)
        for _ in range(100):  # 10 s
            if await engine.list(workflow="tick"):
                break
            await trio.sleep(0.1)
        assert await engine.list(workflow="tick")


# -- a debounced start recorded elsewhere: started at its due time ---------------------------


def _debounce_elsewhere(url: str) -> str:
    """Another process's ``durable-trio run --detach --debounce KEY --debounce-delay 1``."""

    async def main() -> str:
        async with dt.open_operations(url, namespace="wakes") as ops:
            return await ops.start_run("once", 4, debounce=dt.Debounce(key="k", delay=1))

    return trio.run(main)


async def test_a_debounced_start_from_another_process_starts_at_its_due_time(
    shared_url: str,
) -> None:
    """SQLite, Redis and PostgreSQL: the owner's reconcile (and its re-read of pending starts)
    runs every 10 minutes; a start debounced 1 s by another process runs within seconds (the
    store's DEBOUNCED ring told the owner when it is due)."""
    app = one_step()
    async with (
        dt.open_backend(shared_url) as backend,
        dt.open_worker(app, backend),
        open_engine(app, backend, reconcile_interval=600, watch_interval=0.2) as owner,
    ):
        await trio.sleep(0.3)  # the owner's first reads are done
        run_id = await trio.to_thread.run_sync(_debounce_elsewhere, shared_url)
        with trio.fail_after(15):
            assert await owner.result(run_id) == 8


async def test_a_burst_of_debounced_starts_costs_an_engine_a_read_per_gap(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """100 debounced starts recorded by an operator's calls over 0.1 s ring 100 times; the
    engine's loop reads the pending starts once per ``RUNG_GAP`` at most, not once per ring."""
    from durable_trio._engine._debounced import RUNG_GAP

    app = one_step()
    async with dt.open_backend("memory://") as backend:
        async with (
            dt.open_worker(app, backend),
            open_engine(app, backend, reconcile_interval=600) as engine,
            dt.open_operations(backend, namespace=app.name) as ops,
        ):
            await trio.sleep(1)
            store = engine.store
            reads: list[float] = []
            inner = store.start_debounced

            async def counted(limit: int = 100) -> Any:
                reads.append(trio.current_time())
                return await inner(limit)

            store.start_debounced = counted  # type: ignore[method-assign]
            began = trio.current_time()
            ids = set()
            for n in range(100):
                debounce = dt.Debounce(key=f"k{n}", delay=5)
                ids.add(await ops.start_run("once", n, debounce=debounce))
                await trio.sleep(0.001)
            await trio.sleep(5)
            await trio.testing.wait_all_tasks_blocked()
            for run_id in ids:
                assert (await engine.get(run_id)).status is RunStatus.COMPLETED
            rung = [t for t in reads if t < began + 5]
            assert 1 <= len(rung) <= 4, rung  # (one per 0.05 s over 0.1 s; not 100)
            assert all(b - a >= RUNG_GAP - 1e-9 for a, b in itertools.pairwise(rung))
