"""``Rate``: a step's fleet-wide rate limit (``@app.step(rate_limit=dt.Rate(100, per=1.0))``)."""

from __future__ import annotations

from typing import Any

import attrs

from .._errors import ConfigError
from ..brokers._rates import check_rate

__all__ = ["Rate", "check_rate_limit"]


@attrs.frozen
class Rate:
    """At most ``count`` attempts of a step start in any window of ``per`` seconds, across
    the whole fleet (a sliding window kept by the broker: exact, not a token bucket).

    Args:
        count: starts allowed per window, an int from 1 to 100,000.
        per: the window, seconds (finite, above 0, at most one day; default 1).
        key: per-key rates are not supported yet: ``app.step`` refuses a rate with a key.

    Raises:
        ConfigError: ``count`` or ``per`` out of range.
    """

    count: int
    per: float = 1.0
    key: Any = None

    def __attrs_post_init__(self) -> None:
        check_rate(self.count, self.per)


def check_rate_limit(rate_limit: Any) -> Rate | None:
    """Check ``app.step``'s ``rate_limit``.

    Raises:
        ConfigError: not ``None`` or a :class:`Rate`, or a rate with a ``key``.
    """
    if rate_limit is None:
        return None
    if not isinstance(rate_limit, Rate):
        raise ConfigError(f"app.step: rate_limit must be a dt.Rate, got {rate_limit!r}")
    if rate_limit.key is not None:
        raise ConfigError(
            "app.step: per-key rates (dt.Rate(..., key=...)) are not supported yet; "
            "give a rate for the whole step (no key), or max_concurrency with "
            "concurrency_key for a per-key bound"
        )
    return rate_limit
