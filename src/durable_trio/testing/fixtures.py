"""pytest fixtures for testing durable_trio applications (with pytest-trio).

Enable them in your top-level ``conftest.py``::

    pytest_plugins = ["durable_trio.testing.fixtures"]

(or import the fixtures you use into a ``conftest.py``: ``from durable_trio.testing.fixtures
import memory_backend, engine_for, workers_for``). Then, in a trio test that asks for pytest-trio's
``autojump_clock`` too (pytest-trio takes the clock from the TEST's own arguments, so the test must
name it)::

    async def test_order(autojump_clock, engine_for, workers_for):
        async with workers_for(app, 2), engine_for(app) as engine:
            run_id = await engine.start("order", {"id": 1})
            assert await engine.result(run_id) == {...}
            assert trio.current_time() == 42.0   # virtual: exact

Everything runs on the memory backend, on trio's (virtual) clock.
"""

from __future__ import annotations

from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any, Protocol

import pytest

from .._backend import Backend, open_backend
from .._engine import App, Engine, Worker, open_engine, open_worker

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from contextlib import AbstractAsyncContextManager

__all__ = ["EngineFactory", "WorkersFactory", "engine_for", "memory_backend", "workers_for"]


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
