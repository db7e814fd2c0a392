"""One backoff for every retry loop: exponential, capped, optionally jittered.

The delay after the ``n``-th failure in a row (``n >= 1``) is ``min(maximum, initial *
multiplier ** (n - 1))``, then shortened by a random fraction in ``[0, jitter)`` of itself, so
the cap is a real upper bound and processes that failed together do not retry in lockstep. The
exponent is capped, so a long outage never overflows. Every loop that retries (a connection
pool's reconnect, a doorbell's resubscribe, a poll loop's idle sleep, a supervisor's restart)
takes its delays from a :class:`Backoff`, so their formulas do not drift apart.

Example::

    backoff = Backoff(initial=0.05, maximum=2.0, jitter=0.5)
    failures = 0
    while True:
        try:
            return await connect()
        except BrokerUnavailable:
            failures += 1
            await trio.sleep(backoff.delay(failures))
"""

from __future__ import annotations

import math
import random

import attrs

from ._attrs_shared import shared_eq, shared_hash, shared_repr
from ._errors import ConfigError

__all__ = ["Backoff"]

#: The largest exponent used: ``2 ** 32`` times the initial delay is past any cap in use.
_MAX_EXPONENT = 32


def _check(instance: Backoff, attribute: attrs.Attribute[float], value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
        raise ConfigError(f"Backoff.{attribute.name} must be a finite number >= 0, got {value!r}")


@attrs.frozen(repr=False, eq=False)
class Backoff:
    """Exponential backoff with a cap and jitter (see the module docstring).

    Attributes:
        initial: the delay after the first failure, in seconds (or poll intervals: any unit).
        maximum: the cap on any one delay (before jitter).
        multiplier: each further failure multiplies the delay by this (``>= 1``).
        jitter: each delay is shortened by a random fraction in ``[0, jitter)`` of itself
            (0: exact; 0.5: between half and all of it).
    """

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    initial: float = attrs.field(validator=_check)
    maximum: float = attrs.field(validator=_check)
    multiplier: float = attrs.field(default=2.0, validator=_check)
    jitter: float = attrs.field(default=0.0, validator=_check)

    def __attrs_post_init__(self) -> None:
        if self.initial > self.maximum:
            raise ConfigError(
                f"Backoff: initial ({self.initial!r}) must not exceed maximum ({self.maximum!r})"
            )
        if self.multiplier < 1:
            raise ConfigError(f"Backoff.multiplier must be >= 1, got {self.multiplier!r}")
        if self.jitter > 1:
            raise ConfigError(f"Backoff.jitter must be between 0 and 1, got {self.jitter!r}")

    def base(self, failures: int) -> float:
        """The delay after ``failures`` failures in a row, before jitter (``failures < 1``:
        no failure yet, 0)."""
        if failures < 1:
            return 0.0
        exponent = min(failures - 1, _MAX_EXPONENT)
        return min(self.maximum, self.initial * self.multiplier**exponent)

    def delay(self, failures: int, *, rng: random.Random | None = None) -> float:
        """The delay after ``failures`` failures in a row, jittered (``rng``: where the jitter
        comes from; a seeded one makes it reproducible)."""
        base = self.base(failures)
        if self.jitter and base:
            base *= 1.0 - self.jitter * (rng or random).random()
        return base
