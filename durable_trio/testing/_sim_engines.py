"""The engines of a simulation: one (or several) engine processes over one shared run store,
each killed and replaced under its ``engine_id`` when the fault schedule says so."""

from __future__ import annotations

import random
from collections import Counter
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import trio

from .._engine import (
    Applied,
    Engine,
    EngineClosed,
    EngineStatistics,
    RunRecord,
    RunStatus,
    StepKind,
    StepRecord,
    StepState,
    open_engine,
)
from .._engine._cancel import CANCEL_MARK
from .._engine._counters import COUNTERS
from .._engine._heartbeats import HEARTBEAT_TIMEOUT
from .._engine._stores.memory import MemoryRunStore
from .._errors import BrokerError, BrokerUnavailable
from ..backends._backend import Backend
from ._sim_generations import GuardedGenerations, PrunedGeneration, RecordingGenerations
from .faults import BrokerFaults, FaultyKeyStore, Injector, wrap_broker

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from .._engine import App, DuplicateResult, RunPage
    from ..brokers.memory import MemoryBroker
    from ..keys.memory import MemoryKeyStore
    from ._report import Faults
    from ._sim_ledger import Ledger

__all__ = ["EngineGeneration", "Engines", "Pruned", "RecordingStore"]

T = TypeVar("T")


@attrs.frozen
class Pruned:
    """A run a prune deleted: its record just before, when, the prune's cutoff, and its
    parent's status then (``None``: no parent, or the parent gone)."""

    run: RunRecord
    at: float
    ended_before: float
    parent_status: RunStatus | None


class RecordingStore(MemoryRunStore):
    """The engine's run store, counting every checkpoint that reaches a final state."""

    def __init__(self) -> None:
        super().__init__()
        self.settled: Counter[tuple[str, str]] = Counter()
        self.failovers: list[tuple[str, str, int, float]] = []
        """``(run, step, attempt, when)`` of every attempt failed over for want of beats
        (``when`` on the trio clock)."""
        self.late_marks: list[str] = []
        """Runs whose cancel mark was written after they had ended (an invariant's breach)."""
        self.prunes: dict[str, Pruned] = {}
        """Retention (issue 34): every run deleted by a prune, as it was just before."""
        self.pruned_twice: list[str] = []
        """Runs a prune deleted more than once (created again after a prune: a breach)."""
        self.generation_prunes: list[PrunedGeneration] = []
        """Retention of previous generations (continue-as-new): every one a prune deleted."""
        self.generations = RecordingGenerations(self)
        """Continue-as-new's calls on this store (``generations_of``), prunes recorded."""

    async def prune_finished(
        self, ended_before: float, *, workflow: str | None = None, limit: int = 100
    ) -> list[str]:
        before = dict(self._runs)  # (the prune is atomic: no checkpoint until it has run)
        pruned = await super().prune_finished(ended_before, workflow=workflow, limit=limit)
        now = self.now()
        for run_id in pruned:
            run = before[run_id]
            parent = None if run.parent is None else before.get(run.parent)
            if run_id in self.prunes:
                self.pruned_twice.append(run_id)
            self.prunes[run_id] = Pruned(
                run.out(), now, ended_before, None if parent is None else parent.status
            )
        return pruned

    async def begin_step(self, step: StepRecord) -> StepRecord:
        run = self._runs.get(step.run_id)
        late = (
            step.step_id == CANCEL_MARK
            and run is not None
            and run.status.terminal
            and step.step_id not in run.steps
        )
        stored = await super().begin_step(step)
        if late:
            self.late_marks.append(step.run_id)
        return stored

    async def update_step(self, step: StepRecord, *, expect_attempt: int) -> Applied:
        verdict = await super().update_step(step, expect_attempt=expect_attempt)
        if verdict is Applied.APPLIED and step.status is not StepState.PENDING:
            self.settled[(step.run_id, step.step_id)] += 1
        if (
            verdict is Applied.APPLIED
            and isinstance(step.error, dict)
            and step.error.get("code") == HEARTBEAT_TIMEOUT
            and (step.attempt != expect_attempt or step.status is StepState.FAILED)
        ):
            self.failovers.append((step.run_id, step.step_id, expect_attempt, self.now()))
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

    def __init__(self, inner: RecordingStore) -> None:
        self.inner = inner
        self.dead = False

    async def _call(self, call: Callable[[], Awaitable[T]]) -> T:
        if self.dead:
            await trio.lowlevel.checkpoint()
            raise BrokerUnavailable("injected: the engine is gone")
        return await call()

    def now(self) -> float:
        return self.inner.now()

    @property
    def generations(self) -> GuardedGenerations:
        """Continue-as-new's store calls, through this view (``_sim_generations``)."""
        return GuardedGenerations(self)

    async def create_run(self, run: RunRecord) -> tuple[RunRecord, bool]:
        return await self._call(lambda: self.inner.create_run(run))

    async def put_schedule(self, name: str, spec: str, *, replace: bool) -> bool:
        return await self._call(lambda: self.inner.put_schedule(name, spec, replace=replace))

    async def get_schedules(self) -> list[tuple[str, str, float | None]]:
        return await self._call(self.inner.get_schedules)

    async def delete_schedule(self, name: str) -> bool:
        return await self._call(lambda: self.inner.delete_schedule(name))

    async def mark_schedule_tick(self, name: str, tick: float) -> None:
        await self._call(lambda: self.inner.mark_schedule_tick(name, tick))

    async def get_schedule_states(self) -> dict[str, str]:
        return await self._call(self.inner.get_schedule_states)

    async def put_schedule_state(self, name: str, state: str) -> None:
        await self._call(lambda: self.inner.put_schedule_state(name, state))

    async def get_run(self, run_id: str) -> RunRecord | None:
        return await self._call(lambda: self.inner.get_run(run_id))

    async def list_runs(
        self, *, status: RunStatus | None = None, workflow: str | None = None, limit: int = 100
    ) -> list[RunRecord]:
        return await self._call(
            lambda: self.inner.list_runs(status=status, workflow=workflow, limit=limit)
        )

    async def page_runs(self, **filters: Any) -> RunPage:
        return await self._call(lambda: self.inner.page_runs(**filters))

    async def count_runs(self) -> dict[RunStatus, int]:
        return await self._call(self.inner.count_runs)

    async def reopen_run(
        self, run_id: str, steps: Sequence[StepRecord], *, run_timeout: float | None
    ) -> bool:
        return await self._call(
            lambda: self.inner.reopen_run(run_id, steps, run_timeout=run_timeout)
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

    async def begin_step_unless_finished(self, step: StepRecord) -> StepRecord | None:
        return await self._call(lambda: self.inner.begin_step_unless_finished(step))

    async def update_step(self, step: StepRecord, *, expect_attempt: int) -> Applied:
        return await self._call(lambda: self.inner.update_step(step, expect_attempt=expect_attempt))

    async def mark_dispatched(self, run_id: str, step_id: str, attempt: int) -> bool:
        return await self._call(lambda: self.inner.mark_dispatched(run_id, step_id, attempt))

    async def append_signal(self, run_id: str, name: str, payload: str) -> int | None:
        return await self._call(lambda: self.inner.append_signal(run_id, name, payload))

    async def read_signal(self, run_id: str, name: str, seq: int) -> str | None:
        return await self._call(lambda: self.inner.read_signal(run_id, name, seq))

    async def put_event(self, run_id: str, key: str, value: str) -> None:
        await self._call(lambda: self.inner.put_event(run_id, key, value))

    async def get_events(self, run_id: str) -> dict[str, str]:
        return await self._call(lambda: self.inner.get_events(run_id))

    async def create_run_deduped(self, run: RunRecord, key: str) -> tuple[RunRecord, bool]:
        return await self._call(lambda: self.inner.create_run_deduped(run, key))

    async def debounce_run(
        self, key: str, run: RunRecord, *, delay: float, max_wait: float | None
    ) -> str:
        return await self._call(
            lambda: self.inner.debounce_run(key, run, delay=delay, max_wait=max_wait)
        )

    async def start_debounced(self, limit: int = 100) -> tuple[list[RunRecord], float | None]:
        return await self._call(lambda: self.inner.start_debounced(limit))

    async def debounced_due(self, run_id: str) -> float | None:
        return await self._call(lambda: self.inner.debounced_due(run_id))

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()  # the shared store belongs to the simulation

    async def prune_finished(
        self, ended_before: float, *, workflow: str | None = None, limit: int = 100
    ) -> list[str]:
        return await self._call(
            lambda: self.inner.prune_finished(ended_before, workflow=workflow, limit=limit)
        )

    async def count_finished(self, ended_before: float, *, workflow: str | None = None) -> int:
        return await self._call(lambda: self.inner.count_finished(ended_before, workflow=workflow))

    async def finished_workflows(self) -> list[str]:
        return await self._call(self.inner.finished_workflows)


@attrs.define(eq=False)
class EngineGeneration:
    """One engine process: killed, it is replaced by the next generation."""

    injector: Injector
    store: _EngineStore
    engine: Engine | None = None
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    stop: trio.Event = attrs.Factory(trio.Event)
    killed: bool = False
    redeployed: bool = False
    """Stopped gracefully to be replaced by the deployed code (issue 18: versioning)."""

    @property
    def gone(self) -> bool:
        """Killed, or closing for a deploy: a call it failed is made again on the next one."""
        return self.killed or self.redeployed


def _summed(a: EngineStatistics | None, b: EngineStatistics) -> EngineStatistics:
    """Counters summed over engine generations (gauges: the latest)."""
    if a is None:
        return b
    return attrs.evolve(b, **{name: getattr(a, name) + getattr(b, name) for name in COUNTERS})


class Engines:
    """The simulation's engine processes: ``count`` of them over the shared ``store``, each
    over its own faulty view of the broker and key store, each replaced after a kill.

    Args:
        app: the app the engines drive.
        store: the run store they share.
        broker, keys: the broker and key store they share (each generation wraps them in its
            own injector).
        ledger: where what they do is recorded.
        seed: the simulation's seed.
        count: engine processes.
        faults: the simulation's faults.
        engine_options, transport_options: :func:`~durable_trio.open_engine` keywords.
    """

    def __init__(
        self,
        app: App,
        store: RecordingStore,
        broker: MemoryBroker,
        keys: MemoryKeyStore,
        ledger: Ledger,
        *,
        seed: int,
        count: int,
        faults: Faults,
        engine_options: dict[str, Any],
        transport_options: dict[str, Any],
    ) -> None:
        self.app = app
        self.store = store
        self.broker = broker
        self.keys = keys
        self.ledger = ledger
        self.seed = seed
        self.count = count
        self.faults = faults
        self.engine_options = engine_options
        self.transport_options = transport_options
        self.statistics: EngineStatistics | None = None
        """The engines' counters, summed over every generation (set once they are closed)."""
        self.duplicates: list[DuplicateResult] = []
        """The duplicate completed results every generation recorded, with their causes."""
        self._healed = False
        self._current: list[EngineGeneration | None] = [None] * count
        self._up_event = trio.Event()
        """Set while some engine is up (replaced when the last one goes down)."""
        self._stopping = trio.Event()
        self._done = [trio.Event() for _ in range(count)]
        self.deployed_app: App | None = None
        """The new code a rolling deploy brings (see :meth:`deploy`)."""
        self._deployed = [False] * count

    def start(self, nursery: trio.Nursery) -> None:
        """Start every engine (each a task of ``nursery``, replaced after each kill)."""
        for index, done in enumerate(self._done):
            nursery.start_soon(self._run, index, done)

    async def _run(self, index: int, done: trio.Event) -> None:
        """Engine ``index``, and after each kill its replacement (same ``engine_id``: it takes
        the runs over at start), until the simulation stops it."""
        seed = self.seed
        ledger = self.ledger
        # Damaged claims strike the workers only, unless asked for the engine explicitly: a
        # result set aside unread leaves its run waiting for it (docs/testing.md).
        engine_faults = self.faults.engine_broker or attrs.evolve(
            self.faults.broker, damage_probability=0.0
        )
        several = self.count > 1
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
                ledger.fault_recorder(name),
            )
            if several:
                injector.pushed = ledger.pushes_observer(engine_id)
            current = EngineGeneration(injector, _EngineStore(self.store))
            backend = Backend(
                url="memory://",
                broker=wrap_broker(self.broker, injector),
                keys=FaultyKeyStore(self.keys, injector),
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
            options.setdefault("on_error", ledger.error_hook(name))
            app = self.deployed_app if self._deployed[index] else self.app
            assert app is not None
            with current.scope:
                async with open_engine(app, backend, store=current.store, **options) as engine:
                    current.engine = engine
                    self._current[index] = current
                    self._up_event.set()
                    if self._stopping.is_set():  # stopped while this one was starting
                        current.stop.set()
                    ledger.event("engine-up", engine=name)
                    await current.stop.wait()
                    if not current.killed:
                        self.statistics = _summed(self.statistics, engine.statistics())
                        self.duplicates.extend(engine.duplicates())
            self._current[index] = None
            if current.redeployed and not self._stopping.is_set():
                generation += 1  # closed gracefully (its runs handed back): the new code next
                continue
            if not current.killed:
                break
            ledger.event("engine-gone", engine=name)
            with trio.move_on_after(self.faults.engine_restart_delay):
                await self._stopping.wait()
            if self._stopping.is_set():
                break
            generation += 1
        done.set()

    def _up(self) -> list[EngineGeneration]:
        return [e for e in self._current if e is not None and not e.gone]

    async def live(self, turn: int = 0) -> EngineGeneration:
        """An engine now up (the ``turn``-th of them, round the ones up), waiting while none
        is."""
        while not (up := self._up()):
            await self._up_event.wait()
        return up[turn % len(up)]

    async def call(self, fn: Callable[[Engine], Awaitable[T]], turn: int = 0) -> T:
        """``await fn(engine)`` on an engine up (the ``turn``-th, as :meth:`live`); made again
        on the next one if that engine died or closed for a deploy meanwhile (its broker or
        engine error then says nothing about ``fn``). Any other exception is ``fn``'s."""
        while True:
            current = await self.live(turn)
            assert current.engine is not None
            try:
                return await fn(current.engine)
            except (BrokerError, EngineClosed):
                if not current.gone:
                    raise

    def kill(self, index: int) -> None:
        """Kill engine ``index`` abruptly (if it is up): its replacement starts
        ``engine_restart_delay`` later."""
        current = self._current[index]
        if current is None or current.killed or current.engine is None:
            return
        ledger = self.ledger
        ledger.fault_counts["engine-kill"] += 1
        ledger.event("fault", kind="engine-kill", process=current.injector.name)
        ledger.engine_kills.append(ledger.now())
        current.killed = True
        if not self._up():
            self._up_event = trio.Event()  # set by the next engine up
        current.injector.kill()
        current.store.dead = True
        self.statistics = _summed(self.statistics, current.engine.statistics())
        self.duplicates.extend(current.engine.duplicates())
        # An attempt the engine may have sent without recording it yet is sent again by its
        # replacement: one redelivery such a kill explains (at least once, results applied
        # once).
        for key in self.store.unconfirmed_dispatches():
            ledger.duplicate_pushes[key] += 1
        current.scope.cancel()
        current.stop.set()

    def deploy(self, index: int) -> None:
        """Replace engine ``index`` by one running :attr:`deployed_app`: the one up is closed
        gracefully (its runs handed back, taken over by its successor at start), a killed one's
        replacement starts on the new code."""
        self._deployed[index] = True
        self.ledger.event("deploy", engine=index)
        current = self._current[index]
        if current is not None and not current.killed:
            current.redeployed = True
            if not self._up():
                self._up_event = trio.Event()  # set by the next engine up
            current.stop.set()

    def heal(self) -> None:
        """No more per-call faults, for the engines up and every replacement."""
        self._healed = True
        for current in self._current:
            if current is not None:
                current.injector.quiet_down()

    async def stop(self) -> None:
        """Close every engine (no replacement from now on) and wait until they are closed."""
        self._stopping.set()
        for current in self._current:
            if current is not None:
                current.stop.set()
        for done in self._done:
            await done.wait()
