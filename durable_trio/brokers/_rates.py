"""What every broker that keeps rate limits (``SupportsRateLimits``) shares: the check of a
rate and the sliding-window grant computed from a queue's log of start times."""

from __future__ import annotations

import collections
import math
from typing import TYPE_CHECKING, Any

from .._errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "KEY_SEPARATOR",
    "MAX_RATE_COUNT",
    "MAX_RATE_PER",
    "RateLogs",
    "check_rate",
    "grant",
    "log_name",
    "window_fields",
]

#: Between a queue and a key in the name of a per-key log (``log_name``): the ASCII unit
#: separator, which a queue name has no reason to hold.
KEY_SEPARATOR = "\x1f"


def log_name(queue: str, key: str | None) -> str:
    """The name of the start log of ``queue`` (``key=None``) or of one key of it: the brokers
    that keep their logs in a table keep a per-key log under this name, so per-key rates need
    no new column (and the rows of ``queue``'s keys sort together, after ``queue``)."""
    return queue if key is None else f"{queue}{KEY_SEPARATOR}{key}"

#: The most starts a rate may allow per window (each start is one entry of the broker's log).
MAX_RATE_COUNT = 100_000
#: The longest window a rate may have, in seconds (one day).
MAX_RATE_PER = 86_400.0


def window_fields(
    count: int | None, per: float | None, per_key: bool, counts: Sequence[int]
) -> dict[str, Any]:
    """The rate fields of a ``QueueStats`` (``rate``, ``rate_per``, ``window``,
    ``rate_per_key``, ``window_keys``). ``counts``: the starts in the window of the keyless log
    (one number), or, for a per-key rate, of each key with any (``window`` is then the busiest
    key's, ``window_keys`` how many keys have one)."""
    if count is None or per is None:
        return {}
    if not per_key:
        return {"rate": count, "rate_per": per, "window": sum(counts)}
    live = [n for n in counts if n > 0]
    return {
        "rate": count,
        "rate_per": per,
        "window": max(live, default=0),
        "rate_per_key": True,
        "window_keys": len(live),
    }


def check_rate(count: object, per: object) -> tuple[int, float]:
    """``(count, per)`` as a rate: ``count`` an int from 1 to :data:`MAX_RATE_COUNT`, ``per``
    a finite number of seconds above 0, at most :data:`MAX_RATE_PER`.

    Raises:
        ConfigError: anything else.
    """
    if type(count) is not int or not 1 <= count <= MAX_RATE_COUNT:
        raise ConfigError(f"a rate's count is an int from 1 to {MAX_RATE_COUNT}, got {count!r}")
    if (
        isinstance(per, bool)
        or not isinstance(per, int | float)
        or not math.isfinite(per)
        or not 0 < per <= MAX_RATE_PER
    ):
        raise ConfigError(
            f"a rate's per is a number of seconds above 0, at most {MAX_RATE_PER:g}, got {per!r}"
        )
    return count, float(per)


def grant(
    times: Sequence[float], now: float, want: int, count: int, per: float
) -> tuple[int, float]:
    """The starts a claim may take now: ``(granted, retry_after)``.

    ``times`` are the queue's start times still in the window (each ``> now - per``), oldest
    first. At most ``count - len(times)`` (and ``want``) are granted; with none granted,
    ``retry_after`` is the seconds until enough of the oldest leave the window for one more
    (``0.0`` otherwise). A start at ``t`` stays in the window until ``t + per`` (excluded), so
    no span of ``per`` seconds ever holds more than ``count`` starts.
    """
    free = count - len(times)
    if free > 0:
        return min(free, max(want, 0)), 0.0
    # The (len - count + 1)-th oldest must leave for one start to fit.
    return 0, max(0.0, times[len(times) - count] + per - now)


class RateLogs:
    """The rates and start logs of one process's queues (the memory broker's store)."""

    def __init__(self) -> None:
        self.rates: dict[str, tuple[int, float]] = {}
        self.per_key: set[str] = set()
        """The queues whose rate holds per key (what the operator's view counts)."""
        self._starts: dict[str, collections.deque[float]] = {}

    def set(self, queue: str, count: int | None, per: float, per_key: bool = False) -> None:
        if count is None:
            self.rates.pop(queue, None)
            self.per_key.discard(queue)
        else:
            self.rates[queue] = check_rate(count, per)
            if per_key:
                self.per_key.add(queue)
            else:
                self.per_key.discard(queue)

    def _live(self, queue: str, now: float, per: float) -> collections.deque[float]:
        starts = self._starts.setdefault(queue, collections.deque())
        while starts and starts[0] <= now - per:
            starts.popleft()
        return starts

    def take(self, queue: str, want: int, now: float, key: str | None = None) -> tuple[int, float]:
        rate = self.rates.get(queue)
        if rate is None:
            return want, 0.0
        count, per = rate
        if key is not None:  # (an idle key of the queue leaves nothing behind)
            prefix = log_name(queue, "")
            for name in [
                n
                for n, s in self._starts.items()
                if n.startswith(prefix) and (not s or s[-1] <= now - per)
            ]:
                del self._starts[name]
        starts = self._live(log_name(queue, key), now, per)
        granted, retry_after = grant(starts, now, want, count, per)
        starts.extend([now] * granted)
        return granted, retry_after

    def give_back(self, queue: str, at: float, n: int, key: str | None = None) -> None:
        starts = self._starts.get(log_name(queue, key))
        while n > 0 and starts and starts[-1] == at:  # (logged last: any later ones are >= at)
            starts.pop()
            n -= 1
        if n > 0 and starts:
            kept = list(starts)
            for i in range(len(kept) - 1, -1, -1):
                if n and kept[i] == at:
                    del kept[i]
                    n -= 1
            starts.clear()
            starts.extend(kept)

    def window(self, queue: str, now: float) -> dict[str, Any]:
        """The rate fields of ``queue``'s ``QueueStats`` (:func:`window_fields`)."""
        rate = self.rates.get(queue)
        if rate is None:
            return {}
        count, per = rate
        if queue not in self.per_key:
            return window_fields(count, per, False, [len(self._live(queue, now, per))])
        prefix = log_name(queue, "")
        names = [n for n in self._starts if n.startswith(prefix)]
        return window_fields(count, per, True, [len(self._live(n, now, per)) for n in names])
