"""Checks of the arguments given to the public calls, made at once, in the caller.

A wrong argument fails the call that received it, with a message naming the call, the argument
and what it was given: :class:`TypeError` for a value of the wrong type, :class:`ConfigError` for
a value of the right type that cannot work (an empty name, a negative duration). Never later,
in a loop that would retry it (docs/engine.md, "Bad input at the API edge").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, TypeGuard

from ._errors import ConfigError
from ._wire import RemoteTask

__all__ = [
    "MAX_PORTABLE_PRIORITY",
    "MAX_RUN_ID",
    "MIN_PORTABLE_PRIORITY",
    "check_backoff_range",
    "check_bool",
    "check_callable",
    "check_name",
    "check_optional_name",
    "check_positive",
    "check_priority",
    "check_run_id",
    "check_seconds",
    "check_task",
    "check_tasks",
    "check_type",
    "check_utf8",
    "given",
]

#: The longest run id a caller may choose, in characters, on every backend (PostgreSQL's index
#: of a run's key holds at most 2,704 bytes: 512 characters are at most 2,048 in UTF-8).
MAX_RUN_ID = 512

#: The priorities every broker keeps exactly (Redis scores are doubles: integers up to 2**53).
MIN_PORTABLE_PRIORITY = -(2**53)
MAX_PORTABLE_PRIORITY = 2**53


def _shown(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 60 else f"{shown[:57]}..."


def given(value: Any) -> str:
    """What a caller passed, for a message: its type and a short repr."""
    return f"a {type(value).__name__} ({_shown(value)})"


def check_name(value: Any, call: str, argument: str, hint: str = "") -> str:
    """``value`` if it is a non-empty ``str``.

    Raises:
        TypeError: it is not a ``str``.
        ConfigError: it is empty.
    """
    if type(value) is not str:
        raise TypeError(f"{call}: {argument} must be a str, got {given(value)}{hint}")
    if not value:
        raise ConfigError(f"{call}: {argument} must not be empty")
    if not value.isascii():
        check_utf8(value, call, argument)
    return value


def check_utf8(value: str, call: str, argument: str) -> str:
    """``value`` if it encodes as UTF-8: no store (nor a queue's JSON) can hold a lone
    surrogate, as a command line's non-UTF-8 bytes decode to (``surrogateescape``).

    Raises:
        ConfigError: it holds a lone surrogate.
    """
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise ConfigError(
            f"{call}: {argument} is not valid UTF-8 (a lone surrogate at index {exc.start}),"
            f" got {_shown(value)}"
        ) from None
    return value


def check_optional_name(value: Any, call: str, argument: str) -> str | None:
    """``value`` if it is ``None`` or a non-empty ``str`` (see :func:`check_name`)."""
    if value is None:
        return None
    return check_name(value, call, argument)


def check_run_id(value: Any, call: str, argument: str = "run_id") -> str | None:
    """``value`` if it is ``None`` or a run id a caller may choose: a non-empty ``str`` of at
    most :data:`MAX_RUN_ID` characters (see :func:`check_name`).

    Raises:
        TypeError: it is not a ``str``.
        ConfigError: it is empty, or longer.
    """
    if value is None:
        return None
    run_id = check_name(value, call, argument)
    if len(run_id) > MAX_RUN_ID:
        raise ConfigError(
            f"{call}: {argument} is at most {MAX_RUN_ID} characters, not {len(run_id)}"
        )
    return run_id


def check_callable(value: Any, call: str, argument: str, hint: str = "") -> None:
    """Refuse ``value`` unless it is callable.

    Raises:
        TypeError: it is not.
    """
    if not callable(value):
        raise TypeError(f"{call}: {argument} must be callable, got {given(value)}{hint}")


def check_type(value: Any, kind: type, call: str, argument: str, *, optional: bool = True) -> None:
    """Refuse ``value`` unless it is a ``kind`` (or ``None``, when ``optional``).

    Raises:
        TypeError: it is not.
    """
    if (value is None and optional) or isinstance(value, kind):
        return
    wanted = f"a {kind.__name__}" + (" or None" if optional else "")
    raise TypeError(f"{call}: {argument} must be {wanted}, got {given(value)}")


def check_bool(value: Any, call: str, argument: str) -> bool:
    """``value`` if it is a ``bool``.

    Raises:
        TypeError: it is not.
    """
    if type(value) is not bool:
        raise TypeError(f"{call}: {argument} must be True or False, got {given(value)}")
    return value


def _is_real(value: object) -> bool:
    """An int or a float, else any :class:`numbers.Real` (``numbers`` imported only then: its
    ABCs cost an import every process would pay for the rare other number types)."""
    if type(value) is float or type(value) is int:
        return True
    import numbers

    return isinstance(value, numbers.Real)


def check_seconds(value: Any, call: str, argument: str, *, positive: bool = False) -> float:
    """``value`` as a float, if it is a real, finite number of seconds ``>= 0`` (``> 0`` when
    ``positive``).

    Raises:
        TypeError: it is not a real number (a ``bool`` is not one here).
        ConfigError: it is negative (or zero, when ``positive``), NaN or infinite.
    """
    if type(value) is float and 0.0 <= value < math.inf and (value or not positive):
        return value  # the common case, without the ABC check below
    if isinstance(value, bool) or not _is_real(value):
        raise TypeError(f"{call}: {argument} must be a number of seconds, got {given(value)}")
    try:
        seconds = float(value)
    except OverflowError:  # an int past the largest float
        seconds = math.inf
    if not math.isfinite(seconds) or seconds < 0 or (positive and seconds == 0):
        bound = "> 0" if positive else ">= 0"
        raise ConfigError(
            f"{call}: {argument} must be a finite number of seconds {bound}, got {_shown(value)}"
        )
    return seconds


def check_positive(**values: float) -> None:
    """Refuse any of ``values`` (an option's name -> its value) that is not ``> 0`` (NaN
    included): the connection options of the Redis and PostgreSQL clients.

    Raises:
        ConfigError: naming the first such option.
    """
    for name, value in values.items():
        if not value > 0:
            raise ConfigError(f"{name} must be positive, not {value}")


def check_backoff_range(backoff_initial: float, backoff_max: float) -> None:
    """Refuse a reconnect backoff whose first delay is negative or past its cap.

    Raises:
        ConfigError: it is.
    """
    if not 0 <= backoff_initial <= backoff_max:
        raise ConfigError("backoff_initial must be between 0 and backoff_max")


def check_priority(value: Any, call: str, argument: str = "priority") -> int | None:
    """``value`` if it is ``None`` or an ``int`` every broker keeps exactly.

    Raises:
        TypeError: it is not an ``int`` (a ``bool`` is not one here).
        ConfigError: it is outside ``[MIN_PORTABLE_PRIORITY, MAX_PORTABLE_PRIORITY]``.
    """
    if value is None:
        return None
    if type(value) is not int:
        raise TypeError(f"{call}: {argument} must be an int or None, got {given(value)}")
    if not MIN_PORTABLE_PRIORITY <= value <= MAX_PORTABLE_PRIORITY:
        raise ConfigError(
            f"{call}: {argument} must be between -2**53 and 2**53 (what every broker keeps "
            f"exactly), got {_shown(value)}"
        )
    return value


def _plain(task: Any) -> TypeGuard[RemoteTask]:
    """Whether ``task`` passes :func:`check_task` for sure: the common case (every dispatch),
    in exact type tests, so the check costs next to nothing on the hot path."""
    return bool(
        type(task) is RemoteTask
        and type(task.run_id) is str
        and type(task.step_id) is str
        and type(task.name) is str
        and type(task.task_id) is str
        and task.run_id
        and task.step_id
        and task.name
        and task.task_id
        and (task.group is None or (type(task.group) is str and task.group))
        and type(task.attempt) is int
        and task.attempt >= 1
        and (
            task.priority is None
            or (
                type(task.priority) is int
                and MIN_PORTABLE_PRIORITY <= task.priority <= MAX_PORTABLE_PRIORITY
            )
        )
        and task.deadline is None
        and (task.max_attempts is None or type(task.max_attempts) is int)
    )


def check_task(task: Any, call: str, argument: str = "task") -> RemoteTask:
    """``task`` if it is a :class:`RemoteTask` whose fields have their types (its input is
    checked where it is encoded: a :class:`PayloadError` naming the path).

    Raises:
        TypeError: it is not a ``RemoteTask``, or a field has the wrong type.
        ConfigError: a name or id is empty, ``attempt < 1``, a priority out of range.
    """
    if _plain(task):
        return task
    if not isinstance(task, RemoteTask):
        raise TypeError(f"{call}: {argument} must be a RemoteTask, got {given(task)}")
    for field in ("run_id", "step_id", "name", "task_id"):
        check_name(getattr(task, field), call, f"{argument}.{field}")
    check_optional_name(task.group, call, f"{argument}.group")
    attempt = task.attempt
    if type(attempt) is not int:
        raise TypeError(f"{call}: {argument}.attempt must be an int, got {given(attempt)}")
    if attempt < 1:
        raise ConfigError(f"{call}: {argument}.attempt must be >= 1, got {attempt!r}")
    check_priority(task.priority, call, f"{argument}.priority")
    max_attempts = task.max_attempts
    if max_attempts is not None and (type(max_attempts) is not int or max_attempts < 1):
        raise TypeError(
            f"{call}: {argument}.max_attempts must be an int >= 1 or None, "
            f"got {given(max_attempts)}"
        )
    deadline = task.deadline
    if deadline is not None and (
        isinstance(deadline, bool) or not _is_real(deadline) or not math.isfinite(deadline)
    ):
        raise TypeError(
            f"{call}: {argument}.deadline must be a finite number or None, got {given(deadline)}"
        )
    return task


def check_tasks(tasks: Any, call: str) -> list[RemoteTask]:
    """``tasks`` as a list, if it is an iterable of valid tasks (see :func:`check_task`).

    Raises:
        TypeError: it is not an iterable of tasks (a single task, a str, a mapping), or an
            item is not a valid task.
        ConfigError: an item has a bad value.
    """
    if isinstance(tasks, str | bytes | RemoteTask | Mapping) or not isinstance(tasks, Iterable):
        raise TypeError(f"{call}: tasks must be an iterable of RemoteTask, got {given(tasks)}")
    items = list(tasks)
    for index, task in enumerate(items):
        check_task(task, call, f"tasks[{index}]")
    return items
