"""``open_engine``: an engine, its run store and its transport, opened and closed together."""

from __future__ import annotations

import uuid
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .._failures import one_exception, raise_bare
from .._transport._facade import open_queue_transport
from .._transport._options import log_error
from ._engine import Engine, start_engine
from ._options import EngineOptions
from ._retry import Retry
from ._schedules import schedule_options
from ._step_watch import step_watch_options
from ._stores import open_run_store
from ._wall_clock import calendar_clock, follow_the_timers

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from .._transport._options import ErrorHook
    from ..backends._backend import Backend
    from ._app import App
    from ._stores import RunStore

__all__ = ["open_engine"]


@asynccontextmanager
async def open_engine(
    app: App,
    backend: Backend,
    *,
    store: RunStore | None = None,
    engine_id: str | None = None,
    run_lease: float = 30.0,
    reconcile_interval: float | None = 5.0,
    watch_interval: float | None = 1.0,
    reconcile: bool = True,
    release_on_close: bool = True,
    default_retry: Retry | None = None,
    seed: int | str | None = None,
    turn_timeout: float = 300.0,
    serve_tenants: bool = False,
    heartbeat_check_interval: float = 1.0,
    cancel_grace: float = 30.0,
    max_child_depth: int = 100,
    retention: float | None = None,
    retention_interval: float = 60.0,
    retention_batch: int = 100,
    **transport_options: Any,
) -> AsyncIterator[Engine]:
    """Open an engine that drives ``app``'s workflows over ``backend``.

    On entry it reconciles: runs left in flight by a dead engine (or by an earlier process
    under the same ``engine_id``) are taken over and replayed, their unconfirmed dispatches
    re-dispatched. Leaving the block stops driving runs (see :meth:`Engine.aclose`) and closes
    the transport.

    Args:
        app: the workflows (and the retry policies of its steps).
        backend: from :func:`~durable_trio.open_backend`.
        store: a run store (default: the backend's, see ``open_run_store``).
        engine_id, run_lease, reconcile_interval, watch_interval, reconcile,
            release_on_close, default_retry, seed, turn_timeout, serve_tenants: see
            :class:`EngineOptions`.
        wall_clock, schedule_grace, schedule_recheck: (keywords) the scheduler's, see
            :class:`EngineOptions` (``docs/engine.md``, "Schedules"); without ``wall_clock``
            the schedules follow the clock of the store's durable timers (virtual under a
            ``MockClock`` on the memory store).
        step_timeout_grace, unstarted_report_after: (keywords) the step watch's, see
            :class:`EngineOptions` (``docs/engine.md``, "Step timeouts").
        audit_interval: (keyword) the loss audit's period, see :class:`EngineOptions`.
            release_on_close, default_retry, seed, turn_timeout, serve_tenants,
            heartbeat_check_interval, cancel_grace, max_child_depth: see
            :class:`EngineOptions`.
        retention, retention_interval, retention_batch: how long finished runs are kept
            before this engine deletes them (default ``None``: for good), see
            :class:`EngineOptions` (``docs/engine.md``, "Retention").
        **transport_options: :func:`~durable_trio.open_queue_transport` options; ``namespace``
            defaults to the app's name, ``result_concurrency`` to 16.

    Raises:
        ConfigError: an option that cannot work.

    Error handling:
        The block ends with one exception, never an internal exception group. The body's own
        exception leaves as it is raised; a failure of the engine's tasks, its transport or its
        run store at the same time (a programming error, not a broker outage, which they report
        and retry) is attached to it as ``__context__`` and named in a note. Without a body
        exception that failure itself is raised.
    """
    options = EngineOptions(
        engine_id=engine_id or uuid.uuid4().hex,
        run_lease=run_lease,
        reconcile_interval=reconcile_interval,
        watch_interval=watch_interval,
        reconcile=reconcile,
        release_on_close=release_on_close,
        default_retry=default_retry or Retry(),
        seed=seed,
        turn_timeout=turn_timeout,
        serve_tenants=serve_tenants,
        **step_watch_options(transport_options),
        **schedule_options(transport_options),
        heartbeat_check_interval=heartbeat_check_interval,
        cancel_grace=cancel_grace,
        max_child_depth=max_child_depth,
        retention=retention,
        retention_interval=retention_interval,
        retention_batch=retention_batch,
    )
    transport_options.setdefault("namespace", app.name)
    transport_options.setdefault("result_concurrency", 16)
    namespace = str(transport_options["namespace"])
    on_error: ErrorHook = transport_options.get("on_error", log_error)
    # What the engine's start or the body raises leaves bare, not wrapped in the root
    # nursery's group; what the engine's tasks, the transport or the store raise meanwhile is
    # attached to it, not dropped (see _failures).
    body_error: BaseException | None = None
    background: list[BaseException] = []
    try:
        async with AsyncExitStack() as stack:
            if store is None:
                store = await stack.enter_async_context(open_run_store(backend, namespace))
            transport = await stack.enter_async_context(
                open_queue_transport(backend, **transport_options)
            )
            if options.wall_clock is follow_the_timers:
                # Schedules on the clock of the store's durable timers (virtual in tests).
                options = attrs.evolve(options, wall_clock=calendar_clock(store))
            # The engine builds its pieces (the services they share, result application, the
            # periodic loops) and composes them behind the public API.
            engine = Engine(app, store, transport, options, on_error)
            try:
                # The engine's tree (._tree) runs in this nursery; leaving the block asks for
                # its close and waits for it (Engine.aclose).
                async with trio.open_nursery() as root:
                    try:
                        try:
                            await start_engine(engine, root)
                        except BaseException as exc:
                            body_error = exc
                        else:
                            try:
                                yield engine
                            except BaseException as exc:
                                body_error = exc
                    finally:
                        await engine.aclose()
            except BaseExceptionGroup as group:
                background.append(group)
    except BaseException as exc:  # opening or closing the transport or the store
        background.append(exc)
    error = one_exception(body_error, background, owner="the engine")
    if error is not None:
        raise_bare(error)
