"""Schedules (issue 18, item 4): workflow runs started on a cron calendar or every N seconds.

A schedule is stored in the run store (:meth:`RunStore.put_schedule` and friends) with its
state: paused, and the last tick handled. Every engine that reconciles runs the scheduler
loop (:class:`Scheduler`): it sleeps until the soonest next tick of the stored schedules
(re-reading them at least every ``schedule_recheck`` seconds, for schedules another engine or
the CLI added), then starts each due tick's run through the store's idempotent ``create_run``
under a run id fixed by the schedule and the tick (``sched:{name}:{tick, UTC ISO 8601}``):
several engines firing the same tick, or an engine killed mid-tick and another taking over,
make one run.

Times are the engine's wall clock (``EngineOptions.wall_clock``: by default the clock the run
store's durable timers follow, so :func:`virtual_wall_clock`, trio's virtual clock from a fixed
epoch, where they are virtual, and ``time.time`` elsewhere: ``_wall_clock``). Cron expressions
are evaluated by ``cronsim`` in the schedule's time zone (``zoneinfo``); see
``docs/engine.md``, "Schedules", for the DST and catch-up semantics.
"""

from __future__ import annotations

import datetime
import functools
import math
from typing import TYPE_CHECKING, Any, Final, Protocol

import attrs
import trio

from .._errors import BrokerError, ConfigError, PayloadError
from .._lazy import lazy_getattr
from .._logs import get_logger
from ._errors import EngineClosed, EngineError
from ._new_run import record_new_run
from ._schedule_overlap import OverlapGate
from ._stores._wakes import SCHEDULES, following, ring

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Mapping

    from trio_util import RepeatedEvent

    from ._options import EngineOptions
    from ._schedule_defs import (
        CATCH_UP_POLICIES,
        MAX_EVERY,
        MIN_EVERY,
        OVERLAP_POLICIES,
        BackfillTick,
        CatchUp,
        Overlap,
        Schedule,
        ScheduleInfo,
    )
    from ._stores import RunStore
else:
    #: The names of :mod:`._schedule_defs` this module re-exports: imported on first use
    #: (PEP 562), not with every engine.
    _DEFINITIONS = frozenset({
        "CATCH_UP_POLICIES", "MAX_EVERY", "MIN_EVERY", "OVERLAP_POLICIES", "BackfillTick",
        "CatchUp", "Overlap", "Schedule", "ScheduleInfo",
    })  # fmt: skip

    __getattr__ = lazy_getattr(globals(), dict.fromkeys(_DEFINITIONS, "._schedule_defs"))


class _App(Protocol):
    """What the scheduler reads of an :class:`App` (not imported: ``_app`` imports this)."""

    name: str

    @property
    def workflows(self) -> Mapping[str, object]: ...

    @property
    def schedules(self) -> Mapping[str, Schedule]: ...


class _Engine(Protocol):
    """What the scheduler uses of an :class:`Engine` (not imported: it imports this)."""

    @property
    def app(self) -> _App: ...

    @property
    def store(self) -> RunStore: ...

    @property
    def options(self) -> EngineOptions: ...

    def report(self, exc: BaseException) -> None: ...

    async def start(
        self, workflow: str, input: Any = None, *, run_id: str | None = None
    ) -> str: ...

    async def cancel(self, run_id: str, *, reason: str = "cancelled") -> bool: ...

    async def result(self, run_id: str) -> Any: ...


__all__ = [
    "CATCH_UP_POLICIES",
    "MAX_BACKFILL",
    "MAX_EVERY",
    "MIN_EVERY",
    "OVERLAP_POLICIES",
    "BackfillTick",
    "Schedule",
    "ScheduleInfo",
    "Scheduler",
    "Schedules",
    "schedule_options",
    "schedule_run_id",
]

#: The most ticks one backfill starts (:meth:`Schedules.backfill`): a wider range is refused.
MAX_BACKFILL: Final = 1000


_log = get_logger("durable_trio")

#: ``open_engine`` keywords that are the scheduler's :class:`EngineOptions`.
SCHEDULE_OPTIONS: Final = ("wall_clock", "schedule_grace", "schedule_recheck")


def schedule_options(keywords: dict[str, Any]) -> dict[str, Any]:
    """Take the scheduler's options out of ``keywords`` (``open_engine``'s)."""
    return {name: keywords.pop(name) for name in SCHEDULE_OPTIONS if name in keywords}


def schedule_run_id(name: str, tick: float) -> str:
    """The id of the run a schedule's tick starts: ``sched:{name}:{tick as UTC ISO 8601}``
    (microseconds only when the tick has them)."""
    moment = datetime.datetime.fromtimestamp(tick, datetime.UTC)
    spec = "seconds" if moment.microsecond == 0 else "microseconds"
    return f"sched:{name}:{moment.isoformat(timespec=spec).replace('+00:00', 'Z')}"


def _utc(moment: float) -> str:
    """A wall-clock time in an error message, as the commands print times (UTC, said)."""
    shown = datetime.datetime.fromtimestamp(moment, datetime.UTC)
    return shown.strftime("%Y-%m-%d %H:%M:%S UTC")


def _range_time(what: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"backfill: {what} must be a time (Unix seconds), got {value!r}")
    return float(value)


class Schedules:
    """The schedules of a namespace, in its run store: ``engine.schedules`` (and the
    ``durable-trio schedules`` command). Changes are seen by every engine of the namespace at
    once (the run store rings :data:`SCHEDULES`; a lost ring: within ``schedule_recheck``
    seconds).

    Args:
        store: the namespace's run store.
        wall_clock: the calendar time source (``time.time``).
        app: when given, ``add`` refuses a workflow the app does not register.
        on_change: called after each change (wakes the local scheduler).
        known: (without ``app``) the workflows the namespace's live engines run, from their
            keys (``known_workflows``; ``None``: no engine is live, nothing is known):
            ``list`` gives a schedule of another workflow an ``error``.
    """

    def __init__(
        self,
        store: RunStore,
        wall_clock: Callable[[], float],
        *,
        app: _App | None = None,
        on_change: Callable[[], None] | None = None,
        known: Collection[str] | None = None,
    ) -> None:
        self._store = store
        self._wall = wall_clock
        self._app = app
        self._on_change = on_change or (lambda: None)
        self._known = known

    async def add(
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
        replace: bool = False,
    ) -> bool:
        """Store schedule ``name``: each tick starts a run of ``workflow`` with ``input``.

        Its first tick is the first after now. ``replace``: overwrite an existing schedule
        of that name (its last tick is kept: no tick runs twice).

        Returns:
            Whether it was stored (``False``: the name exists and ``replace`` is false).

        Raises:
            ConfigError: bad input (see :meth:`Schedule.make`) or an unknown workflow.
        """
        from ._schedule_defs import Schedule

        schedule = Schedule.make(
            name, workflow, cron=cron, every=every, input=input, timezone=timezone,
            catch_up=catch_up, max_catch_up=max_catch_up, overlap=overlap,
            created_at=self._wall(),
        )  # fmt: skip
        self._check_workflow(schedule)
        stored: bool = await self._store.put_schedule(name, schedule.dumps(), replace=replace)
        await self._changed()
        return stored

    async def _changed(self) -> None:
        """Wake this process's scheduler, and ring every engine's (best-effort: a lost ring
        waits for their ``schedule_recheck``)."""
        self._on_change()
        await ring(self._store, SCHEDULES)

    def _check_workflow(self, schedule: Schedule) -> None:
        if self._app is not None and schedule.workflow not in self._app.workflows:
            raise ConfigError(
                f"schedule {schedule.name!r}: no workflow {schedule.workflow!r} in app "
                f"{self._app.name!r}"
            )

    async def list(self) -> list[ScheduleInfo]:
        """Every stored schedule, by name: a damaged one with its ``error`` (and no
        ``schedule``); one whose workflow the ``app`` does not register (without an app:
        that no live engine runs, per ``known``) with its ``error`` too (engines skip it)."""
        from ._schedule_defs import LATEST_TIME, OverlapState, Schedule, ScheduleInfo

        now = self._wall()
        infos = []
        rows = sorted(await self._store.get_schedules())
        states = await self._store.get_schedule_states() if rows else {}
        for name, text, last in rows:
            try:
                schedule = Schedule.load_row(name, text, last)
            except ConfigError as exc:
                shown = last if last is not None and 0 <= last <= LATEST_TIME else None
                infos.append(ScheduleInfo(name=name, schedule=None, last_tick=shown,
                                          next_tick=None, error=str(exc)))  # fmt: skip
                continue
            upcoming = None if schedule.paused else schedule.next_after(max(now, last or now))
            error = self._unknown(schedule.workflow)
            state = OverlapState.loads(states.get(name))
            info = ScheduleInfo(
                name=name, schedule=schedule, last_tick=last, next_tick=upcoming, error=error,
                skipped=state.skipped, buffered=state.buffered,
            )  # fmt: skip
            infos.append(info)
        return infos

    def _unknown(self, workflow: str) -> str | None:
        """Why ``workflow`` is unknown (``None``: known, or nothing to tell)."""
        if self._app is not None:
            if workflow in self._app.workflows:
                return None
            return f"unknown workflow: no {workflow!r} in app {self._app.name!r}"
        if self._known is None or workflow in self._known:
            return None
        return (
            f"unknown workflow: no live engine runs {workflow!r} "
            f"(they run: {', '.join(sorted(self._known)) or 'none'})"
        )

    async def get(self, name: str) -> ScheduleInfo | None:
        """One stored schedule, or ``None``."""
        for info in await self.list():
            if info.name == name:
                return info
        return None

    async def pause(self, name: str) -> bool:
        """Pause it: no tick starts until :meth:`resume` (ticks meanwhile are skipped).
        Returns whether it exists.

        Raises:
            ConfigError: the stored schedule is damaged (delete it, or add it again with
                ``replace``)."""
        return await self._set_paused(name, True)

    async def resume(self, name: str) -> bool:
        """Resume it: its next tick after now starts (ticks while paused never do).
        Returns whether it exists.

        Raises:
            ConfigError: the stored schedule is damaged (as :meth:`pause`)."""
        return await self._set_paused(name, False)

    async def _set_paused(self, name: str, paused: bool) -> bool:
        info = await self.get(name)
        if info is None:
            return False
        if info.schedule is None:
            raise ConfigError(f"{info.error}; delete it or add it again with replace")
        if not paused and info.schedule.paused:
            # Ticks that fell while it was paused are not "missed": mark them handled.
            newest = next(info.schedule.ticks_back(self._wall()), None)
            if newest is not None:
                await self._store.mark_schedule_tick(name, newest)
        changed = attrs.evolve(info.schedule, paused=paused)
        stored: bool = await self._store.put_schedule(name, changed.dumps(), replace=True)
        await self._changed()
        return stored

    async def backfill(
        self, name: str, start: float, end: float, *, dry_run: bool = False
    ) -> tuple[BackfillTick, ...] | None:
        """Start the runs of schedule ``name``'s ticks from ``start`` to ``end`` (both
        included; wall-clock Unix seconds, in the past), oldest first, each under its tick's
        run id (``sched:{name}:{tick}``): a tick whose run exists (the schedule started it,
        or an earlier backfill did) starts nothing, so backfilling a range again, or after
        an interrupted backfill, starts each tick exactly once. The runs are recorded
        pending (as ``engine.start(detach=True)``): an engine of the namespace takes each
        over. The overlap policy does not apply (every tick of the range starts), nor the
        catch-up policy, nor ``paused``; the schedule's last tick and overlap state are left
        as they are. ``dry_run``: start nothing, tell what would start.

        Returns:
            Each tick of the range (``None``: no such schedule).

        Raises:
            ConfigError: the stored schedule is damaged, its workflow unknown (with an
                ``app``), ``start``/``end`` not times, ``start > end``, ``end`` after now,
                or the range holds more than :data:`MAX_BACKFILL` (1,000) ticks.
            EngineError: a tick's run id exists as a run of another workflow.
        """
        start = _range_time("start", start)
        end = _range_time("end", end)
        if start > end:
            raise ConfigError(f"backfill: the start {_utc(start)} is after the end {_utc(end)}")
        now = self._wall()
        if end > now:
            raise ConfigError(
                f"backfill: the end {_utc(end)} is after now ({_utc(now)}): a backfill starts "
                "past ticks (the schedule starts the others)"
            )
        info = await self.get(name)
        if info is None:
            return None
        schedule = info.schedule
        if schedule is None:
            raise ConfigError(f"{info.error}; delete it or add it again with replace")
        self._check_workflow(schedule)
        ticks: list[float] = []
        for tick in schedule.ticks_back(end):
            if tick < start:
                break
            if len(ticks) == MAX_BACKFILL:
                raise ConfigError(
                    f"backfill: the range holds more than {MAX_BACKFILL} ticks of schedule "
                    f"{name!r}: backfill it in narrower ranges"
                )
            ticks.append(tick)
        ticks.reverse()
        from ._schedule_defs import BackfillTick

        done = []
        for tick in ticks:
            run_id = schedule_run_id(name, tick)
            if dry_run:
                started = await self._store.get_run(run_id) is None
            else:
                _, started = await record_new_run(
                    self._store, schedule.workflow, schedule.input, run_id=run_id,
                    owner=None, lease=0.0, timeout=None, parent=None,
                )  # fmt: skip
            done.append(BackfillTick(tick=tick, run_id=run_id, started=started))
        return tuple(done)

    async def delete(self, name: str) -> bool:
        """Delete it (runs it started stay). Returns whether it existed."""
        deleted: bool = await self._store.delete_schedule(name)
        await self._changed()
        return deleted


class Scheduler:
    """The scheduler loop of one engine (see the module docstring)."""

    def __init__(self, engine: _Engine, schedules: Schedules, changed: RepeatedEvent) -> None:
        self._engine = engine
        self._schedules = schedules
        self._changed = changed
        self._reported: set[tuple[str, str]] = set()
        self._unknown: dict[str, str] = {}
        """Schedule -> the workflow it names that the app does not register (warned of)."""
        self._registered = False
        self._gate = OverlapGate(engine, changed.set)

    async def start(self) -> None:
        """Store the app's declared schedules before the engine is handed out (a store
        outage: reported, and the loop tries again)."""
        try:
            await self.register_app_schedules()
            self._registered = True
        except BrokerError as exc:
            self._engine.report(exc)

    async def register_app_schedules(self) -> None:
        """Store the app's declared schedules: a new one is added; a stored one whose
        definition changed is replaced (keeping its paused state and last tick)."""
        store = self._engine.store
        wall = self._engine.options.wall_clock
        declared = self._engine.app.schedules
        if not declared:
            return
        from ._schedule_defs import Schedule

        stored = {name: text for name, text, _ in await store.get_schedules()}
        for name, schedule in declared.items():
            text = stored.get(name)
            if text is None:
                fresh = attrs.evolve(schedule, created_at=wall())
                await store.put_schedule(name, fresh.dumps(), replace=False)
                continue
            try:
                current = Schedule.loads(name, text)
            except ConfigError:
                current = None
            if current is None or not schedule.same_definition(current):
                kept = attrs.evolve(
                    schedule,
                    paused=current.paused if current else False,
                    created_at=current.created_at if current else wall(),
                )
                await store.put_schedule(name, kept.dumps(), replace=True)

    async def run(self) -> None:
        """Register the app's schedules, then start due ticks until cancelled."""
        # A schedule changed elsewhere (the CLI, the console, another engine): read the
        # schedules now, not at the next ``schedule_recheck``.
        with following(self._engine.store, SCHEDULES, self._changed.set):
            async with trio.open_nursery() as watchers:
                self._gate.watch_in = watchers
                await self._run()
                watchers.cancel_scope.cancel()

    async def _run(self) -> None:
        options = self._engine.options
        while not self._registered:
            try:
                await self.register_app_schedules()
                self._registered = True
            except BrokerError as exc:
                self._engine.report(exc)
                await trio.sleep(options.schedule_recheck)
        while True:
            try:
                soonest = await self.tick()
            except EngineClosed:  # closing: the tick stays unmarked for the next engine
                return
            now = options.wall_clock()
            delay = options.schedule_recheck
            if soonest is not None:
                delay = min(delay, max(0.0, soonest - now))
            with trio.move_on_after(delay):
                await self._changed.wait()

    def _report_once(self, name: str, exc: BaseException) -> None:
        key = (name, str(exc))
        if key not in self._reported:
            self._reported.add(key)
            self._engine.report(exc)

    def _warn_unknown(self, name: str, workflow: str) -> None:
        """One WARNING line per schedule (again only if it changes workflow): the app does not
        register its workflow, so this engine skips it (the engines of another app sharing
        the namespace may run it; ``durable-trio schedules list`` marks it when none does)."""
        if self._unknown.get(name) == workflow:
            return
        self._unknown[name] = workflow
        engine = self._engine
        _log.warning(
            "schedule %r names workflow %r, which app %r does not register: engine %s skips it",
            name, workflow, engine.app.name, engine.options.engine_id,
        )  # fmt: skip

    def _forget(self, name: str) -> None:
        """Schedule ``name`` worked: should it break again, that is reported again."""
        if self._reported:
            self._reported = {key for key in self._reported if key[0] != name}

    async def tick(self) -> float | None:
        """Start every due tick once; return the soonest next tick (wall clock)."""
        engine = self._engine
        options = engine.options
        try:
            rows = await engine.store.get_schedules()
        except BrokerError as exc:
            engine.report(exc)
            return None
        try:
            states = await engine.store.get_schedule_states() if rows else {}
        except BrokerError as exc:
            engine.report(exc)
            return None
        soonest: float | None = None
        if self._unknown:  # deleted schedules: warned of again should they come back
            present = {row[0] for row in rows}
            self._unknown = {n: w for n, w in self._unknown.items() if n in present}
        for name, text, last in rows:
            try:
                upcoming = await self._fire(name, text, last, states.get(name))
            except EngineClosed:
                raise
            except BrokerError as exc:
                engine.report(exc)
                upcoming = options.wall_clock() + options.schedule_recheck
            except (ConfigError, PayloadError, EngineError) as exc:
                # Damaged, an input or run id its workflow refuses: one schedule's fault,
                # reported (once) and skipped; the loop serves the others.
                self._report_once(name, exc)
                continue
            except (ValueError, ArithmeticError, TypeError) as exc:
                # Its calendar (or its state's encoding) failed on a row that passed the
                # checks: the same (no input may end the loop of every engine of the namespace).
                damaged = ConfigError(f"schedule {name!r}: its calendar failed ({exc!r}); skipped")
                self._report_once(name, damaged)
                continue
            else:
                self._forget(name)
            if upcoming is not None and (soonest is None or upcoming < soonest):
                soonest = upcoming
        return soonest

    async def _fire(
        self, name: str, text: str, last: float | None, state: str | None
    ) -> float | None:
        engine = self._engine
        options = engine.options
        from ._schedule_defs import Schedule

        schedule = Schedule.load_row(name, text, last)
        if schedule.paused:
            return None
        if schedule.workflow not in engine.app.workflows:
            self._warn_unknown(name, schedule.workflow)
            return None
        self._unknown.pop(name, None)
        now = options.wall_clock()
        ticks, newest = schedule.due(last, now, options.schedule_grace)
        if schedule.overlap != "allow":
            run_of = functools.partial(schedule_run_id, name)
            latest = lambda: next(schedule.ticks_back(options.wall_clock()), None)  # noqa: E731
            await self._gate.fire(name, schedule, ticks, last, state, run_of, latest)
        else:
            for tick in ticks:
                run_id = schedule_run_id(name, tick)
                await engine.start(schedule.workflow, schedule.input, run_id=run_id)
                await engine.store.mark_schedule_tick(name, tick)
        if newest is not None and (not ticks or newest > ticks[-1]):
            await engine.store.mark_schedule_tick(name, newest)
        base = max(now, newest if newest is not None else now)
        return schedule.next_after(base)
