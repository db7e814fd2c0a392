"""Schedules (issue 18, item 4) under trio's virtual clock, on memory, a real SQLite file and a
private Redis: exact tick times, cron in a time zone (across a DST change), pause / resume /
delete, two engines on one store (one run per tick), each catch-up policy after every engine
was down, run-time schedules through the API and the CLI, bad input, damaged stored data.

SQLite and Redis answer from a thread or a socket: their clock jumps only after 0.2 s of real
idleness (``autojump_threshold``), far more than a store call takes, so the asserted virtual
times stay exact while the store works.
"""

from __future__ import annotations

import datetime
import json
import time
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio._engine import App, RunStatus, WorkflowContext, open_engine, open_run_store
from durable_trio._engine._schedules import Schedule, schedule_run_id
from durable_trio._engine._stores.sqlite import SqliteRunStore
from durable_trio.testing import virtual_wall_clock
from durable_trio.testing.fixtures import (  # the plugin's fixtures, for this module
    engine_for,  # noqa: F401
    memory_backend,  # noqa: F401
    workers_for,  # noqa: F401
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from durable_trio._engine import Engine
    from durable_trio.testing.fixtures import EngineFactory, WorkersFactory

EPOCH = 1_800_000_000.0  # 2027-01-15 08:00:00 UTC; a multiple of 60, 3600 s
#: Options that leave the scheduler's ticks as the only frequent timers.
QUIET: dict[str, Any] = {
    "run_lease": 3600.0,
    "reconcile_interval": None,
    "watch_interval": None,
    "schedule_recheck": 3600.0,
}


@pytest.fixture(
    params=["memory", "sqlite", "redis", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def url(store_kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if store_kind == "memory":
        return "memory://"
    if store_kind == "sqlite":
        return "sqlite:///" + str(tmp_path / "sched.db")
    if store_kind == "postgres":
        return str(request.getfixturevalue("postgres_schema_url"))
    return str(request.getfixturevalue("redis_url"))


@pytest.fixture
def sched_clock(store_kind: str) -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0 if store_kind == "memory" else 0.2)


def reporting_app(started: list[tuple[str, float]]) -> App:
    app = App("reports")

    @app.workflow("report")
    async def report(ctx: WorkflowContext, input: Any) -> Any:
        started.append((ctx.run_id, trio.current_time()))
        return input

    return app


@asynccontextmanager
async def engines(
    app: App, url: str | dt.Backend, count: int = 1, **options: Any
) -> AsyncIterator[list[Engine]]:
    """``count`` engines of ``app`` on one backend (``url``, or one already open)."""
    settings = {**QUIET, "wall_clock": virtual_wall_clock(EPOCH), **options}
    async with AsyncExitStack() as stack:
        if isinstance(url, str):
            backend = await stack.enter_async_context(dt.open_backend(url))
        else:
            backend = url
        # The run store is the backend's (SQLite file, Redis); the queues a memory broker's, so
        # no broker polling wakes the virtual clock.
        queues = backend
        if not backend.url.startswith("memory"):
            queues = await stack.enter_async_context(dt.open_backend("memory://"))
        store = await stack.enter_async_context(open_run_store(backend, app.name))
        opened = [
            await stack.enter_async_context(
                open_engine(app, queues, store=store, engine_id=f"e{i}", **settings)
            )
            for i in range(count)
        ]
        yield opened


def times(started: list[tuple[str, float]]) -> list[float]:
    return [t for _, t in started]


async def test_every_60_starts_runs_at_exactly_60_120_180(
    url: str, sched_clock: trio.testing.MockClock
) -> None:
    started: list[tuple[str, float]] = []
    app = reporting_app(started)
    app.schedule("minutely", "report", every=60, input={"k": 1})
    async with engines(app, url) as (engine,):
        await trio.sleep_until(200)
        assert times(started) == [60, 120, 180]
        ids = [run_id for run_id, _ in started]
        assert ids[0] == "sched:minutely:2027-01-15T08:01:00Z"
        assert ids == [schedule_run_id("minutely", EPOCH + t) for t in (60, 120, 180)]
        for run_id in ids:
            assert await engine.result(run_id) == {"k": 1}
        (info,) = await engine.schedules.list()
        assert info.last_tick == EPOCH + 180
        assert info.next_tick == EPOCH + 240


@pytest.mark.parametrize("store_kind", ["memory", "sqlite", "redis"])  # calendar, not store
async def test_cron_in_a_time_zone(url: str, sched_clock: trio.testing.MockClock) -> None:
    # Kathmandu is UTC+05:45: "15 * * * *" there fires at :30 UTC. The wall clock starts at
    # 08:29 UTC (14:14 local): the first tick is 08:30 UTC, at virtual t = 60.
    started: list[tuple[str, float]] = []
    app = reporting_app(started)
    app.schedule("quarter", "report", cron="15 * * * *", timezone="Asia/Kathmandu")
    async with engines(app, url, wall_clock=virtual_wall_clock(EPOCH + 29 * 60)) as (engine,):
        await trio.sleep_until(120)
        (info,) = await engine.schedules.list()
    assert started == [("sched:quarter:2027-01-15T08:30:00Z", 60)]
    assert info.next_tick == EPOCH + 90 * 60  # 09:30 UTC


async def test_cron_in_a_time_zone_across_a_dst_change(
    autojump_clock: trio.testing.MockClock,
) -> None:
    url = "memory://"  # three virtual days: the other stores run the short test above
    # 2027-03-28 is the spring-forward day in Paris: 02:00 CET jumps to 03:00 CEST.
    # "30 2 * * *" has no 02:30 that day: cronsim fires at 03:00 CEST, the first valid time.
    paris = datetime.timezone(datetime.timedelta(hours=1))
    epoch = datetime.datetime(2027, 3, 27, 0, 0, tzinfo=paris).timestamp()
    started: list[tuple[str, float]] = []
    app = reporting_app(started)
    app.schedule("nightly", "report", cron="30 2 * * *", timezone="Europe/Paris")
    async with engines(app, url, wall_clock=virtual_wall_clock(epoch)):
        await trio.sleep_until(3 * 86400)
    hour = 3600
    assert times(started) == [
        2.5 * hour,  # 27 March 02:30 CET
        24 * hour + 2 * hour,  # 28 March 03:00 CEST = 01:00 UTC (02:30 does not exist)
        48 * hour + 1.5 * hour,  # 29 March 02:30 CEST = 00:30 UTC
    ]
    assert started[1][0] == "sched:nightly:2027-03-28T01:00:00Z"


async def test_pause_resume_delete(url: str, sched_clock: trio.testing.MockClock) -> None:
    started: list[tuple[str, float]] = []
    app = reporting_app(started)
    async with engines(app, url) as (engine,):
        assert await engine.schedules.add("s", "report", every=10)
        assert not await engine.schedules.add("s", "report", every=10)  # taken
        await trio.sleep_until(25)
        assert await engine.schedules.pause("s")
        await trio.sleep_until(55)
        info = await engine.schedules.get("s")
        assert info is not None
        assert info.schedule is not None
        assert info.schedule.paused
        assert info.next_tick is None
        assert await engine.schedules.resume("s")
        await trio.sleep_until(75)
        assert await engine.schedules.delete("s")
        assert not await engine.schedules.delete("s")
        assert not await engine.schedules.pause("s")
        await trio.sleep_until(100)
    # 10, 20 before the pause; 30-50 fell while paused (never started); 60, 70 after resume.
    assert times(started) == [10, 20, 60, 70]


async def test_two_engines_on_one_store_start_each_tick_once(
    url: str, sched_clock: trio.testing.MockClock
) -> None:
    started: list[tuple[str, float]] = []
    app = reporting_app(started)
    app.schedule("both", "report", every=30)
    async with engines(app, url, count=2) as (first, _):
        await trio.sleep_until(100)
        runs = await first.store.list_runs()
    assert times(started) == [30, 60, 90]
    assert sorted(r.run_id for r in runs) == sorted(run_id for run_id, _ in started)


CATCH_UPS: list[tuple[str, list[int]]] = [
    ("skip", [1000]),  # the 6 missed ticks (400-900) never start; the next on-time does
    ("once", [980, 1000]),  # the latest missed tick (900) starts when an engine is back
    ("all", [980, 980, 980, 1000]),  # the newest max_catch_up=3 missed ticks: 700-900
]


@pytest.mark.parametrize(
    ("store_kind", "catch_up", "expected"),
    [
        *((kind, *case) for kind in ("memory", "sqlite", "redis") for case in CATCH_UPS),
        # PostgreSQL: the store's part once, in the mode that starts the most missed ticks
        # (each case waits out ~25 s of real idleness on the virtual clock).
        pytest.param("postgres", *CATCH_UPS[2], marks=pytest.mark.postgres),
    ],
)
async def test_catch_up_after_every_engine_was_down(
    url: str, sched_clock: trio.testing.MockClock, catch_up: str, expected: list[float]
) -> None:
    started: list[tuple[str, float]] = []
    app = reporting_app(started)
    # overlap="allow": the ticks of one catch-up start at once, each beside the others.
    app.schedule(
        "hourly", "report", every=100, catch_up=catch_up, max_catch_up=3, overlap="allow"  # type: ignore[arg-type]
    )
    async with dt.open_backend(url) as backend:
        async with engines(app, backend):
            await trio.sleep_until(350)
        assert times(started) == [100, 200, 300]
        started.clear()
        # Every engine down for ticks 400..900; back at 980, when 900 is 80 s old: past
        # schedule_grace (60 s), so missed.
        await trio.sleep_until(980)
        async with engines(app, backend) as (engine,):
            await trio.sleep_until(1050)
            ids = sorted(run_id for run_id, _ in started)
            count = len(await engine.store.list_runs())
    assert times(started) == expected
    if catch_up == "all":
        assert ids[:3] == [schedule_run_id("hourly", EPOCH + t) for t in (700, 800, 900)]
    if catch_up == "once":
        assert ids[0] == schedule_run_id("hourly", EPOCH + 900)
    assert count == 3 + len(expected)


@pytest.mark.parametrize(
    ("catch_up", "expected"),
    [("skip", [1000.0]), ("once", [900.0, 1000.0]), ("all", [800.0, 900.0, 1000.0])],
)
def test_once_starts_the_latest_missed_tick_beside_an_on_time_one(
    catch_up: str, expected: list[float]
) -> None:
    """Back at 1010 after the last tick handled at 300: 1000 is on time (10 s old), 400-900
    were missed. ``once`` starts the latest missed tick (900) too, as the docs say; it used to
    start only the on-time tick when there was one."""
    schedule = Schedule.make(
        "hourly", "report", every=100, catch_up=catch_up, max_catch_up=3, created_at=0.0
    )
    assert schedule.due(300.0, 1010.0, 60.0) == (expected, 1000.0)


async def test_bad_input_is_a_config_error_at_once() -> None:
    app = App("bad")

    @app.workflow("wf")
    async def wf(ctx: WorkflowContext, _: Any) -> None:
        return None

    cases: list[dict[str, Any]] = [
        {"cron": "not a cron"},
        {"cron": "0 3 * * *", "timezone": "Mars/Olympus"},
        {"every": 0},
        {"every": -5},
        {"every": 1e-300},  # each tick's math overflowed and killed every engine
        {"every": 0.001},  # 1,000 runs a second
        {"every": 1e12},  # ticks past year 9999
        {"every": float("nan")},
        {},
        {"cron": "0 3 * * *", "every": 5},
        {"every": 5, "catch_up": "sometimes"},
        {"every": 5, "max_catch_up": 0},
    ]
    for kwargs in cases:
        with pytest.raises(dt.ConfigError):
            app.schedule("s", "wf", **kwargs)
    with pytest.raises(dt.ConfigError, match="no workflow"):
        app.schedule("s", "missing", every=5)
    with pytest.raises(dt.ConfigError, match="schedule name"):
        app.schedule("bad name!", "wf", every=5)
    app.schedule("s", "wf", every=5)
    with pytest.raises(dt.ConfigError, match="already declared"):
        app.schedule("s", "wf", every=5)


async def test_runtime_add_refuses_bad_input(autojump_clock: trio.testing.MockClock) -> None:
    started: list[tuple[str, float]] = []
    app = reporting_app(started)
    async with engines(app, "memory://") as (engine,):
        with pytest.raises(dt.ConfigError, match="no workflow"):
            await engine.schedules.add("s", "nope", every=5)
        with pytest.raises(dt.ConfigError, match="every"):
            await engine.schedules.add("s", "report", every=0)
        assert await engine.schedules.list() == []


async def test_a_damaged_stored_schedule_is_reported_and_skipped(
    url: str, sched_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A damaged row is reported through the error hook once; a row of a workflow the app
    does not register is a WARNING line once (another app's engines may run it), skipped."""
    started: list[tuple[str, float]] = []
    errors: list[BaseException] = []
    app = reporting_app(started)
    app.schedule("good", "report", every=50)
    async with engines(app, url, on_error=errors.append) as (engine,):
        await engine.store.put_schedule("broken", "{not json", replace=False)
        wrong = Schedule.make("ghost", "report", every=10).dumps().replace("report", "gone")
        await engine.store.put_schedule("ghost", wrong, replace=False)
        await trio.sleep_until(120)
        infos = {i.name: i for i in await engine.schedules.list()}
    assert times(started) == [50, 100]
    assert infos["broken"].schedule is None
    assert "not JSON" in str(infos["broken"].error)
    messages = [str(e) for e in errors]
    assert sum("not JSON" in m for m in messages) == 1  # reported once, not every pass
    assert not any("'gone'" in m for m in messages)
    warned = [r for r in caplog.records if "'gone'" in r.getMessage()]
    assert [r.levelname for r in warned] == ["WARNING"]  # once, not every pass


#: Stored rows no API accepts, as a hand edit or a damaged disk leaves them (issue 36, item 5).
RAW_ROWS: dict[str, tuple[str, float | None]] = {
    "tiny": ('{"workflow": "report", "every": 1e-300}', None),
    "far": ('{"workflow": "report", "every": 1e12, "created_at": 1800000000.0}', None),
    "born-never": ('{"workflow": "report", "every": 60, "created_at": 1e300}', None),
    "last-never": ('{"workflow": "report", "every": 60, "created_at": 1800000000.0}', 1e300),
    "paused-text": ('{"workflow": "report", "every": 60, "paused": "no"}', None),
}


@pytest.mark.parametrize("store_kind", ["memory", "sqlite"])
async def test_a_bad_stored_schedule_is_reported_once_and_the_engine_lives(
    url: str, sched_clock: trio.testing.MockClock
) -> None:
    """Rows written raw into the store (a real SQLite file, the memory store) that once killed
    every engine of the namespace within a pass (``OverflowError``), and broke ``list``: each
    is reported exactly once per engine, skipped, and the good schedule ticks on time."""
    started: list[tuple[str, float]] = []
    errors: list[BaseException] = []
    app = reporting_app(started)
    app.schedule("good", "report", every=50)
    async with engines(app, url, on_error=errors.append, schedule_recheck=7.0) as (engine,):
        for name, (spec, last) in RAW_ROWS.items():
            assert await engine.store.put_schedule(name, spec, replace=False)
            if last is not None:
                await engine.store.mark_schedule_tick(name, last)
        await trio.sleep_until(120)  # about 17 passes of the scheduler
        infos = {i.name: i for i in await engine.schedules.list()}
        with pytest.raises(dt.ConfigError, match="'tiny'"):
            await engine.schedules.pause("tiny")
        with pytest.raises(dt.ConfigError, match="'tiny'"):
            await engine.schedules.resume("tiny")
        assert await engine.schedules.delete("tiny")
    assert times(started) == [50, 100]
    for name in RAW_ROWS:
        assert infos[name].schedule is None, name
        assert infos[name].next_tick is None
        assert infos[name].last_tick is None
        assert f"{name!r}" in str(infos[name].error)
        assert sum(f"{name!r}" in str(e) for e in errors) == 1, name
    assert "every" in str(infos["tiny"].error)
    assert "last tick" in str(infos["last-never"].error)
    assert all(isinstance(e, dt.ConfigError) for e in errors)


async def test_a_schedule_whose_tick_run_cannot_start_is_reported_once_and_skipped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A tick whose run cannot start (here: its id is a run of another workflow, left by a
    schedule of that name before a redeploy) is that schedule's fault: reported once, and
    the others tick on."""
    started: list[tuple[str, float]] = []
    errors: list[BaseException] = []
    app = reporting_app(started)

    @app.workflow("other")
    async def other(ctx: WorkflowContext, _: Any) -> None:
        return None

    app.schedule("good", "report", every=50)
    app.schedule("clash", "report", every=60)
    async with engines(app, "memory://", on_error=errors.append, schedule_recheck=7.0) as (engine,):
        await engine.start("other", run_id=schedule_run_id("clash", EPOCH + 60), detach=True)
        await trio.sleep_until(110)
    assert times(started) == [50, 100]
    assert len(errors) == 1
    assert "exists as a run of 'other'" in str(errors[0])


async def test_a_changed_declaration_replaces_the_stored_one_keeping_its_state(
    autojump_clock: trio.testing.MockClock,
) -> None:
    started: list[tuple[str, float]] = []
    app = reporting_app(started)
    app.schedule("s", "report", every=10)
    redeployed = reporting_app(started)
    redeployed.schedule("s", "report", every=20, input="v2")
    async with dt.open_backend("memory://") as backend:
        async with engines(app, backend) as (engine,):
            await engine.schedules.pause("s")
        async with engines(redeployed, backend) as (engine,):
            (info,) = await engine.schedules.list()
    assert info.schedule is not None
    assert (info.schedule.every, info.schedule.input, info.schedule.paused) == (20.0, "v2", True)


@pytest.mark.parametrize(
    "store_kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_schedules_cli(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    from durable_trio.cli._main import main

    backend = ["--backend", url, "--namespace", "reports"]
    nightly = ["nightly", "report", "--cron", "0 3 * * *", "--timezone", "Europe/Paris"]
    assert main(["schedules", "add", *nightly, "--input", '{"to": "ops"}', *backend]) == 0
    often = ["often", "report", "--every", "30", "--overlap", "allow"]
    assert main(["schedules", "add", *often, *backend]) == 0
    assert main(["schedules", "add", "bad", "report", "--every", "0", *backend]) == 2
    assert main(["schedules", "pause", "often", *backend]) == 0
    capsys.readouterr()
    assert main(["schedules", "list", "--json", *backend]) == 0
    listed = {s["name"]: s for s in json.loads(capsys.readouterr().out)}
    assert listed["nightly"]["cron"] == "0 3 * * *"
    assert listed["nightly"]["input"] == {"to": "ops"}
    assert listed["often"]["paused"] is True
    assert listed["often"]["overlap"] == "allow"
    assert listed["nightly"]["overlap"] == "skip"
    assert main(["schedules", "resume", "often", *backend]) == 0
    assert main(["schedules", "delete", "nightly", *backend]) == 0
    assert main(["schedules", "delete", "nightly", *backend]) == 1
    capsys.readouterr()
    assert main(["schedules", "list", *backend]) == 0
    out = capsys.readouterr().out
    assert "often" in out
    assert "nightly" not in out

    # An engine of the namespace fires the schedule the CLI added.
    started: list[tuple[str, float]] = []

    async def serve() -> None:
        async with engines(reporting_app(started), url) as (engine,):
            await trio.sleep(95)
            assert RunStatus.COMPLETED in (await engine.store.count_runs())

    trio.run(serve, clock=trio.testing.MockClock(autojump_threshold=0.2))
    # Added (real time) before the virtual epoch: at t=0 the ticks of the last schedule_grace
    # (60 s: 07:59:00, 07:59:30, 08:00:00) are on time and start; then 30, 60, 90.
    assert times(started) == [0, 0, 0, 30, 60, 90]
    assert started[0][0] == "sched:often:2027-01-15T07:59:00Z"


def test_schedules_cli_bad_every_and_bad_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--every 1e-300`` (and 0.001, 1e12) is refused (exit 2, one line); a raw bad row does
    not break ``list``, ``pause``/``resume`` say it is damaged (exit 2), ``delete`` removes it;
    with ``--app``, a schedule of a workflow the app no longer has is listed as an error."""
    from durable_trio.cli._main import main

    db = tmp_path / "cli.db"
    backend = ["--backend", f"sqlite:///{db}", "--namespace", "reports"]
    for every in ("1e-300", "0.001", "1e12", "nan"):
        assert main(["schedules", "add", "x", "report", "--every", every, *backend]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        assert "every must be seconds from 1 to" in err
    assert main(["schedules", "add", "ok", "report", "--every", "60", *backend]) == 0
    assert main(["schedules", "add", "gone", "removed-wf", "--every", "60", *backend]) == 0

    async def damage() -> None:
        async with dt.open_backend(f"sqlite:///{db}") as opened:
            async with open_run_store(opened, "reports") as store:
                await store.put_schedule("tiny", RAW_ROWS["tiny"][0], replace=False)

    trio.run(damage)
    capsys.readouterr()
    assert main(["schedules", "list", *backend]) == 0
    out = capsys.readouterr().out
    assert "tiny" in out
    assert "DAMAGED" in out
    assert main(["schedules", "list", "--json", *backend]) == 0
    listed = {s["name"]: s for s in json.loads(capsys.readouterr().out)}
    assert "every" in listed["tiny"]["error"]
    assert listed["gone"]["error"] is None  # without --app, no app to check against
    for verb in ("pause", "resume"):
        assert main(["schedules", verb, "tiny", *backend]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        assert "stored schedule 'tiny'" in err
    assert main(["schedules", "delete", "tiny", *backend]) == 0

    module = tmp_path / "reports_app.py"
    module.write_text(
        "import durable_trio as dt\n"
        "app = dt.App('reports')\n"
        "@app.workflow('report')\n"
        "async def report(ctx, input):\n"
        "    return input\n"
    )
    capsys.readouterr()
    app_args = ["--backend", f"sqlite:///{db}", "--app", f"{module}:app"]
    assert main(["schedules", "list", *app_args]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "unknown workflow" in rows["gone"]
    assert "unknown workflow" not in rows["ok"]
    assert main(["schedules", "list", "--json", *app_args]) == 0
    listed = {s["name"]: s for s in json.loads(capsys.readouterr().out)}
    assert "unknown workflow" in listed["gone"]["error"]
    assert listed["ok"]["error"] is None


# --------------------------------------------------------------------------- simulation

#: Seeds run with two engines killed and replaced while a schedule ticks (kept: they hold).
SCHEDULE_SEEDS = (3, 11, 18)


@pytest.mark.parametrize("seed", SCHEDULE_SEEDS)
def test_simulated_schedule_ticks_once_with_two_engines_and_kills(seed: int) -> None:
    from durable_trio.testing import Faults, Simulation

    app = App("sim-sched")

    @app.step("work")
    async def work(n: int) -> int:
        return n + 1

    @app.workflow("order")
    async def order(ctx: WorkflowContext, n: int) -> int:
        return int(await ctx.step("work", n))

    @app.workflow("tick")
    async def tick(ctx: WorkflowContext, _: Any) -> str:
        await ctx.sleep(5)
        return ctx.run_id

    app.schedule("every-minute", "tick", every=60, catch_up="skip")

    def workload(rng: Any, index: int) -> tuple[str, Any]:
        return "order", rng.randrange(100)

    faults = Faults(engine_kills_per_hour=12.0, engine_restart_delay=120.0)
    report = Simulation(
        app,
        workload,
        seed=seed,
        runs=30,
        duration=3600,
        engines=2,
        faults=faults,
        engine_options={"wall_clock": virtual_wall_clock(EPOCH), "run_lease": 30.0},
    ).run_sync()
    assert report.violations == ()
    assert report.faults.get("engine-kill", 0) >= 3
    (ticks,) = [e for e in report.history if e["ev"] == "schedule-ticks"]
    assert ticks["started"] >= 55  # 60 ticks in the hour; a few while both engines were down


async def test_a_schedule_starts_remote_workflow_runs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A remote workflow (its code on a workflow worker, a turn at a time) is scheduled the
    same way: the engine starts the tick's run, the worker runs its turns."""
    from durable_trio._engine import open_worker

    app = App("remote-reports")

    @app.workflow("remote-report", remote=True)
    async def remote_report(ctx: WorkflowContext, input: Any) -> Any:
        await ctx.sleep(1)
        return input

    app.schedule("remote", "remote-report", every=60, input="r")
    async with dt.open_backend("memory://") as backend, open_worker(app, backend):
        async with engines(app, backend) as (engine,):
            await trio.sleep_until(130)
            runs = await engine.store.list_runs()
            outputs = {r.run_id: await engine.result(r.run_id) for r in runs}
    assert outputs == {schedule_run_id("remote", EPOCH + t): "r" for t in (60, 120)}


async def test_a_store_outage_is_reported_and_the_scheduler_goes_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Fault injection at one point: the store's schedule reads fail for the first 3 calls (the
    registration at start included); each failure is reported, the loop retries, and the ticks
    still start at their exact times."""
    from durable_trio._engine._stores.memory import MemoryRunStore

    class Flaky(MemoryRunStore):
        failures = 3

        async def get_schedules(self) -> list[tuple[str, str, float | None]]:
            if self.failures:
                self.failures -= 1
                await trio.lowlevel.checkpoint()
                raise dt.BrokerUnavailable("injected: the store is down")
            return await super().get_schedules()

    started: list[tuple[str, float]] = []
    errors: list[BaseException] = []
    app = reporting_app(started)
    app.schedule("s", "report", every=60)
    store = Flaky()
    async with dt.open_backend("memory://") as backend:
        settings = {**QUIET, "schedule_recheck": 1.0, "wall_clock": virtual_wall_clock(EPOCH)}
        async with open_engine(app, backend, store=store, on_error=errors.append, **settings):
            await trio.sleep_until(130)
    assert times(started) == [60, 120]
    assert sum(isinstance(e, dt.BrokerUnavailable) for e in errors) == 3


async def test_a_tick_due_while_the_engine_closes_is_left_for_the_next_engine(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Found in CI: the scheduler resumed from a store read whose answer was in before the
    engine began closing, then started the tick's run without a checkpoint between and met
    ``EngineClosed``, which ended the engine's block with that error. Reproduced at that point:
    the read's answer is released in the same step as the close begins. The close is clean,
    the tick stays unmarked, and the next engine starts it once, at its start."""
    from durable_trio._engine._stores.memory import MemoryRunStore

    class Gated(MemoryRunStore):
        armed = False
        gate = trio.Event()
        waiting = trio.Event()

        async def get_schedules(self) -> list[tuple[str, str, float | None]]:
            rows = await super().get_schedules()
            if self.armed:
                self.waiting.set()
                await self.gate.wait()
            return rows

    started: list[tuple[str, float]] = []
    app = reporting_app(started)
    app.schedule("s", "report", every=60)
    store = Gated()
    settings = {**QUIET, "wall_clock": virtual_wall_clock(EPOCH)}
    async with dt.open_backend("memory://") as backend:
        async with open_engine(app, backend, store=store, engine_id="first", **settings) as engine:
            await trio.sleep_until(30)
            store.armed = True
            await store.waiting.wait()
            assert trio.current_time() == 60
            store.gate.set()  # the read's answer is in ...
            await engine.aclose()  # ... and closing begins before the scheduler resumes
        assert started == []
        store.armed = False
        async with open_engine(app, backend, store=store, engine_id="second", **settings):
            await trio.sleep_until(70)
    assert started == [(schedule_run_id("s", EPOCH + 60), 60)]


# ------------------------------------------------------------ the default calendar (issue 30, 5)


def stepping_app(started: list[tuple[str, float]]) -> App:
    """A scheduled workflow with a remote step (workers run it) and a durable timer."""
    app = App("stepping")

    @app.step("double")
    async def double(x: int) -> int:
        return 2 * x

    @app.workflow("report")
    async def report(ctx: WorkflowContext, input: Any) -> Any:
        started.append((ctx.run_id, trio.current_time()))
        await ctx.sleep(5)
        return await ctx.step("double", 21)

    app.schedule("minutely", "report", every=60)
    return app


async def test_without_a_wall_clock_schedules_follow_the_memory_stores_virtual_timers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """No ``wall_clock`` given: the memory store's timers are trio's virtual clock, and so is
    the schedules' calendar (from the whole-hour default epoch): exactly 5 ticks in 330 s."""
    started: list[tuple[str, float]] = []
    app = reporting_app(started)
    app.schedule("minutely", "report", every=60)
    async with dt.open_backend("memory://") as backend, open_engine(app, backend) as engine:
        await trio.sleep_until(330)
        assert engine.options.wall_clock() == virtual_wall_clock()()
    assert times(started) == [60, 120, 180, 240, 300]
    assert started[0][0] == "sched:minutely:2027-01-15T08:01:00Z"


async def test_schedules_fire_on_the_fixtures_virtual_clock(
    autojump_clock: trio.testing.MockClock,
    engine_for: EngineFactory,  # noqa: F811
    workers_for: WorkersFactory,  # noqa: F811
) -> None:
    """``engine_for``/``workers_for`` (imported here; the plugin's own wiring of the clock runs
    in ``tests/test_virtual_examples.py``): every=60 fires 5 times in 330 virtual seconds, and
    each run's durable timer and remote step end on time."""
    started: list[tuple[str, float]] = []
    app = stepping_app(started)
    async with workers_for(app), engine_for(app) as engine:
        await trio.sleep_until(330)
        assert times(started) == [60, 120, 180, 240, 300]
        for run_id, _ in started:
            assert await engine.result(run_id) == 42
    assert trio.current_time() == 330


@pytest.fixture
def thread_clock() -> trio.testing.MockClock:
    """Virtual, but jumping only after real idleness (a SQLite commit runs in a thread)."""
    return trio.testing.MockClock(autojump_threshold=0.2)


async def test_a_store_on_the_wall_clock_keeps_the_wall_calendar(
    thread_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """A SQLite store's timers read the wall clock, so its schedules do too (under a
    MockClock as well); after ``follow_trio_clock()`` both are virtual."""
    async with dt.open_backend("sqlite:///" + str(tmp_path / "c.db")) as backend:
        async with open_run_store(backend, "c") as store:
            assert isinstance(store, SqliteRunStore)
            async with open_engine(App("c"), backend, store=store, **QUIET) as engine:
                assert abs(engine.options.wall_clock() - time.time()) < 60
            store.follow_trio_clock()
            async with open_engine(App("c"), backend, store=store, **QUIET) as engine:
                assert engine.options.wall_clock() == virtual_wall_clock()()
