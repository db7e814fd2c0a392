"""``__repr__``, ``__eq__`` and ``__hash__`` shared by many frozen attrs classes.

attrs compiles these three methods for each class it builds, which is most of what a class
costs at import: the wire protocol's messages (:mod:`durable_trio._wire`), imported by every
worker, take them from here instead (``@attrs.frozen(repr=False, eq=False)`` and the three names
assigned in the class body). They behave as attrs' own: the repr names every field
(``RemoteTask(run_id='r', ...)``), two instances are equal when of the same class with equal
fields (else ``NotImplemented``), and the hash is that of the class and the field values. A
field declared ``repr=False`` is left out of the repr, one declared ``eq=False`` out of the
equality and the hash, as attrs leaves them out (``tests/test_lazy_exports.py`` checks that no
class sharing them has a field attrs would treat otherwise: a repr or an eq function, a hash
flag of its own).
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["shared_eq", "shared_hash", "shared_repr"]

#: Each class's names of the fields its equality and hash compare, read once.
_NAMES: dict[type, tuple[str, ...]] = {}
#: Each class's names of the fields its repr shows, read once.
_SHOWN: dict[type, tuple[str, ...]] = {}


def _names(cls: type) -> tuple[str, ...]:
    names = _NAMES.get(cls)
    if names is None:
        names = _NAMES[cls] = tuple(field.name for field in attrs.fields(cls) if field.eq)
    return names


def _shown(cls: type) -> tuple[str, ...]:
    names = _SHOWN.get(cls)
    if names is None:
        names = _SHOWN[cls] = tuple(field.name for field in attrs.fields(cls) if field.repr)
    return names


def _values(self: Any) -> tuple[Any, ...]:
    return tuple(getattr(self, name) for name in _names(self.__class__))


def shared_repr(self: Any) -> str:
    """``Class(field=value!r, ...)``, as attrs writes it."""
    fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in _shown(self.__class__))
    return f"{self.__class__.__qualname__.rsplit('>.', 1)[-1]}({fields})"


def shared_eq(self: Any, other: object) -> Any:
    """Equal: the same class and equal fields, in order (``NotImplemented`` for another
    class, as attrs answers)."""
    if other.__class__ is not self.__class__:
        return NotImplemented
    return _values(self) == _values(other)


def shared_hash(self: Any) -> int:
    """The class's and the fields' hash (a field that is not hashable raises, as in attrs)."""
    return hash((self.__class__, *_values(self)))
