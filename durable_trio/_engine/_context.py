"""What workflow code sees: :class:`WorkflowContext`, step handles, and :func:`step_info`."""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Generic, NoReturn, Protocol, TypeVar, cast, overload

import attrs
import trio

from .._arguments import (
    check_callable,
    check_name,
    check_priority,
    check_run_id,
    check_seconds,
    check_type,
)
from .._attrs_shared import shared_eq, shared_hash, shared_repr
from .._errors import ConfigError
from .._json_values import check_json
from .._transport._step_beats import StepBeats, current_beats
from ._errors import EngineError, NonDeterminismError, SignalTimeout, StreamError
from ._generations import ContinueAsNew, continuation_of
from ._payloads import PLAIN, signature_of, structure_as, to_json
from ._records import StepKind, normalize_json
from ._retry import Retry
from ._step_timeouts import StepTimeouts

if TYPE_CHECKING:
    from collections.abc import Coroutine, Generator, Mapping

    from ._records import OnParentCancel, RunRecord, StepRecord
    from ._replay import History

__all__ = [
    "STREAM_EVENT",
    "UPDATE_DONE",
    "UPDATE_LOG",
    "Quiescence",
    "Registry",
    "StepHandle",
    "StepInfo",
    "WorkflowContext",
    "check_unreserved",
    "step_info",
]


class Registry(Protocol):
    """What a context reads of its app (an :class:`~._app.App`, which imports this module):
    the registered steps and workflows, for the types of their outputs."""

    @property
    def steps(self) -> Mapping[str, Any]: ...

    @property
    def workflows(self) -> Mapping[str, Any]: ...


T = TypeVar("T")

#: The event key of ``ctx.emit``'s checkpoints: the engine appends their value to the run's
#: stream (``_stream``) instead of setting an event.
STREAM_EVENT = "durable_trio.stream"

#: The reserved signal names of a run's updates (``_updates``): the requests, their outcomes.
UPDATE_LOG = "durable_trio.update"
UPDATE_DONE = "durable_trio.update.done"


@attrs.frozen(repr=False, eq=False)
class StepInfo:
    """Where the running step code is: see :func:`step_info`."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    run_id: str
    step_id: str
    attempt: int
    """1 for the first attempt, 2 for the first retry, ..."""
    name: str
    kind: str
    """``"remote"`` (a worker runs it, ``ctx.step``) or ``"local"`` (``ctx.run``)."""
    previous_heartbeat: Any = None
    """The details of the previous attempt's last beat, if it beat (a remote step's retry
    can resume from there)."""
    beats: StepBeats | None = attrs.field(default=None, repr=False, eq=False)
    """Where :meth:`heartbeat` goes (``None``: a local step, whose beats go nowhere)."""
    emitter: Callable[[Any], Awaitable[int]] | None = attrs.field(
        default=None, repr=False, eq=False
    )
    """Where :meth:`emit` goes (``None``: this step cannot emit)."""

    async def emit(self, value: Any) -> int:
        """Publish ``value`` (JSON) on the run's stream, read by ``engine.stream(run_id)`` as
        it comes (docs/engine.md, "Streaming"): appended to the run store, durably, before
        this returns. An attempt delivered again emits the same entries again, which the
        readers skip (each value is keyed by the step, the attempt and its place among the
        attempt's emits); a retry's emits are new values.

        Returns:
            The value's place in the run's stream log.

        Raises:
            PayloadError: ``value`` is not a JSON value.
            StreamValueTooLarge: its JSON is larger than the stream's bound.
            StreamFull: the run's stream is full.
            StreamError: the run has finished, or this step cannot emit (a local step of a
                remote workflow's turn, a ``transport.handle`` handler, a tenant pod's worker).
        """
        if self.emitter is None:
            check_json(value, "an emitted value")
            raise StreamError(
                f"step {self.name!r} cannot emit: only a step served by open_worker (outside "
                "a tenant pod) or a local step (ctx.run) of a workflow the engine drives can"
            )
        return await self.emitter(value)

    def heartbeat(self, details: Any = None) -> None:
        """Say the step is alive, with optional JSON ``details``. Synchronous and cheap: the
        worker pushes at most one beat per ``step_heartbeat_interval``, with the latest
        details; the engine records the last one on the step (``engine.history``) and, for a
        step declared with ``heartbeat_timeout=``, fails the attempt over (retryable, retried
        at once) once its beats stop for longer. A local step (``ctx.run``) runs in the
        engine: its beats are accepted and dropped.

        Raises:
            PayloadError: ``details`` is not a JSON value.
        """
        if self.beats is not None:
            self.beats.heartbeat(details)
        else:
            check_json(details, "heartbeat details")

    @property
    def idempotency_key(self) -> str:
        """``"{run_id}:{step_id}"``: the same for every attempt and every redelivery of the step,
        different for every other step. Key your side effects on it (a payment provider's
        idempotency key, a unique constraint, an upsert)."""
        return f"{self.run_id}:{self.step_id}"


def check_unreserved(name: str, what: str) -> None:
    """Refuse the name of a run's stream log (:data:`STREAM_EVENT`) or of its update logs
    (:data:`UPDATE_LOG`, :data:`UPDATE_DONE`) as a signal or event name.

    Raises:
        ConfigError: ``name`` is reserved.
    """
    if name in (STREAM_EVENT, UPDATE_LOG, UPDATE_DONE):
        raise ConfigError(f"{name!r} is reserved (a run's own log) and cannot be {what}")


_CURRENT_STEP: contextvars.ContextVar[StepInfo] = contextvars.ContextVar("durable_trio_step")


def step_info() -> StepInfo:
    """The step running in this task: its run id, step id, attempt and idempotency key.

    Call it inside a step function (served by :func:`open_worker`), inside a handler given to
    ``transport.handle``, or inside the function given to ``ctx.run``. Its
    :meth:`StepInfo.heartbeat` beats.

    Raises:
        RuntimeError: called outside a step.
    """
    try:
        return _CURRENT_STEP.get()
    except LookupError:
        pass
    beats = current_beats()  # a handler given to transport.handle
    if beats is None:
        raise RuntimeError(
            "step_info() is only available inside a running step (a step function served by "
            "open_worker, a transport.handle handler, or the function given to ctx.run)"
        )
    task = beats.task
    return StepInfo(
        task.run_id, task.step_id, task.attempt, task.name, "remote", task.last_heartbeat, beats
    )


class _Driver(Protocol):
    """What a context needs from the engine that drives its run."""

    async def remote(
        self,
        step_id: str,
        name: str,
        input: Any,
        retry: Retry | None,
        priority: int | None,
        timeouts: StepTimeouts | None = None,
    ) -> Any: ...

    async def local(
        self, step_id: str, name: str, fn: Callable[[], Any], retry: Retry | None
    ) -> Any: ...

    async def timer(self, step_id: str, seconds: float) -> None: ...

    async def wait_signal(
        self,
        step_id: str,
        name: str,
        seq: int,
        timeout: float | None,  # noqa: ASYNC109 (a durable deadline, not a trio one)
    ) -> Any: ...

    async def set_event(self, step_id: str, key: str, value: Any) -> None: ...

    def mark_patch(self, change_id: str) -> None:
        """Record the version marker of ``change_id`` before any later checkpoint."""


class Quiescence:
    """Counts the workflow's running threads of control during a remote workflow turn (the
    body, and the children of every :meth:`WorkflowContext.gather`): the turn is over once
    every one of them waits on a step the engine has yet to settle (``running`` reaches 0),
    or the workflow returned. Exact, with no timing involved: workflow code awaits only
    ``ctx`` calls."""

    __slots__ = ("running", "settled")

    def __init__(self) -> None:
        self.running = 1
        self.settled = trio.Event()

    def fork(self, children: int) -> None:
        """A gather: the parent waits, ``children`` start."""
        if children:
            self.running += children - 1

    def join(self, *, last: bool) -> None:
        """A gather child ended; the last one hands its turn back to the parent."""
        if not last:
            self._less()

    def finish(self) -> None:
        """The workflow returned or raised."""
        self.settled.set()

    async def block(self) -> None:
        """This thread waits on the engine: never returns (the turn is cancelled)."""
        self._less()
        await trio.sleep_forever()

    def _less(self) -> None:
        self.running -= 1
        if self.running <= 0:
            self.settled.set()


class StepHandle(Generic[T]):
    """An awaitable step: its id was assigned when it was created (at CALL time), so handles
    created in one order keep their ids whatever order they complete in.

    ``await`` it once (directly, or through :meth:`WorkflowContext.gather`). A handle never
    awaited runs nothing.
    """

    __slots__ = ("_awaited", "_ctx", "_start", "kind", "name", "step_id")

    def __init__(
        self,
        ctx: WorkflowContext,
        step_id: str,
        kind: StepKind,
        name: str,
        start: Callable[[], Coroutine[Any, Any, T]],
    ) -> None:
        self._ctx = ctx
        self.step_id = step_id
        self.kind = kind
        self.name = name
        self._start = start
        self._awaited = False

    def __repr__(self) -> str:
        return f"<StepHandle {self.kind.value} {self.name!r} id={self.step_id}>"

    def __await__(self) -> Generator[Any, None, T]:
        if self._awaited:
            raise RuntimeError(f"{self!r} was already awaited (a step handle runs once)")
        self._awaited = True
        # The coroutine is made only now: a handle never awaited leaves no "never awaited"
        # coroutine behind.
        return self._start().__await__()


class WorkflowContext:
    """The handle a workflow uses to run steps, durable timers and local steps.

    Every call below is checkpointed in the run store and replayed after a crash: on replay a
    completed call returns its recorded outcome at once, without running again. Workflow code
    must therefore be deterministic: the same calls in the same order on every run (see
    ``docs/engine.md``).

    Attributes:
        run_id: the run being driven.
        workflow: the workflow's name.
    """

    def __init__(
        self, driver: _Driver, run: RunRecord, history: History, *, app: Registry | None = None
    ) -> None:
        self._driver = driver
        self._app = app
        self.run_id = run.run_id
        self.workflow = run.workflow
        self._history = history
        self._next = 0
        self._tracker: Quiescence | None = getattr(driver, "tracker", None)
        # continue-as-new (issue 34, item 5): a later generation numbers its steps on from the
        # generations before it and takes the signals they did not consume (._generations).
        start = continuation_of(getattr(history, "continued", None))
        self.generation = start.generation
        self._next = start.last_step
        self.__dict__["_signal_counts"] = dict(start.signals)

    def __repr__(self) -> str:
        return f"<WorkflowContext run={self.run_id!r} workflow={self.workflow!r}>"

    @property
    def is_replaying(self) -> bool:
        """Whether the workflow is re-executing calls already in its history (after a crash or
        a restart). Use it to keep side effects of the workflow body itself (log lines, prints)
        from repeating; never to change which steps are called."""
        return self._history.replaying

    def _next_id(self) -> str:
        self._next += 1
        return str(self._next)

    def step(
        self,
        name: str,
        input: Any = None,
        *,
        retry: Retry | None = None,
        priority: int | None = None,
        timeout: float | None = None,
        schedule_to_start_timeout: float | None = None,
    ) -> StepHandle[Any]:
        """Run step ``name`` on a worker: ``await ctx.step("charge-card", order)``.

        The task carries the idempotency key ``"{run_id}:{step_id}"``; failures are retried
        per the step's :class:`Retry` (``retry`` here, else the app's, else the engine's
        default), each retry held by the broker for its backoff delay.

        Args:
            name: the registered step name.
            input: its JSON input.
            retry: overrides the step's retry policy for this call.
            priority: task priority (lower first); default: the step's.
            timeout: start-to-close seconds for each attempt; default: the step's.
            schedule_to_start_timeout: seconds an attempt may wait for a worker to take it;
                default: the step's.

        Returns:
            A handle; awaiting it returns the step's JSON output.

        Raises:
            StepFailed: (when awaited) the step failed for good; catch it to compensate.
            PayloadError: ``input`` is not a JSON value (NaN, a set, nested deeper than
                ``MAX_JSON_DEPTH``, ...); ``path`` names where.
            TypeError: ``name`` is not a str, ``retry`` not a :class:`Retry`, ``priority``
                not an int (at once, in the workflow).
            ConfigError: ``name`` is empty, ``priority`` outside what every broker keeps, a
                timeout not a positive number of seconds.
            UnknownStep: (a ``ConfigError``, when awaited) the engine's app registers steps
                and ``name`` is not one of them.
        """
        step_id = self._next_id()  # before the checks, as histories recorded it
        check_name(name, "ctx.step", "name")
        value = normalize_json(to_json(input), f"the input of step {name!r}")
        check_type(retry, Retry, "ctx.step", "retry")
        check_priority(priority, "ctx.step")
        timeouts = StepTimeouts.given("ctx.step", timeout, schedule_to_start_timeout)
        driver = self._driver
        step = None if self._app is None else self._app.steps.get(name)
        output = PLAIN if step is None else signature_of(step.fn, 0).output
        if output is PLAIN:  # (no frame of its own: a burst of runs holds one per step)
            return StepHandle(
                self,
                step_id,
                StepKind.REMOTE,
                name,
                partial(driver.remote, step_id, name, value, retry, priority, timeouts),
            )

        async def typed() -> Any:
            result = await driver.remote(step_id, name, value, retry, priority, timeouts)
            return structure_as(result, output, f"the output of step {name!r}")

        return StepHandle(self, step_id, StepKind.REMOTE, name, typed)

    @overload
    def run(
        self, name: str, fn: Callable[[], Awaitable[T]], *, retry: Retry | None = None
    ) -> StepHandle[T]: ...

    @overload
    def run(
        self, name: str, fn: Callable[[], T], *, retry: Retry | None = None
    ) -> StepHandle[T]: ...

    def run(
        self, name: str, fn: Callable[[], Any], *, retry: Retry | None = None
    ) -> StepHandle[Any]:
        """Run ``fn()`` (sync or async) here, in the engine, as a checkpointed local step.

        Its JSON result is recorded; on replay it is returned without calling ``fn`` again. Use
        it for anything non-deterministic the workflow needs (the time, a random id, a lookup).
        A failure is retried per ``retry`` (default: the engine's ``default_retry``; durable
        backoff), then raised as :class:`StepFailed`. ``step_info()`` works inside ``fn``.

        A crash while ``fn`` runs re-runs it on resume (at least once, like a remote step).

        Args:
            name: a label (checked on replay).
            fn: a callable with no arguments returning a JSON value (or an awaitable of one).
            retry: its retry policy.

        Raises:
            TypeError: ``name`` is not a str, ``fn`` not callable, ``retry`` not a
                :class:`Retry` (at once, in the workflow).
            ConfigError: ``name`` is empty.
        """
        step_id = self._next_id()  # before the checks, as ctx.step
        swapped = " (the call is ctx.run(name, fn): are they swapped?)" if callable(name) else ""
        check_name(name, "ctx.run", "name", swapped)
        check_callable(fn, "ctx.run", "fn")
        check_type(retry, Retry, "ctx.run", "retry")
        driver = self._driver
        return StepHandle(
            self, step_id, StepKind.LOCAL, name, lambda: driver.local(step_id, name, fn, retry)
        )

    def sleep(self, seconds: float) -> StepHandle[None]:
        """A durable timer: ``await ctx.sleep(3600)``.

        The wake-up time is checkpointed when the call is first made; after a crash the run
        wakes at that same time (at once if it has passed), not ``seconds`` after the restart.

        Raises:
            TypeError: ``seconds`` is not a number.
            ConfigError: ``seconds`` is negative or not finite.
        """
        delay = check_seconds(seconds, "ctx.sleep", "seconds")
        step_id = self._next_id()
        driver = self._driver
        return StepHandle(
            self, step_id, StepKind.TIMER, "sleep", lambda: driver.timer(step_id, delay)
        )

    async def gather(self, *handles: StepHandle[Any], return_exceptions: bool = False) -> list[Any]:
        """Run several steps at once and wait for ALL of them (structured: none outlives the
        call)::

            a, b = await ctx.gather(ctx.step("fetch-a", x), ctx.step("fetch-b", x))

        The handles' step ids were fixed when they were created, left to right, so replay is
        deterministic whichever finishes first.

        Args:
            *handles: handles from :meth:`step`, :meth:`run` or :meth:`sleep` of this context,
                not yet awaited.
            return_exceptions: put a failed step's exception in its slot instead of raising.

        Returns:
            The outputs, in the order of ``handles``.

        Raises:
            StepFailed: (without ``return_exceptions``) once every handle settled, the failure
                of the FIRST failed handle in argument order — deterministic on replay.
            TypeError: something that is not a fresh handle of this context.
        """
        for handle in handles:
            if not isinstance(handle, StepHandle) or handle._ctx is not self:
                raise TypeError(f"ctx.gather takes step handles of this context, not {handle!r}")
            if handle._awaited:
                raise TypeError(f"{handle!r} was already awaited")
        results: list[Any] = [None] * len(handles)
        errors: list[Exception | None] = [None] * len(handles)
        fatal: list[NonDeterminismError] = []
        tracker = self._tracker
        remaining = len(handles)
        if tracker is not None:
            tracker.fork(remaining)

        async def settle(index: int, handle: StepHandle[Any], nursery: trio.Nursery) -> None:
            nonlocal remaining
            try:
                results[index] = await handle
            except NonDeterminismError as exc:
                # Replay has diverged: the siblings may wait for steps that will never come.
                fatal.append(exc)
                nursery.cancel_scope.cancel()
            except Exception as exc:  # settled into its slot; the nursery never sees it
                errors[index] = exc
            remaining -= 1
            if tracker is not None:
                tracker.join(last=remaining == 0)

        async with trio.open_nursery() as nursery:
            for index, handle in enumerate(handles):
                nursery.start_soon(settle, index, handle, nursery)
        if fatal:
            raise fatal[0]
        if return_exceptions:
            return [e if e is not None else r for r, e in zip(results, errors, strict=True)]
        for error in errors:
            if error is not None:
                raise error
        return results

    def wait_signal(self, name: str, timeout: float | None = None) -> StepHandle[Any]:
        """Wait for signal ``name`` (``engine.signal(run_id, name, payload)``) and return its
        payload: ``approved = await ctx.wait_signal("approve", timeout=3600)``.

        A signal sent before the wait is buffered. The k-th wait on ``name`` that completes
        consumes the k-th signal of that name: each exactly once, in order. The payload is
        checkpointed; replay returns it without reading the signal log. Wait on one name from
        one thread of control at a time (concurrent waits on the same name take their place in
        the log when they start).

        Args:
            name: the signal's name.
            timeout: seconds to wait (a durable deadline, like :meth:`sleep`); ``None``: forever.

        Raises:
            SignalTimeout: (when awaited) no signal within ``timeout``; none consumed. Catch it.
            SignalDataError: (when awaited) the stored signal is damaged (not JSON).
            TypeError: ``name`` is not a str, ``timeout`` not a number.
            ConfigError: ``name`` is empty, ``timeout`` negative or not finite.
        """
        step_id = self._next_id()
        check_name(name, "ctx.wait_signal", "name")
        check_unreserved(name, "a signal name")
        delay = None if timeout is None else check_seconds(timeout, "ctx.wait_signal", "timeout")
        counts: dict[str, int] = self.__dict__.setdefault("_signal_counts", {})
        driver = self._driver

        async def start() -> Any:
            seq = counts.get(name, 0) + 1
            counts[name] = seq
            try:
                return await driver.wait_signal(step_id, name, seq, delay)
            except SignalTimeout:
                if counts.get(name) == seq:  # consumed nothing: the next wait takes this one
                    counts[name] = seq - 1
                raise

        return StepHandle(self, step_id, StepKind.SIGNAL, name, start)

    def emit(self, value: Any) -> StepHandle[None]:
        """Publish ``value`` (JSON) on the run's stream, read by ``engine.stream(run_id)`` as
        it comes (docs/engine.md, "Streaming"): ``await ctx.emit({"done": 3})``. Keyed by its
        call position and checkpointed: a replay does not publish it again.

        Raises:
            PayloadError: ``value`` is not a JSON value (at once, in the workflow).
            StreamValueTooLarge: its JSON is larger than the stream's bound.
            StreamFull: the run's stream is full.
        """
        step_id = self._next_id()
        normalized = normalize_json(value, "an emitted value")
        driver = self._driver
        return StepHandle(
            self,
            step_id,
            StepKind.EVENT,
            STREAM_EVENT,
            lambda: driver.set_event(step_id, STREAM_EVENT, normalized),
        )

    def set_event(self, key: str, value: Any) -> StepHandle[None]:
        """Publish ``key -> value`` (latest wins) for ``engine.get_event(run_id, key)`` and
        ``engine.status``: ``await ctx.set_event("progress", {"done": 3})``. Checkpointed:
        replay does not write it again.

        Raises:
            PayloadError: ``value`` is not a JSON value (at once, in the workflow).
            TypeError: ``key`` is not a str.
            ConfigError: ``key`` is empty.
        """
        step_id = self._next_id()
        check_name(key, "ctx.set_event", "key")
        check_unreserved(key, "an event key")
        normalized = normalize_json(value, f"the value of event {key!r}")
        driver = self._driver
        return StepHandle(
            self, step_id, StepKind.EVENT, key, lambda: driver.set_event(step_id, key, normalized)
        )

    # ------------------------------------------------------------------ updates (_updates)

    def on_update(
        self,
        name: str,
        handler: Callable[[Any], Any] | None = None,
        *,
        validate: Callable[[Any], object] | None = None,
    ) -> Any:
        """Handle update ``name`` (``engine.update(run_id, name, payload)``) with the plain
        function ``handler(payload)``, which may change the workflow's state and returns the
        caller's JSON value (docs/engine.md, "Updates"). ``validate(payload)``, if given, runs
        first: raising rejects the update (``UpdateRejected`` in the caller, nothing in the
        history). Without ``handler``: a decorator (``@ctx.on_update("add")``).

        Raises:
            TypeError: ``handler`` or ``validate`` is not a plain (non-async) callable.
            ConfigError: ``name`` is empty; a remote workflow (no updates).
        """
        check_name(name, "ctx.on_update", "name")
        register = getattr(self._driver, "on_update", None)
        if register is None:
            raise ConfigError("updates are not supported in remote workflows yet")
        if handler is None:
            return lambda fn: register(name, fn, validate) or fn
        register(name, handler, validate)
        return handler

    def patched(self, change_id: str) -> bool:
        """Whether this run takes the new branch of the code change ``change_id``::

            if ctx.patched("send-receipt"):
                await ctx.step("send-receipt", order)   # new code
            else:
                await ctx.step("email", order)          # what old runs did

        A run reaching this call at the frontier of its history (new work, not replaying)
        records a marker for ``change_id`` and gets ``True``; a replay gets ``True`` when its
        history holds the marker and ``False`` when it was recorded without it (a run started
        on the old code), so old and new runs both complete. Markers sit outside the step
        numbering (stored as ``patch:<change id>``): adding a ``patched`` call shifts no step
        id of an old history. Once no run without the marker is left, replace the call by
        :meth:`deprecate_patch` and keep only the new branch.

        Raises:
            TypeError: ``change_id`` is not a str.
            ConfigError: ``change_id`` is empty.
        """
        check_name(change_id, "ctx.patched", "change_id")
        history = self._history
        if history.has_patch(change_id):
            return True
        if history.replaying:
            return False
        history.add_patch(change_id)
        self._driver.mark_patch(change_id)
        return True

    def deprecate_patch(self, change_id: str) -> None:
        """Say the code change ``change_id`` no longer branches: every run takes the new code.
        Histories with or without its marker both replay; nothing is recorded. Remove the call
        once no run recorded with :meth:`patched` is left (a marker in history that no call
        reaches is ignored).

        Raises:
            TypeError: ``change_id`` is not a str.
            ConfigError: ``change_id`` is empty.
        """
        check_name(change_id, "ctx.deprecate_patch", "change_id")

    def continue_as_new(self, input: Any = None) -> NoReturn:
        """End this generation of the run and start the next one, under the same run id, from
        the top of the workflow with ``input``: a workflow that loops forever keeps a bounded
        history (issue 34, item 5; docs/engine.md, Continue-as-new)::

            if len(seen) >= 1000:
                ctx.continue_as_new({"cursor": cursor})

        The history so far becomes a previous generation (kept, inspectable, removed with the
        run by retention); signals sent and not consumed carry over. Call it from the
        workflow's own flow (not inside ``ctx.gather``). It raises a ``BaseException`` the
        engine catches: ``except Exception`` does not stop it.

        Raises:
            PayloadError: ``input`` is not a JSON value.
            EngineError: a remote workflow (not supported yet): its run fails with it.
        """
        if not getattr(self._driver, "continues_as_new", False):
            raise EngineError(
                "ctx.continue_as_new: a remote workflow cannot continue as new yet "
                "(docs/engine.md, Continue-as-new)"
            )
        raise ContinueAsNew(normalize_json(to_json(input), "the input of ctx.continue_as_new"))

    # ------------------------------------------------------------------ child workflows

    def child(
        self,
        workflow: str,
        input: Any = None,
        run_id: str | None = None,
        *,
        on_parent_cancel: OnParentCancel = "cancel",
    ) -> StepHandle[Any]:
        """Run workflow ``workflow`` as a child run and wait for its end:
        ``total = await ctx.child("ship-parcel", parcel)``.

        The child is an ordinary run in the run store (any engine of the namespace may drive
        it; ``engine.get`` and ``runs show`` show it); its id is ``f"{ctx.run_id}/{step_id}"``
        (deterministic from this run's id and the call's position) unless ``run_id`` is given.
        Starting it is a checkpointed step: on replay the same child is found, never a second.

        Args:
            workflow: a workflow the engine's app registers.
            input: its JSON input.
            run_id: the child's run id (default: derived from this run's id and position).
            on_parent_cancel: ``"cancel"`` (default): cancelling this run cancels the child
                (and its own children); ``"abandon"``: the child goes on.

        Returns:
            A handle; awaiting it returns the child's output (it works in :meth:`gather`).

        Raises:
            ChildFailed: (when awaited) the child failed or was cancelled; catch it to
                compensate.
            UnknownWorkflow: (when awaited) the app does not register ``workflow``.
            PayloadError: ``input`` is not a JSON value.
            TypeError, ConfigError: a bad argument (at once, in the workflow).
        """
        step_id, value = self._child_call("ctx.child", workflow, input, run_id, on_parent_cancel)
        driver = self._child_driver()

        output = self._child_output(workflow)

        async def start_and_wait() -> Any:
            record = await driver.child_start(step_id, workflow, value, run_id, on_parent_cancel)
            return output(await driver.child_wait(record))

        return StepHandle(self, step_id, StepKind.CHILD, workflow, start_and_wait)

    async def start_child(
        self,
        workflow: str,
        input: Any = None,
        run_id: str | None = None,
        *,
        on_parent_cancel: OnParentCancel = "cancel",
    ) -> StepHandle[Any]:
        """Start workflow ``workflow`` as a child run now and return a handle to await its end
        later (alone or in :meth:`gather`)::

            handles = [await ctx.start_child("ship-parcel", p) for p in parcels]
            totals = await ctx.gather(*handles)

        Same arguments, ids and errors as :meth:`child`; the start is checkpointed when this
        call returns.
        """
        step_id, value = self._child_call(
            "ctx.start_child", workflow, input, run_id, on_parent_cancel
        )
        driver = self._child_driver()
        record = await driver.child_start(step_id, workflow, value, run_id, on_parent_cancel)
        output = self._child_output(workflow)

        async def wait() -> Any:
            return output(await driver.child_wait(record))

        return StepHandle(self, step_id, StepKind.CHILD, workflow, wait)

    def _child_output(self, workflow: str) -> Callable[[Any], Any]:
        """The child's JSON output as the type its workflow's return annotation names (the
        JSON itself when this app does not register it with one)."""
        definition = None if self._app is None else self._app.workflows.get(workflow)
        if definition is None or definition.fn is None:
            return lambda value: value
        output = signature_of(definition.fn, 1).output
        what = f"the output of child workflow {workflow!r}"
        return lambda value: structure_as(value, output, what)

    def _child_call(
        self, call: str, workflow: str, input: Any, run_id: str | None, on_parent_cancel: str
    ) -> tuple[str, Any]:
        step_id = self._next_id()  # before the checks, as ctx.step
        check_name(workflow, call, "workflow")
        check_run_id(run_id, call)
        if on_parent_cancel not in ("cancel", "abandon"):
            raise ConfigError(
                f"{call}: on_parent_cancel must be 'cancel' or 'abandon', got {on_parent_cancel!r}"
            )
        return step_id, normalize_json(to_json(input), f"the input of child workflow {workflow!r}")

    def _child_driver(self) -> _ChildDriver:
        driver = self._driver
        if not hasattr(driver, "child_start"):
            raise EngineError(
                "child workflows are not supported in remote workflows yet (issue 18)"
            )
        return cast("_ChildDriver", driver)


class _ChildDriver(Protocol):
    async def child_start(
        self,
        step_id: str,
        workflow: str,
        input: Any,
        run_id: str | None,
        on_parent_cancel: OnParentCancel,
    ) -> StepRecord: ...

    async def child_wait(self, record: StepRecord) -> Any: ...
