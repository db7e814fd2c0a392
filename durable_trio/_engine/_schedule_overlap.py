"""Schedule overlap policies (issue 33, item 5): what a tick does while the run of the
schedule's previous tick is unfinished, as Temporal's ``ScheduleOverlapPolicy``.

- ``skip`` (the default): the tick starts nothing; it is counted (``skipped``) and logged.
- ``buffer_one``: the tick waits and starts when that run ends (its run id is still the
  tick's); at most one waits: a tick while one waits is dropped (counted as skipped).
- ``allow``: the tick starts (runs stack): the behaviour before overlap policies.
- ``cancel_other``: the unfinished run is cancelled (``engine.cancel``: a run driven here
  compensates, bounded by ``cancel_grace``), then the tick starts.

The scheduler keeps, per schedule, an :class:`OverlapState` (``_schedule_defs``) in the run store
(:meth:`RunStore.put_schedule_state`): the tick of the newest run it started, the tick buffered,
the count of ticks skipped. "The previous run" is the run of any of: that newest started tick, the
last tick handled, the buffered tick: so a state written late by a second engine firing the same
tick (its writes are last-writer-wins) still sees the run the first one started. Every decision
starts runs through ``engine.start`` under the tick's run id, so two engines that agree start one
run; they may disagree only when the previous run ends between their two reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import attrs

from .._errors import BrokerError
from .._logs import get_logger
from ._errors import EngineClosed, EngineError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    import trio

    from ._schedule_defs import OverlapState
    from ._stores import RunStore

__all__ = ["OverlapGate"]

_log = get_logger("durable_trio")


class _Schedule(Protocol):
    """What the gate reads of a :class:`Schedule` (not imported: ``_schedules`` imports this)."""

    @property
    def workflow(self) -> str: ...

    @property
    def input(self) -> Any: ...

    @property
    def overlap(self) -> str: ...


class _Engine(Protocol):
    """What the gate uses of an :class:`Engine`."""

    @property
    def store(self) -> RunStore: ...

    async def start(
        self, workflow: str, input: Any = None, *, run_id: str | None = None
    ) -> str: ...

    async def cancel(self, run_id: str, *, reason: str = "cancelled") -> bool: ...

    async def result(self, run_id: str) -> Any: ...


class OverlapGate:
    """One engine's scheduler's application of the overlap policies (see the module
    docstring). ``watch_in``: the nursery where it waits for the run a buffered tick waits
    on (to ``wake`` the scheduler the moment it ends); without one the scheduler's recheck
    finds it ended."""

    def __init__(self, engine: _Engine, wake: Callable[[], None]) -> None:
        self._engine = engine
        self._wake = wake
        self.watch_in: trio.Nursery | None = None
        self._watched: set[str] = set()

    async def fire(
        self,
        name: str,
        schedule: _Schedule,
        ticks: list[float],
        last: float | None,
        stored: str | None,
        run_of: Callable[[float], str],
        latest: Callable[[], float | None],
    ) -> None:
        """Handle the due ``ticks`` (oldest first) of ``schedule`` under its overlap policy,
        marking each handled; ``last``: its last tick handled before them; ``stored``: its
        stored state; ``latest``: the newest tick of its calendar now."""
        from ._schedule_defs import OverlapState  # (imported with the first schedule's tick)

        store = self._engine.store
        state = OverlapState.loads(stored)
        written = state
        if state.buffered is not None:
            state = await self._release(schedule, state, last, run_of)
        if schedule.overlap == "cancel_other" and len(ticks) > 1:
            # A catch-up of several ticks: each would cancel the one before; the newest starts.
            state = attrs.evolve(state, skipped=state.skipped + len(ticks) - 1)
            ticks = ticks[-1:]
        previous = last
        for tick in ticks:
            # Read again just before deciding: another engine (or this one, before a stall)
            # may have started a newer tick meanwhile; and the newest tick of the calendar now.
            fresh = OverlapState.loads((await store.get_schedule_states()).get(name))
            state = state.merge(fresh)
            busy = await self._unfinished(run_of, state.started, previous, state.buffered, latest())
            policy = schedule.overlap
            if await store.get_run(run_of(tick)) is not None:
                busy = []  # another engine started this tick: so did this one, by its id
            if busy and policy == "cancel_other":
                for run_id in busy:
                    await self._cancel(run_id, f"schedule {name!r}: tick {run_of(tick)} "
                                       "replaces it (overlap cancel_other)")  # fmt: skip
                busy = []
            if not busy:
                await self._engine.start(schedule.workflow, schedule.input, run_id=run_of(tick))
                state = attrs.evolve(state, started=tick)
            elif policy == "buffer_one" and state.buffered is None:
                state = attrs.evolve(state, buffered=tick)
                self._watch(busy)
            else:
                state = attrs.evolve(state, skipped=state.skipped + 1)
                _log.info(
                    "schedule %r: tick %s starts nothing: run %r is unfinished (overlap %s)",
                    name, run_of(tick), busy[0], policy,
                )  # fmt: skip
            if state != written:
                await store.put_schedule_state(name, state.dumps())
                written = state
            await store.mark_schedule_tick(name, tick)
            previous = tick
        if state != written:
            await store.put_schedule_state(name, state.dumps())

    async def _release(
        self,
        schedule: _Schedule,
        state: OverlapState,
        last: float | None,
        run_of: Callable[[float], str],
    ) -> OverlapState:
        """Start the buffered tick if the run it waits on ended (or note that another engine
        started it)."""
        assert state.buffered is not None
        buffered = run_of(state.buffered)
        if await self._engine.store.get_run(buffered) is None:
            busy = await self._unfinished(run_of, state.started, last, None)
            if busy:
                self._watch(busy)
                return state
            await self._engine.start(schedule.workflow, schedule.input, run_id=buffered)
        return attrs.evolve(state, started=state.buffered, buffered=None)

    async def _unfinished(self, run_of: Callable[[float], str], *ticks: float | None) -> list[str]:
        """The run ids of ``ticks`` whose run exists, unfinished."""
        found = []
        for run_id in dict.fromkeys(run_of(t) for t in ticks if t is not None):
            run = await self._engine.store.get_run(run_id)
            if run is not None and not run.status.terminal:
                found.append(run_id)
        return found

    async def _cancel(self, run_id: str, reason: str) -> None:
        try:
            await self._engine.cancel(run_id, reason=reason)
        except EngineClosed:
            raise
        except EngineError:  # gone meanwhile (RunNotFound): nothing to cancel
            pass

    def _watch(self, run_ids: Iterable[str]) -> None:
        nursery = self.watch_in
        if nursery is None:
            return
        for run_id in run_ids:
            if run_id not in self._watched:
                self._watched.add(run_id)
                nursery.start_soon(self._wait_end, run_id)

    async def _wait_end(self, run_id: str) -> None:
        try:
            await self._engine.result(run_id)
        except EngineClosed:
            return
        except (EngineError, BrokerError):  # it failed, was cancelled or is gone (or the
            pass  # store failed: the scheduler's recheck looks again)
        finally:
            self._watched.discard(run_id)
        self._wake()
