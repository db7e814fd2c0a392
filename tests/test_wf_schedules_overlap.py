"""Schedule overlap policies and backfill (issue 33, item 5), under trio's virtual clock, on
memory, a real SQLite file, a private Redis and a private PostgreSQL.

A 2 s schedule of a workflow that takes 5 s (4.5 s for ``buffer_one``, so no run ends on a
tick): ``skip`` (the default) starts a tick only when the previous run ended, ``buffer_one``
starts one held tick the moment that run ends, ``allow`` stacks runs, ``cancel_other``
cancels the running one and starts the tick. The workflow waits with ``trio.sleep`` (not a
durable timer: the SQLite, Redis and PostgreSQL stores' clock is the real one, so a durable
timer would end a few real milliseconds off the virtual second), so every time is exact.

Backfill starts each tick of a past range exactly once: again, after an interrupted backfill,
through the engine's API, ``Operations`` and the CLI.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing

import durable_trio as dt
import test_wf_schedules as base
from durable_trio._engine import App, RunStatus, WorkflowContext, open_run_store
from durable_trio._engine._schedule_defs import MAX_CATCH_UP
from durable_trio._engine._schedules import MAX_BACKFILL, Schedule, Schedules, schedule_run_id
from durable_trio.testing import virtual_wall_clock
from test_wf_schedules import EPOCH, engines

if TYPE_CHECKING:
    from pathlib import Path

    from durable_trio._engine._stores import RunStore

# The stores and clock of test_wf_schedules: memory, SQLite, Redis, PostgreSQL.
store_kind = base.store_kind
url = base.url
sched_clock = base.sched_clock


class Log:
    """What the scheduled runs did: (run id, start) in order, and the most at once."""

    def __init__(self) -> None:
        self.started: list[tuple[str, float]] = []
        self.running = 0
        self.most = 0

    def ticks(self) -> list[str]:
        """The started run ids' ticks, seconds after the epoch."""
        return [run_id.rsplit(":", 1)[1] for run_id, _ in self.started]

    def times(self) -> list[float]:
        return [t for _, t in self.started]


def slow_app(log: Log, seconds: float, *, durable: bool = False) -> App:
    """``durable``: wait on a durable timer (a cancel reaches the workflow there, at once)."""
    app = App("reports")

    @app.workflow("slow")
    async def slow(ctx: WorkflowContext, input: Any) -> Any:
        log.started.append((ctx.run_id, trio.current_time()))
        log.running += 1
        log.most = max(log.most, log.running)
        try:
            if durable:
                await ctx.sleep(seconds)
            else:
                await trio.sleep(seconds)
        finally:
            log.running -= 1
        return input

    return app


def at(seconds: float) -> str:
    """The run id of the 2 s schedule's tick ``seconds`` after the epoch."""
    return schedule_run_id("two", EPOCH + seconds)


async def test_skip_is_the_default_and_never_stacks(
    url: str, sched_clock: trio.testing.MockClock
) -> None:
    """A 2 s schedule of a 5 s workflow: ticks 4, 6, 10, 12 start nothing (counted)."""
    log = Log()
    app = slow_app(log, 5)
    app.schedule("two", "slow", every=2)
    async with engines(app, url) as (engine,):
        await trio.sleep_until(15)
        (info,) = await engine.schedules.list()
        runs = await engine.store.list_runs()
    assert [run_id for run_id, _ in log.started] == [at(2), at(8), at(14)]
    assert log.times() == [2, 8, 14]
    assert log.most == 1
    assert info.schedule is not None
    assert info.schedule.overlap == "skip"
    assert info.skipped == 4
    assert info.last_tick == EPOCH + 14
    assert len(runs) == 3


async def test_allow_stacks_runs_as_before(url: str, sched_clock: trio.testing.MockClock) -> None:
    log = Log()
    app = slow_app(log, 5)
    app.schedule("two", "slow", every=2, overlap="allow")
    async with engines(app, url) as (engine,):
        await trio.sleep_until(15)
        (info,) = await engine.schedules.list()
    assert log.times() == [2, 4, 6, 8, 10, 12, 14]
    assert log.most == 3
    assert info.skipped == 0


async def test_buffer_one_starts_one_held_tick_when_the_run_ends(
    url: str, sched_clock: trio.testing.MockClock
) -> None:
    """4.5 s runs: tick 4 waits for the run of 2 (ends 6.5), 6 is dropped; the run of 4 ends
    at 11, where the held 8 starts (10 dropped); the held 12 starts at 15.5 (14 dropped)."""
    log = Log()
    app = slow_app(log, 4.5)
    app.schedule("two", "slow", every=2, overlap="buffer_one")
    async with engines(app, url) as (engine,):
        await trio.sleep_until(12.5)
        (held,) = await engine.schedules.list()
        await trio.sleep_until(15.75)
        (info,) = await engine.schedules.list()
    assert log.started == [(at(2), 2), (at(4), 6.5), (at(8), 11), (at(12), 15.5)]
    assert log.most == 1
    assert held.buffered == EPOCH + 12
    assert info.buffered is None
    assert info.skipped == 3  # 6, 10, 14


async def test_cancel_other_cancels_the_running_one_then_starts(
    url: str, sched_clock: trio.testing.MockClock
) -> None:
    log = Log()
    app = slow_app(log, 5, durable=True)
    app.schedule("two", "slow", every=2, overlap="cancel_other")
    async with engines(app, url) as (engine,):
        await trio.sleep_until(9)
        statuses = {r.run_id: r.status for r in await engine.store.list_runs()}
        ended = await engine.get(at(2))
    assert log.times() == [2, 4, 6, 8]
    assert log.most == 1
    assert statuses == {
        at(2): RunStatus.CANCELLED,
        at(4): RunStatus.CANCELLED,
        at(6): RunStatus.CANCELLED,
        at(8): RunStatus.RUNNING,
    }
    assert ended.updated_at is not None
    assert "cancel_other" in json.dumps(ended.error)


async def test_an_unknown_overlap_in_a_stored_row_is_a_damaged_row(
    url: str, sched_clock: trio.testing.MockClock
) -> None:
    """Reported once through the error hook, skipped; the other schedules tick on."""
    log = Log()
    errors: list[BaseException] = []
    app = slow_app(log, 0.5)
    app.schedule("two", "slow", every=2)
    async with engines(app, url, on_error=errors.append) as (engine,):
        spec = Schedule.make("odd", "slow", every=2, created_at=EPOCH).dumps()
        odd = spec.replace('"overlap":"skip"', '"overlap":"sometimes"')
        assert odd != spec
        await engine.store.put_schedule("odd", odd, replace=False)
        await trio.sleep_until(7)
        infos = {i.name: i for i in await engine.schedules.list()}
    assert log.times() == [2, 4, 6]
    assert infos["odd"].schedule is None
    assert "overlap" in str(infos["odd"].error)
    assert sum("sometimes" in str(e) for e in errors) == 1


#: Overlap states whose numbers no state holds (damaged data): a skip count one more skip
#: would overflow the JSON encoder's 64-bit integers with (the engine died at the next skipped
#: tick, and every engine after it), ticks past year 9999 (the schedule never fired again, its
#: run id's date out of range). Each reads as a fresh state.
DAMAGED_STATES = [
    pytest.param("{}", id="fresh"),  # (what each damaged one reads as)
    pytest.param('{"skipped": 18446744073709551615}', id="skipped-u64-max"),
    pytest.param('{"started": 1e20}', id="started-past-9999"),
    pytest.param('{"buffered": 1e20}', id="buffered-past-9999"),
    pytest.param('{"started": -5, "skipped": -1}', id="negative"),
]


@pytest.mark.parametrize("state", DAMAGED_STATES)
async def test_a_damaged_overlap_state_reads_as_fresh(
    url: str, sched_clock: trio.testing.MockClock, state: str
) -> None:
    """The 5 s runs of the 2 s schedule of ``test_skip_is_the_default_and_never_stacks``,
    its state damaged at 3 s (while the run of 2 runs): the ticks go on as after a fresh
    state, which lets one tick overlap at worst (the run of 6 starts before the run of 2
    ends: ``OverlapState.loads``), and nothing is reported."""
    log = Log()
    errors: list[BaseException] = []
    app = slow_app(log, 5)
    app.schedule("two", "slow", every=2)
    async with engines(app, url, on_error=errors.append) as (engine,):
        await trio.sleep_until(3)
        await engine.store.put_schedule_state("two", state)
        await trio.sleep_until(15)
        (info,) = await engine.schedules.list()
    assert log.times() == [2, 6, 12]
    assert (log.most, info.skipped) == (2, 4)
    assert errors == []


def test_max_catch_up_is_bounded() -> None:
    """``catch_up="all"`` starts its ticks in one pass of the scheduler, the other schedules
    waiting: at most :data:`MAX_CATCH_UP` (1,000). A stored row asking more (stored before
    the bound, or damaged: 300,000 starved every schedule beside it) reads as the bound."""
    with pytest.raises(dt.ConfigError, match="max_catch_up must be an int from 1 to 1000"):
        Schedule.make("big", "slow", every=1, catch_up="all", max_catch_up=MAX_CATCH_UP + 1)
    spec = Schedule.make("big", "slow", every=1, catch_up="all", max_catch_up=5, created_at=EPOCH)
    stored = spec.dumps().replace('"max_catch_up":5', '"max_catch_up":300000')
    assert stored != spec.dumps()
    assert Schedule.loads("big", stored).max_catch_up == MAX_CATCH_UP


def test_a_row_stored_before_overlap_policies_reads_as_skip() -> None:
    text = '{"workflow": "report", "every": 60, "created_at": 1800000000.0}'
    assert Schedule.loads("old", text).overlap == "skip"
    with pytest.raises(dt.ConfigError, match="overlap is one of"):
        Schedule.make("s", "report", every=60, overlap="sometimes")


async def test_a_changed_overlap_replaces_the_declared_schedule(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    async with dt.open_backend("memory://") as backend:
        app = slow_app(log, 5)
        app.schedule("two", "slow", every=2)
        async with engines(app, backend) as (engine,):
            (info,) = await engine.schedules.list()
            assert info.schedule is not None
            assert info.schedule.overlap == "skip"
        again = slow_app(log, 5)
        again.schedule("two", "slow", every=2, overlap="allow")
        async with engines(again, backend) as (engine,):
            (info,) = await engine.schedules.list()
            assert info.schedule is not None
            assert info.schedule.overlap == "allow"


# ------------------------------------------------------------------------------- backfill


class Interrupted(Exception):
    pass


class DiesAfter:
    """A run store that dies (raises) at its ``n + 1``-th ``create_run``: a killed backfill."""

    def __init__(self, inner: RunStore, n: int) -> None:
        self.inner = inner
        self.left = n

    async def create_run(self, run: Any) -> Any:
        if self.left == 0:
            raise Interrupted
        self.left -= 1
        return await self.inner.create_run(run)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_backfill_starts_each_tick_of_the_range_exactly_once(
    url: str, sched_clock: trio.testing.MockClock
) -> None:
    """Ticks -100..-50 (every 10 s): a dry run starts nothing; a backfill killed after 3
    runs, then a second one, start the 6 ticks once; a third starts nothing. The engine
    takes the pending runs over."""
    log = Log()
    app = slow_app(log, 1)
    app.schedule("ten", "slow", every=10)
    first, last = EPOCH - 100, EPOCH - 50
    ids = [schedule_run_id("ten", EPOCH + t) for t in (-100, -90, -80, -70, -60, -50)]
    async with engines(app, url) as (engine,):
        planned = await engine.schedules.backfill("ten", first, last, dry_run=True)
        assert planned is not None
        assert [t.run_id for t in planned] == ids
        assert all(t.started for t in planned)
        assert await engine.store.list_runs() == []
        wall = virtual_wall_clock(EPOCH)
        killed = Schedules(DiesAfter(engine.store, 3), wall)
        with pytest.raises(Interrupted):
            await killed.backfill("ten", first, last)
        done = await engine.schedules.backfill("ten", first, last)
        assert done is not None
        assert [(t.run_id, t.started) for t in done] == [(i, n >= 3) for n, i in enumerate(ids)]
        again = await engine.schedules.backfill("ten", first - 5, last)
        assert again is not None
        assert not any(t.started for t in again)
        # The runs are pending, as a detached start leaves them: an engine's reconcile (here
        # called: QUIET has no periodic one) takes them over.
        await engine.reconcile()  # (those a ring had it take already are not counted)
        await trio.sleep_until(5)
        runs = {r.run_id: r.status for r in await engine.store.list_runs()}
        (info,) = await engine.schedules.list()
    assert runs == dict.fromkeys(ids, RunStatus.COMPLETED)
    assert sorted(run_id for run_id, _ in log.started) == ids  # each ran once
    assert info.last_tick is None  # the schedule's own ticks are untouched


async def test_backfill_refuses_a_future_reversed_or_too_wide_range(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = Log()
    app = slow_app(log, 1)
    app.schedule("two", "slow", every=2)
    async with engines(app, "memory://") as (engine,):
        schedules = engine.schedules
        with pytest.raises(dt.ConfigError, match="after now"):
            await schedules.backfill("two", EPOCH - 10, EPOCH + 10)
        with pytest.raises(dt.ConfigError, match="is after the end"):
            await schedules.backfill("two", EPOCH - 10, EPOCH - 20)
        with pytest.raises(dt.ConfigError, match="more than 1000 ticks"):
            await schedules.backfill("two", EPOCH - 2 * MAX_BACKFILL, EPOCH)
        with pytest.raises(dt.ConfigError, match="must be a time"):
            await schedules.backfill("two", float("nan"), EPOCH)
        assert await schedules.backfill("nope", EPOCH - 10, EPOCH) is None
        widest = await schedules.backfill("two", EPOCH - 2 * (MAX_BACKFILL - 1), EPOCH)
        assert widest is not None
        assert len(widest) == MAX_BACKFILL
        assert len(await engine.store.list_runs(limit=2000)) == MAX_BACKFILL


async def test_operations_backfill(tmp_path: Path) -> None:
    from durable_trio._ops import open_operations

    db = f"sqlite:///{tmp_path / 'ops.db'}"
    async with dt.open_backend(db) as backend, open_run_store(backend, "reports") as store:
        await Schedules(store, lambda: 1_700_000_000.0).add("hourly", "slow", every=3600)
    async with open_operations(db, namespace="reports") as ops:
        done = await ops.backfill_schedule("hourly", 1_600_000_000, 1_600_010_000)
        assert done is not None
        assert [t.started for t in done] == [True, True, True]  # 13:00, 14:00, 15:00 UTC
        again = await ops.backfill_schedule("hourly", 1_600_000_000, 1_600_010_000)
        assert again is not None
        assert [t.started for t in again] == [False, False, False]
        runs = await ops.list_runs()
    assert sorted(r.run_id for r in runs.runs) == [
        "sched:hourly:2020-09-13T13:00:00Z",
        "sched:hourly:2020-09-13T14:00:00Z",
        "sched:hourly:2020-09-13T15:00:00Z",
    ]
    assert {r.status for r in runs.runs} == {RunStatus.PENDING}


def test_schedules_backfill_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from durable_trio.cli._main import main

    backend = ["--backend", f"sqlite:///{tmp_path / 'cli.db'}", "--namespace", "reports"]
    minutely = ["minutely", "slow", "--every", "60", "--overlap", "buffer_one"]
    assert main(["schedules", "add", *minutely, *backend]) == 0
    span = ["--from", "2024-01-01T00:00:00Z", "--to", "2024-01-01T00:02:00"]  # UTC: 3 ticks
    capsys.readouterr()
    assert main(["schedules", "backfill", "minutely", *span, "--dry-run", *backend]) == 0
    out = capsys.readouterr().out
    assert out.count("would start") == 4  # 3 ticks, and the summary
    assert "sched:minutely:2024-01-01T00:01:00Z" in out
    assert main(["schedules", "backfill", "minutely", *span, *backend]) == 0
    assert "3 started, 0 had a run" in capsys.readouterr().out
    unix = ["--from", "1704067200", "--to", "1704067260", "--json"]  # 00:00 and 00:01
    assert main(["schedules", "backfill", "minutely", *unix, *backend]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["runId"], r["started"]) for r in rows] == [
        ("sched:minutely:2024-01-01T00:00:00Z", False),
        ("sched:minutely:2024-01-01T00:01:00Z", False),
    ]
    assert main(["schedules", "backfill", "nope", *span, *backend]) == 1
    far = ["--from", "2000-01-01", "--to", "2024-01-01"]
    assert main(["schedules", "backfill", "minutely", *far, *backend]) == 2
    err = capsys.readouterr().err
    assert "more than 1000 ticks" in err
    assert main(["schedules", "backfill", "minutely", "--from", "then", "--to", "0", *backend]) == 2
    assert "not a time" in capsys.readouterr().err
    assert main(["schedules", "list", *backend]) == 0
    out = capsys.readouterr().out
    assert "overlap" in out.splitlines()[0]
    assert "buffer_one" in out
    assert main(["schedules", "list", "--json", *backend]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert (listed["overlap"], listed["skipped"], listed["buffered"]) == ("buffer_one", 0, None)


# ----------------------------------------------------------------------------- simulation


def sim_app(overlap: str) -> App:
    app = App("sim-overlap")

    @app.step("work")
    async def work(n: int) -> int:
        return n + 1

    @app.workflow("order")
    async def order(ctx: WorkflowContext, n: int) -> int:
        return int(await ctx.step("work", n))

    @app.workflow("long")
    async def long(ctx: WorkflowContext, _: Any) -> str:
        await ctx.sleep(90)  # longer than the schedule's period: ticks meet a running run
        return ctx.run_id

    app.schedule("every-minute", "long", every=60, overlap=overlap)  # type: ignore[arg-type]
    return app


def simulate(app: App, seed: int) -> Any:
    from durable_trio.testing import Faults, Simulation

    def workload(rng: Any, index: int) -> tuple[str, Any]:
        return "order", rng.randrange(100)

    return Simulation(
        app,
        workload,
        seed=seed,
        runs=20,
        duration=1800,
        engines=2,
        faults=Faults(engine_kills_per_hour=12.0, engine_restart_delay=120.0),
        engine_options={"wall_clock": virtual_wall_clock(EPOCH), "run_lease": 30.0},
    ).run_sync()


@pytest.mark.parametrize("seed", [3, 11])
def test_simulated_skip_never_runs_two_at_once_with_two_engines_and_kills(seed: int) -> None:
    """Two engines killed and replaced; 90 s runs every 60 s. The harness's invariant: under
    ``skip`` no run of the schedule is created while another is unfinished; a tick may be
    missing only while one was (or while no engine was up)."""
    report = simulate(sim_app("skip"), seed)
    assert report.violations == ()
    assert report.faults.get("engine-kill", 0) >= 2
    (ticks,) = [e for e in report.history if e["ev"] == "schedule-ticks"]
    assert 8 <= ticks["started"] <= ticks["due"] // 2 + 1  # about one tick in two


def test_the_simulation_sees_two_runs_at_once() -> None:
    """The invariant is not vacuous: the same schedule under ``allow`` stacks runs, which the
    check, applied to its spans, reports."""
    from durable_trio.testing._sim_ledger import Ledger
    from durable_trio.testing._sim_schedules import _check_one_at_once

    ledger = Ledger(transport_options={})
    _check_one_at_once(ledger, "s", [(0.0, 90.0), (60.0, 150.0)])
    _check_one_at_once(ledger, "t", [(0.0, 90.0), (120.0, 210.0)])
    assert len(ledger.violations) == 1
    assert "two runs at once" in ledger.violations[0]
    report = simulate(sim_app("allow"), 3)
    (ticks,) = [e for e in report.history if e["ev"] == "schedule-ticks"]
    assert ticks["started"] > ticks["due"] // 2 + 1  # allow: about every tick starts


def test_the_console_shows_the_overlap_policy_and_its_skips() -> None:
    from durable_trio._engine._schedules import ScheduleInfo
    from durable_trio.console._schedules_view import render_schedules

    schedule = Schedule.make("two", "slow", every=2, overlap="buffer_one", created_at=EPOCH)
    info = ScheduleInfo(
        name="two", schedule=schedule, last_tick=EPOCH + 8, next_tick=EPOCH + 10, skipped=3,
        buffered=EPOCH + 8,
    )  # fmt: skip
    page = str(render_schedules([info], allow_actions=False))
    assert "<th>overlap</th>" in page
    assert '<td data-overlap="buffer_one">buffer_one (3 skipped) · one buffered</td>' in page


# ------------------------------------------------------------------------- the stored state


async def test_the_overlap_state_lives_and_dies_with_its_schedule(
    url: str, sched_clock: trio.testing.MockClock
) -> None:
    spec = Schedule.make("s", "slow", every=2, created_at=EPOCH).dumps()
    async with dt.open_backend(url) as backend, open_run_store(backend, "reports") as store:
        await store.put_schedule_state("ghost", '{"skipped": 1}')  # no such schedule: nothing
        assert await store.get_schedule_states() == {}
        assert await store.put_schedule("s", spec, replace=False)
        await store.put_schedule_state("s", '{"skipped": 2}')
        assert await store.put_schedule("s", spec, replace=True)  # a new definition keeps it
        await store.mark_schedule_tick("s", EPOCH + 2)
        assert await store.get_schedule_states() == {"s": '{"skipped": 2}'}
        assert await store.delete_schedule("s")
        assert await store.put_schedule("s", spec, replace=False)
        assert await store.get_schedule_states() == {}  # deleted with it


async def test_an_older_sqlite_file_gets_the_state_column(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE dt_schedules (namespace TEXT NOT NULL, name TEXT NOT NULL, "
        "spec TEXT NOT NULL, last_tick REAL, PRIMARY KEY (namespace, name)) WITHOUT ROWID"
    )
    old = '{"workflow": "slow", "every": 2, "created_at": 1800000000.0}'
    db.execute("INSERT INTO dt_schedules VALUES ('reports', 'old', ?, 1800000010.0)", (old,))
    db.commit()
    db.close()
    async with dt.open_backend(f"sqlite:///{path}") as backend:
        async with open_run_store(backend, "reports") as store:
            (info,) = await Schedules(store, lambda: EPOCH + 20).list()
            assert info.schedule is not None
            assert info.schedule.overlap == "skip"  # stored before overlap policies
            await store.put_schedule_state("old", '{"skipped": 3}')
            assert await store.get_schedule_states() == {"old": '{"skipped": 3}'}


@pytest.mark.postgres
async def test_a_postgres_schema_at_runs_version_1_is_migrated(postgres_url: str) -> None:
    from durable_trio._engine._stores._pg_tables import RUNS_MIGRATIONS
    from durable_trio._postgres._migrations import migrate, schema_versions
    from durable_trio._postgres._pool import open_pool

    schema = f"t_{uuid.uuid4().hex[:12]}"
    old = '{"workflow": "slow", "every": 2, "created_at": 1800000000.0}'
    async with open_pool(postgres_url, size=2) as pool:
        assert await migrate(pool, schema, "runs", RUNS_MIGRATIONS[:1]) == 1
        await pool.execute(
            f'INSERT INTO "{schema}".run_schedules (namespace, name, spec) VALUES ($1, $2, $3)',
            "reports", "old", old,
        )  # fmt: skip
    async with dt.open_backend(f"{postgres_url}?schema={schema}") as backend:
        async with open_run_store(backend, "reports") as store:
            (info,) = await Schedules(store, lambda: EPOCH).list()
            assert info.schedule is not None
            assert info.schedule.overlap == "skip"
            await store.put_schedule_state("old", '{"skipped": 1}')
            assert await store.get_schedule_states() == {"old": '{"skipped": 1}'}
    async with open_pool(postgres_url, size=2) as pool:
        assert (await schema_versions(pool, schema))["runs"] == len(RUNS_MIGRATIONS)
