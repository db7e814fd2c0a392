"""Updates (issue 34, item 6): ``engine.update(run_id, name, payload)`` asks a running workflow
to run its handler of ``name`` (``ctx.on_update``) and returns the handler's value.

The logs: two per-run append logs of the run store, under reserved signal names (as the stream,
``_stream``): :data:`UPDATE_LOG` holds the requests (``{"id", "name", "payload"}``, appended by
any caller, any process), :data:`UPDATE_DONE` their outcomes (``{"id", "seq", "at", "status",
"value" | "error"}``, appended only by the run's driver). So updates are on every store, durable,
rung on the run's wakes, refused once the run has finished and deleted with it by retention,
with no schema change.

Determinism: a handler is a plain function run inside the workflow, between two of its awaits.
The run's driver counts the workflow's durable calls as they are entered (``ctx.step``,
``ctx.run``, ``ctx.sleep``, ``ctx.wait_signal``, ``ctx.set_event``, ``ctx.emit``, children: the
``k``-th entered has count ``k``) and applies a request only while at least one call is in
flight (the workflow is suspended in it); the outcome records ``at = k``, the count then. The
workflow resumes from no call while an outcome is being written (the call waits for it). On
replay, the outcomes recorded at ``k`` are re-applied (the handler run again, its value
ignored) when call ``k`` is entered, before it proceeds: the workflow's state is the same at
every call as it was. Crash between a handler's run and its outcome's append: the process and
its state are gone; the request is still unanswered and is applied once by the next driver.

Rejections (no handler of the name, a validator that raised) are recorded as outcomes that
re-apply nothing; the caller raises :class:`UpdateRejected`. A handler that raises fails the
update (:class:`UpdateFailed` in the caller), not the workflow; its replay runs it again (it
may have changed state before raising) and ignores the exception.

Callers: :func:`send_update` appends the request (unless an outcome of its ``update_id`` is
already recorded: a retried caller), whose append rings the run's driver (the store's ring, in
any process), and waits for the outcome on the run's wakes (a store read every
:data:`UPDATE_POLL` seconds as the safety net), from any process.
"""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Callable
from contextlib import ExitStack, suppress
from functools import partial
from typing import TYPE_CHECKING, Any

import attrs
import orjson
import trio

from .._arguments import check_name
from .._attrs_shared import shared_eq, shared_hash, shared_repr
from .._errors import ConfigError
from .._json_values import check_json
from ._context import UPDATE_DONE, UPDATE_LOG
from ._errors import (
    NonDeterminismError,
    RunNotFound,
    UpdateFailed,
    UpdateRejected,
    UpdateTimeout,
)
from ._generations import continuation_of
from ._records import normalize_json
from ._stores._wakes import wakes_of

if TYPE_CHECKING:
    from ._stores import RunStore

__all__ = [
    "MAX_UPDATES",
    "UPDATE_POLL",
    "UPDATE_QUIET_MAX",
    "UpdateServant",
    "UpdatingDriver",
    "engine_update",
    "read_outcomes",
    "send_update",
]

#: Requests a run takes at most (a request past it is rejected by the caller, nothing stored).
MAX_UPDATES = 10_000

#: Seconds between two store reads of a driver or a caller that heard no ring (the safety net).
UPDATE_POLL = 1.0

#: The longest interval of a driven run's safety-net read of its requests, on a store whose
#: wakes are heard (the interval starts at :data:`UPDATE_POLL`, doubles while none comes).
UPDATE_QUIET_MAX = 30.0

#: The driver calls a context makes that count as the workflow's awaits.
_CALLS = (
    "remote",
    "local",
    "timer",
    "wait_signal",
    "set_event",
    "child_start",
    "child_wait",
)


@attrs.frozen(repr=False, eq=False)
class _Handler:
    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    fn: Callable[[Any], Any]
    validate: Callable[[Any], object] | None


def _decode(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        entry = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    return entry if isinstance(entry, dict) and isinstance(entry.get("id"), str) else None


async def read_outcomes(store: RunStore, run_id: str, start: int = 1) -> list[dict[str, Any]]:
    """The run's recorded outcomes from seq ``start`` on (damaged entries skipped)."""
    found: list[dict[str, Any]] = []
    seq = start
    while seq <= MAX_UPDATES:
        text = await store.read_signal(run_id, UPDATE_DONE, seq)
        if text is None:
            break
        seq += 1
        entry = _decode(text)
        found.append(entry if entry is not None else {"id": "", "status": "damaged"})
    return found


class UpdateServant:
    """A run driver's updates: its handlers, its count of calls entered and in flight, and the
    task (:meth:`serve`) that applies the requests (see the module docstring)."""

    def __init__(self, driver: Any) -> None:
        # What it reads of its driver, not the driver: a driver holds its servant, and a
        # cycle between them would outlive the run until a full collection (issue 6's
        # figures: the garbage collector took a third of a burst of runs).
        self.services = driver.services
        self.run_id: str = driver.run.run_id
        self.workflow: str = driver.run.workflow
        self.handlers: dict[str, _Handler] = {}
        self.entered = 0
        self.in_flight = 0
        self.writing: trio.Lock | None = None
        """Held while an outcome is written (made by the first request :meth:`serve` applies)."""
        self.flying: trio.Event | None = None
        """Set when the workflow enters a call (made by :meth:`serve` while it waits for one)."""
        self.answered: set[str] = set()
        self.loaded = trio.Event()
        history = getattr(driver, "history", None)
        self.generation = continuation_of(getattr(history, "continued", None)).generation
        """The run's generation (continue-as-new): outcomes re-apply in their own only."""
        """:meth:`load` is done: the workflow's first call waits for it."""
        self.replay: dict[int, list[dict[str, Any]]] = {}
        self.fresh: tuple[ExitStack, trio.Event] | None = None
        """A new run's watch of its wakes, taken before the run was created (:meth:`watch_new`)."""
        self._driver_scope: trio.CancelScope = driver.scope
        self._serving: trio.CancelScope | None = None
        self._stopped = False
        self.failed: Exception | None = None
        """What :meth:`serve` raised (its driver was cancelled for it, and raises it)."""

    def watch_new(self, watch: ExitStack, rung: trio.Event) -> None:
        """The run was created here with ``watch`` (of its wakes' ``rung``) taken BEFORE its
        create: a request, appended only to a run that exists, rings it; so the request log is
        not read at the start (issue 32: one statement fewer per run, and the workflow's first
        call does not wait for it). :meth:`serve` takes the watch over."""
        self.fresh = (watch, rung)
        self.loaded.set()

    def drop_watch(self) -> None:
        """Close a :meth:`watch_new` watch :meth:`serve` never took over (idempotent)."""
        fresh, self.fresh = self.fresh, None
        if fresh is not None:
            fresh[0].close()

    # -- the serving's life (started by the engine's UpdateDesk, ._update_desk) ----------------

    def serving_scope(self) -> trio.CancelScope | None:
        """The scope of the serving about to start (``None``: it runs, or the driver ended).
        A new run's watch is let go first: the serving watches anew and reads at once."""
        if self._serving is not None or self._stopped:
            return None
        self.drop_watch()
        self._serving = trio.CancelScope()
        return self._serving

    async def serve_within(self, scope: trio.CancelScope) -> None:
        """:meth:`serve` in ``scope`` (cancelled when the driver ends); what it raises cancels
        the driver, which raises it (:attr:`failed`)."""
        with scope:
            try:
                await self.serve()
            except Exception as exc:
                self.failed = exc
                self._driver_scope.cancel()

    def stop_serving(self) -> None:
        """The driver ended: the serving stops where it waits, and none starts (idempotent)."""
        self._stopped = True
        if self._serving is not None:
            self._serving.cancel()
        self.drop_watch()

    # -- the workflow's side ------------------------------------------------------------

    def on_update(
        self, name: str, fn: Callable[[Any], Any], validate: Callable[[Any], object] | None
    ) -> None:
        for given, what in ((fn, "handler"), (validate, "validate")):
            if given is None and what == "validate":
                continue
            if not callable(given) or inspect.iscoroutinefunction(given):
                raise TypeError(f"ctx.on_update: {what} must be a plain (non-async) function")
        self.handlers[name] = _Handler(fn, validate)

    async def load(self) -> None:
        """Read the outcomes recorded: what a replay re-applies, and where."""
        services = self.services
        run_id = self.run_id
        outcomes = await services.guard(lambda: read_outcomes(services.store, run_id), "reading")
        for outcome in outcomes:
            if outcome["id"] in self.answered:
                continue
            self.answered.add(outcome["id"])
            at = outcome.get("at")
            if outcome.get("gen", 0) != self.generation:
                continue  # applied in an earlier generation: its history is not replayed
            if outcome.get("status") in ("ok", "failed") and isinstance(at, int):
                self.replay.setdefault(at, []).append(outcome)

    def _reapply(self, count: int) -> None:
        for outcome in self.replay.pop(count, ()):
            name = str(outcome.get("name"))
            handler = self.handlers.get(name)
            if handler is None:
                raise NonDeterminismError(
                    f"non-determinism in run {self.run_id!r}: its history applied "
                    f"update {name!r} before call {count}, and the workflow has no handler of "
                    "it there now",
                    run_id=self.run_id,
                    step_id=str(count),
                    expected=f"ctx.on_update({name!r})",
                    found=None,
                )
            with suppress(Exception):  # it failed the update the first time too
                handler.fn(outcome.get("payload"))

    def next_generation(self, generation: int) -> None:
        """The run continued as new: the new generation registers its own handlers and counts
        its calls from the start (its replay after a crash starts from its mark)."""
        self.generation = generation
        self.handlers.clear()
        self.entered = 0
        self.replay.clear()

    async def call(self, method: Callable[..., Any], *args: Any) -> Any:
        """One of the workflow's calls: counted, re-applying what replay holds for it."""
        if not self.loaded.is_set():
            await self.loaded.wait()
        self.entered += 1
        self._reapply(self.entered)
        self.in_flight += 1
        flying = self.flying
        if flying is not None:
            self.flying = None
            flying.set()
        try:
            return await method(*args)
        finally:
            writing = self.writing
            if writing is not None and writing.locked():
                # An outcome being written: the workflow waits for it.
                with trio.CancelScope(shield=True):
                    async with writing:
                        pass
            self.in_flight -= 1

    def _apply(self, request: dict[str, Any]) -> dict[str, Any]:
        """Run ``request`` now (synchronously: the workflow does not move meanwhile)."""
        name, payload = request.get("name"), request.get("payload")
        outcome: dict[str, Any] = {"id": request["id"], "name": name, "payload": payload}
        handler = self.handlers.get(name) if isinstance(name, str) else None
        if handler is None:
            known = ", ".join(sorted(self.handlers)) or "none"
            message = f"workflow {self.workflow!r} has no update {name!r} ({known})"
            return {**outcome, "status": "rejected", "error": {"message": message}}
        if handler.validate is not None:
            try:
                handler.validate(payload)
            except Exception as exc:
                error = {"type": type(exc).__name__, "message": str(exc)}
                return {**outcome, "status": "rejected", "error": error}
        outcome["at"] = self.entered
        if self.generation:
            outcome["gen"] = self.generation
        try:
            value = normalize_json(handler.fn(payload), f"the value of update {name!r}")
        except Exception as exc:
            error = {"type": type(exc).__name__, "message": str(exc)}
            return {**outcome, "status": "failed", "error": error}
        return {**outcome, "status": "ok", "value": value}

    async def serve(self) -> None:
        """Apply the run's requests in log order, each once, while the workflow is in a call."""
        services = self.services
        store = services.store
        run_id = self.run_id
        wakes = wakes_of(store)
        seq = 1
        quiet = UPDATE_POLL  # the safety net's interval: doubles while nothing comes
        while seq <= MAX_UPDATES:
            with ExitStack() as watch:
                fresh, self.fresh = self.fresh, None
                if fresh is not None:  # a new run, watched since before its create: no read
                    watch.enter_context(fresh[0])
                    rung, text = fresh[1], None
                else:
                    rung = watch.enter_context(wakes.watching(run_id)) if wakes else trio.Event()
                    text = await services.guard(
                        partial(store.read_signal, run_id, UPDATE_LOG, seq), "reading"
                    )
                if not self.loaded.is_set():
                    # No request yet means no outcome yet either (only a driver appends one,
                    # for a request it read): the outcomes are read only behind a request
                    # (issue 32: one read fewer per run; nearly every run takes no update).
                    if text is not None:
                        await self.load()
                    self.loaded.set()
                if text is None:
                    with trio.move_on_after(quiet):
                        await rung.wait()
                    if wakes is not None and not rung.is_set():
                        # Every running run serves its updates: with the store's wakes heard,
                        # the poll backs off, so a fleet of long-sleeping runs costs a read
                        # per run per UPDATE_QUIET_MAX, not per second.
                        quiet = min(quiet * 2, UPDATE_QUIET_MAX)
                    continue
            quiet = UPDATE_POLL
            request = _decode(text)
            if request is None or request["id"] in self.answered:
                seq += 1
                continue
            if self.writing is None:
                self.writing = trio.Lock()
            writing = self.writing
            while True:
                while self.in_flight == 0:
                    self.flying = flying = trio.Event()
                    await flying.wait()
                async with writing:
                    if self.in_flight == 0:
                        continue
                    outcome = {**self._apply(request), "seq": seq}
                    body = orjson.dumps(outcome).decode()
                    await services.guard(
                        partial(store.append_signal, run_id, UPDATE_DONE, body), "recording"
                    )
                    self.answered.add(request["id"])
                    break
            seq += 1


class UpdatingDriver:
    """What a workflow's context drives through: the run's driver, each call counted by its
    :class:`UpdateServant`; anything else goes to the driver as it is."""

    def __init__(self, driver: Any, servant: UpdateServant) -> None:
        self._driver = driver
        self._servant = servant

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._driver, name)
        if name in _CALLS:
            servant = self._servant

            async def counted(*args: Any) -> Any:
                return await servant.call(value, *args)

            return counted
        return value

    def on_update(
        self, name: str, fn: Callable[[Any], Any], validate: Callable[[Any], object] | None
    ) -> None:
        self._servant.on_update(name, fn, validate)


def _outcome(entry: dict[str, Any], run_id: str, name: str) -> Any:
    status = entry.get("status")
    found = entry.get("error")
    error: dict[str, Any] = found if isinstance(found, dict) else {}
    message = str(error.get("message", ""))
    if status == "ok":
        return entry.get("value")
    if status == "failed":
        raise UpdateFailed(
            f"update {name!r} of run {run_id!r} failed: {error.get('type')}: {message}",
            error_type=str(error.get("type", "")),
        )
    if status == "rejected":
        raise UpdateRejected(f"update {name!r} of run {run_id!r} was rejected: {message}")
    raise UpdateFailed(f"the outcome of update {name!r} of run {run_id!r} is damaged")


async def send_update(
    store: RunStore,
    run_id: str,
    name: str,
    payload: Any = None,
    *,
    update_id: str | None = None,
    timeout: float | None = None,  # noqa: ASYNC109 (the caller's bound, not the run's)
) -> Any:
    """:meth:`Engine.update`: append the request (once per ``update_id``), wake the run, and
    wait for its outcome.

    Raises:
        RunNotFound: no such run.
        UpdateRejected: refused (no handler, the validator, the run finished).
        UpdateFailed: the handler raised.
        UpdateTimeout: no outcome within ``timeout`` seconds.
        PayloadError: ``payload`` is not a JSON value.
    """
    check_name(name, "engine.update", "name")
    if update_id is not None:
        check_name(update_id, "engine.update", "update_id")
    if timeout is not None and not (isinstance(timeout, int | float) and timeout >= 0):
        raise ConfigError(f"engine.update: timeout must be seconds >= 0, got {timeout!r}")
    check_json(payload, f"the payload of update {name!r}")
    update_id = update_id or uuid.uuid4().hex
    deadline = None if timeout is None else trio.current_time() + timeout
    wakes = wakes_of(store)
    requested = False
    start = 1
    while True:
        with ExitStack() as watch:
            rung = watch.enter_context(wakes.watching(run_id)) if wakes else trio.Event()
            run = await store.get_run(run_id)  # read BEFORE the log: an end seen here is final
            if run is None and not requested:
                raise RunNotFound(run_id)
            outcomes = await read_outcomes(store, run_id, start)
            start += len(outcomes)
            for entry in outcomes:
                if entry["id"] == update_id:
                    return _outcome(entry, run_id, name)
            if run is None or run.status.terminal:
                state = "deleted" if run is None else run.status.value
                raise UpdateRejected(f"run {run_id!r} is {state}: update {name!r} was not handled")
            if not requested:
                await _request(store, run_id, name, payload, update_id)
                requested = True  # (its append rang ``rung``: the next read comes at once)
            now = trio.current_time()
            if deadline is not None and now >= deadline:
                raise UpdateTimeout(
                    f"update {name!r} of run {run_id!r} got no outcome within {timeout:g} s "
                    f"(update id {update_id!r}: call again with it for its outcome)"
                )
            wait = UPDATE_POLL if deadline is None else min(UPDATE_POLL, deadline - now)
            with trio.move_on_after(wait):
                await rung.wait()


async def _request(store: RunStore, run_id: str, name: str, payload: Any, update_id: str) -> None:
    """Append the request (its append rings the run's wakes: the driver, in any process)."""
    if await store.read_signal(run_id, UPDATE_LOG, MAX_UPDATES) is not None:
        raise UpdateRejected(f"run {run_id!r} has taken {MAX_UPDATES} updates: no more")
    text = orjson.dumps({"id": update_id, "name": name, "payload": payload}).decode()
    seq = await store.append_signal(run_id, UPDATE_LOG, text)
    if seq is None:
        run = await store.get_run(run_id)
        if run is None:
            raise RunNotFound(run_id)
        raise UpdateRejected(f"run {run_id!r} is {run.status.value}: it takes no updates")


async def engine_update(
    engine: Any,
    run_id: str,
    name: str,
    payload: Any = None,
    *,
    update_id: str | None = None,
    timeout: float | None = None,  # noqa: ASYNC109 (the caller's bound, not the run's)
) -> Any:
    """``engine.update(run_id, name, payload=None, *, update_id=None, timeout=None)``
    (docs/engine.md, "Updates"): run the workflow's handler of ``name`` and return its value.
    See :func:`send_update`."""
    run = await engine.store.get_run(run_id)
    definition = None if run is None else engine.app.workflows.get(run.workflow)
    if definition is not None and definition.remote:
        raise UpdateRejected(  # (a remote workflow's context has no ctx.on_update)
            f"run {run_id!r} is of the remote workflow {run.workflow!r}: it takes no updates"
        )
    return await send_update(
        engine.store,
        run_id,
        name,
        payload,
        update_id=update_id,
        timeout=timeout,
    )
