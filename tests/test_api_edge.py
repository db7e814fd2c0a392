"""Bad input at the API edge, and per-run timeouts (issue 15, items 6 and 4).

A wrong argument to ``ctx.step``, ``ctx.run``, ``ctx.sleep``, ``engine.start`` or
``transport.dispatch`` / ``dispatch_many`` fails that call at once, in the caller (the virtual
clock has not moved, nothing was written or sent), with a ``TypeError`` (wrong type) or a
``ConfigError`` (bad value) naming the call and the argument. A programming error met while
checkpointing fails the run; a transient store error keeps its retry.

``engine.start(..., timeout=)`` fails the run at exactly its deadline, which is stored with the
run and kept across engine restarts.

Every engine test runs with the memory run store and with the SQLite one. The SQLite store runs
its real SQL on a connection driven inline (no thread: a thread's work would count as idle time
to ``autojump_clock``) and reads trio's clock as its own, so its times are exact too.
"""

from __future__ import annotations

import math
import sqlite3
import types
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import pytest
import trio
import trio.testing

import durable_trio as dt
from durable_trio._engine import (
    App,
    RunFailed,
    RunStatus,
    RunStore,
    RunTimedOut,
    StepKind,
    StepRecord,
    StepState,
    WorkflowContext,
    open_engine,
    open_worker,
)
from durable_trio._engine._stores import sqlite as sqlite_store
from durable_trio._engine._stores.sqlite import SqliteRunStore
from durable_trio.brokers.sqlite import translate_error
from helpers import Errors

if TYPE_CHECKING:
    from pathlib import Path

    from durable_trio._engine import Engine

STORE_KINDS = ["memory", "sqlite"]


# --------------------------------------------------------------------------- fixtures


class InlineConnection:
    """The part of ``ConnectionThread`` a SQLite run store uses, run in trio's thread: each
    call one transaction (``BEGIN IMMEDIATE`` ... ``COMMIT`` for a write), errors translated
    as the thread translates them."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.read_only = None  # (read and write, as ConnectionThread by default)
        self._db = sqlite3.connect(self.path, isolation_level=None)
        self._users = 1

    def acquire(self) -> None:
        self._users += 1

    async def call(self, fn: Callable[[sqlite3.Connection], Any], *, write: bool) -> Any:
        await trio.lowlevel.checkpoint_if_cancelled()
        db = self._db
        try:
            if write:
                db.execute("BEGIN IMMEDIATE")
            value = fn(db)
            if write:
                db.execute("COMMIT")
        except BaseException as exc:
            if db.in_transaction:
                db.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):
                raise translate_error(exc) from exc
            raise
        await trio.lowlevel.checkpoint()
        return value

    async def release(self) -> None:
        self._users -= 1
        if self._users <= 0:
            self._db.close()
        await trio.lowlevel.checkpoint()


StoreFactory = Callable[[], AbstractAsyncContextManager[RunStore | None]]


@pytest.fixture(params=STORE_KINDS)
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def run_store(
    store_kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[RunStore | None]:
    """The run store the engines of one test share: ``None`` for the memory backend's own (it
    outlives each engine, as the backend does), else a SQLite store on trio's clock."""
    if store_kind == "memory":
        yield None
        return
    monkeypatch.setattr(sqlite_store, "time", types.SimpleNamespace(time=trio.current_time))
    store = await SqliteRunStore._on(InlineConnection(tmp_path / "runs.db"), "shop")  # type: ignore[arg-type]
    try:
        yield store
    finally:
        await store.aclose()


def engine_on(
    app: App, backend: dt.Backend, store: RunStore | None, **options: Any
) -> AbstractAsyncContextManager[Engine]:
    return open_engine(app, backend, store=store, **options)


def app_with_steps() -> App:
    app = App("shop")

    @app.step("double")
    async def double(x: int) -> int:
        return x * 2

    @app.step("hang")
    async def hang(_: Any) -> None:
        await trio.sleep_forever()

    @app.step("slow")
    async def slow(seconds: float) -> float:
        await trio.sleep(seconds)
        return trio.current_time()

    return app


def fn() -> int:
    return 1


class Odd:
    """Not a JSON value."""


async def fails_at_once(
    run_store: RunStore | None, call: Callable[[WorkflowContext], Any]
) -> tuple[BaseException, RunFailed, dt.EngineStatistics, list[StepRecord], Errors]:
    """Run a workflow whose body makes ``call``; return what the call raised (in the caller,
    at the call), the run's failure, the statistics, the history and the errors reported."""
    app = app_with_steps()
    raised: list[BaseException] = []

    @app.workflow("bad")
    async def bad(ctx: WorkflowContext, _: Any) -> None:
        try:
            call(ctx)  # the call itself raises: nothing to await
        except Exception as exc:
            raised.append(exc)
            raise
        raise AssertionError("the call did not raise")

    errors = Errors()
    async with dt.open_backend("memory://") as backend:
        async with (
            open_worker(app, backend),
            engine_on(app, backend, run_store, on_error=errors) as engine,
        ):
            run_id = await engine.start("bad", run_id="r")
            with pytest.raises(RunFailed) as failed:
                await engine.result(run_id)
            assert trio.current_time() == 0.0
            stats = engine.statistics()
            history = await engine.history(run_id)
    (exc,) = raised
    return exc, failed.value, stats, history, errors


def check_failed_with(
    exc: BaseException, failed: RunFailed, kind: type[BaseException], match: str
) -> None:
    assert isinstance(exc, kind), exc
    assert match in str(exc), str(exc)
    assert failed.error_type == type(exc).__name__
    assert failed.error["message"] == str(exc)


# --------------------------------------------------------------------------- ctx.step


@pytest.mark.parametrize(
    ("args", "kwargs", "kind", "match"),
    [
        ((123,), {}, TypeError, "ctx.step: name must be a str, got a int (123)"),
        ((None,), {}, TypeError, "ctx.step: name must be a str, got a NoneType"),
        ((b"double",), {}, TypeError, "ctx.step: name must be a str, got a bytes"),
        (("",), {}, dt.ConfigError, "ctx.step: name must not be empty"),
        (("double", Odd()), {}, dt.PayloadError, "the input of step 'double'"),
        (("double", {"x": math.nan}), {}, dt.PayloadError, "at $.x"),
        (("double", 1), {"retry": 3}, TypeError, "ctx.step: retry must be a Retry or None"),
        (("double", 1), {"retry": {"max_attempts": 2}}, TypeError, "retry must be a Retry"),
        (("double", 1), {"priority": "high"}, TypeError, "priority must be an int or None"),
        (("double", 1), {"priority": True}, TypeError, "priority must be an int or None"),
        (("double", 1), {"priority": 1.5}, TypeError, "priority must be an int or None"),
        (("double", 1), {"priority": 2**60}, dt.ConfigError, "priority must be between"),
    ],
)
async def test_ctx_step_refuses_bad_arguments_at_once(
    autojump_clock: trio.testing.MockClock,
    run_store: RunStore | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    kind: type[BaseException],
    match: str,
) -> None:
    exc, failed, stats, history, errors = await fails_at_once(
        run_store, lambda ctx: ctx.step(*args, **kwargs)
    )
    check_failed_with(exc, failed, kind, match)
    assert (stats.steps_dispatched, stats.retries, stats.runs_failed) == (0, 0, 1)
    assert history == []
    assert errors.seen == []


# --------------------------------------------------------------------------- ctx.run


@pytest.mark.parametrize(
    ("args", "kwargs", "kind", "match"),
    [
        (
            (fn, 5),
            {},
            TypeError,
            "ctx.run: name must be a str, got a function (<function fn at",
        ),
        ((fn, 5), {}, TypeError, "(the call is ctx.run(name, fn): are they swapped?)"),
        ((7, fn), {}, TypeError, "ctx.run: name must be a str, got a int (7)"),
        (("", fn), {}, dt.ConfigError, "ctx.run: name must not be empty"),
        (("now", 5), {}, TypeError, "ctx.run: fn must be callable, got a int (5)"),
        (("now", None), {}, TypeError, "ctx.run: fn must be callable, got a NoneType"),
        (("now", fn), {"retry": "twice"}, TypeError, "ctx.run: retry must be a Retry or None"),
    ],
)
async def test_ctx_run_refuses_bad_arguments_at_once(
    autojump_clock: trio.testing.MockClock,
    run_store: RunStore | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    kind: type[BaseException],
    match: str,
) -> None:
    exc, failed, stats, history, errors = await fails_at_once(
        run_store, lambda ctx: ctx.run(*args, **kwargs)
    )
    check_failed_with(exc, failed, kind, match)
    assert (stats.local_steps_run, stats.runs_failed) == (0, 1)
    assert history == []
    assert errors.seen == []  # never "checkpointing failed (retrying in ...)"


# --------------------------------------------------------------------------- ctx.sleep


@pytest.mark.parametrize(
    ("seconds", "kind", "match"),
    [
        ("10", TypeError, "ctx.sleep: seconds must be a number of seconds, got a str ('10')"),
        (None, TypeError, "ctx.sleep: seconds must be a number of seconds, got a NoneType"),
        (True, TypeError, "ctx.sleep: seconds must be a number of seconds, got a bool"),
        ([1], TypeError, "ctx.sleep: seconds must be a number of seconds, got a list"),
        (-1, dt.ConfigError, "ctx.sleep: seconds must be a finite number of seconds >= 0"),
        (math.nan, dt.ConfigError, "seconds must be a finite number of seconds >= 0, got nan"),
        (math.inf, dt.ConfigError, "seconds must be a finite number of seconds >= 0, got inf"),
        (10**400, dt.ConfigError, "seconds must be a finite number of seconds >= 0, got 1000"),
    ],
)
async def test_ctx_sleep_refuses_bad_arguments_at_once(
    autojump_clock: trio.testing.MockClock,
    run_store: RunStore | None,
    seconds: Any,
    kind: type[BaseException],
    match: str,
) -> None:
    exc, failed, stats, history, errors = await fails_at_once(
        run_store, lambda ctx: ctx.sleep(seconds)
    )
    check_failed_with(exc, failed, kind, match)
    assert (stats.timers_fired, stats.runs_failed) == (0, 1)
    assert history == []
    assert errors.seen == []


async def test_good_arguments_still_work(
    autojump_clock: trio.testing.MockClock, run_store: RunStore | None
) -> None:
    """The checks refuse only what cannot work: an int sleep, a priority, a Retry, a lambda."""
    app = app_with_steps()

    @app.workflow("fine")
    async def fine(ctx: WorkflowContext, x: int) -> list[Any]:
        await ctx.sleep(1)
        await ctx.sleep(0.5)
        a = await ctx.step("double", x, retry=dt.Retry(max_attempts=1), priority=-(2**53))
        b = await ctx.run("local", lambda: a + 1, retry=dt.Retry(max_attempts=2))
        return [a, b]

    async with dt.open_backend("memory://") as backend:
        async with open_worker(app, backend), engine_on(app, backend, run_store) as engine:
            run_id = await engine.start("fine", 4, run_id="ok", detach=False, timeout=60)
            assert await engine.result(run_id) == [8, 9]
    assert trio.current_time() == 1.5


# --------------------------------------------------------------------------- engine.start


@pytest.mark.parametrize(
    ("args", "kwargs", "kind", "match"),
    [
        ((5,), {}, TypeError, "engine.start: workflow must be a str, got a int (5)"),
        ((None,), {}, TypeError, "engine.start: workflow must be a str, got a NoneType"),
        (("",), {}, dt.ConfigError, "engine.start: workflow must not be empty"),
        (("nap", Odd()), {}, dt.PayloadError, "the input of workflow 'nap'"),
        (("nap", [1, math.inf]), {}, dt.PayloadError, "at $[1]"),
        (("nap",), {"run_id": 5}, TypeError, "engine.start: run_id must be a str, got a int"),
        (("nap",), {"run_id": ""}, dt.ConfigError, "engine.start: run_id must not be empty"),
        (("nap",), {"run_id": "r" * 513}, dt.ConfigError, "run_id is at most 512 characters"),
        (("nap",), {"detach": "yes"}, TypeError, "engine.start: detach must be True or False"),
        (("nap",), {"detach": 1}, TypeError, "engine.start: detach must be True or False"),
        (("nap",), {"timeout": "10"}, TypeError, "engine.start: timeout must be a number"),
        (("nap",), {"timeout": True}, TypeError, "engine.start: timeout must be a number"),
        (("nap",), {"timeout": 0}, dt.ConfigError, "timeout must be a finite number of seconds >"),
        (("nap",), {"timeout": -5}, dt.ConfigError, "seconds > 0, got -5"),
        (("nap",), {"timeout": math.nan}, dt.ConfigError, "seconds > 0, got nan"),
        (("nap",), {"timeout": math.inf}, dt.ConfigError, "seconds > 0, got inf"),
    ],
)
async def test_engine_start_refuses_bad_arguments_at_once(
    autojump_clock: trio.testing.MockClock,
    run_store: RunStore | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    kind: type[BaseException],
    match: str,
) -> None:
    app = App("shop")

    @app.workflow("nap")
    async def nap(ctx: WorkflowContext, _: Any) -> None:
        await ctx.sleep(1)

    errors = Errors()
    async with dt.open_backend("memory://") as backend:
        async with engine_on(app, backend, run_store, on_error=errors) as engine:
            with pytest.raises(kind) as raised:
                await engine.start(*args, **kwargs)
            assert trio.current_time() == 0.0
            assert await engine.list() == []
            assert engine.statistics().runs_started == 0
    assert match in str(raised.value), str(raised.value)
    assert errors.seen == []


# --------------------------------------------------------------------------- transport


def task(**fields: Any) -> dt.RemoteTask:
    """A well-typed task, or one with ``fields`` forced in (attrs does not check types)."""
    good = dt.RemoteTask(run_id="r", step_id="1", attempt=1, name="double", input=1)
    return attrs.evolve(good, **fields)


@pytest.fixture(params=["memory", "sqlite"])
def backend_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "memory":
        return "memory://"
    return f"sqlite:///{tmp_path / 'broker.db'}".replace("///", "////", 1)


@pytest.mark.parametrize(
    ("args", "kwargs", "kind", "match"),
    [
        (({"run_id": "r"},), {}, TypeError, "transport.dispatch: task must be a RemoteTask"),
        (("double",), {}, TypeError, "task must be a RemoteTask, got a str ('double')"),
        ((task(run_id=1),), {}, TypeError, "task.run_id must be a str, got a int (1)"),
        ((task(step_id=None),), {}, TypeError, "task.step_id must be a str, got a NoneType"),
        ((task(name=""),), {}, dt.ConfigError, "task.name must not be empty"),
        ((task(task_id=""),), {}, dt.ConfigError, "task.task_id must not be empty"),
        ((task(group=3),), {}, TypeError, "task.group must be a str, got a int"),
        ((task(attempt="1"),), {}, TypeError, "task.attempt must be an int, got a str"),
        ((task(attempt=0),), {}, dt.ConfigError, "task.attempt must be >= 1, got 0"),
        ((task(priority="hi"),), {}, TypeError, "task.priority must be an int or None"),
        ((task(priority=-(2**60)),), {}, dt.ConfigError, "task.priority must be between"),
        ((task(deadline="soon"),), {}, TypeError, "task.deadline must be a finite number"),
        ((task(input={1, 2}),), {}, dt.PayloadError, "not JSON-serialisable"),
        ((task(),), {"delay": "1"}, TypeError, "transport.dispatch: delay must be a number"),
        ((task(),), {"delay": None}, TypeError, "delay must be a number of seconds"),
        ((task(),), {"delay": -1}, dt.ConfigError, "delay must be a finite number of seconds"),
        ((task(),), {"delay": math.nan}, dt.ConfigError, ">= 0, got nan"),
    ],
)
async def test_transport_dispatch_refuses_bad_arguments_at_once(
    autojump_clock: trio.testing.MockClock,
    backend_url: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    kind: type[BaseException],
    match: str,
) -> None:
    async with (
        dt.open_backend(backend_url) as backend,
        dt.open_queue_transport(backend, namespace="shop") as transport,
    ):
        before = trio.current_time()
        with pytest.raises(kind) as raised:
            await transport.dispatch(*args, **kwargs)
        assert trio.current_time() == before
        assert await transport.health.queue_depth("double") == 0
    assert match in str(raised.value), str(raised.value)


@pytest.mark.parametrize(
    ("tasks", "kind", "match"),
    [
        (task(), TypeError, "transport.dispatch_many: tasks must be an iterable of RemoteTask"),
        ("double", TypeError, "tasks must be an iterable of RemoteTask, got a str"),
        ({"a": task()}, TypeError, "tasks must be an iterable of RemoteTask, got a dict"),
        (None, TypeError, "tasks must be an iterable of RemoteTask, got a NoneType"),
        ([task(), 5], TypeError, "transport.dispatch_many: tasks[1] must be a RemoteTask"),
        ([task(), task(attempt=-1)], dt.ConfigError, "tasks[1].attempt must be >= 1"),
        ([task(name=3)], TypeError, "tasks[0].name must be a str, got a int (3)"),
    ],
)
async def test_transport_dispatch_many_refuses_bad_arguments_at_once(
    autojump_clock: trio.testing.MockClock,
    backend_url: str,
    tasks: Any,
    kind: type[BaseException],
    match: str,
) -> None:
    async with (
        dt.open_backend(backend_url) as backend,
        dt.open_queue_transport(backend, namespace="shop") as transport,
    ):
        before = trio.current_time()
        with pytest.raises(kind) as raised:
            await transport.dispatch_many(tasks)
        assert trio.current_time() == before
        # Checked before anything is sent: not even the good tasks ahead of a bad one.
        assert await transport.health.queue_depth("double") == 0
    assert match in str(raised.value), str(raised.value)


async def test_transport_dispatch_many_takes_any_iterable_of_tasks(
    autojump_clock: trio.testing.MockClock, backend_url: str
) -> None:
    async with (
        dt.open_backend(backend_url) as backend,
        dt.open_queue_transport(backend, namespace="shop") as transport,
    ):
        ids = await transport.dispatch_many(task(step_id=str(n)) for n in range(3))
        assert len(ids) == 3
        assert await transport.health.queue_depth("double") == 3
        await transport.dispatch(task(step_id="9"), delay=0)


# --------------------------------------------------------------------------- checkpoint errors


class FaultyStore:
    """Wraps a run store: a step's first write (``begin_step``, or ``begin_step_unless_finished``
    for a local step's outcome written as its first checkpoint) first raises what ``faults``
    holds, one per call, then goes through (``bad_name``: writes it with a name no store can
    encode, a function)."""

    def __init__(self, inner: RunStore, faults: list[BaseException], *, bad_name: bool = False):
        self.inner = inner
        self.faults = faults
        self.bad_name = bad_name
        self.calls: list[float] = []
        self.trio_clock = getattr(inner, "trio_clock", False)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def begin_step(self, step: StepRecord) -> StepRecord:
        self.calls.append(trio.current_time())
        if self.faults:
            await trio.lowlevel.checkpoint()
            raise self.faults.pop(0)
        if self.bad_name:
            step = attrs.evolve(step, name=fn)  # type: ignore[arg-type]
        return await self.inner.begin_step(step)

    async def begin_step_unless_finished(self, step: StepRecord) -> StepRecord | None:
        self.calls.append(trio.current_time())
        if self.faults:
            await trio.lowlevel.checkpoint()
            raise self.faults.pop(0)
        if self.bad_name:
            step = attrs.evolve(step, name=fn)  # type: ignore[arg-type]
        return await self.inner.begin_step_unless_finished(step)


@asynccontextmanager
async def inner_store(run_store: RunStore | None, backend: dt.Backend) -> AsyncIterator[RunStore]:
    if run_store is not None:
        yield run_store
        return
    async with dt.open_run_store(backend, "shop") as store:
        yield store


async def run_with_store_faults(
    run_store: RunStore | None, faults: list[BaseException], *, bad_name: bool = False
) -> tuple[Any, float, FaultyStore, Errors]:
    app = app_with_steps()

    @app.workflow("one")
    async def one(ctx: WorkflowContext, _: Any) -> int:
        return await ctx.run("local", lambda: 21) * 2

    errors = Errors()
    async with dt.open_backend("memory://") as backend, inner_store(run_store, backend) as inner:
        store = FaultyStore(inner, faults, bad_name=bad_name)
        async with engine_on(app, backend, store, on_error=errors) as engine:
            run_id = await engine.start("one", run_id="r")
            try:
                outcome: Any = await engine.result(run_id)
            except RunFailed as exc:
                outcome = exc
    return outcome, trio.current_time(), store, errors


@pytest.mark.parametrize(
    "fault",
    [TypeError("cannot encode a function"), ValueError("a value the store cannot write")],
    ids=["TypeError", "ValueError"],
)
async def test_a_programming_error_while_checkpointing_fails_the_run_at_once(
    autojump_clock: trio.testing.MockClock, run_store: RunStore | None, fault: Exception
) -> None:
    outcome, now, store, errors = await run_with_store_faults(run_store, [fault])
    assert isinstance(outcome, RunFailed)
    assert (outcome.error_type, outcome.error["message"]) == (type(fault).__name__, str(fault))
    assert now == 0.0
    assert store.calls == [0.0]  # tried once, never retried
    assert errors.seen == []


async def test_a_transient_store_error_while_checkpointing_is_retried(
    autojump_clock: trio.testing.MockClock, run_store: RunStore | None
) -> None:
    faults: list[BaseException] = [dt.BrokerError("down"), dt.BrokerUnavailable("still down")]
    outcome, now, store, errors = await run_with_store_faults(run_store, faults)
    assert outcome == 42
    assert store.calls == [0.0, 0.05, 0.05 + 0.1]  # the guard's backoff: 0.05 s, doubling
    assert now == 0.05 + 0.1
    assert [str(e) for e in errors.seen] == [
        "checkpointing failed (retrying in 0.05 s): down",
        "checkpointing failed (retrying in 0.10 s): still down",
    ]


class WritesOf:
    """Wraps a run store: records each step write as ``(method, step id, status written)``;
    ``finish_first``: the run is cancelled (as by another engine) just before the first
    ``begin_step_unless_finished``."""

    def __init__(self, inner: RunStore, *, finish_first: bool = False) -> None:
        self.inner = inner
        self.writes: list[tuple[str, str, StepState]] = []
        self.finish_first = finish_first
        self.trio_clock = getattr(inner, "trio_clock", False)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def begin_step(self, step: StepRecord) -> StepRecord:
        self.writes.append(("begin_step", step.step_id, step.status))
        return await self.inner.begin_step(step)

    async def begin_step_unless_finished(self, step: StepRecord) -> StepRecord | None:
        self.writes.append(("begin_step_unless_finished", step.step_id, step.status))
        if self.finish_first:
            self.finish_first = False
            assert await self.inner.finish_run(step.run_id, RunStatus.CANCELLED)
        return await self.inner.begin_step_unless_finished(step)

    async def update_step(self, step: StepRecord, *, expect_attempt: int) -> Any:
        self.writes.append(("update_step", step.step_id, step.status))
        return await self.inner.update_step(step, expect_attempt=expect_attempt)


async def test_a_sync_local_step_is_one_write_and_an_async_one_shows_pending_while_it_runs(
    autojump_clock: trio.testing.MockClock, run_store: RunStore | None
) -> None:
    """A fresh local step whose function returns without awaiting has its outcome written as
    its first checkpoint (one write, not a pending one then the outcome); one that awaits is
    checkpointed pending first, so the run's history shows it while it waits. Each function
    is called once."""
    app = App("shop")
    calls: list[str] = []

    def now() -> int:
        calls.append("now")
        return 5

    async def wait() -> int:
        calls.append("wait")
        await trio.sleep(10)
        return 7

    @app.workflow("w")
    async def w(ctx: WorkflowContext, _: Any) -> int:
        return await ctx.run("now", now) + await ctx.run("wait", wait)

    async with dt.open_backend("memory://") as backend, inner_store(run_store, backend) as inner:
        store = WritesOf(inner)
        async with engine_on(app, backend, store) as engine:
            await engine.start("w", run_id="r")
            await trio.sleep(5)
            during = [(s.step_id, s.status) for s in await engine.history("r")]
            outcome = await engine.result("r")
            history = await engine.history("r")
    assert outcome == 12
    assert calls == ["now", "wait"]
    assert during == [("1", StepState.COMPLETED), ("2", StepState.PENDING)]
    assert store.writes == [
        ("begin_step_unless_finished", "1", StepState.COMPLETED),
        ("begin_step", "2", StepState.PENDING),
        ("update_step", "2", StepState.COMPLETED),
    ]
    assert [[a["outcome"] for a in s.attempts] for s in history] == [["completed"], ["completed"]]


async def test_a_sync_local_step_that_fails_first_writes_its_retry_as_its_first_checkpoint(
    autojump_clock: trio.testing.MockClock, run_store: RunStore | None
) -> None:
    app = App("shop")
    calls: list[tuple[int, float]] = []

    def flaky() -> str:
        attempt = dt.step_info().attempt
        calls.append((attempt, trio.current_time()))
        if attempt == 1:
            raise RuntimeError("not yet")
        return "ok"

    @app.workflow("w")
    async def w(ctx: WorkflowContext, _: Any) -> str:
        return await ctx.run("flaky", flaky, retry=dt.Retry(initial=2.0, jitter=0.0))

    async with dt.open_backend("memory://") as backend, inner_store(run_store, backend) as inner:
        store = WritesOf(inner)
        async with engine_on(app, backend, store) as engine:
            await engine.start("w", run_id="r")
            outcome = await engine.result("r")
            [step] = await engine.history("r")
    assert outcome == "ok"
    assert calls == [(1, 0.0), (2, 2.0)]
    assert store.writes == [
        ("begin_step_unless_finished", "1", StepState.PENDING),
        ("update_step", "1", StepState.COMPLETED),
    ]
    assert [a["outcome"] for a in step.attempts] == ["failed", "completed"]
    assert step.attempts[0]["error"]["message"] == "RuntimeError: not yet"


async def test_a_sync_local_step_of_a_run_settled_meanwhile_is_not_written(
    autojump_clock: trio.testing.MockClock, run_store: RunStore | None
) -> None:
    """Cancelled by another engine while the step ran: its outcome is not written and this
    engine stops driving the run."""
    app = App("shop")
    after: list[str] = []

    @app.workflow("w")
    async def w(ctx: WorkflowContext, _: Any) -> int:
        value = await ctx.run("now", lambda: 5)
        after.append("went on")
        return value

    async with dt.open_backend("memory://") as backend, inner_store(run_store, backend) as inner:
        store = WritesOf(inner, finish_first=True)
        async with engine_on(app, backend, store) as engine:
            await engine.start("w", run_id="r")
            with pytest.raises(dt.RunCancelled):
                await engine.result("r")
            history = await engine.history("r")
            assert engine.statistics().active_runs == 0
    assert after == []
    assert history == []
    assert store.writes == [("begin_step_unless_finished", "1", StepState.COMPLETED)]


@pytest.mark.parametrize("store_kind", ["sqlite"])
async def test_a_value_sqlite_cannot_bind_fails_the_run_instead_of_retrying_forever(
    autojump_clock: trio.testing.MockClock, run_store: RunStore | None
) -> None:
    """The report of issue 15: a function reached the SQLite store ("Error binding parameter
    ...: type 'function' is not supported") and was retried every 5 s forever."""
    outcome, now, store, errors = await run_with_store_faults(run_store, [], bad_name=True)
    assert isinstance(outcome, RunFailed)
    assert outcome.error_type == "TypeError"
    assert "the SQLite run store cannot write this change" in outcome.error["message"]
    assert "type 'function' is not supported" in outcome.error["message"]
    assert (now, store.calls, errors.seen) == (0.0, [0.0], [])


async def test_the_sqlite_store_refuses_an_unbindable_value_and_keeps_working(
    tmp_path: Path,
) -> None:
    """With its real connection thread: a programming error, not a BrokerError; the rest of
    its batch and later changes are unaffected."""
    store = await SqliteRunStore.open(tmp_path / "runs.db", "shop")
    try:
        await store.create_run(dt.RunRecord("r", "w", None, RunStatus.RUNNING, 0, 0))
        good = StepRecord("r", "1", StepKind.LOCAL, "ok", StepState.PENDING)
        bad = attrs.evolve(good, step_id="2", name=fn)  # type: ignore[arg-type]
        results: dict[str, Any] = {}

        async def begin(step: StepRecord) -> None:
            try:
                results[step.step_id] = await store.begin_step(step)
            except Exception as exc:
                results[step.step_id] = exc

        async with trio.open_nursery() as nursery:  # one batch: one savepoint each
            nursery.start_soon(begin, good)
            nursery.start_soon(begin, bad)
        assert isinstance(results["2"], TypeError)
        assert not isinstance(results["2"], dt.BrokerError)
        assert isinstance(results["2"].__cause__, sqlite3.Error)
        assert results["1"].name == "ok"
        later = await store.begin_step(attrs.evolve(good, step_id="3"))
        assert [s.step_id for s in await store.get_steps("r")] == ["1", "3"]
        assert later.step_id == "3"
    finally:
        await store.aclose()


# --------------------------------------------------------------------------- run timeouts


def timed_app() -> App:
    app = app_with_steps()

    @app.workflow("wait")
    async def wait(ctx: WorkflowContext, step: str | None) -> float:
        if step is None:
            await ctx.sleep(100)
        else:
            await ctx.step(step, 20.0)
        return trio.current_time()

    @app.workflow("quick")
    async def quick(ctx: WorkflowContext, _: Any) -> float:
        await ctx.sleep(5)
        return trio.current_time()

    return app


async def test_a_run_times_out_at_exactly_its_deadline(
    autojump_clock: trio.testing.MockClock, run_store: RunStore | None
) -> None:
    app = timed_app()
    errors, worker_errors = Errors(), Errors()
    async with dt.open_backend("memory://") as backend:
        async with (
            open_worker(app, backend, on_error=worker_errors),
            engine_on(app, backend, run_store, on_error=errors) as engine,
        ):
            await trio.sleep(2)
            run_id = await engine.start("wait", "hang", run_id="w", timeout=10)
            with pytest.raises(RunTimedOut) as timed_out:
                await engine.result(run_id)
            assert trio.current_time() == 12.0
            record = await engine.get(run_id)
            history = await engine.history(run_id)
            # A result arriving afterwards is ignored, as for any run that ended.
            await engine.transport.publish_result(
                dt.StepResult("w", "1", 1, dt.StepStatus.COMPLETED, output=None)
            )
            await trio.sleep(1)
            stats = engine.statistics()
            after = await engine.history(run_id)
    assert isinstance(timed_out.value, RunFailed)
    assert timed_out.value.error_type == "RunTimedOut"
    assert str(timed_out.value) == (
        "run 'w' timed out: RunTimedOut: the run did not end within its timeout of 10 s; "
        "it was waiting on 'hang' (id 1)"
    )
    assert record.status is RunStatus.FAILED
    assert (record.timeout, record.deadline) == (10.0, 12.0)
    assert record.error == {
        "type": "RunTimedOut",
        "message": timed_out.value.error["message"],
        "timeout": 10.0,
        "deadline": 12.0,
        "pending": [{"stepId": "1", "kind": "remote", "name": "hang"}],
    }
    assert [(s.step_id, s.status) for s in history] == [("1", StepState.PENDING)]
    assert after == history
    # Ignored: the worker's answer to the cancel it was sent, and the injected late result.
    assert (stats.runs_timed_out, stats.runs_failed, stats.orphan_results) == (1, 1, 2)
    assert stats.active_runs == stats.waiting_steps == 0
    assert errors.seen == []
    # The step cancelled because its run ended is logged at INFO, not reported as an error.
    assert worker_errors.messages() == []


async def test_a_run_that_ends_before_its_deadline_is_unaffected(
    autojump_clock: trio.testing.MockClock, run_store: RunStore | None
) -> None:
    app = timed_app()
    async with dt.open_backend("memory://") as backend:
        async with engine_on(app, backend, run_store) as engine:
            run_id = await engine.start("quick", run_id="q", timeout=10)
            assert await engine.result(run_id) == 5.0
            await trio.sleep(20)
            record = await engine.get(run_id)
            stats = engine.statistics()
    assert (record.status, record.output, record.error) == (RunStatus.COMPLETED, 5.0, None)
    assert (stats.runs_completed, stats.runs_failed, stats.runs_timed_out) == (1, 0, 0)


async def test_a_second_start_of_the_same_run_keeps_its_first_timeout(
    autojump_clock: trio.testing.MockClock, run_store: RunStore | None
) -> None:
    app = timed_app()
    async with dt.open_backend("memory://") as backend:
        async with engine_on(app, backend, run_store) as engine:
            await engine.start("wait", None, run_id="w", timeout=10)
            await trio.sleep(3)
            assert await engine.start("wait", None, run_id="w", timeout=100) == "w"
            assert await engine.start("wait", None, run_id="w") == "w"
            with pytest.raises(RunTimedOut):
                await engine.result("w")
    assert trio.current_time() == 10.0


async def test_a_restart_before_the_deadline_keeps_the_deadline(
    autojump_clock: trio.testing.MockClock, run_store: RunStore | None
) -> None:
    app = timed_app()
    async with dt.open_backend("memory://") as backend:
        async with engine_on(app, backend, run_store, engine_id="first") as first:
            await first.start("wait", None, run_id="w", timeout=10)
            await trio.sleep(4)
        assert await first.status("w") is RunStatus.PENDING  # released on close
        await trio.sleep(2)
        async with engine_on(app, backend, run_store, engine_id="second") as second:
            assert second.statistics().runs_resumed == 1
            with pytest.raises(RunTimedOut):
                await second.result("w")
            assert trio.current_time() == 10.0  # not 6 + 10
            stats = second.statistics()
    assert stats.runs_timed_out == 1


async def test_a_run_past_its_deadline_when_an_engine_takes_it_over_fails_at_once(
    autojump_clock: trio.testing.MockClock, run_store: RunStore | None
) -> None:
    app = timed_app()
    async with dt.open_backend("memory://") as backend:
        # "Dead": it stops without releasing its runs; the next one has the same id.
        async with engine_on(
            app, backend, run_store, engine_id="svc", release_on_close=False
        ) as first:
            await first.start("wait", None, run_id="w", timeout=10)
            await trio.sleep(4)
        await trio.sleep(11)
        async with engine_on(app, backend, run_store, engine_id="svc") as again:
            assert trio.current_time() == 15.0
            stats = again.statistics()
            record = await again.get("w")
            history = await again.history("w")
            with pytest.raises(RunTimedOut):
                await again.result("w")
    assert record.status is RunStatus.FAILED
    assert record.error["type"] == "RunTimedOut"
    assert record.error["pending"] == [{"stepId": "1", "kind": "timer", "name": "sleep"}]
    assert (stats.runs_resumed, stats.runs_timed_out, stats.timers_fired) == (0, 1, 0)
    assert [(s.kind, s.status) for s in history] == [(StepKind.TIMER, StepState.PENDING)]


async def test_a_detached_run_counts_its_timeout_from_its_start(
    autojump_clock: trio.testing.MockClock, run_store: RunStore | None
) -> None:
    app = timed_app()
    async with dt.open_backend("memory://") as backend:
        async with engine_on(app, backend, run_store, reconcile=False) as starter:
            await starter.start("quick", run_id="d", detach=True, timeout=8)
        await trio.sleep(4)
        async with engine_on(app, backend, run_store, reconcile_interval=5) as engine:
            # Taken over by the reconcile at t=4; its 5 s timer would fire at t=9.
            with pytest.raises(RunTimedOut):
                await engine.result("d")
    assert trio.current_time() == 8.0


async def test_a_remote_workflow_times_out_too(autojump_clock: trio.testing.MockClock) -> None:
    worker_app = App("shop")

    @worker_app.workflow("nap", remote=True)
    async def nap(ctx: WorkflowContext, _: Any) -> None:
        await ctx.sleep(100)

    engine_app = App("shop")
    engine_app.remote_workflow("nap")
    async with (
        dt.open_backend("memory://") as backend,
        open_worker(worker_app, backend),
        open_engine(engine_app, backend) as engine,
    ):
        run_id = await engine.start("nap", timeout=30)
        with pytest.raises(RunTimedOut):
            await engine.result(run_id)
        assert trio.current_time() == 30.0
        stats = engine.statistics()
    assert (stats.runs_timed_out, stats.timers_fired) == (1, 0)
