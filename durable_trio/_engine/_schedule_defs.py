"""A schedule's definition (:class:`Schedule`: validated, stored as JSON, its calendar), its
overlap state as stored (:class:`OverlapState`, read by ``_schedule_overlap``) and what
:meth:`Schedules.list` and :meth:`Schedules.backfill` return.

Apart from :mod:`._schedules` (the engine's scheduler loop and ``engine.schedules``, imported
with every engine) so that an engine whose app and store hold no schedule never builds these
classes (attrs building them was ~6 M instructions of every app's imports): imported by the
first schedule declared, added, listed or read from the store. :mod:`._schedules` re-exports
the names.
"""

from __future__ import annotations

import datetime
import math
import re
from typing import TYPE_CHECKING, Any, Final, Literal

import attrs
import orjson

from .._attrs_shared import shared_eq, shared_hash, shared_repr
from .._errors import ConfigError
from ._payloads import to_json
from ._records import normalize_json

if TYPE_CHECKING:
    from collections.abc import Iterator


__all__ = [
    "CATCH_UP_POLICIES",
    "LATEST_TIME",
    "MAX_CATCH_UP",
    "MAX_EVERY",
    "MIN_EVERY",
    "OVERLAP_POLICIES",
    "BackfillTick",
    "CatchUp",
    "Overlap",
    "OverlapState",
    "Schedule",
    "ScheduleInfo",
]

CatchUp = Literal["skip", "once", "all"]
#: What a schedule does with ticks missed while no engine ran (see :class:`Schedule`).
CATCH_UP_POLICIES: Final = ("skip", "once", "all")
Overlap = Literal["skip", "buffer_one", "allow", "cancel_other"]
#: What a tick does while the schedule's previous run is unfinished (see :class:`Schedule`).
OVERLAP_POLICIES: Final = ("skip", "buffer_one", "allow", "cancel_other")
_NAME = r"^[A-Za-z0-9_.\-]{1,200}$"  # (re caches it compiled, on first use)
#: The shortest ``every`` (seconds): each tick is a durable run (a store write and a driver),
#: so a sub-second period is a load generator, not a schedule.
MIN_EVERY: Final = 1.0
#: The longest ``every`` (seconds, 366 days): longer calendars are cron's, and ticks stay
#: dates a ``datetime`` can name (``every=1e12`` would put the next tick past year 9999).
MAX_EVERY: Final = 366 * 86_400.0
#: The span of a stored time (``created_at``, a last tick): from the Unix epoch to the end of
#: year 9999 (the last instant ``datetime`` names); outside it, the row is damaged.
LATEST_TIME: Final = 253_402_300_799.0
#: The most ticks ``catch_up="all"`` starts at once (``max_catch_up``): one pass of the
#: scheduler starts them one after another, the other schedules waiting (a stored row asking
#: more is read as this many: docs/decisions.md).
MAX_CATCH_UP: Final = 1000
#: The most skipped ticks an overlap state counts (a stored count past it is damaged: read as
#: none, where one more would overflow the JSON encoder's 64-bit integers).
_MOST_SKIPPED: Final = 2**53


def _is_stored_time(value: Any) -> bool:
    """Whether ``value`` is a time a stored schedule may hold: a number from the Unix epoch to
    :data:`LATEST_TIME` (NaN and the infinities are outside)."""
    return (
        not isinstance(value, bool) and isinstance(value, int | float) and 0 <= value <= LATEST_TIME
    )


def _check_time(name: str, what: str, value: Any) -> float:
    """``value`` as a stored time of schedule ``name``, or ``ConfigError`` (damaged)."""
    if not _is_stored_time(value):
        raise ConfigError(f"stored schedule {name!r} has a bad {what} {value!r}")
    return float(value)


@attrs.frozen(kw_only=True, repr=False, eq=False)
class Schedule:
    """A schedule's definition (validated: build one with :meth:`make`)."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    name: str
    workflow: str
    cron: str | None = None
    """A 5-field cron expression (``cronsim``: also ``L``, ``W``, ``#``, ``@daily``...)."""
    every: float | None = None
    """Or: seconds between ticks, aligned on the Unix epoch (tick = k * every)."""
    input: Any = None
    timezone: str = "UTC"
    """The IANA zone the cron expression reads its calendar in."""
    catch_up: CatchUp = "skip"
    """Ticks missed while no engine ran (older than ``schedule_grace``): ``skip`` them,
    run ``once`` (the latest), or run ``all`` (the latest ``max_catch_up`` of them)."""
    max_catch_up: int = 10
    overlap: Overlap = "skip"
    """A tick while the run of the schedule's previous tick is unfinished: ``skip`` it
    (counted), ``buffer_one`` (it starts when that run ends; at most one waits, later ones
    are dropped), ``allow`` (runs stack), ``cancel_other`` (cancel that run, then start)."""
    paused: bool = False
    created_at: float | None = None
    """Wall-clock time it was first stored: its first tick is the first after this."""

    @classmethod
    def make(
        cls,
        name: Any,
        workflow: Any,
        *,
        cron: Any = None,
        every: Any = None,
        input: Any = None,
        timezone: Any = "UTC",
        catch_up: Any = "skip",
        max_catch_up: Any = 10,
        overlap: Any = "skip",
        paused: bool = False,
        created_at: float | None = None,
    ) -> Schedule:
        """Validate and build a schedule.

        Raises:
            ConfigError: a bad name, cron expression, time zone, ``every`` (not a number of
                seconds from :data:`MIN_EVERY`, 1, to :data:`MAX_EVERY`, 366 days), both or
                neither of ``cron``/``every``, catch-up policy, ``max_catch_up`` or overlap
                policy, or an input that is not JSON.
        """
        if not isinstance(name, str) or not re.match(_NAME, name):
            raise ConfigError(
                f"a schedule name is 1-200 letters, digits, '_', '.', '-', got {name!r}"
            )
        if not isinstance(workflow, str) or not workflow:
            raise ConfigError(f"schedule {name!r}: workflow must be a workflow name")
        if (cron is None) == (every is None):
            raise ConfigError(f"schedule {name!r}: give cron= or every= (one of them)")
        if every is not None and (
            isinstance(every, bool)
            or not isinstance(every, int | float)
            or not math.isfinite(every)
            or not MIN_EVERY <= every <= MAX_EVERY
        ):
            raise ConfigError(
                f"schedule {name!r}: every must be seconds from {MIN_EVERY:g} to "
                f"{MAX_EVERY:.0f} (366 days; cron= for longer), got {every!r}"
            )
        if not isinstance(timezone, str) or not timezone:
            raise ConfigError(f"schedule {name!r}: timezone must be an IANA name")
        # zoneinfo (and its tzpath's sysconfig) when a schedule is made, not at import.
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            zone = ZoneInfo(timezone)
        except (ZoneInfoNotFoundError, ValueError) as exc:
            raise ConfigError(f"schedule {name!r}: unknown timezone {timezone!r}") from exc
        if cron is not None:
            if not isinstance(cron, str):
                raise ConfigError(f"schedule {name!r}: cron must be a str, got {cron!r}")
            from cronsim import CronSim, CronSimError  # (a cron schedule only)

            try:
                CronSim(cron, datetime.datetime.now(zone))
            except CronSimError as exc:
                raise ConfigError(f"schedule {name!r}: bad cron {cron!r}: {exc}") from exc
        if catch_up not in CATCH_UP_POLICIES:
            raise ConfigError(
                f"schedule {name!r}: catch_up is one of {CATCH_UP_POLICIES}, got {catch_up!r}"
            )
        if (
            isinstance(max_catch_up, bool)
            or not isinstance(max_catch_up, int)
            or not 1 <= max_catch_up <= MAX_CATCH_UP
        ):
            raise ConfigError(
                f"schedule {name!r}: max_catch_up must be an int from 1 to {MAX_CATCH_UP}, "
                f"got {max_catch_up!r}"
            )
        if overlap not in OVERLAP_POLICIES:
            raise ConfigError(
                f"schedule {name!r}: overlap is one of {OVERLAP_POLICIES}, got {overlap!r}"
            )
        return cls(
            name=name,
            workflow=workflow,
            cron=cron,
            every=None if every is None else float(every),
            input=normalize_json(to_json(input), f"the input of schedule {name!r}"),
            timezone=timezone,
            catch_up=catch_up,
            max_catch_up=max_catch_up,
            overlap=overlap,
            paused=bool(paused),
            created_at=created_at,
        )

    # -- stored form ---------------------------------------------------------------------------

    def dumps(self) -> str:
        """Its stored JSON text."""
        return orjson.dumps(
            {
                "workflow": self.workflow,
                "cron": self.cron,
                "every": self.every,
                "input": self.input,
                "timezone": self.timezone,
                "catch_up": self.catch_up,
                "max_catch_up": self.max_catch_up,
                "overlap": self.overlap,
                "paused": self.paused,
                "created_at": self.created_at,
            }
        ).decode()

    @classmethod
    def loads(cls, name: str, text: str) -> Schedule:
        """Read a stored schedule.

        Raises:
            ConfigError: damaged (not JSON, or not a valid schedule).
        """
        try:
            data = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise ConfigError(f"stored schedule {name!r} is not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"stored schedule {name!r} is not an object")
        created = data.get("created_at")
        if created is not None:
            created = _check_time(name, "created_at", created)
        paused = data.get("paused", False)
        if not isinstance(paused, bool):
            raise ConfigError(f"stored schedule {name!r} has a bad paused {paused!r}")
        try:
            return cls._from_stored(name, data, created, paused)
        except ConfigError as exc:
            raise ConfigError(f"stored schedule {name!r} is damaged ({exc})") from exc

    @classmethod
    def _from_stored(
        cls, name: str, data: dict[str, Any], created: float | None, paused: bool
    ) -> Schedule:
        return cls.make(
            name,
            data.get("workflow"),
            cron=data.get("cron"),
            every=data.get("every"),
            input=data.get("input"),
            timezone=data.get("timezone", "UTC"),
            catch_up=data.get("catch_up", "skip"),
            max_catch_up=_at_most_catch_up(data.get("max_catch_up", 10)),
            # A row stored before overlap policies: the default (docs/decisions.md).
            overlap=data.get("overlap", "skip"),
            paused=paused,
            created_at=created,
        )

    @classmethod
    def load_row(cls, name: str, text: str, last: Any) -> Schedule:
        """Read a stored schedule and check its last tick (``None``: none yet): the one way
        the scheduler and :meth:`Schedules.list` read a row, so a row written by hand or
        damaged on disk is a ``ConfigError`` for both, never an arithmetic error later.

        Raises:
            ConfigError: damaged (see :meth:`loads`), or a last tick that is not a time.
        """
        if last is not None:
            _check_time(name, "last tick", last)
        return cls.loads(name, text)

    def same_definition(self, other: Schedule) -> bool:
        """Whether ``other`` defines the same ticks and run (state aside)."""
        mine = attrs.evolve(self, paused=False, created_at=None)
        return bool(mine == attrs.evolve(other, paused=False, created_at=None))

    # -- the calendar -----------------------------------------------------------------------

    def ticks_back(self, at: float) -> Iterator[float]:
        """Its ticks at or before ``at``, newest first (unbounded: the caller stops)."""
        if self.every is not None:
            k = math.floor(at / self.every)
            while True:
                yield k * self.every
                k -= 1
        assert self.cron is not None
        from zoneinfo import ZoneInfo

        zone = ZoneInfo(self.timezone)
        # cronsim gives the ticks strictly before a time; ticks are whole seconds.
        start = datetime.datetime.fromtimestamp(math.floor(at) + 1, zone)
        from cronsim import CronSim

        for moment in CronSim(self.cron, start, reverse=True):
            yield moment.timestamp()

    def next_after(self, at: float) -> float | None:
        """Its first tick strictly after ``at`` (``None``: the expression has no more)."""
        if self.every is not None:
            return (math.floor(at / self.every) + 1) * self.every
        assert self.cron is not None
        from zoneinfo import ZoneInfo

        zone = ZoneInfo(self.timezone)
        start = datetime.datetime.fromtimestamp(math.floor(at), zone)
        from cronsim import CronSim

        for moment in CronSim(self.cron, start):
            return moment.timestamp()
        return None  # pragma: no cover (cronsim raises StopIteration only past year 2099)

    def due(self, last: float | None, now: float, grace: float) -> tuple[list[float], float | None]:
        """The ticks to start now, oldest first, and the newest due tick (to record).

        Due ticks are those after ``last`` (the last tick handled; ``None``: after
        ``created_at``) and at or before ``now``. Those at most ``grace`` seconds old are on
        time and start (at most ``max_catch_up`` of them); older ones were missed: ``skip``
        drops them, ``once`` starts the newest missed tick (whether or not a tick is on time
        beside it), ``all`` starts the newest ``max_catch_up`` due ticks.
        """
        anchor = last if last is not None else self.created_at
        if anchor is None:
            return [], None
        chosen: list[float] = []
        newest: float | None = None
        missed_started = False
        for tick in self.ticks_back(now):
            if tick <= anchor or len(chosen) >= self.max_catch_up:
                break
            if newest is None:
                newest = tick
            if now - tick <= grace or self.catch_up == "all":
                chosen.append(tick)  # on time (or every missed one, under "all")
            elif self.catch_up == "once" and not missed_started:
                chosen.append(tick)  # the latest missed tick, beside any on-time ones
                missed_started = True
            else:
                break  # (skip; once, after its one) older ticks are missed too: none starts
        chosen.reverse()
        return chosen, newest


@attrs.frozen(kw_only=True, repr=False, eq=False)
class ScheduleInfo:
    """A stored schedule as :meth:`Schedules.list` shows it."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    name: str
    schedule: Schedule | None
    """``None``: the stored schedule is damaged (``error`` says how)."""
    last_tick: float | None
    next_tick: float | None
    error: str | None = None
    skipped: int = 0
    """Ticks that started nothing under its overlap policy (see :class:`Schedule`)."""
    buffered: float | None = None
    """The tick waiting for the previous run to end (``buffer_one``), or ``None``."""


@attrs.frozen(kw_only=True, repr=False, eq=False)
class BackfillTick:
    """One tick of a backfill (:meth:`Schedules.backfill`)."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    tick: float
    run_id: str
    started: bool
    """Whether the backfill started its run (``False``: the run existed: the schedule or an
    earlier backfill started it); with ``dry_run``, whether it would."""


def _at_most_catch_up(value: Any) -> Any:
    """A stored ``max_catch_up`` past :data:`MAX_CATCH_UP` (a row stored before the bound, or
    damaged) read as the bound; anything else as stored (``Schedule.make`` checks it)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > MAX_CATCH_UP:
        return MAX_CATCH_UP
    return value


def _tick(value: Any) -> float | None:
    """A stored tick of an overlap state; one that is no time a calendar has (past year 9999,
    before 1970, not finite: damaged) reads as none."""
    return float(value) if _is_stored_time(value) else None


@attrs.frozen(repr=False, eq=False)
class OverlapState:
    """A schedule's overlap state, as stored (JSON text)."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    started: float | None = None
    """The tick of the newest run the scheduler started (``None``: none yet)."""
    buffered: float | None = None
    """The tick waiting for the unfinished run to end (``buffer_one``)."""
    skipped: int = 0
    """Ticks that started nothing (``skip``; dropped by ``buffer_one``; superseded by
    ``cancel_other`` within one catch-up)."""

    @classmethod
    def loads(cls, text: str | None) -> OverlapState:
        """Read a stored state; a missing or damaged one reads as a fresh state (the runs,
        checked by id, are the truth: a lost state can at worst let one tick overlap)."""
        if text is None:
            return cls()
        try:
            data = orjson.loads(text)
        except orjson.JSONDecodeError:
            return cls()
        if not isinstance(data, dict):
            return cls()
        skipped = data.get("skipped", 0)
        if isinstance(skipped, bool) or not isinstance(skipped, int):
            skipped = 0
        if not 0 <= skipped <= _MOST_SKIPPED:
            skipped = 0
        return cls(_tick(data.get("started")), _tick(data.get("buffered")), skipped)

    def merge(self, other: OverlapState) -> OverlapState:
        """This state with what ``other`` (read again from the store) knows newer: the newest
        tick started, a buffered tick (unless that one started since), the most skips."""
        started = max((t for t in (self.started, other.started) if t is not None), default=None)
        buffered = self.buffered if self.buffered is not None else other.buffered
        if buffered is not None and started is not None and buffered <= started:
            buffered = None
        return OverlapState(started, buffered, max(self.skipped, other.skipped))

    def dumps(self) -> str:
        return orjson.dumps(
            {"started": self.started, "buffered": self.buffered, "skipped": self.skipped}
        ).decode()
