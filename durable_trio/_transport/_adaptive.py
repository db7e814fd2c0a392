"""Concurrency control (T6, docs/spec.md): a fixed limit, or an adaptive one moved by a latency
gradient.

The adaptive controller follows the idea of Netflix concurrency-limits' Gradient2 (with Vegas's
baseline): compare the latency of the latest tick (the short window) with the best latency seen
over the long window (the baseline, what a step costs without queueing). While the short window
stays within ``tolerance`` x the baseline, latency is not rising with load, so the limit grows by
about sqrt(limit) per tick; past it, the gradient (``tolerance x baseline / short``, floored at
0.5) shrinks the limit. Moves are smoothed. The limit never grows while the worker does not use
it (in-flight well under the limit), nor past a memory (RSS) bound or a saturated CPU.

Only step durations feed the gradient; workflow turns count as in-flight work only.
"""

from __future__ import annotations

import math
import os
import resource
import time
from collections import deque
from typing import TYPE_CHECKING

import attrs
import trio
from trio_util import periodic

from .._attrs_shared import shared_eq, shared_hash, shared_repr
from .._errors import ConfigError
from .._wire import WorkerStatus

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["Adaptive", "ConcurrencyController", "read_rss_bytes"]

#: The shortest window a fixed-limit worker's CPU figure is measured over (seconds).
_MIN_CPU_WINDOW = 1.0

#: Throughput is counted in one-second buckets, so what it keeps does not grow with the rate
#: (one counter a second, not one settle time a step); at most this many buckets are kept (the
#: longest ``throughput`` window, in seconds).
_THROUGHPUT_BUCKETS = 64


@attrs.frozen(kw_only=True, repr=False, eq=False)
class Adaptive:
    """Adaptive concurrency: the limit moves between ``min`` and ``max``.

    Attributes:
        min: the floor of the limit.
        max: the ceiling of the limit.
        initial: where the limit starts (``min`` when absent).
        tick: seconds between two moves of the controller.
        tolerance: how far the short window's latency may rise over the baseline before the
            limit is cut (1.3: 30 %, which keeps p95 within about 1.5x the unloaded latency).
        smoothing: weight of a new estimate against the current limit (0..1).
        long_window: ticks the baseline (the best tick's latency) is taken over (600: ten
            minutes at the default tick, long enough that queueing never becomes the baseline).
        max_rss_bytes: stop growing past this resident memory (``None``: no bound).
        max_cpu: stop growing when the process uses this fraction of one core or more.
    """

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    min: int = 1
    max: int = 64
    initial: int | None = None
    tick: float = 1.0
    tolerance: float = 1.3
    smoothing: float = 0.2
    long_window: int = 600
    max_rss_bytes: int | None = None
    max_cpu: float = 0.95

    def __attrs_post_init__(self) -> None:
        if not (1 <= self.min <= self.max):
            raise ConfigError(f"Adaptive needs 1 <= min <= max, got min={self.min} max={self.max}")
        if self.initial is not None and not (self.min <= self.initial <= self.max):
            raise ConfigError(
                f"Adaptive initial={self.initial} is outside [{self.min}, {self.max}]"
            )
        if self.tick <= 0 or self.tolerance < 1 or not (0 < self.smoothing <= 1):
            raise ConfigError("Adaptive needs tick > 0, tolerance >= 1 and 0 < smoothing <= 1")
        if self.long_window < 1:
            raise ConfigError("Adaptive long_window must be at least 1 tick")


#: RSS is the process's: every transport of a process shares one reading this young (seconds
#: of real time). A simulation runs many virtual workers in one process, hours a minute.
_RSS_MAX_AGE = 0.5
_rss_reading: tuple[float, int | None] = (-math.inf, None)


def read_rss_bytes() -> int | None:
    """This process's resident memory, from /proc where there is one (a reading is reused for
    up to half a second of real time)."""
    global _rss_reading
    now = time.monotonic()
    if now - _rss_reading[0] < _RSS_MAX_AGE:
        return _rss_reading[1]
    try:
        with open("/proc/self/statm", "rb") as statm:
            rss: int | None = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        rss = peak_kib * 1024 if peak_kib else None
    _rss_reading = (now, rss)
    return rss


class ConcurrencyController:
    """Owns the step concurrency limit and the figures of the worker status (T6).

    Args:
        concurrency: a fixed ``int`` or an :class:`Adaptive` policy.
        on_limit: called with the new limit whenever it moves (the transport wakes loops
            waiting for a slot at once).
        read_rss: how to read RSS (injectable for tests).
        read_cpu_time: process CPU seconds so far (injectable for tests).
    """

    def __init__(
        self,
        concurrency: int | Adaptive,
        *,
        on_limit: Callable[[int], None] = lambda _: None,
        read_rss: Callable[[], int | None] = read_rss_bytes,
        read_cpu_time: Callable[[], float] = time.process_time,
    ) -> None:
        self.policy = concurrency if isinstance(concurrency, Adaptive) else None
        if self.policy is not None:
            self.limit = self.policy.initial or self.policy.min
        else:
            assert isinstance(concurrency, int)
            self.limit = concurrency
        self._on_limit = on_limit
        self._read_rss = read_rss
        self._read_cpu_time = read_cpu_time
        self.in_flight = 0
        self.duplicates = 0
        self.last_adjustment: float | None = None
        # This tick's step durations as a sum and a count: the mean is all a tick reads, and a
        # list would grow for as long as nothing empties it (a fixed limit has no ticks).
        self._window_total = 0.0
        self._window_count = 0
        self._recent: deque[float] = deque(maxlen=512)  # for p95
        # Throughput: steps settled in the current second, and (second, steps) of the seconds
        # before it, oldest first.
        self._second = 0
        self._second_count = 0
        self._settled: deque[tuple[int, int]] = deque(maxlen=_THROUGHPUT_BUCKETS)
        self._baseline: deque[float] = deque(
            maxlen=self.policy.long_window if self.policy is not None else 1
        )
        self._cpu: float | None = None
        self._rss: int | None = None
        self._estimate = float(self.limit)

    @property
    def is_adaptive(self) -> bool:
        return self.policy is not None

    # -- the hot path: two cheap calls per job ----------------------------------------------

    def on_start(self) -> None:
        self.in_flight += 1

    def on_settle(self, started: float, now: float, *, step: bool = True) -> None:
        """A job started at ``started`` finished at ``now`` (trio clock). Only steps feed the
        latency figures."""
        self.in_flight -= 1
        if step:
            duration = now - started
            self._window_total += duration
            self._window_count += 1
            self._recent.append(duration)
            second = int(now)  # cheaper than floor (around zero, two seconds share a bucket)
            if second == self._second:
                self._second_count += 1
            else:
                if self._second_count:
                    self._settled.append((self._second, self._second_count))
                self._second, self._second_count = second, 1

    # -- figures -----------------------------------------------------------------------------

    def throughput(self, window: float = 10.0) -> float:
        """Steps settled per second over the last ``window`` seconds (counted in whole
        one-second buckets: the current, partial one included)."""
        first = int(trio.current_time() - window) + 1
        steps = self._second_count if self._second >= first else 0
        steps += sum(count for second, count in self._settled if second >= first)
        return steps / window

    def p95_ms(self) -> float | None:
        if not self._recent:
            return None
        ordered = sorted(self._recent)
        return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)] * 1000

    def snapshot(self) -> WorkerStatus:
        """The liveness snapshot (T11): mode, limit, in-flight, RSS, CPU, throughput, p95..."""
        if self.policy is None:
            # A fixed limit needs no ticks: the pressure figures are read here, CPU over the
            # time since the last snapshot at least _MIN_CPU_WINDOW ago.
            self._read_pressure(trio.current_time())
        return WorkerStatus(
            mode="adaptive" if self.is_adaptive else "fixed",
            limit=self.limit,
            in_flight=self.in_flight,
            rss_bytes=self._rss if self._rss is not None else self._read_rss(),
            cpu=self._cpu,
            throughput=self.throughput(),
            p95_ms=self.p95_ms(),
            last_adjustment=self.last_adjustment,
            duplicates=self.duplicates,
        )

    # -- the controller -------------------------------------------------------------------------

    def _read_pressure(self, now: float) -> None:
        """RSS now, and CPU (share of one core) since the last reading, if that was at least
        ``_MIN_CPU_WINDOW`` ago (a shorter window says little)."""
        self._rss = self._read_rss()
        if self._cpu_at is not None and now - self._cpu_at < _MIN_CPU_WINDOW:
            return
        cpu_now = self._read_cpu_time()
        if self._cpu_mark is not None and self._cpu_at is not None and now > self._cpu_at:
            self._cpu = max(0.0, (cpu_now - self._cpu_mark) / (now - self._cpu_at))
        self._cpu_mark, self._cpu_at = cpu_now, now

    def adjust(self, elapsed: float) -> None:
        """One tick: read pressure, fold this tick's latencies in, move the limit."""
        cpu_now = self._read_cpu_time()
        if self._cpu_mark is not None and elapsed > 0:
            self._cpu = max(0.0, (cpu_now - self._cpu_mark) / elapsed)
        self._cpu_mark = cpu_now
        self._rss = self._read_rss()
        total, count = self._window_total, self._window_count
        self._window_total, self._window_count = 0.0, 0
        policy = self.policy
        if policy is None or not count:
            return
        short = total / count
        baseline_window = self._baseline
        baseline_window.append(short)  # the oldest tick falls out (maxlen: the long window)
        baseline = min(baseline_window)
        gradient = max(0.5, min(1.0, policy.tolerance * baseline / short)) if short > 0 else 1.0
        pressure = (
            policy.max_rss_bytes is not None and (self._rss or 0) > policy.max_rss_bytes
        ) or (self._cpu is not None and self._cpu >= policy.max_cpu)
        # An idle-ish worker (well under its limit) learns nothing about a higher limit; a
        # queueing one (gradient < 1) gets no allowance on top of the cut.
        app_limited = self.in_flight < self.limit / 2
        grow = gradient >= 1.0 and not pressure and not app_limited
        target = self._estimate * gradient + (math.sqrt(self._estimate) if grow else 0.0)
        if pressure:
            target = min(target, self._estimate * 0.9)
        self._estimate = max(
            float(policy.min),
            min(
                float(policy.max),
                self._estimate * (1 - policy.smoothing) + target * policy.smoothing,
            ),
        )
        new_limit = max(policy.min, min(policy.max, round(self._estimate)))
        if new_limit != self.limit:
            self.limit = new_limit
            self.last_adjustment = time.time()
            self._on_limit(new_limit)

    _cpu_mark: float | None = None
    _cpu_at: float | None = None
    """When ``_cpu_mark`` was read (fixed mode: read by :meth:`snapshot`)."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Tick forever (adaptive). A fixed limit needs no ticks (:meth:`snapshot` reads the
        pressure figures): this returns at once, so an idle worker has one timer less."""
        start = trio.current_time()
        self._cpu_mark, self._cpu_at = self._read_cpu_time(), start
        task_status.started()
        if self.policy is None:
            return
        # The controller moves on the time that actually passed (periodic's delta): a tick
        # that wakes late costs nothing. The first iteration, at once, has no delta yet.
        # adjust never awaits, so a cancel lands in periodic's own sleep and ends it whole.
        async for _, elapsed in periodic(self.policy.tick):
            if elapsed is not None:
                self.adjust(elapsed)
