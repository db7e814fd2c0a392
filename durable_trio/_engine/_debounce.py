"""Debounce and dedup keys of ``engine.start`` (issue 33, item 4): the values and their checks.

A key is scoped by its workflow: the stores see :func:`scoped_key`, one opaque string (the JSON
array ``[workflow, key]``), so the same key in two workflows names two windows.
"""

from __future__ import annotations

import math
from typing import Any, Final

import attrs
import orjson

from .._arguments import check_name, given
from .._attrs_shared import shared_eq, shared_hash, shared_repr
from .._errors import ConfigError

__all__ = [
    "MAX_DEBOUNCE_SECONDS",
    "MAX_KEY_LENGTH",
    "Debounce",
    "check_folding",
    "check_key",
    "scoped_key",
]

#: The longest debounce or dedup key, in characters.
MAX_KEY_LENGTH: Final = 512

#: The longest ``delay`` and ``max_wait`` of a debounce, in seconds: one week.
MAX_DEBOUNCE_SECONDS: Final = 7 * 24 * 3600.0


def check_key(value: Any, call: str, argument: str) -> str:
    """``value`` if it is a non-empty ``str`` of at most :data:`MAX_KEY_LENGTH` characters.

    Raises:
        TypeError: it is not a ``str``.
        ConfigError: it is empty or longer.
    """
    key = check_name(value, call, argument)
    if len(key) > MAX_KEY_LENGTH:
        raise ConfigError(
            f"{call}: {argument} is at most {MAX_KEY_LENGTH} characters, not {len(key)}"
        )
    return key


def _seconds(value: Any, argument: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"dt.Debounce: {argument} must be a number of seconds, got {given(value)}")
    seconds = float(value)
    if not math.isfinite(seconds) or not 0 < seconds <= MAX_DEBOUNCE_SECONDS:
        raise ConfigError(
            f"dt.Debounce: {argument} must be a finite number of seconds > 0 and at most "
            f"{MAX_DEBOUNCE_SECONDS:g} (one week), not {value!r}"
        )
    return seconds


def _check_key(instance: Debounce, attribute: attrs.Attribute[str], value: Any) -> None:
    check_key(value, "dt.Debounce", "key")


def _delay(value: Any) -> float:
    return _seconds(value, "delay")


def _max_wait(value: Any) -> float | None:
    return None if value is None else _seconds(value, "max_wait")


@attrs.frozen(repr=False, eq=False)
class Debounce:
    """Fold the starts of one key into one run (``engine.start(..., debounce=)``).

    Trailing edge: the run starts ``delay`` seconds after the LAST start with the key (each
    start pushes it back), with the latest start's input and timeout; ``max_wait`` bounds how
    long the first start of a window waits for it (a steady stream of starts still starts a run
    every ``max_wait`` seconds). Every start of a window returns the same run id. See
    docs/concurrency.md, "Debounce and dedup keys".

    Attributes:
        key: what the starts folded together share (a non-empty str of at most 512
            characters), within their workflow.
        delay: seconds of quiet after the last start before the run starts (> 0, at most one
            week).
        max_wait: seconds at most from the window's first start to the run's start (``None``:
            no bound, the default; else at least ``delay`` and at most one week).

    Raises:
        TypeError: ``key`` is not a str, ``delay`` or ``max_wait`` not a number.
        ConfigError: a value out of those bounds.
    """

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    key: str = attrs.field(validator=_check_key)
    delay: float = attrs.field(converter=_delay)
    max_wait: float | None = attrs.field(default=None, converter=_max_wait)

    def __attrs_post_init__(self) -> None:
        if self.max_wait is not None and self.max_wait < self.delay:
            raise ConfigError(
                f"dt.Debounce: max_wait ({self.max_wait:g} s) must be at least delay "
                f"({self.delay:g} s)"
            )


def scoped_key(workflow: str, key: str) -> str:
    """The store's key of ``key`` within ``workflow`` (one string, unambiguous)."""
    return orjson.dumps([workflow, key]).decode()


def check_folding(
    run_id: str | None,
    parent: str | None,
    dedup_key: Any,
    debounce: Any,
    call: str = "engine.start",
) -> None:
    """Check ``engine.start``'s ``dedup_key`` and ``debounce`` (and what they exclude).

    Raises:
        TypeError: ``dedup_key`` is not a str, ``debounce`` not a :class:`Debounce`.
        ConfigError: an empty or too long ``dedup_key``; either with ``run_id`` (the store
            picks the id of a run folded with others) or ``parent`` (a child run is started
            by its parent, once); both together.
    """
    if dedup_key is not None:
        check_key(dedup_key, call, "dedup_key")
    if debounce is not None and not isinstance(debounce, Debounce):
        raise TypeError(f"{call}: debounce must be a dt.Debounce, got {given(debounce)}")
    if dedup_key is None and debounce is None:
        return
    what = "dedup_key" if debounce is None else "debounce"
    if dedup_key is not None and debounce is not None:
        raise ConfigError(f"{call}: dedup_key and debounce cannot be given together")
    if run_id is not None:
        raise ConfigError(f"{call}: {what} picks the run id: give no run_id")
    if parent is not None:
        raise ConfigError(f"{call}: a child run (parent=) takes no {what}")
