"""The simulation harness: an engine (or several), N workers and a memory broker in one
``trio.run`` under a virtual clock, with faults injected from one seed, and invariants checked
after every run.

::

    simulation (one trio.run, MockClock(autojump_threshold=0))
    ├── engines       one (or ``engines``) open_engine over its own FaultyBroker (delays,
    │                 drops, lost replies), sharing the one run store; each killed and
    │                 restarted under its engine_id, if the faults say so
    ├── worker slots  one task per slot: a worker, killed / restarted / closed over and over,
    │                 each generation with its own FaultyBroker + FaultyKeyStore + instance id
    ├── workload      starts the runs at seeded arrival times, awaits each one's outcome
    ├── faults        the seeded schedule: kill, graceful restart, pause renewal, stall
    └── key checks    after each close (and a killed worker's key TTL), its liveness keys

Everything random comes from the seed: arrival times, inputs (through the workload callable),
the fault schedule, every per-call fault draw, and — for the duration of the run — trio's own
scheduler (it shuffles ready tasks with a module-level generator, which the harness seeds and
restores afterwards). Ids are deterministic (``run-00042``, worker ``w1-3``, engine
``engine``). So one seed gives one history, byte for byte.
"""

from __future__ import annotations

import math
import os
import random
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import orjson
import trio
import trio.testing

from .._engine import (
    App,
    Applied,
    Engine,
    EngineClosed,
    EngineStatistics,
    RunCancelled,
    RunFailed,
    StepKind,
    StepRecord,
    StepState,
    Worker,
    open_engine,
    open_worker,
    step_info,
)
from .._engine._statistics import COUNTERS
from .._engine._stores.memory import MemoryRunStore
from .._errors import BrokerError, BrokerUnavailable
from .._liveness import MIN_HEARTBEAT_TTL
from .._naming import QueueNames, sanitize_token
from ..adapters.memory import MemoryBroker
from ..backends._backend import Backend
from ..keys.memory import MemoryKeyStore
from ._determinism import seeded_scheduler
from ._report import Faults, InvariantViolation, SimulationReport
from .faults import BrokerFaults, FaultyKeyStore, Injector, wrap_broker

if TYPE_CHECKING:
    from collections.abc import Awaitable, Sequence

    from .._engine import RunRecord, RunStatus
    from .._engine._app import StepFunction

__all__ = [
    "SEED_VARIABLE",
    "Faults",
    "InvariantViolation",
    "Simulation",
    "SimulationReport",
    "Workload",
]

#: The environment variable that overrides the seed of every :class:`Simulation` (replays).
SEED_VARIABLE = "DURABLE_TRIO_SEED"

#: ``workload(rng, index) -> (workflow name, input)``: what the ``index``-th run starts.
Workload = Callable[[random.Random, int], tuple[str, Any]]

#: The transport options a simulation uses unless told otherwise: short thresholds, so a lost
#: lease shows within a minute of virtual time.
DEFAULT_TRANSPORT_OPTIONS: dict[str, Any] = {
    "stalled_threshold": 30.0,
    "stalled_check_interval": 10.0,
    "close_timeout": 5.0,
    "cleanup_timeout": 2.0,
    "worker_heartbeat_interval": 10.0,
}

#: Cleanup phases of a transport close bounded by ``cleanup_timeout`` each (docs/close.md):
#: consumers, liveness, cancelled handlers, renewal, handback, inboxes.
_CLEANUP_PHASES = 6

_HOUR = 3600.0

T = TypeVar("T")


@attrs.define(eq=False)
class _Execution:
    worker: str
    start: float
    end: float | None = None
    outcome: str = "running"
    output: bytes | None = None


@attrs.define(eq=False)
class _Slot:
    index: int
    worker_id: str = ""
    injector: Injector | None = None
    keys: FaultyKeyStore | None = None
    scope: trio.CancelScope | None = None
    worker: Worker | None = None
    stop: trio.Event = attrs.Factory(trio.Event)
    killed: bool = False
    up: bool = False
    stalled_during_close: bool = False


class _RecordingStore(MemoryRunStore):
    """The engine's run store, counting every checkpoint that reaches a final state."""

    def __init__(self) -> None:
        super().__init__()
        self.settled: Counter[tuple[str, str]] = Counter()

    async def update_step(self, step: StepRecord, *, expect_attempt: int) -> Applied:
        verdict = await super().update_step(step, expect_attempt=expect_attempt)
        if verdict is Applied.APPLIED and step.status is not StepState.PENDING:
            self.settled[(step.run_id, step.step_id)] += 1
        return verdict

    def unconfirmed_dispatches(self) -> list[tuple[str, str, int]]:
        """The pending remote attempts whose dispatch is not recorded (read at once, no
        yield: an engine killed now may have sent them)."""
        return [
            (step.run_id, step.step_id, step.attempt)
            for run in self._runs.values()
            for step in run.steps.values()
            if step.kind is StepKind.REMOTE
            and step.status is StepState.PENDING
            and not step.dispatched
        ]


class _EngineStore:
    """One engine generation's view of the shared run store: once that engine is killed, every
    call raises (the process is gone: nothing it would still write reaches the store)."""

    trio_clock = True  # (as the memory store it wraps: timers wake at their exact time)

    def __init__(self, inner: _RecordingStore) -> None:
        self.inner = inner
        self.dead = False

    async def _call(self, call: Callable[[], Awaitable[T]]) -> T:
        if self.dead:
            await trio.lowlevel.checkpoint()
            raise BrokerUnavailable("injected: the engine is gone")
        return await call()

    def now(self) -> float:
        return self.inner.now()

    async def create_run(self, run: RunRecord) -> tuple[RunRecord, bool]:
        return await self._call(lambda: self.inner.create_run(run))

    async def get_run(self, run_id: str) -> RunRecord | None:
        return await self._call(lambda: self.inner.get_run(run_id))

    async def list_runs(
        self, *, status: RunStatus | None = None, workflow: str | None = None, limit: int = 100
    ) -> list[RunRecord]:
        return await self._call(
            lambda: self.inner.list_runs(status=status, workflow=workflow, limit=limit)
        )

    async def claim_runs(
        self, owner: str, lease: float, *, include_own: bool = False, limit: int = 100
    ) -> list[RunRecord]:
        return await self._call(
            lambda: self.inner.claim_runs(owner, lease, include_own=include_own, limit=limit)
        )

    async def renew_runs(self, owner: str, run_ids: Sequence[str], lease: float) -> set[str]:
        return await self._call(lambda: self.inner.renew_runs(owner, run_ids, lease))

    async def release_runs(self, owner: str, run_ids: Sequence[str]) -> None:
        await self._call(lambda: self.inner.release_runs(owner, run_ids))

    async def finish_run(
        self, run_id: str, status: RunStatus, *, output: object = None, error: object = None
    ) -> bool:
        return await self._call(
            lambda: self.inner.finish_run(run_id, status, output=output, error=error)
        )

    async def get_steps(self, run_id: str) -> list[StepRecord]:
        return await self._call(lambda: self.inner.get_steps(run_id))

    async def get_step(self, run_id: str, step_id: str) -> StepRecord | None:
        return await self._call(lambda: self.inner.get_step(run_id, step_id))

    async def get_steps_many(self, keys: Sequence[tuple[str, str]]) -> list[StepRecord | None]:
        return await self._call(lambda: self.inner.get_steps_many(keys))

    async def begin_step(self, step: StepRecord) -> StepRecord:
        return await self._call(lambda: self.inner.begin_step(step))

    async def update_step(self, step: StepRecord, *, expect_attempt: int) -> Applied:
        return await self._call(lambda: self.inner.update_step(step, expect_attempt=expect_attempt))

    async def mark_dispatched(self, run_id: str, step_id: str, attempt: int) -> bool:
        return await self._call(lambda: self.inner.mark_dispatched(run_id, step_id, attempt))

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()  # the shared store belongs to the simulation


@attrs.define(eq=False)
class _EngineGeneration:
    """One engine process: killed, it is replaced by the next generation."""

    injector: Injector
    store: _EngineStore
    engine: Engine | None = None
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    stop: trio.Event = attrs.Factory(trio.Event)
    killed: bool = False


def _summed(a: EngineStatistics | None, b: EngineStatistics) -> EngineStatistics:
    """Counters summed over engine generations (gauges: the latest)."""
    if a is None:
        return b
    return attrs.evolve(b, **{name: getattr(a, name) + getattr(b, name) for name in COUNTERS})


def _arrivals(rng: random.Random, rate_per_hour: float, duration: float) -> list[float]:
    """Poisson arrival times in ``[0, duration)``."""
    if rate_per_hour <= 0:
        return []
    times = []
    t = rng.expovariate(rate_per_hour / _HOUR)
    while t < duration:
        times.append(t)
        t += rng.expovariate(rate_per_hour / _HOUR)
    return times


class Simulation:
    """One engine, ``workers`` workers and a memory broker, a seeded workload and seeded
    faults, in one ``trio.run`` under a virtual clock. See ``docs/testing.md``.

    Args:
        app: the app under test (its workflows are driven by the engine, its steps by the
            workers).
        workload: ``(rng, index) -> (workflow, input)`` for the ``index``-th run; draw inputs
            from ``rng`` only (it is seeded).
        seed: the seed of everything random. The environment variable ``DURABLE_TRIO_SEED``
            overrides it (that is how the replay command replays a failing seed).
        runs: how many runs the workload starts, at random times during ``duration``.
        duration: virtual seconds during which runs start and faults strike.
        workers: worker processes (slots: a killed worker is replaced in its slot).
        engines: engine processes sharing the run store (default 1). With more than one, each
            has its own ``engine_id`` (``engine0``, ``engine1``, ...), runs are started on them
            in turn, any of them applies any result or decision, and a killed one's runs are
            taken over by the others once their lease lapses (``reconcile_interval`` 15 s and
            ``watch_interval`` 5 s unless ``engine_options`` says otherwise).
        concurrency: steps each worker runs at once.
        faults: what goes wrong (default: a bit of everything, see :class:`Faults`).
        drain_timeout: after ``duration``, faults stop and the runs still going get this long
            (virtual) to finish; a run unfinished after that is reported lost.
        expected_output: ``(workflow, input) -> output``: each completed run's output is
            checked against it.
        engine_options: :func:`~durable_trio.open_engine` keywords (defaults: one engine that
            never reconciles after start and never watches the store).
        transport_options: transport keywords for the engine and every worker (defaults:
            :data:`DEFAULT_TRANSPORT_OPTIONS`).
        replay: the command printed to replay a failing seed, with ``{seed}`` in it (default:
            the pytest node being run, or this process's command line, with
            ``DURABLE_TRIO_SEED`` set).
    """

    def __init__(
        self,
        app: App,
        workload: Workload,
        *,
        seed: int,
        runs: int = 100,
        duration: float = _HOUR,
        workers: int = 4,
        engines: int = 1,
        concurrency: int = 8,
        faults: Faults | None = None,
        drain_timeout: float = 6 * _HOUR,
        expected_output: Callable[[str, Any], Any] | None = None,
        engine_options: dict[str, Any] | None = None,
        transport_options: dict[str, Any] | None = None,
        replay: str | None = None,
    ) -> None:
        override = os.environ.get(SEED_VARIABLE)
        self.seed = int(override) if override else seed
        self.app = app
        self.workload = workload
        self.runs = runs
        self.duration = float(duration)
        self.worker_count = workers
        if engines < 1:
            raise ValueError(f"a simulation needs at least one engine, not {engines}")
        self.engine_count = engines
        self.concurrency = concurrency
        self.faults = faults if faults is not None else Faults()
        self.drain_timeout = drain_timeout
        self.expected_output = expected_output
        self.engine_options = dict(engine_options or {})
        self.transport_options = {**DEFAULT_TRANSPORT_OPTIONS, **(transport_options or {})}
        self._replay = replay
        self._reset()

    # ------------------------------------------------------------------ public API

    def run_sync(self) -> SimulationReport:
        """Run the simulation in its own ``trio.run`` under ``MockClock(autojump_threshold=0)``
        and check the invariants.

        Raises:
            InvariantViolation: an invariant broke (the message names the seed and the replay
                command).
        """
        clock = trio.testing.MockClock(autojump_threshold=0)
        return trio.run(self.run, clock=clock)

    async def run(self) -> SimulationReport:
        """Run the simulation inside the current ``trio.run`` (which must use a virtual clock:
        pytest-trio's ``autojump_clock``), then check the invariants. Prefer :meth:`run_sync`
        from plain code.

        Raises:
            InvariantViolation: as :meth:`run_sync`.
        """
        self._reset()
        wall = time.perf_counter()
        with seeded_scheduler(f"{self.seed}:scheduler"):
            await self._simulate()
        report = self._report(time.perf_counter() - wall)
        if report.violations:
            shown = "\n".join(f"  - {v}" for v in report.violations[:20])
            more = len(report.violations) - 20
            raise InvariantViolation(
                f"simulation seed {self.seed}: {len(report.violations)} invariant violation(s)\n"
                f"{shown}{f'{chr(10)}  ... and {more} more' if more > 0 else ''}\n"
                f"replay: {report.replay_command}\n\n{report.summary()}",
                report,
            )
        return report

    def replay_command(self) -> str:
        """A one-line shell command that replays this simulation's seed."""
        seed = self.seed
        if self._replay is not None:
            return self._replay.format(seed=seed)
        node = os.environ.get("PYTEST_CURRENT_TEST")
        if node:
            node_id = node.rsplit(" (", 1)[0]
            return f"{SEED_VARIABLE}={seed} {sys.executable} -m pytest -q {shlex.quote(node_id)}"
        return f"{SEED_VARIABLE}={seed} {shlex.join([sys.executable, *sys.argv])}"

    # ------------------------------------------------------------------ state

    def _reset(self) -> None:
        self._t0 = 0.0
        self._history: list[dict[str, Any]] = []
        self._executions: dict[tuple[str, str, int], list[_Execution]] = {}
        self._fault_windows: dict[str, list[tuple[float, float]]] = {}
        self._duplicate_pushes: Counter[tuple[str, str, int]] = Counter()
        self._damaged: list[tuple[str, float, dict[str, Any]]] = []
        self._set_aside: set[tuple[str, str]] = set()
        self._fault_counts: Counter[str] = Counter()
        self._errors: Counter[str] = Counter()
        self._violations: list[str] = []
        self._outcomes: dict[str, tuple[str, Any]] = {}
        self._inputs: dict[str, tuple[str, Any]] = {}
        self._closes: list[float] = []
        self._lost_leases = 0
        self._slots: list[_Slot] = []
        self._stopping = False
        self._healed = False
        self._store = _RecordingStore()
        self._broker = MemoryBroker()
        self._keys = MemoryKeyStore()
        namespace = (
            self.transport_options.get("namespace")
            or self.engine_options.get("namespace")
            or self.app.name
        )
        self._names = QueueNames(str(namespace))
        self._store_steps: dict[str, list[StepRecord]] = {}
        self._engine_stats: EngineStatistics | None = None
        self._engines: list[_EngineGeneration | None] = [None] * self.engine_count
        self._engine_up = trio.Event()
        """Set while some engine is up (replaced when the last one goes down)."""
        self._engines_stop = trio.Event()
        self._task_pushers: dict[tuple[str, str, int], Counter[str]] = {}
        """How often each engine pushed each step attempt (several engines: see ``_check``)."""
        self._end = 0.0

    def _now(self) -> float:
        return trio.current_time() - self._t0

    def _event(self, event: str, /, **fields: Any) -> None:
        self._history.append({"t": self._now(), "ev": event, **fields})

    def _violation(self, message: str) -> None:
        self._violations.append(message)

    @property
    def close_bound(self) -> float:
        """The longest a graceful worker close may take (``close_timeout`` plus a
        ``cleanup_timeout`` per cleanup phase)."""
        options = self.transport_options
        return float(options["close_timeout"]) + _CLEANUP_PHASES * float(options["cleanup_timeout"])

    @property
    def _threshold(self) -> float:
        threshold = self.transport_options.get("stalled_threshold")
        return float(threshold) if threshold is not None else 120.0

    @property
    def _key_ttl(self) -> float:
        interval = float(self.transport_options["worker_heartbeat_interval"])
        return max(MIN_HEARTBEAT_TTL, 3 * interval)

    def _recorder(self, process: str) -> Callable[[str, dict[str, Any]], None]:
        def record(kind: str, details: dict[str, Any]) -> None:
            self._fault_counts[kind] += 1
            self._event("fault", kind=kind, **details)
            now = self._now()
            if kind in ("drop", "lost-reply"):
                self._fault_windows.setdefault(process, []).append((now, now))
            elif kind == "delay" and (
                details["op"] == "renew_jobs" or details["seconds"] >= self._threshold / 2
            ):
                # A late renewal (or any call late by half the stalled threshold) can cost
                # the process its claims.
                self._fault_windows.setdefault(process, []).append((now, now + details["seconds"]))
            elif kind == "damage":
                self._damaged.append((process, now, details))
            for run_id, step_id, attempt in details.get("tasks", ()):
                self._duplicate_pushes[(run_id, step_id, attempt)] += 1

        return record

    def _on_error(self, process: str) -> Callable[[BaseException], None]:
        def hook(exc: BaseException) -> None:
            name = type(exc).__name__
            self._errors[name] += 1
            self._event("error", process=process, type=name)

        return hook

    # ------------------------------------------------------------------ the step recorder

    def _instrumented(self, worker_id: str, injector: Injector) -> App:
        """The app as one worker serves it: every step recorded (who ran which attempt, when,
        with what outcome), and held while the worker is stalled."""
        shadow = App(self.app.name)
        for name, definition in self.app.steps.items():
            shadow.step(name, retry=definition.retry, priority=definition.priority)(
                self._recorded(definition.fn, worker_id, injector)
            )
        for name, workflow in self.app.workflows.items():
            if workflow.fn is None:
                shadow.remote_workflow(name)
            else:  # a remote workflow's turns are served by the workers too
                shadow.workflow(name, remote=workflow.remote)(workflow.fn)
        return shadow

    def _recorded(self, fn: StepFunction, worker_id: str, injector: Injector) -> StepFunction:
        async def step(value: Any) -> Any:
            info = step_info()
            key = (info.run_id, info.step_id, info.attempt)
            execution = _Execution(worker_id, self._now())
            self._executions.setdefault(key, []).append(execution)
            where = {"run": info.run_id, "step": info.step_id, "attempt": info.attempt}
            self._event("exec", **where, worker=worker_id)
            try:
                output = await fn(value)
                await injector.wait_out_stall()  # a frozen process finishes nothing
            except BaseException as exc:
                execution.end = self._now()
                execution.outcome = (
                    "cancelled" if isinstance(exc, trio.Cancelled) else type(exc).__name__
                )
                self._event("exec-end", **where, worker=worker_id, outcome=execution.outcome)
                raise
            execution.end = self._now()
            execution.outcome = "ok"
            try:
                execution.output = orjson.dumps(output)
            except TypeError:
                execution.output = None
            self._event("exec-end", **where, worker=worker_id, outcome="ok")
            return output

        return step

    # ------------------------------------------------------------------ the simulation

    async def _simulate(self) -> None:
        self._t0 = trio.current_time()
        self._slots = [_Slot(i) for i in range(self.worker_count)]
        self._event("begin", seed=self.seed, workers=self.worker_count, runs=self.runs)
        async with trio.open_nursery() as nursery:
            engines_done = [trio.Event() for _ in range(self.engine_count)]
            for index, done in enumerate(engines_done):
                nursery.start_soon(self._run_engines, index, done)
            await self._live_engine()
            slots_done = trio.Event()
            nursery.start_soon(self._run_slots, nursery, slots_done)
            async with trio.open_nursery() as runs:
                runs.start_soon(self._inject_faults)
                await self._start_runs(runs)
                await trio.sleep_until(self._t0 + self.duration)
                self._heal()
                runs.cancel_scope.deadline = self._t0 + self.duration + self.drain_timeout
            self._event("drained", unfinished=len(self._inputs) - len(self._outcomes))
            self._stopping = True
            for slot in self._slots:
                slot.stop.set()
            await slots_done.wait()
            self._engines_stop.set()
            for current in self._engines:
                if current is not None:
                    current.stop.set()
            for done in engines_done:
                await done.wait()
            for run_id in self._inputs:
                self._store_steps[run_id] = await self._store.get_steps(run_id)
            for queue in sorted({details["queue"] for _, _, details in self._damaged}):
                for failed in await self._broker.failed_jobs(queue, limit=1_000_000):
                    if failed.error.startswith("damaged: "):
                        self._set_aside.add((queue, failed.id))
            # keep the key checks scheduled by the last closes (the nursery waits for them)
        self._end = self._now()
        self._event("end")

    async def _run_engines(self, index: int, done: trio.Event) -> None:
        """Engine ``index``, and after each kill its replacement (same ``engine_id``: it takes
        the runs over at start), until the simulation stops it."""
        seed = self.seed
        # Damaged claims strike the workers only, unless asked for the engine explicitly: a
        # result set aside unread leaves its run waiting for it (docs/testing.md).
        engine_faults = self.faults.engine_broker or attrs.evolve(
            self.faults.broker, damage_probability=0.0
        )
        several = self.engine_count > 1
        engine_id = f"engine{index}" if several else "engine"
        generation = 0
        while True:
            # The first generation is "engine" (its draws are those of a simulation without
            # engine kills), the next ones "engine-1", "engine-2", ... ("engine0-1", ... when
            # there are several).
            name = engine_id if generation == 0 else f"{engine_id}-{generation}"
            injector = Injector(
                name,
                random.Random(f"{seed}:{name}"),
                BrokerFaults() if self._healed else engine_faults,
                self._recorder(name),
            )
            if several:
                injector.pushed = self._pushes_observer(engine_id)
            current = _EngineGeneration(injector, _EngineStore(self._store))
            backend = Backend(
                url="memory://",
                broker=wrap_broker(self._broker, injector),
                keys=FaultyKeyStore(self._keys, injector),
            )
            options: dict[str, Any] = {
                "engine_id": engine_id,
                "seed": seed,  # the retry jitter too
                # One engine needs neither: it drives every run and applies every result. Several
                # take over each other's runs, and learn of results applied by the others.
                "reconcile_interval": 15.0 if several else None,
                "watch_interval": 5.0 if several else None,
                **self.transport_options,
                **self.engine_options,
            }
            options.setdefault("instance_id", name)
            options.setdefault("on_error", self._on_error(name))
            with current.scope:
                async with open_engine(
                    self.app, backend, store=current.store, **options
                ) as engine:
                    current.engine = engine
                    self._engines[index] = current
                    self._engine_up.set()
                    if self._engines_stop.is_set():  # stopped while this one was starting
                        current.stop.set()
                    self._event("engine-up", engine=name)
                    await current.stop.wait()
                    if not current.killed:
                        self._engine_stats = _summed(self._engine_stats, engine.statistics())
            self._engines[index] = None
            if not current.killed:
                break
            self._event("engine-gone", engine=name)
            with trio.move_on_after(self.faults.engine_restart_delay):
                await self._engines_stop.wait()
            if self._engines_stop.is_set():
                break
            generation += 1
        done.set()

    def _up(self) -> list[_EngineGeneration]:
        return [e for e in self._engines if e is not None and not e.killed]

    async def _live_engine(self, turn: int = 0) -> _EngineGeneration:
        """An engine now up (the ``turn``-th of them, round the ones up), waiting while none
        is."""
        while not (up := self._up()):
            await self._engine_up.wait()
        return up[turn % len(up)]

    def _pushes_observer(self, engine_id: str) -> Callable[[list[list[Any]]], None]:
        def pushed(tasks: list[list[Any]]) -> None:
            for run_id, step_id, attempt in tasks:
                key = (run_id, step_id, attempt)
                self._task_pushers.setdefault(key, Counter())[engine_id] += 1

        return pushed

    def _kill_engine(self, index: int) -> None:
        current = self._engines[index]
        if current is None or current.killed or current.engine is None:
            return
        self._fault_counts["engine-kill"] += 1
        self._event("fault", kind="engine-kill", process=current.injector.name)
        current.killed = True
        if not self._up():
            self._engine_up = trio.Event()  # set by the next engine up
        current.injector.kill()
        current.store.dead = True
        self._engine_stats = _summed(self._engine_stats, current.engine.statistics())
        # An attempt the engine may have sent without recording it yet is sent again by its
        # replacement: one redelivery such a kill explains (at least once, results applied
        # once).
        for key in self._store.unconfirmed_dispatches():
            self._duplicate_pushes[key] += 1
        current.scope.cancel()
        current.stop.set()

    def _heal(self) -> None:
        """Stop every fault: the runs still going get the drain time to finish."""
        self._healed = True
        for current in self._engines:
            if current is not None:
                current.injector.quiet_down()
        for slot in self._slots:
            if slot.injector is not None:
                slot.injector.quiet_down()
        self._event("healed")

    async def _start_runs(self, runs: trio.Nursery) -> None:
        rng = random.Random(f"{self.seed}:workload")
        arrivals = sorted(rng.uniform(0, self.duration) for _ in range(self.runs))
        for index, at in enumerate(arrivals):
            await trio.sleep_until(self._t0 + at)
            workflow, value = self.workload(rng, index)
            run_id = f"run-{index:05d}"
            self._inputs[run_id] = (workflow, value)
            while True:  # idempotent by run id: started again on the next engine if need be
                current = await self._live_engine(index)
                assert current.engine is not None
                try:
                    await current.engine.start(workflow, value, run_id=run_id)
                except (BrokerError, EngineClosed):
                    if not current.killed:
                        raise
                    continue
                break
            self._event("start", run=run_id, workflow=workflow)
            runs.start_soon(self._await_run, run_id)

    async def _await_run(self, run_id: str) -> None:
        while True:
            current = await self._live_engine()
            assert current.engine is not None
            try:
                output = await current.engine.result(run_id)
            except RunFailed as exc:
                self._outcomes[run_id] = ("failed", exc.error)
            except RunCancelled as exc:
                self._outcomes[run_id] = ("cancelled", exc.error)
            except (BrokerError, EngineClosed):
                if not current.killed:
                    raise
                continue  # asked again of the replacement
            else:
                self._outcomes[run_id] = ("completed", output)
            break
        self._event("end-run", run=run_id, status=self._outcomes[run_id][0])

    # ------------------------------------------------------------------ workers

    async def _run_slots(self, nursery: trio.Nursery, done: trio.Event) -> None:
        async with trio.open_nursery() as slots:
            for slot in self._slots:
                slots.start_soon(self._run_slot, slot, nursery)
        done.set()

    async def _run_slot(self, slot: _Slot, checks: trio.Nursery) -> None:
        generation = 0
        while not self._stopping:
            worker_id = f"w{slot.index}-{generation}"
            generation += 1
            await self._serve(slot, worker_id, checks)
            if slot.killed:
                slot.stop = trio.Event()  # set by the final shutdown: no restart then
                if self._stopping:
                    return
                with trio.move_on_after(self.faults.restart_delay):
                    await slot.stop.wait()

    async def _serve(self, slot: _Slot, worker_id: str, checks: trio.Nursery) -> None:
        injector = Injector(
            worker_id,
            random.Random(f"{self.seed}:{worker_id}"),
            BrokerFaults() if self._healed else self.faults.broker,
            self._recorder(worker_id),
        )
        keys = FaultyKeyStore(self._keys, injector)
        backend = Backend(url="memory://", broker=wrap_broker(self._broker, injector), keys=keys)
        options: dict[str, Any] = {**self.transport_options, "instance_id": worker_id}
        options.setdefault("on_error", self._on_error(worker_id))
        slot.worker_id, slot.injector, slot.keys = worker_id, injector, keys
        slot.stop, slot.killed, slot.stalled_during_close = trio.Event(), False, False
        closing_at = 0.0
        with trio.CancelScope() as scope:
            slot.scope = scope
            async with open_worker(
                self._instrumented(worker_id, injector),
                backend,
                concurrency=self.concurrency,
                **options,
            ) as worker:
                slot.worker, slot.up = worker, True
                self._event("worker-up", worker=worker_id)
                await slot.stop.wait()
                closing_at = trio.current_time()
                slot.stalled_during_close = injector.stalled
        slot.up = False
        assert slot.worker is not None
        self._lost_leases += slot.worker.transport.statistics().duplicates
        if slot.killed:
            self._event("worker-gone", worker=worker_id)
            # Nobody removes a killed worker's keys: they must expire by their TTL.
            checks.start_soon(self._check_keys_later, worker_id, self._now() + self._key_ttl)
            return
        took = trio.current_time() - closing_at
        self._closes.append(took)
        # A close hands back what did not finish within close_timeout (a step whose result
        # push was still in flight too): a redelivery it explains.
        self._fault_windows.setdefault(worker_id, []).append((closing_at - self._t0, self._now()))
        self._event("worker-closed", worker=worker_id, took=took)
        if took > self.close_bound:
            self._violation(
                f"worker {worker_id}'s graceful close took {took:.3f} s (bound "
                f"{self.close_bound:.3f} s)"
            )
        if keys.failed_removals or slot.stalled_during_close or injector.stalled:
            # The injector kept the keys from being removed: they must still expire.
            checks.start_soon(self._check_keys_later, worker_id, self._now() + self._key_ttl)
        else:
            leftover = await self._liveness_keys(worker_id)
            if leftover:
                self._violation(
                    f"worker {worker_id} closed gracefully at {self._now():.3f} but its "
                    f"liveness keys remain: {leftover}"
                )

    async def _liveness_keys(self, worker_id: str) -> list[str]:
        suffix = f":{sanitize_token(worker_id)}"
        last_status = self._names.worker_last_status(worker_id)
        return [
            entry.key
            for entry in await self._keys.entries(f"{self._names.prefix}-")
            if entry.key.endswith(suffix) and entry.key != last_status
        ]

    async def _check_keys_later(self, worker_id: str, at: float) -> None:
        await trio.sleep_until(self._t0 + at + 1e-6)
        leftover = await self._liveness_keys(worker_id)
        if leftover:
            self._violation(
                f"worker {worker_id}'s liveness keys outlived their TTL ({self._key_ttl:g} s): "
                f"{leftover}"
            )

    # ------------------------------------------------------------------ scheduled faults

    def _schedule(self) -> list[tuple[float, str, int, float]]:
        faults = self.faults
        rng = random.Random(f"{self.seed}:faults")
        plan: list[tuple[float, str, int, float]] = []
        kinds: list[tuple[str, float, tuple[float, float]]] = [
            ("kill", faults.kills_per_hour, (0.0, 0.0)),
            ("restart", faults.restarts_per_hour, (0.0, 0.0)),
            ("pause-renewal", faults.renewal_pauses_per_hour, faults.renewal_pause),
            ("stall", faults.stalls_per_hour, faults.stall),
        ]
        for kind, rate, (low, high) in kinds:
            for at in _arrivals(rng, rate, self.duration):
                plan.append((at, kind, rng.randrange(self.worker_count), rng.uniform(low, high)))
        # (drawn last: a simulation without engine kills draws what it drew before they were)
        for at in _arrivals(rng, faults.engine_kills_per_hour, self.duration):
            victim = rng.randrange(self.engine_count) if self.engine_count > 1 else 0
            plan.append((at, "engine-kill", victim, 0.0))
        plan.sort()
        return plan

    async def _inject_faults(self) -> None:
        for at, kind, index, seconds in self._schedule():
            await trio.sleep_until(self._t0 + at)
            if kind == "engine-kill":
                self._kill_engine(index)
                continue
            slot = self._slots[index]
            injector = slot.injector
            if not slot.up or injector is None or slot.stop.is_set():
                continue  # down already (killed, restarting): nothing to strike
            worker_id = slot.worker_id
            now = self._now()
            self._fault_counts[kind] += 1
            self._event("fault", kind=kind, process=worker_id, seconds=seconds)
            windows = self._fault_windows.setdefault(worker_id, [])
            if kind == "kill":
                windows.append((now, math.inf))
                slot.killed = True
                injector.kill()
                assert slot.scope is not None
                slot.scope.cancel()
                slot.stop.set()
            elif kind == "restart":
                slot.stop.set()
            elif kind == "pause-renewal":
                windows.append((now, now + seconds))
                injector.pause_renewal(seconds)
            else:
                windows.append((now, now + seconds))
                injector.stall(seconds)

    # ------------------------------------------------------------------ invariants

    def _faulted(self, worker: str, start: float, end: float) -> bool:
        return any(a <= end and b >= start for a, b in self._fault_windows.get(worker, ()))

    def _check(self) -> None:
        # 1. no run lost
        for run_id, (workflow, value) in self._inputs.items():
            outcome = self._outcomes.get(run_id)
            if outcome is None:
                self._violation(f"run {run_id} ({workflow}) never ended (lost)")
            elif self.expected_output is not None:
                status, output = outcome
                expected = self.expected_output(workflow, value)
                if status != "completed" or output != expected:
                    self._violation(
                        f"run {run_id} ({workflow}) ended {status} with {output!r}, "
                        f"expected completed with {expected!r}"
                    )
        # 2. every settled step settled once, with a result a worker produced
        for (run_id, step_id), count in self._store.settled.items():
            if count != 1:
                self._violation(f"step {run_id}:{step_id} was settled {count} times")
        for run_id, steps in self._store_steps.items():
            for record in steps:
                if record.kind is not StepKind.REMOTE or record.status is not StepState.COMPLETED:
                    continue
                key = (run_id, record.step_id, record.attempt)
                produced = {e.output for e in self._executions.get(key, ()) if e.outcome == "ok"}
                if orjson.dumps(record.output) not in produced:
                    self._violation(
                        f"step {run_id}:{record.step_id} completed with an output no execution "
                        f"of attempt {record.attempt} produced"
                    )
        # 3. duplicates only where a lease was lost (or a push was repeated): every execution
        # after the first needs a cause, and one earlier execution (whose claim a fault took,
        # or which was cancelled and handed back) or one repeated push causes one redelivery.
        for key, executions in self._executions.items():
            pushes = self._duplicate_pushes.get(key, 0)
            # Several engines: two that applied copies of one decision (or of one result) at
            # once may each have sent the attempt, and then again on seeing it undispatched
            # (docs/remote.md). An attempt sent by more than one engine: each send beyond the
            # first explains one redelivery. (Sent by one engine only: no such allowance.)
            senders = self._task_pushers.get(key)
            if senders is not None and len(senders) > 1:
                pushes += sum(senders.values()) - 1
            causes = executions[:1]
            for after in executions[1:]:
                cause = next(
                    (
                        e
                        for e in causes
                        if e.outcome == "cancelled" or self._faulted(e.worker, e.start, after.start)
                    ),
                    None,
                )
                if cause is not None:
                    causes.remove(cause)
                elif pushes:
                    pushes -= 1
                else:
                    self._violation(
                        f"step {key[0]}:{key[1]} attempt {key[2]} ran again on {after.worker} "
                        f"at {after.start:.3f} with no fault to explain it (earlier: "
                        + ", ".join(
                            f"{e.worker} at {e.start:.3f} ({e.outcome})"
                            for e in executions[: executions.index(after)]
                        )
                        + ")"
                    )
                causes.append(after)

        # 6. a damaged claim is set aside unread: never run, kept in the failed set (unless
        # its worker met a fault before it could fail it: then the claim came back by lease
        # expiry, undamaged, and ran as any redelivery does)
        cleanup = float(self.transport_options["cleanup_timeout"])
        for process, at, details in self._damaged:
            task = details.get("task")
            if task is not None and any(
                e.worker == process and e.start == at for e in self._executions.get(tuple(task), ())
            ):
                self._violation(f"a damaged claim ran: {details} on {process} at {at:.3f}")
            if (details["queue"], details["job"]) not in self._set_aside and not self._faulted(
                process, at, at + 2 * cleanup
            ):
                self._violation(f"a damaged claim was not set aside: {details} on {process}")

    def _report(self, wall: float) -> SimulationReport:
        self._check()
        statuses = Counter(status for status, _ in self._outcomes.values())
        executions = sum(len(e) for e in self._executions.values())
        assert self._engine_stats is not None
        return SimulationReport(
            seed=self.seed,
            workers=self.worker_count,
            duration=self.duration,
            virtual_seconds=self._end,
            wall_seconds=wall,
            runs_started=len(self._inputs),
            runs_completed=statuses["completed"],
            runs_failed=statuses["failed"],
            runs_cancelled=statuses["cancelled"],
            runs_unfinished=len(self._inputs) - len(self._outcomes),
            step_executions=executions,
            duplicate_executions=executions - len(self._executions),
            lost_leases=self._lost_leases,
            faults=dict(sorted(self._fault_counts.items())),
            errors_reported=dict(sorted(self._errors.items())),
            graceful_closes=len(self._closes),
            longest_close=max(self._closes, default=0.0),
            close_bound=self.close_bound,
            engine=self._engine_stats,
            violations=tuple(self._violations),
            history=tuple(self._history),
            replay_command=self.replay_command(),
        )
