"""``Rate``: a step's fleet-wide rate limit (``@app.step(rate_limit=dt.Rate(100, per=1.0))``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from .._attrs_shared import shared_eq, shared_hash, shared_repr
from .._errors import ConfigError
from ..brokers._rates import check_rate

__all__ = ["Rate", "check_rate_limit"]


@attrs.frozen(repr=False, eq=False)
class Rate:
    """At most ``count`` attempts of a step start in any window of ``per`` seconds, across
    the whole fleet (a sliding window kept by the broker: exact, not a token bucket).

    Args:
        count: starts allowed per window, an int from 1 to 100,000.
        per: the window, seconds (finite, above 0, at most one day; default 1).
        key: ``input -> str``: the rate then holds per key value, keys independent
            (``lambda order: order["account"]``); ``None``: for the whole step. The engine
            computes the key at dispatch, as a ``concurrency_key`` (a step with both gives
            the same function to each: one key per job).

    Raises:
        ConfigError: ``count`` or ``per`` out of range.
    """

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    count: int
    per: float = 1.0
    key: Callable[[Any], str] | None = None

    def __attrs_post_init__(self) -> None:
        check_rate(self.count, self.per)


def check_rate_limit(rate_limit: Any, concurrency_key: Any = None) -> Rate | None:
    """Check ``app.step``'s ``rate_limit`` (and its key against ``concurrency_key``).

    Raises:
        ConfigError: not ``None`` or a :class:`Rate`, a ``key`` that is not callable, or a
            ``key`` and a ``concurrency_key`` that are not the same function (a job has one
            key: give the same function to both, or key only one of them).
    """
    if rate_limit is None:
        return None
    if not isinstance(rate_limit, Rate):
        raise ConfigError(f"app.step: rate_limit must be a dt.Rate, got {rate_limit!r}")
    key = rate_limit.key
    if key is not None and not callable(key):
        raise ConfigError(f"app.step: a rate's key must be a function input -> str, got {key!r}")
    if key is not None and concurrency_key is not None and key is not concurrency_key:
        raise ConfigError(
            "app.step: rate_limit's key and concurrency_key differ; a job has one key: give "
            "the same function to both (key = lambda input: ...; concurrency_key=key, "
            "rate_limit=dt.Rate(..., key=key)), or key only one of them"
        )
    return rate_limit
