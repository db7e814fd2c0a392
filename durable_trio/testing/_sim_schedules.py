"""The simulation's schedule invariant (issue 18, item 4): each tick of each of the app's
schedules started exactly once, and none missed while an engine was up to see it on time.

Run ids are ``sched:{name}:{tick}`` and the store creates each once, so "at most once" is
that every scheduled run's tick is on the schedule's calendar (none invented or shifted);
"none missed" is that every tick, from the schedule's creation to the end of the simulated
time, at which some engine was up (for a second after it) has its run. A tick while no engine
was up may be missing (the ``skip`` policy); one that started (well before the end) must have
ended.

Overlap policies (issue 33, item 5): under any but ``allow``, a tick may also be missing while a
run of its schedule was unfinished (skipped, or dropped beside a buffered one); and under
``skip`` no two runs of one schedule were ever unfinished at once (each run, from its creation
to its end in the store, ends before the next one is created).
"""

from __future__ import annotations

import datetime
import itertools
import math
from typing import TYPE_CHECKING, Any

import trio

from .._engine._records import RunStatus
from .._engine._schedules import Schedule
from .._engine._wall_clock import follow_the_timers, virtual_wall_clock
from .._errors import ConfigError

if TYPE_CHECKING:
    from .._engine._app import App
    from .._engine._stores import RunStore
    from ._sim_ledger import Ledger

__all__ = ["check_schedule_ticks"]

#: A scheduled run started this long before the end of the faulted time must have ended (the
#: simulation stops once the workload's runs are done, maybe with a scheduled one in flight).
_SETTLE = 300.0
#: A tick counts as seen by an engine up from it for this long (virtual seconds).
_SEEN_WITHIN = 1.0


def _up_intervals(ledger: Ledger, end: float) -> list[tuple[float, float]]:
    """(up, gone) of every engine generation, in ledger time."""
    opened: dict[str, float] = {}
    intervals = []
    for event in ledger.history:
        if event["ev"] == "engine-up":
            opened[event["engine"]] = event["t"]
        elif event["ev"] == "engine-gone" and event["engine"] in opened:
            intervals.append((opened.pop(event["engine"]), event["t"]))
    intervals.extend((start, end) for start in opened.values())
    return intervals


def _check_one_at_once(ledger: Ledger, name: str, spans: list[tuple[float, float]]) -> None:
    """Under ``skip``: each run ended before the next one was created."""
    for (_, ended), (created, _) in itertools.pairwise(spans):
        if created < ended:
            ledger.violation(
                f"schedule {name!r} (overlap skip) had two runs at once: one created at "
                f"t={created:.3f} while another ran until t={ended:.3f}"
            )


def _tick_of(name: str, run_id: str) -> float:
    stamp = run_id.removeprefix(f"sched:{name}:").replace("Z", "+00:00")
    return datetime.datetime.fromisoformat(stamp).timestamp()


async def check_schedule_ticks(
    app: App, store: RunStore, ledger: Ledger, engine_options: dict[str, Any], until: float
) -> None:
    """Add a violation to ``ledger`` for every tick started twice, invented, missed while an
    engine was up (before ``until``: the end of the faulted time, ledger time), or never
    ended.
    The calendar is ``engine_options``'s ``wall_clock``, or the engines' default: the memory
    store under the simulation's ``MockClock`` makes it ``virtual_wall_clock()``."""
    if not app.schedules:
        return
    wall_clock = engine_options.get("wall_clock", follow_the_timers)
    if wall_clock is follow_the_timers:
        wall_clock = virtual_wall_clock()
    offset = wall_clock() - (trio.current_time() - ledger.t0)  # wall = ledger time + offset
    intervals = _up_intervals(ledger, ledger.now())
    stored = {name: spec for name, spec, _ in await store.get_schedules()}
    runs = await store.list_runs(limit=1_000_000)
    for name in app.schedules:
        spec = stored.get(name)
        if spec is None:
            ledger.violation(f"schedule {name!r} was never stored")
            continue
        try:
            schedule = Schedule.loads(name, spec)
        except ConfigError as exc:
            ledger.violation(f"schedule {name!r} is damaged in the store: {exc}")
            continue
        assert schedule.created_at is not None
        mine = [r for r in runs if r.run_id.startswith(f"sched:{name}:")]
        ticks = {_tick_of(name, r.run_id) for r in mine}
        # Each run's (created, ended) in ledger time (the memory store's clock is trio's).
        spans = sorted(
            (r.created_at - ledger.t0, r.updated_at - ledger.t0 if r.status.terminal else math.inf)
            for r in mine
        )
        if schedule.overlap == "skip":
            _check_one_at_once(ledger, name, spans)
        for run in mine:
            started = _tick_of(name, run.run_id) - offset
            ended = run.status in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED)
            if started <= until - _SETTLE and not ended:
                ledger.violation(f"scheduled run {run.run_id} never ended ({run.status})")
        expected = []
        for tick in schedule.ticks_back(ledger.now() + offset):
            if tick <= schedule.created_at:
                break
            expected.append(tick)
        calendar = set(expected)
        for tick in sorted(ticks - calendar):
            ledger.violation(f"schedule {name!r} started a tick not on its calendar: {tick}")
        for tick in sorted(calendar - ticks):
            at = tick - offset
            if schedule.overlap != "allow" and any(c <= at <= e + _SEEN_WITHIN for c, e in spans):
                continue  # a run of the schedule was unfinished: skipped (or dropped)
            if at <= until and any(a <= at and at + _SEEN_WITHIN <= b for a, b in intervals):
                ledger.violation(
                    f"schedule {name!r} missed its tick at t={at:.3f} while an engine was up"
                )
        ledger.event("schedule-ticks", schedule=name, started=len(ticks), due=len(calendar))
