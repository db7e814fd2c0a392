"""pytest fixtures for testing durable_trio applications (with pytest-trio).

Enable them in your top-level ``conftest.py``::

    pytest_plugins = ["durable_trio.testing.fixtures"]

Enabled as a plugin, it also wires the clock: a trio test that asks for one of these fixtures runs
on ``MockClock(autojump_threshold=0)`` (virtual time, which jumps whenever every task is blocked)
without naming a clock, unless it names a clock fixture of its own (``mock_clock``, say), which is
used instead, or chose its runner itself (``@pytest.mark.trio(run=trio.run)``: the wall clock)::

    async def test_order(engine_for, workers_for):
        async with workers_for(app, 2), engine_for(app) as engine:
            run_id = await engine.start("order", {"id": 1})
            assert await engine.result(run_id) == {...}
            assert trio.current_time() == 42.0   # virtual: exact

(Imported into a ``conftest.py`` instead, ``from durable_trio.testing.fixtures import
memory_backend, engine_for, workers_for``, the fixtures work the same but the clock is not wired:
pytest-trio takes the clock from the test's own arguments, so such a test names
``autojump_clock``.)

With the plugin, a hypothesis ``@given`` test that uses these fixtures runs EACH EXAMPLE in its
own ``trio.run``, on a fresh ``MockClock(autojump_threshold=0)`` and a fresh ``memory://``
backend (:func:`examples_on_virtual_clock`): pytest resolves fixtures once per test, not per
example, and pytest-trio runs a hypothesis test's examples on ``trio.run`` with that one
clock, so without this the examples ran on the wall clock, or shared a clock and the first
example's closed backend. Outside pytest, :func:`run_given` runs such a test the same way.

Everything runs on the memory backend, on trio's (virtual) clock.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import pytest
import trio
import trio.testing

from .._engine import App, Engine, Worker, open_engine, open_worker
from ..backends import Backend, open_backend

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
    from contextlib import AbstractAsyncContextManager

__all__ = [
    "EngineFactory",
    "WorkersFactory",
    "engine_for",
    "examples_on_virtual_clock",
    "memory_backend",
    "run_given",
    "virtual_run",
    "workers_for",
]

T = TypeVar("T")

_FIXTURES = frozenset({"memory_backend", "engine_for", "workers_for"})
"""The fixtures whose tests the plugin runs on the autojump clock."""
_CLOCKS = frozenset({"autojump_clock", "mock_clock"})
"""pytest-trio's clock fixtures: a hypothesis example gets a fresh copy of the one named."""


class EngineFactory(Protocol):
    """``engine_for(app, **open_engine_options)``: an ``async with`` block that opens an engine
    for ``app`` on the test's memory backend."""

    def __call__(self, app: App, **options: Any) -> AbstractAsyncContextManager[Engine]: ...


class WorkersFactory(Protocol):
    """``workers_for(app, count=1, **open_worker_options)``: an ``async with`` block that opens
    ``count`` workers for ``app`` on the test's memory backend (instance ids ``worker-0``,
    ``worker-1``, ...) and yields them as a list."""

    def __call__(
        self, app: App, count: int = 1, **options: Any
    ) -> AbstractAsyncContextManager[list[Worker]]: ...


@pytest.fixture
async def memory_backend() -> AsyncIterator[Backend]:
    """A fresh ``memory://`` backend (broker and key store), closed after the test."""
    async with open_backend("memory://") as backend:
        yield backend


def _engine_factory(backend: Backend) -> EngineFactory:
    def factory(app: App, **options: Any) -> AbstractAsyncContextManager[Engine]:
        return open_engine(app, backend, **options)

    return factory


def _workers_factory(backend: Backend) -> WorkersFactory:
    @asynccontextmanager
    async def factory(app: App, count: int = 1, **options: Any) -> AsyncIterator[list[Worker]]:
        async with AsyncExitStack() as stack:
            workers = []
            for index in range(count):
                worker_options = {"instance_id": f"worker-{index}", **options}
                workers.append(
                    await stack.enter_async_context(open_worker(app, backend, **worker_options))
                )
            yield workers

    return factory


@pytest.fixture
def engine_for(memory_backend: Backend) -> EngineFactory:
    """A factory of engines on :func:`memory_backend` (see :class:`EngineFactory`)."""
    return _engine_factory(memory_backend)


@pytest.fixture
def workers_for(memory_backend: Backend) -> WorkersFactory:
    """A factory of groups of workers on :func:`memory_backend` (see :class:`WorkersFactory`)."""
    return _workers_factory(memory_backend)


def _fresh_clock(given: object) -> trio.abc.Clock:
    """A new clock like ``given`` (a named clock fixture's value, resolved once per test)."""
    if isinstance(given, trio.testing.MockClock):
        return trio.testing.MockClock(rate=given.rate, autojump_threshold=given.autojump_threshold)
    if isinstance(given, trio.abc.Clock):
        return given  # not a MockClock: nothing to copy it from
    return trio.testing.MockClock(autojump_threshold=0)


def examples_on_virtual_clock(test: Callable[..., Awaitable[object]]) -> Callable[..., None]:
    """Wrap the async body of a hypothesis test (its ``.hypothesis.inner_test``) so that each
    call, that is each example, runs in its own ``trio.run`` on a fresh virtual clock with a
    fresh ``memory://`` backend.

    The arguments named ``memory_backend``, ``engine_for`` and ``workers_for`` (given, as
    pytest gives its fixtures, or missing from the call) get the example's own; a clock
    argument (``autojump_clock``, ``mock_clock``) is replaced by a fresh copy, on which the
    example runs (default: ``MockClock(autojump_threshold=0)``); other arguments pass as given.
    The plugin applies it to every ``@given`` trio test that uses these fixtures.

    Raises:
        pytest.UsageError: (when called) an argument is another trio (async) fixture, which
            pytest-trio sets up once per test, in a ``trio.run`` no example runs in: open it
            inside the test instead.
    """
    if getattr(test, "_durable_trio_examples", False):
        return test  # type: ignore[return-value]
    wanted = [name for name in inspect.signature(test).parameters if name in _FIXTURES]

    @functools.wraps(test)
    def example(*args: Any, **kwargs: Any) -> None:
        for name in wanted:
            kwargs.setdefault(name, None)
        clocks = [value for value in kwargs.values() if isinstance(value, trio.abc.Clock)]
        clock = _fresh_clock(clocks[0] if clocks else None)
        for name, value in kwargs.items():
            if name not in _FIXTURES and type(value).__name__ == "TrioFixture":
                raise pytest.UsageError(
                    f"{name!r} is a trio fixture, set up once per test and not per hypothesis "
                    "example: open it inside the test (memory_backend, engine_for and "
                    "workers_for are fresh for each example)"
                )

        async def body() -> None:
            async with open_backend("memory://") as backend:
                fresh: dict[str, Any] = {
                    "memory_backend": backend,
                    "engine_for": _engine_factory(backend),
                    "workers_for": _workers_factory(backend),
                }
                values = {
                    name: fresh[name]
                    if name in fresh
                    else clock
                    if isinstance(value, trio.abc.Clock)
                    else value
                    for name, value in kwargs.items()
                }
                await test(*args, **values)

        trio.run(body, clock=clock)

    # pytest-trio wraps a trio test's hypothesis body in its own runner (``trio.run`` with the
    # test's one clock) unless it is marked as wrapped already.
    example._trio_test_runner_wrapped = True  # type: ignore[attr-defined]
    example._durable_trio_examples = True  # type: ignore[attr-defined]
    return example


def run_given(test: Callable[..., object]) -> None:
    """Run the ``@given`` test ``test`` (async, using these fixtures) outside pytest, each
    example as the plugin runs it under pytest (:func:`examples_on_virtual_clock`).

    Raises:
        TypeError: ``test`` is not a hypothesis test of an async function.
    """
    hypothesis = getattr(test, "hypothesis", None)
    inner = getattr(hypothesis, "inner_test", None)
    body = inner
    if getattr(inner, "_durable_trio_examples", False):
        body = getattr(inner, "__wrapped__", None)
    if hypothesis is None or not inspect.iscoroutinefunction(body):
        raise TypeError(f"run_given: {test!r} is not a @given test of an async function")
    hypothesis.inner_test = examples_on_virtual_clock(body)
    # Hypothesis asks for the arguments it does not draw (pytest's fixtures): placeholders,
    # which each example replaces with its own.
    test(**{name: None for name in inspect.signature(test).parameters if name in _FIXTURES})


def virtual_run(
    fn: Callable[[], Awaitable[T]],
    *,
    clock: trio.abc.Clock | None = None,
    instruments: Sequence[trio.abc.Instrument] = (),
) -> T:
    """``trio.run`` on ``MockClock(autojump_threshold=0)`` unless a ``clock`` is given.

    The runner the plugin gives pytest-trio (``pytest.mark.trio(run=virtual_run)``) for every
    trio test that uses these fixtures.
    """
    if clock is None:
        clock = trio.testing.MockClock(autojump_threshold=0)
    return trio.run(fn, clock=clock, instruments=instruments)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the trio tests that use these fixtures on the autojump clock (see the module doc).

    The marker goes first, so pytest-trio finds it before ``trio_mode``'s own. A test that
    chose its runner itself (``@pytest.mark.trio(run=trio.run)`` on the function: the wall
    clock) keeps it.
    """
    for item in items:
        if not _FIXTURES.intersection(getattr(item, "fixturenames", ())):
            continue
        test = getattr(item, "obj", None)
        own = getattr(test, "pytestmark", ())
        if any(mark.name == "trio" and "run" in mark.kwargs for mark in own):
            continue
        hypothesis = getattr(test, "hypothesis", None)
        inner = getattr(hypothesis, "inner_test", test)
        if getattr(inner, "_durable_trio_examples", False):  # (parametrized: done already)
            item.add_marker(pytest.mark.trio(run=virtual_run), append=False)
            _allow_per_example_fixtures(item)
        elif inspect.iscoroutinefunction(inner):
            if hypothesis is not None:
                hypothesis.inner_test = examples_on_virtual_clock(inner)
                _allow_per_example_fixtures(item)
            # (On a hypothesis test the mark only makes its async fixtures trio fixtures,
            # which its examples replace: pytest-trio leaves the wrapped body alone.)
            item.add_marker(pytest.mark.trio(run=virtual_run), append=False)


def _allow_per_example_fixtures(item: pytest.Item) -> None:
    """Suppress hypothesis's ``function_scoped_fixture`` health check for ``item`` when every
    function-scoped fixture it names is one each example gets afresh (these fixtures, a
    pytest-trio clock): the check warns of fixtures NOT reset between examples."""
    info = getattr(item, "_fixtureinfo", None)
    function = getattr(item, "function", None)
    if info is None or function is None:
        return
    for name in inspect.signature(function).parameters:
        definitions = info.name2fixturedefs.get(name)
        if definitions and definitions[-1].scope == "function" and name not in _FIXTURES | _CLOCKS:
            return  # another fixture is not reset: hypothesis's check stays and says so
    from hypothesis import HealthCheck, settings

    obj = getattr(item, "obj", None)
    test = getattr(obj, "__func__", obj)
    # Where hypothesis's pytest plugin reads a test's settings (and sets them itself).
    current: settings = getattr(test, "_hypothesis_internal_use_settings", None) or (
        settings.default or settings()
    )
    suppressed = list(current.suppress_health_check)
    if test is None or HealthCheck.function_scoped_fixture in suppressed:
        return
    suppressed.append(HealthCheck.function_scoped_fixture)
    test._hypothesis_internal_use_settings = settings(
        parent=current, suppress_health_check=suppressed
    )
