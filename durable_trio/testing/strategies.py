"""Hypothesis strategies for every wire message (for round-trip tests, ours and yours).

Requires ``hypothesis`` (the ``test`` extra).
"""

from __future__ import annotations

import enum
import typing
from typing import Any

import attrs
import hypothesis.strategies as st

from .._codec import MESSAGE_TYPES

__all__ = ["MESSAGE_TYPES", "json_values", "message_of", "wire_messages"]

#: Any JSON value: null, booleans, integers in the 64-bit range, finite floats, strings, and
#: arrays and objects of those.
json_values: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


def _strategy_for(tp: Any) -> st.SearchStrategy[Any]:
    if tp is Any:
        return json_values
    if tp is str:
        return st.text(max_size=24)
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(-(2**63), 2**63 - 1)
    if tp is float:
        return st.floats(allow_nan=False, allow_infinity=False)
    origin = typing.get_origin(tp)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        return st.none() | st.one_of(*(_strategy_for(o) for o in options))
    if origin is tuple:
        return st.lists(_strategy_for(typing.get_args(tp)[0]), max_size=4).map(tuple)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(list(tp))
    if attrs.has(tp):
        return message_of(tp)
    raise TypeError(f"no strategy for {tp!r}")


def message_of(cls: type[Any]) -> st.SearchStrategy[Any]:
    """A strategy producing instances of the wire message class ``cls``."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: _strategy_for(hints[f.name]) for f in attrs.fields(cls)}
    return st.builds(cls, **fields)


def wire_messages() -> st.SearchStrategy[Any]:
    """A strategy producing any wire message: an instance of any class in
    :data:`MESSAGE_TYPES` (tasks, results, heartbeats, control, workflow turns and decisions,
    step events, run requests and replies, tenant events, registrations, worker status)."""
    return st.one_of(*(message_of(cls) for cls in MESSAGE_TYPES))
