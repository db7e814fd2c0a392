"""A step's retry policy read back from its checkpoint (:class:`StoredRetry`).

Apart from :mod:`._retry` (the policy an app declares, imported with every app) so that it is
imported by the first failed attempt whose retry is decided, not by every engine's start.
"""

from __future__ import annotations

from typing import Any

import attrs

from .._attrs_shared import shared_eq, shared_hash, shared_repr
from .._errors import ConfigError
from ._retry import Retry

__all__ = ["StoredRetry"]


@attrs.frozen(repr=False, eq=False)
class StoredRetry:
    """A :class:`Retry` read back from a checkpoint: the same numbers, the types by name only."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    policy: Retry
    names: frozenset[str]

    @classmethod
    def from_json(cls, data: Any) -> StoredRetry:
        """Parse :meth:`Retry.to_json` output (anything unreadable: the default policy)."""
        if not isinstance(data, dict):
            return cls(Retry(), frozenset())
        try:
            max_delay = float(data.get("maxDelay", 60.0))
            policy = Retry(
                max_attempts=int(data.get("maxAttempts", 3)),
                # A checkpoint written before a cap below initial was refused: the same delays
                # (every one the cap), not the default policy.
                initial=min(float(data.get("initial", 1.0)), max_delay),
                multiplier=float(data.get("multiplier", 2.0)),
                max_delay=max_delay,
                jitter=float(data.get("jitter", 0.2)),
            )
        except (ConfigError, TypeError, ValueError):
            policy = Retry()
        names = data.get("nonRetryable", [])
        if not isinstance(names, list):
            names = []
        return cls(policy, frozenset(str(n) for n in names))

    def retries_after(self, failed_attempt: int, error_code: str | None) -> bool:
        """As :meth:`Retry.retries_after`, matching codes against the stored names."""
        if failed_attempt >= self.policy.max_attempts:
            return False
        return not (error_code is not None and error_code in self.names)
