"""The simulation harness: an engine (or several), N workers and a memory broker in one
``trio.run`` under a virtual clock, with faults injected from one seed, and invariants checked
after every run.

::

    simulation (one trio.run, MockClock(autojump_threshold=0))
    ├── engines       one (or ``engines``) open_engine over its own FaultyBroker (delays,
    │                 drops, lost replies), sharing the one run store; each killed and
    │                 restarted under its engine_id, if the faults say so   (_sim_engines)
    ├── worker slots  one task per slot: a worker, killed / restarted / closed over and over,
    │                 each generation with its own FaultyBroker + FaultyKeyStore + instance id;
    │                 after each close (and a killed worker's key TTL), its liveness keys
    │                                                                       (_sim_workers)
    ├── workload      starts the runs at seeded arrival times, awaits each one's outcome
    │                                                                       (_sim_runs)
    └── faults        the seeded schedule: kill, graceful restart, pause renewal, stall
                                                                            (_sim_faults)

Each part records what it does in one ledger (``_sim_ledger``: the history, every fault and
the window of time it explains, every step execution); after the run the invariants
(``_sim_invariants``) are checked over it, and the report is built from it.

Everything random comes from the seed: arrival times, inputs (through the workload callable),
the fault schedule, every per-call fault draw, and — for the duration of the run — trio's own
scheduler (it shuffles ready tasks with a module-level generator, which the harness seeds and
restores afterwards). Ids are deterministic (``run-00042``, worker ``w1-3``, engine
``engine``). So one seed gives one history, byte for byte.
"""

from __future__ import annotations

import os
import random
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio
import trio.testing

from .._naming import QueueNames
from ..brokers.memory import MemoryBroker
from ..keys.memory import MemoryKeyStore
from ._determinism import seeded_scheduler
from ._report import Faults, InvariantViolation, SimulationReport
from ._sim_engines import Engines, RecordingStore
from ._sim_faults import FaultSchedule
from ._sim_invariants import Invariants
from ._sim_ledger import Ledger
from ._sim_retention import RetentionCheck
from ._sim_runs import Runs
from ._sim_schedules import check_schedule_ticks
from ._sim_workers import WorkerSlots, close_bound

if TYPE_CHECKING:
    from .._engine import App

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

_HOUR = 3600.0


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
        signals: (issue 18) ``(rng, workflow, input) -> [(delay, name, payload), ...]``: the
            signals sent to each run, ``delay`` virtual seconds after its start; the invariant
            "each signal consumed once, in order per name" is then checked.
        updates: (issue 34) ``(rng, workflow, input) -> [(delay, name, payload, value),
            ...]``: the updates sent to each run (``engine.update`` with an id of their own,
            again through the next engine if one dies), each once the one before returned and
            no sooner than ``delay`` virtual seconds after its start; each must return
            ``value``, and the invariant "each update applied once, in order" is checked.
        cancels: (issue 18) ``(rng, workflow, input) -> delay or None``: each run cancelled
            (``engine.cancel``) ``delay`` virtual seconds after its start, or not; the
            invariants of a cancel (``_sim_cancels.py``) are then checked.
        deploy: (issue 18) ``(new_app, at, stagger)``: a rolling deploy of new workflow code
            (``ctx.patched``): ``at`` virtual seconds in, each engine in turn is closed
            gracefully and replaced by one running ``new_app``, ``stagger`` seconds apart,
            after each worker the same way (step code first; a remote workflow's code is the
            workers'). A process killed later restarts on the code of its turn. No run may then
            fail with ``NonDeterminismError``.
        batched: the shared memory broker batches its finalizes as Redis and SQLite do
            (``coalesce_finalize``), so the workers' finalizes claim their next jobs in the
            same call (``SupportsFinishAndClaim``), under the faults given.
        tags: (issue 34) ``(workflow, input) -> tags`` each run is started with.

    Retention (issue 34): with ``engine_options={"retention": ...}`` (or a workflow's own
    ``retention=``) the engines prune finished runs as they go; the simulation then lingers
    after its drain until every run is due and checks the invariants of ``_sim_retention``
    (nothing unfinished pruned, a pruned run gone with all its records, every due run pruned).
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
        signals: Any = None,
        updates: Any = None,
        cancels: Any = None,
        deploy: tuple[App, float, float] | None = None,
        batched: bool = False,
        tags: Callable[[str, Any], dict[str, str]] | None = None,
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
        self.signals = signals
        self.updates = updates
        self.cancels = cancels
        self.deploy = deploy
        self.batched = batched
        self.tags = tags
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
        """A fresh world: the shared run store, broker and key store, and the parts over them."""
        store = RecordingStore()
        broker = MemoryBroker()
        if self.batched:
            broker.coalesce_finalize = True  # (one instance: the class stays unbatched)
        keys = MemoryKeyStore()
        namespace = (
            self.transport_options.get("namespace")
            or self.engine_options.get("namespace")
            or self.app.name
        )
        names = QueueNames(str(namespace))
        ledger = Ledger(transport_options=self.transport_options)
        engines = Engines(
            self.app,
            store,
            broker,
            keys,
            ledger,
            seed=self.seed,
            count=self.engine_count,
            faults=self.faults,
            engine_options=self.engine_options,
            transport_options=self.transport_options,
        )
        deploy = getattr(self, "deploy", None)
        engines.deployed_app = deploy[0] if deploy is not None else None
        workers = WorkerSlots(
            self.app,
            broker,
            keys,
            names,
            ledger,
            seed=self.seed,
            count=self.worker_count,
            concurrency=self.concurrency,
            faults=self.faults,
            transport_options=self.transport_options,
        )
        runs = Runs(
            self.workload,
            seed=self.seed,
            count=self.runs,
            duration=self.duration,
            engines=engines,
            ledger=ledger,
        )
        self._ledger, self._engines, self._workers, self._runs = ledger, engines, workers, runs
        runs.signals = getattr(self, "signals", None)
        runs.updates = getattr(self, "updates", None)
        runs.cancels = getattr(self, "cancels", None)
        runs.tags = getattr(self, "tags", None)
        self._store, self._broker = store, broker
        self._retention = RetentionCheck(
            self.app, self.engine_options, self.faults.engine_restart_delay
        )
        self._schedule = FaultSchedule(
            seed=self.seed,
            faults=self.faults,
            duration=self.duration,
            workers=workers,
            engines=engines,
        )
        self._invariants = Invariants(
            ledger,
            runs,
            store,
            broker,
            expected_output=self.expected_output,
            transport_options=self.transport_options,
            engines=engines,
            engine_options=self.engine_options,
            engine_restart_delay=self.faults.engine_restart_delay,
        )

    @property
    def close_bound(self) -> float:
        """The longest a graceful worker close may take (``close_timeout`` plus a
        ``cleanup_timeout`` per cleanup phase)."""
        return close_bound(self.transport_options)

    # ------------------------------------------------------------------ the simulation

    async def _simulate(self) -> None:
        ledger, engines, workers, runs = self._ledger, self._engines, self._workers, self._runs
        ledger.start()
        ledger.event("begin", seed=self.seed, workers=self.worker_count, runs=self.runs)
        async with trio.open_nursery() as nursery:
            engines.start(nursery)
            await engines.live()
            slots_done = trio.Event()
            nursery.start_soon(workers.run, nursery, slots_done)
            async with trio.open_nursery() as started:
                started.start_soon(self._schedule.run, ledger.t0)
                if self.deploy is not None:
                    started.start_soon(self._roll_out, self.deploy[1], self.deploy[2])
                await runs.start(started)
                await trio.sleep_until(ledger.t0 + self.duration)
                self._heal()
                started.cancel_scope.deadline = ledger.t0 + self.duration + self.drain_timeout
            ledger.event("drained", unfinished=runs.unfinished)
            self._invariants.drained_at = ledger.now()
            self._invariants.drain_timeout = self.drain_timeout
            if self._retention.prunes:  # every run then due is pruned before the end
                ledger.event("linger", seconds=self._retention.linger)
                await trio.sleep(self._retention.linger)
            workers.stop()
            await slots_done.wait()
            await engines.stop()
            await self._invariants.collect()
            if self._retention.prunes:
                self._retention.check(self._store, self._broker, sorted(runs.inputs), ledger)
            await check_schedule_ticks(
                self.app, self._engines.store, ledger, self.engine_options, self.duration
            )
            if self.signals is not None:
                from ._sim_signals import check_signals

                await check_signals(self._store, sorted(runs.inputs), ledger)
            if self.updates is not None:
                from ._sim_updates import check_updates

                await check_updates(self._store, sorted(runs.inputs), ledger)
            if self.deploy is not None:
                for run_id, (status, error) in sorted(runs.outcomes.items()):
                    if isinstance(error, dict) and error.get("type") == "NonDeterminismError":
                        ledger.violation(f"{run_id}: {status} by the deploy: {error!r}")
            if self.cancels is not None:
                from ._sim_cancels import check_cancels

                await check_cancels(self._store, runs.outcomes, runs.asked, ledger)
            # keep the key checks scheduled by the last closes (the nursery waits for them)
        ledger.end = ledger.now()
        ledger.event("end")

    async def _roll_out(self, at: float, stagger: float) -> None:
        """The rolling deploy: each worker, then each engine, replaced by the new code in
        turn, ``stagger`` seconds apart (step code reaches the workers before workflow code
        reaches the engines; a remote workflow's code is the workers')."""
        assert self.deploy is not None
        await trio.sleep_until(self._ledger.t0 + at)
        self._ledger.event("deploy", workers=self.worker_count, engines=self.engine_count)
        self._workers.app = self.deploy[0]  # each worker's next generation runs it
        for index in range(self.worker_count):
            self._workers.strike(index, "restart", 0.0)  # a graceful close, then the new code
            await trio.sleep(stagger)
        for index in range(self.engine_count):
            self._engines.deploy(index)
            await trio.sleep(stagger)

    def _heal(self) -> None:
        """Stop every fault: the runs still going get the drain time to finish."""
        self._engines.heal()
        self._workers.heal()
        self._ledger.event("healed")

    # ------------------------------------------------------------------ the report

    def _report(self, wall: float) -> SimulationReport:
        self._invariants.check()
        ledger, runs, workers = self._ledger, self._runs, self._workers
        peaks = ledger.limit_peaks(self.app)  # (a violation for a limit exceeded)
        rate_peaks = ledger.rate_peaks(self.app)  # (a violation for a rate exceeded)
        statuses = Counter(status for status, _ in runs.outcomes.values())
        executions = sum(len(e) for e in ledger.executions.values())
        assert self._engines.statistics is not None
        return SimulationReport(
            seed=self.seed,
            workers=self.worker_count,
            duration=self.duration,
            virtual_seconds=ledger.end,
            wall_seconds=wall,
            runs_started=len(runs.inputs),
            runs_completed=statuses["completed"],
            runs_failed=statuses["failed"],
            runs_cancelled=statuses["cancelled"],
            runs_unfinished=runs.unfinished,
            step_executions=executions,
            duplicate_executions=executions - len(ledger.executions),
            lost_leases=workers.lost_leases,
            faults=dict(sorted(ledger.fault_counts.items())),
            errors_reported=dict(sorted(ledger.errors.items())),
            graceful_closes=len(workers.closes),
            longest_close=max(workers.closes, default=0.0),
            close_bound=self.close_bound,
            engine=self._engines.statistics,
            violations=tuple(ledger.violations),
            history=tuple(ledger.history),
            replay_command=self.replay_command(),
            concurrency_peaks=peaks,
            rate_peaks=rate_peaks,
        )
