"""``App``: the registry of an application's steps and workflows, by name."""

from __future__ import annotations

import inspect
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import attrs

from .._arguments import check_seconds
from .._attrs_shared import shared_eq, shared_hash, shared_repr
from .._errors import ConfigError, PayloadError
from ._rate import Rate, check_rate_limit
from ._retry import Retry
from ._step_timeouts import StepTimeouts

if TYPE_CHECKING:
    from ._context import WorkflowContext
    from ._schedule_defs import CatchUp, Overlap, Schedule

__all__ = ["App", "StepDefinition", "StepFunction", "WorkflowDefinition", "WorkflowFunction"]

#: ``async def step(input) -> JSON`` (the input is the JSON value the workflow passed), or a
#: plain ``def`` (run in a thread, or with ``cpu=True`` in a worker process).
StepFunction = Callable[[Any], Awaitable[Any]] | Callable[[Any], Any]
#: ``async def workflow(ctx, input) -> JSON``.
WorkflowFunction = Callable[["WorkflowContext", Any], Awaitable[Any]]

S = TypeVar("S", bound=StepFunction)
W = TypeVar("W", bound=WorkflowFunction)


@attrs.frozen(repr=False, eq=False)
class StepDefinition:
    """A registered step."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    name: str
    fn: StepFunction
    retry: Retry | None
    """``None``: the engine's ``default_retry``."""
    priority: int | None = None
    """Task priority (lower runs first), unless ``ctx.step`` says otherwise."""
    timeouts: StepTimeouts = attrs.field(factory=StepTimeouts)
    """Its start-to-close ``timeout`` and ``schedule_to_start_timeout`` (``ctx.step`` may
    override either)."""
    heartbeat_timeout: float | None = None
    """Seconds without a beat, once the step beat, after which the engine fails the attempt
    over (``None``: beats are only recorded)."""
    runs_in: str = "trio"
    """``"trio"`` (an ``async def``), ``"thread"`` (a ``def``: ``trio.to_thread``) or
    ``"process"`` (a ``def`` registered with ``cpu=True``: a ``trio-parallel`` worker
    process); see ``docs/concurrency.md``."""
    max_concurrency: int | None = None
    """Attempts of this step running at once across the whole fleet, at most (per
    concurrency key with ``concurrency_key``); ``None``: no fleet-wide limit. Enforced by the
    broker (see ``docs/concurrency.md``, "Fleet-wide limits")."""
    concurrency_key: Callable[[Any], str] | None = None
    """``input -> str``: the key ``max_concurrency`` holds per (``None``: the whole step)."""
    rate_limit: Rate | None = None
    """At most ``rate_limit.count`` starts per ``rate_limit.per`` seconds, fleet-wide, per
    key value with ``rate_limit.key`` (``None``: no rate). Kept by the broker (see
    ``docs/concurrency.md``, "Rate limits")."""

    @property
    def rate_per_key(self) -> bool:
        """Its rate holds per key (``rate_limit.key``)."""
        return self.rate_limit is not None and self.rate_limit.key is not None

    def key_for(self, input: Any) -> str | None:
        """The key of an attempt with ``input`` (``None``: the step has no key): its
        ``concurrency_key``'s, else its rate's ``key``'s (the same function when both).

        Raises:
            ConcurrencyKeyError: the key function raised or did not return a ``str``.
        """
        key_fn = self.concurrency_key
        what = "concurrency_key"
        if key_fn is None and self.rate_limit is not None:
            key_fn, what = self.rate_limit.key, "rate key"
        if key_fn is None:
            return None
        try:
            key = key_fn(input)
        except Exception as exc:
            raise ConcurrencyKeyError(
                f"step {self.name!r}: its {what} raised {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(key, str):
            raise ConcurrencyKeyError(
                f"step {self.name!r}: its {what} must return a str, "
                f"got {type(key).__name__} {key!r:.80}"
            )
        return key


class ConcurrencyKeyError(PayloadError):
    """A step's ``concurrency_key`` (or its rate's ``key``) raised or returned something else
    than a ``str``: the step fails, not retryable (code ``concurrency_key``)."""

    code = "concurrency_key"
    retryable = False


@attrs.frozen(repr=False, eq=False)
class WorkflowDefinition:
    """A registered workflow."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    name: str
    fn: WorkflowFunction | None
    """``None``: a remote workflow declared without its code (only workflow workers have it)."""
    remote: bool = False
    """Its code runs on workflow workers, a turn at a time (see ``docs/remote.md``); the engine
    sends each turn the run's history and applies the turn's decision."""
    retention: float | None = None
    """Seconds its finished runs are kept (``math.inf``: for good); ``None``: the engine's
    ``retention`` (docs/engine.md, "Retention")."""


class App:
    """An application: steps (run by workers) and workflows (driven by engines), by name.

    The same ``App`` object is given to :func:`open_worker` (which serves its steps) and
    :func:`open_engine` (which drives its workflows); processes meet through the broker, on the
    transport namespace named after the app unless ``namespace=`` says otherwise.

    Args:
        name: the app's name (default transport namespace and run store namespace).

    Example::

        app = dt.App("shop")

        @app.step("charge-card", retry=dt.Retry(max_attempts=5))
        async def charge(order: dict) -> dict: ...

        @app.workflow("order")
        async def order(ctx: dt.WorkflowContext, order: dict) -> dict:
            return {"receipt": await ctx.step("charge-card", order)}
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"an App needs a non-empty name, got {name!r}")
        self.name = name
        self._steps: dict[str, StepDefinition] = {}
        self._workflows: dict[str, WorkflowDefinition] = {}
        self._schedules: dict[str, Schedule] = {}

    def __repr__(self) -> str:
        return f"App({self.name!r}, steps={list(self._steps)}, workflows={list(self._workflows)})"

    @property
    def steps(self) -> Mapping[str, StepDefinition]:
        """Registered steps by name (read-only view)."""
        return self._steps

    @property
    def workflows(self) -> Mapping[str, WorkflowDefinition]:
        """Registered workflows by name (read-only view)."""
        return self._workflows

    def step(
        self,
        name: str | None = None,
        *,
        retry: Retry | None = None,
        priority: int | None = None,
        timeout: float | None = None,
        schedule_to_start_timeout: float | None = None,
        heartbeat_timeout: float | None = None,
        cpu: bool = False,
        max_concurrency: int | None = None,
        concurrency_key: Callable[[Any], str] | None = None,
        rate_limit: Rate | None = None,
    ) -> Callable[[S], S]:
        """Register ``async def fn(input) -> JSON`` as step ``name`` (default: the function's
        name). The function is returned unchanged, so it stays callable directly in tests.

        A plain ``def fn(input) -> JSON`` (blocking code) runs in a thread
        (``trio.to_thread``, at most ``open_worker(threads=...)`` at once); with ``cpu=True``
        it runs in a worker process of ``trio-parallel`` instead (CPU-bound code: no GIL
        shared with the worker's event loop). See ``docs/concurrency.md``.

        Inside a step, :func:`step_info` tells its run, step id, attempt and idempotency key.

        Args:
            name: the step name workflows call (``ctx.step(name, input)``).
            retry: its retry policy (default: the engine's ``default_retry``).
            priority: its task priority (lower runs first; default: FIFO).
            timeout: start-to-close seconds: the worker cancels an attempt's handler after
                this and the attempt fails retryable (``StepTimedOut``), retried per
                ``retry`` (default: no limit; see ``docs/engine.md``, "Step timeouts").
            schedule_to_start_timeout: seconds an attempt may wait on its queue for a worker
                to take it; past it the step fails, naming the queue (default: no limit, but
                a wait on a queue no live worker serves is reported after the engine's
                ``unstarted_report_after``).
            heartbeat_timeout: seconds the engine waits for the step's next beat
                (``step_info().heartbeat()``) once it beat: past it, the attempt is failed
                (retryable, code ``heartbeat_timeout``) and retried at once, without waiting
                for the broker's stalled threshold. The timer starts at the attempt's first
                beat. Default ``None``: beats are only recorded.
            cpu: run this ``def`` step in a worker process (``trio-parallel``, the ``cpu``
                extra); it must be a module-level function (it is pickled by name).
            max_concurrency: at most this many attempts of the step run at once across
                every worker of the fleet (default: no limit beyond each worker's
                ``concurrency``). The broker enforces it at every claim, so it holds for any
                number of workers and engines; a slot held by a worker that dies comes back
                when its claim is reclaimed (the stalled sweep). Each worker serving the step
                stores the limit in the broker when it opens (the last one to open wins). A
                broker that cannot enforce it makes ``open_worker`` raise ``ConfigError``.
                See ``docs/concurrency.md``, "Fleet-wide limits".
            concurrency_key: ``input -> str``: ``max_concurrency`` then holds per key value
                (``lambda order: order["account"]``: one account's attempts at most
                ``max_concurrency`` at once), keys independent: a busy key never holds back
                the attempts of the others. The engine calls it at each dispatch; should it
                raise or return something else than a ``str``, the step fails, not retryable
                (code ``concurrency_key``). Keep it a pure function of the input.
            rate_limit: ``dt.Rate(count, per=seconds)``: at most ``count`` attempts of the
                step start in any window of ``per`` seconds, across every worker of the
                fleet. The broker keeps a sliding-window log of starts; a worker takes starts
                before it claims, so jobs past the rate wait in the broker, not in a
                worker's slot. Each worker serving the step stores the rate when it opens
                (the last one to open wins); a broker that cannot keep it makes
                ``open_worker`` raise ``ConfigError``. With ``dt.Rate(..., key=fn)`` the rate
                holds per key value (``fn(input) -> str``, computed at dispatch like a
                ``concurrency_key``, which fails the step the same way should it raise),
                keys independent: a worker claims, takes one start of the job's key, and
                hands a job whose key is past its rate straight back to the broker as a
                delayed job (not an attempt), so a busy key never holds back the others.
                See ``docs/concurrency.md``, "Rate limits".

        Raises:
            ConfigError: not a function, ``cpu=True`` on an ``async def``, the name is taken,
                a timeout (``timeout``, ``schedule_to_start_timeout``,
                ``heartbeat_timeout``) is not a positive number of seconds,
                ``max_concurrency`` is not an int >= 1, or ``concurrency_key`` is not
                callable or is given without ``max_concurrency``, or ``rate_limit`` is not a
                ``dt.Rate``, or its ``key`` is not callable or differs from a
                ``concurrency_key`` also given.
        """
        rate = check_rate_limit(rate_limit, concurrency_key)
        timeouts = StepTimeouts.given("app.step", timeout, schedule_to_start_timeout)
        check_heartbeat_timeout(heartbeat_timeout)
        check_concurrency(max_concurrency, concurrency_key)

        def register(fn: S) -> S:
            step_name = name or fn.__name__
            runs_in = _step_runs_in(fn, f"step {step_name!r}", cpu)
            if step_name in self._steps:
                raise ConfigError(f"step {step_name!r} is already registered in {self.name!r}")
            self._steps[step_name] = StepDefinition(
                step_name,
                fn,
                retry,
                priority,
                timeouts,
                heartbeat_timeout,
                runs_in,
                max_concurrency,
                concurrency_key,
                rate,
            )
            return fn

        return register

    def workflow(
        self, name: str | None = None, *, remote: bool = False, retention: float | None = None
    ) -> Callable[[W], W]:
        """Register ``async def fn(ctx, input) -> JSON`` as workflow ``name`` (default: the
        function's name). The function is returned unchanged.

        Args:
            name: the workflow's name.
            remote: run its code on workflow workers (:func:`open_worker` serves its turns)
                instead of in the engine: the engine sends each turn the run's history and
                applies the turn's decision (see ``docs/remote.md``).
            retention: seconds its finished runs are kept before the engine deletes them
                (``math.inf``: for good); default: the engine's ``retention`` (docs/engine.md,
                "Retention").

        Raises:
            ConfigError: not an ``async def``, the name is taken, or ``retention`` is not a
                positive number of seconds.
        """
        check_retention(retention, "app.workflow")

        def register(fn: W) -> W:
            workflow_name = name or fn.__name__
            _check_async(fn, f"workflow {workflow_name!r}")
            self._add_workflow(WorkflowDefinition(workflow_name, fn, remote, retention))
            return fn

        return register

    def remote_workflow(self, name: str) -> None:
        """Declare remote workflow ``name`` without its code: an engine (a control plane) can
        then drive its runs while only workflow workers hold the code (registered there with
        ``@app.workflow(name, remote=True)``).

        Raises:
            ConfigError: the name is taken.
        """
        self._add_workflow(WorkflowDefinition(name, None, True))

    @property
    def schedules(self) -> Mapping[str, Schedule]:
        """Declared schedules by name (read-only view; see :meth:`schedule`)."""
        return self._schedules

    def schedule(
        self,
        name: str,
        workflow: str,
        *,
        cron: str | None = None,
        every: float | None = None,
        input: Any = None,
        timezone: str = "UTC",
        catch_up: CatchUp = "skip",
        max_catch_up: int = 10,
        overlap: Overlap = "skip",
    ) -> None:
        """Declare schedule ``name``: each tick starts one run of ``workflow`` with ``input``,
        its id ``sched:{name}:{tick, UTC ISO 8601}`` (see ``docs/engine.md``, "Schedules").
        Every engine of the app stores it at start (a changed definition replaces the stored
        one, keeping its paused state and last tick) and fires its ticks.

        Args:
            name: the schedule's name (letters, digits, ``_ . -``).
            workflow: a workflow this app registers (register it first).
            cron: a cron expression (``"0 3 * * *"``), read in ``timezone``.
            every: or seconds between ticks (aligned on the Unix epoch).
            input: the JSON input of each run.
            timezone: the IANA time zone of ``cron`` (default UTC).
            catch_up: ticks missed while no engine ran: ``"skip"`` (default), ``"once"``
                (start the latest) or ``"all"`` (start the latest ``max_catch_up``).
            max_catch_up: the bound on ticks started at once.
            overlap: a tick while the run of the previous one is unfinished: ``"skip"``
                (default: it starts nothing, counted), ``"buffer_one"`` (it starts when that
                run ends; at most one waits), ``"allow"`` (runs stack) or ``"cancel_other"``
                (cancel that run, then start). See ``docs/concurrency.md``.

        Raises:
            ConfigError: a bad cron expression, unknown time zone, ``every`` <= 0, both or
                neither of ``cron`` and ``every``, an unknown workflow, or a taken name.
        """
        from ._schedule_defs import Schedule

        schedule = Schedule.make(
            name, workflow, cron=cron, every=every, input=input, timezone=timezone,
            catch_up=catch_up, max_catch_up=max_catch_up, overlap=overlap,
        )  # fmt: skip
        if workflow not in self._workflows:
            raise ConfigError(f"schedule {name!r}: no workflow {workflow!r} in app {self.name!r}")
        if name in self._schedules:
            raise ConfigError(f"schedule {name!r} is already declared in {self.name!r}")
        self._schedules[name] = schedule

    def _add_workflow(self, definition: WorkflowDefinition) -> None:
        if not isinstance(definition.name, str) or not definition.name:
            raise ConfigError(f"a workflow needs a non-empty name, got {definition.name!r}")
        if definition.name in self._workflows:
            raise ConfigError(
                f"workflow {definition.name!r} is already registered in {self.name!r}"
            )
        self._workflows[definition.name] = definition


def _check_async(fn: Callable[..., Any], what: str) -> None:
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"{what} must be an `async def` function, got {fn!r}")


def _step_runs_in(fn: Callable[..., Any], what: str, cpu: bool) -> str:
    if not callable(fn):
        raise ConfigError(f"{what} must be a function, got {fn!r}")
    if inspect.iscoroutinefunction(fn):
        if cpu:
            raise ConfigError(f"{what}: cpu=True runs a plain `def` in a process, not {fn!r}")
        return "trio"
    if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
        raise ConfigError(f"{what} must be an `async def` or a plain `def`, got {fn!r}")
    return "process" if cpu else "thread"


def check_heartbeat_timeout(value: Any) -> float | None:
    """``value`` (``None`` or a positive number of seconds) as a step's ``heartbeat_timeout``.

    Raises:
        TypeError: not a number.
        ConfigError: not positive and finite.
    """
    if value is None:
        return None
    return check_seconds(value, "app.step", "heartbeat_timeout", positive=True)


def check_concurrency(max_concurrency: Any, concurrency_key: Any) -> None:
    """Check ``app.step``'s ``max_concurrency`` and ``concurrency_key``.

    Raises:
        ConfigError: ``max_concurrency`` is not ``None`` or an int >= 1, or
            ``concurrency_key`` is not callable or comes without ``max_concurrency``.
    """
    if max_concurrency is not None and (type(max_concurrency) is not int or max_concurrency < 1):
        raise ConfigError(f"app.step: max_concurrency must be an int >= 1, got {max_concurrency!r}")
    if concurrency_key is not None:
        if not callable(concurrency_key):
            raise ConfigError(
                "app.step: concurrency_key must be a function of the input, "
                f"got {concurrency_key!r}"
            )
        if max_concurrency is None:
            raise ConfigError(
                "app.step: concurrency_key needs max_concurrency (the limit it holds per key)"
            )
def check_retention(value: Any, call: str) -> float | None:
    """``value`` (``None``, or a positive number of seconds, ``math.inf`` for good) as a
    retention.

    Raises:
        TypeError: not a number.
        ConfigError: not positive (or NaN).
    """
    if value is None:
        return None
    if isinstance(value, float) and value == math.inf:
        return value
    return check_seconds(value, call, "retention", positive=True)
