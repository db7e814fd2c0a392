"""Retry policies: how many attempts, how long between them, which errors are final."""

from __future__ import annotations

import math
import random
from typing import Any

import attrs

from .._attrs_shared import shared_eq, shared_hash, shared_repr
from .._errors import ConfigError

__all__ = ["Retry"]


def _check_attempts(_: Any, attribute: attrs.Attribute[Any], value: int) -> None:
    if type(value) is not int or value < 1:
        raise ConfigError(f"Retry.{attribute.name} must be an integer >= 1, got {value!r}")


def _check_seconds(_: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if not (isinstance(value, int | float) and value >= 0 and math.isfinite(value)):
        raise ConfigError(f"Retry.{attribute.name} must be >= 0 seconds, got {value!r}")


def _check_multiplier(_: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if not (isinstance(value, int | float) and value >= 1 and math.isfinite(value)):
        raise ConfigError(f"Retry.multiplier must be >= 1, got {value!r}")


def _check_jitter(_: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if not (isinstance(value, int | float) and 0 <= value <= 1):
        raise ConfigError(f"Retry.jitter must be between 0 and 1, got {value!r}")


def _check_types(_: Any, attribute: attrs.Attribute[Any], value: tuple[Any, ...]) -> None:
    for item in value:
        if not (isinstance(item, type) and issubclass(item, BaseException)):
            raise ConfigError(f"Retry.non_retryable holds exception types, not {item!r}")


def _check_cap(instance: Retry, attribute: attrs.Attribute[Any], value: float) -> None:
    _check_seconds(instance, attribute, value)
    initial = instance.initial
    if isinstance(initial, int | float) and value < initial:
        raise ConfigError(
            f"Retry.max_delay ({value!r} s) is below initial ({initial!r} s): every delay would "
            "be capped below the first; raise max_delay, or leave it out (it then follows "
            "initial)"
        )


def _default_cap(instance: Retry) -> float:
    """60 s, or ``initial`` when that is longer: ``Retry(initial=600)`` waits 600 s, as asked,
    not the default cap's 60 (docs/decisions.md, "A retry's cap follows its initial delay")."""
    initial = instance.initial
    return float(initial) if isinstance(initial, int | float) and initial > 60.0 else 60.0


def _as_tuple(value: Any) -> tuple[Any, ...]:
    if isinstance(value, type):
        return (value,)
    return tuple(value)


@attrs.frozen(repr=False, eq=False)
class Retry:
    """A step's retry policy: exponential backoff with jitter and a cap.

    The delay before attempt ``n + 1`` (after attempt ``n`` failed) is
    ``min(max_delay, initial * multiplier ** (n - 1))``, then shortened by up to ``jitter`` of
    itself at random (so the cap is a real upper bound, and retries of many runs that failed
    together spread out instead of hitting a recovering service at the same instant).

    With the defaults a step runs at most 3 times, 1 s then 2 s apart (each up to 20 % less).

    Example::

        @app.step("charge-card", retry=dt.Retry(max_attempts=5, initial=0.5,
                                                non_retryable=(CardDeclined,)))
        async def charge(order: dict) -> dict: ...
    """

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    max_attempts: int = attrs.field(default=3, validator=_check_attempts)
    """Attempts in all (1 = never retry)."""
    initial: float = attrs.field(default=1.0, validator=_check_seconds)
    """Seconds before the first retry."""
    multiplier: float = attrs.field(default=2.0, validator=_check_multiplier)
    """Each further retry waits this many times longer (1 = a constant delay)."""
    max_delay: float = attrs.field(
        default=attrs.Factory(_default_cap, takes_self=True), validator=_check_cap
    )
    """The cap on any one delay (before jitter): 60 s, or ``initial`` when that is longer. A
    cap below ``initial`` is a :class:`ConfigError`."""
    jitter: float = attrs.field(default=0.2, validator=_check_jitter)
    """Each delay is shortened by a random fraction in ``[0, jitter)`` of itself (0 = exact)."""
    non_retryable: tuple[type[BaseException], ...] = attrs.field(
        default=(), converter=_as_tuple, validator=_check_types
    )
    """Exception types that fail the step at once. A worker matches them with ``isinstance``;
    the engine, which only sees a remote step's error, by the type's name (the error's
    ``code``)."""

    def delay(self, failed_attempt: int, *, rng: random.Random | None = None) -> float:
        """Seconds to wait after attempt ``failed_attempt`` (1-based) failed.

        Args:
            failed_attempt: the attempt that just failed.
            rng: where the jitter comes from; a seeded :class:`random.Random` makes the delays
                reproducible (``None``: the module's shared generator).

        Returns:
            The delay in seconds, in ``[base * (1 - jitter), base]`` where ``base`` is the
            capped exponential delay.
        """
        exponent = max(0, failed_attempt - 1)
        try:
            base = self.initial * self.multiplier**exponent
        except OverflowError:
            base = math.inf
        base = min(self.max_delay, base)
        if self.jitter and base:
            draw = (rng or random).random()
            base *= 1.0 - self.jitter * draw
        return base

    def schedule(self, *, seed: int | str | None = None) -> list[float]:
        """Every delay this policy would wait, in order (``max_attempts - 1`` of them): handy
        in docs and tests. A ``seed`` makes the jitter reproducible."""
        rng = random.Random(seed) if seed is not None else None
        return [self.delay(n, rng=rng) for n in range(1, self.max_attempts)]

    def retries_after(self, failed_attempt: int, error_code: str | None) -> bool:
        """Whether a retryable failure of ``failed_attempt`` (with error ``code``) is retried."""
        if failed_attempt >= self.max_attempts:
            return False
        return not (error_code is not None and error_code in self.non_retryable_names)

    def is_non_retryable(self, exc: BaseException) -> bool:
        """Whether ``exc`` is one of the :attr:`non_retryable` types (or a subclass)."""
        return bool(self.non_retryable) and isinstance(exc, self.non_retryable)

    @property
    def non_retryable_names(self) -> frozenset[str]:
        """The names of the :attr:`non_retryable` types (what a remote error's code holds)."""
        return frozenset(t.__name__ for t in self.non_retryable)

    def to_json(self) -> dict[str, Any]:
        """The policy as a checkpoint stores it (types by name)."""
        return {
            "maxAttempts": self.max_attempts,
            "initial": self.initial,
            "multiplier": self.multiplier,
            "maxDelay": self.max_delay,
            "jitter": self.jitter,
            "nonRetryable": sorted(self.non_retryable_names),
        }
