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

Everything runs on the memory backend, on trio's (virtual) clock.
"""

from __future__ import annotations

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
    "memory_backend",
    "virtual_run",
    "workers_for",
]

T = TypeVar("T")

_FIXTURES = frozenset({"memory_backend", "engine_for", "workers_for"})
"""The fixtures whose tests the plugin runs on the autojump clock."""


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


@pytest.fixture
def engine_for(memory_backend: Backend) -> EngineFactory:
    """A factory of engines on :func:`memory_backend` (see :class:`EngineFactory`)."""

    def factory(app: App, **options: Any) -> AbstractAsyncContextManager[Engine]:
        return open_engine(app, memory_backend, **options)

    return factory


@pytest.fixture
def workers_for(memory_backend: Backend) -> WorkersFactory:
    """A factory of groups of workers on :func:`memory_backend` (see :class:`WorkersFactory`)."""

    @asynccontextmanager
    async def factory(app: App, count: int = 1, **options: Any) -> AsyncIterator[list[Worker]]:
        async with AsyncExitStack() as stack:
            workers = []
            for index in range(count):
                worker_options = {"instance_id": f"worker-{index}", **options}
                workers.append(
                    await stack.enter_async_context(
                        open_worker(app, memory_backend, **worker_options)
                    )
                )
            yield workers

    return factory


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
        inner = getattr(getattr(test, "hypothesis", None), "inner_test", test)
        if inspect.iscoroutinefunction(inner):
            item.add_marker(pytest.mark.trio(run=virtual_run), append=False)
