"""What counts as a JSON value: the one rule every input, output and checkpoint obeys.

A JSON value is ``None``, a ``bool``, an ``int`` in the 64-bit range (``-2**63`` to
``2**64 - 1``), a finite ``float``, a ``str``, a ``list`` or ``tuple`` of JSON values (a tuple is
written as an array and reads back as a list), or a ``dict`` with ``str`` keys and JSON values,
nested at most :data:`MAX_JSON_DEPTH` arrays and objects deep. NaN and the infinities are
refused, never written as ``null``; so are subclasses (an ``IntEnum`` member, a ``str``
subclass) and everything else (sets, bytes, datetimes, dataclasses, ``attrs`` instances), which
would not read back as what was written.

The check is one iterative walk, so no value, however deep, can reach Python's recursion limit:
code that recurses over a value (cattrs, ``copy.deepcopy``, ``==``) only ever sees values that
passed it.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import orjson

from ._errors import PayloadError

__all__ = [
    "MAX_JSON_DEPTH",
    "check_json",
    "is_json",
    "json_error",
    "parse_json_argument",
    "read_within",
]

#: The deepest an input, an output, a local step's result or an error's details may nest
#: (``[]`` and ``{}`` are one level, a scalar none). Far below the 254 levels ``orjson`` writes,
#: so the records the protocol wraps values in (a history entry, a reply) still fit.
MAX_JSON_DEPTH = 200

_INT_MIN = -(2**63)
_INT_MAX = 2**64 - 1
#: Paths in messages are cut to this many characters (a 200-level path is ~600).
_SHOWN_PATH = 120


def is_json(value: Any, max_depth: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``value`` is a JSON value nested at most ``max_depth`` deep.

    Strings are not checked for lone surrogates (``orjson`` refuses them when it writes; see
    :func:`json_error`): that would cost a pass over every character.
    """
    # The hot path of every dispatch and every result: exact type tests (a subclass is not a
    # JSON value), no function call per item, no path bookkeeping until something is wrong.
    kind = type(value)
    if kind is str or kind is bool or value is None:
        return True
    if kind is int:
        return bool(_INT_MIN <= value <= _INT_MAX)
    if kind is float:
        return bool(value - value == 0.0)  # NaN and the infinities give NaN
    if kind is not dict and kind is not list and kind is not tuple:
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            return False
        if type(node) is dict:
            for key in node:
                if type(key) is not str:
                    return False
            items = node.values()
        else:
            items = node
        for item in items:
            kind = type(item)
            if kind is str or kind is bool or item is None:
                continue
            if kind is int:
                if not _INT_MIN <= item <= _INT_MAX:
                    return False
            elif kind is float:
                if item - item != 0.0:
                    return False
            elif kind is dict or kind is list or kind is tuple:
                stack.append((item, depth + 1))
            else:
                return False
    return True


def _writes_wrapped(value: Any, lists: int) -> bool:
    """Whether ``orjson.dumps`` writes ``value`` wrapped in ``lists`` more lists."""
    for _ in range(lists):
        value = [value]
    try:
        orjson.dumps(value)
    except orjson.JSONEncodeError:
        return False
    return True


def _orjson_write_depth(most: int = 1024) -> int | None:
    """The deepest nesting ``orjson.dumps`` writes (254 since orjson 3.11.6), measured once;
    ``None`` when it writes ``most`` levels (older versions have no limit)."""

    def writes(depth: int) -> bool:
        return _writes_wrapped([], depth - 1)

    if writes(most):
        return None
    low, high = 1, most  # writes(low), not writes(high)
    while high - low > 1:
        middle = (low + high) // 2
        if writes(middle):
            low = middle
        else:
            high = middle
    return low


@functools.cache
def _orjson_depth() -> int | None:
    """:func:`_orjson_write_depth`, measured on the first :func:`read_within` (a long job's
    payload) rather than at import: the bisection costs ~2 M instructions, paid by every process
    that imports the codec, and most never read a payload long enough to need it."""
    return _orjson_write_depth()


def read_within(value: Any, max_depth: int) -> bool:
    """Whether ``value``, as ``orjson.loads`` returned it (so of JSON types only), nests at most
    ``max_depth`` deep.

    orjson reads 1,024 levels but writes fewer: wrapped in as many lists as make up the
    difference, ``value`` is written by orjson exactly when it is shallow enough — the depth
    measured in C, several times faster than :func:`is_json` on a long history.
    """
    depth = _orjson_depth()
    spare = depth - max_depth if depth is not None else -1
    if spare < 0:
        return is_json(value, max_depth)
    return _writes_wrapped(value, spare)


def _step(path: str, key: str) -> str:
    if key.isidentifier():
        return f"{path}.{key}"
    return f"{path}[{json.dumps(key)}]"


def _shown(path: str) -> str:
    if len(path) <= _SHOWN_PATH:
        return path
    return f"{path[: _SHOWN_PATH - 30]}…{path[-29:]}"


def _scalar_problem(value: Any) -> str | None:
    kind = type(value)
    if kind is str:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "a string with a lone surrogate (not UTF-8)"
        return None
    if kind is bool or value is None:
        return None
    if kind is int:
        if _INT_MIN <= value <= _INT_MAX:
            return None
        return f"an integer outside the 64-bit range ({value!r:.40})"
    if kind is float:
        if value - value == 0.0:
            return None
        return f"{value!r} (NaN and the infinities are not JSON numbers)"
    return f"a {kind.__name__} ({value!r:.40}) is not a JSON value"


def json_error(
    value: Any, what: str, path: str = "$", max_depth: int = MAX_JSON_DEPTH
) -> PayloadError | None:
    """Why ``value`` is not a JSON value, as a :class:`PayloadError` whose ``path`` names the
    first offending place (``$.output.a[3]``); ``None`` when nothing is wrong.

    The slow path, taken only once something was refused: it keeps a path per item, and it also
    finds what :func:`is_json` leaves to ``orjson`` (strings with lone surrogates).
    """
    stack: list[tuple[Any, str, int]] = [(value, path, 0)]
    while stack:
        node, where, depth = stack.pop()
        kind = type(node)
        if kind is dict or kind is list or kind is tuple:
            depth += 1
            if depth > max_depth:
                return PayloadError(
                    f"{what} is not JSON-serialisable: nested deeper than {max_depth} levels "
                    f"of arrays and objects at {_shown(where)}",
                    path=where,
                )
            if kind is dict:
                children: list[tuple[Any, str, int]] = []
                for key, item in node.items():
                    if type(key) is not str:
                        return PayloadError(
                            f"{what} is not JSON-serialisable: a key that is not a string "
                            f"({key!r:.40}) at {_shown(where)}",
                            path=where,
                        )
                    children.append((item, _step(where, key), depth))
            else:
                children = [(item, f"{where}[{i}]", depth) for i, item in enumerate(node)]
            stack.extend(reversed(children))  # the first offender in reading order
            continue
        problem = _scalar_problem(node)
        if problem is not None:
            return PayloadError(
                f"{what} is not JSON-serialisable: {problem} at {_shown(where)}", path=where
            )
    return None


def check_json(
    value: Any, what: str = "value", path: str = "$", max_depth: int = MAX_JSON_DEPTH
) -> None:
    """Refuse ``value`` unless it is a JSON value (see the module docstring).

    Args:
        value: the value to check.
        what: what it is, for the message (``the input of step 'charge'``).
        path: where it sits, for the error's ``path`` (``$.output``).
        max_depth: the deepest it may nest.

    Raises:
        PayloadError: it is not; ``path`` names the first offending place.
    """
    if not is_json(value, max_depth):
        raise json_error(value, what, path, max_depth) or PayloadError(
            f"{what} is not JSON-serialisable", path=path
        )


def parse_json_argument(text: str, what: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Read JSON text a user typed (a command's ``PAYLOAD-JSON`` or ``--input``) as a JSON
    value, with one clear error whatever the text: ``json.loads`` recurses once per level, so
    ``[[[[...`` 100,000 deep is a ``RecursionError`` there, never a traceback here.

    Raises:
        PayloadError: ``what`` is not JSON, nests deeper than ``max_depth``, or holds what
            :func:`check_json` refuses (NaN, an integer past 64 bits).
    """
    try:
        value = json.loads(text)
    except RecursionError:
        raise PayloadError(
            f"{what} is not JSON-serialisable: nested deeper than {max_depth} levels of "
            "arrays and objects"
        ) from None
    except ValueError as exc:
        raise PayloadError(f"{what} is not JSON: {exc}") from None
    check_json(value, what, max_depth=max_depth)
    return value
