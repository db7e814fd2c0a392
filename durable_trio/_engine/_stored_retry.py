"""A step's retry policy read back from its checkpoint (:class:`StoredRetry`).

Apart from :mod:`._retry` (the policy an app declares, imported with every app) so that it is
imported by the first failed attempt whose retry is decided, not by every engine's start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from .._attrs_shared import shared_eq, shared_hash, shared_repr
from .._errors import ConfigError
from ._retry import Retry

if TYPE_CHECKING:
    import random

__all__ = ["StoredRetry"]


@attrs.frozen(repr=False, eq=False)
class StoredRetry:
    """A :class:`Retry` read back from a checkpoint: the same numbers, the types by name only."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    policy: Retry
    names: frozenset[str]
    earlier: int = 0
    """Attempts made before an operator's last retry gave the step a fresh budget (its
    ``maxAttempts`` raised by them, the original kept as ``operatorBase``): the backoff
    starts over after them, as the budget does."""

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
        base = data.get("operatorBase")
        earlier = policy.max_attempts - base if type(base) is int and base >= 1 else 0
        return cls(policy, frozenset(str(n) for n in names), max(0, earlier))

    def delay(self, failed_attempt: int, *, rng: random.Random | None = None) -> float:
        """The backoff after ``failed_attempt`` failed, counted within the step's current
        budget of attempts (after an operator's retry: from its first new attempt)."""
        return self.policy.delay(max(1, failed_attempt - self.earlier), rng=rng)

    def retries_after(self, failed_attempt: int, error_code: str | None) -> bool:
        """As :meth:`Retry.retries_after`, matching codes against the stored names."""
        if failed_attempt >= self.policy.max_attempts:
            return False
        return not (error_code is not None and error_code in self.names)
