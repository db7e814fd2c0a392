"""Typed payloads: a step's or workflow's input and output as the types its annotations name.

The wire stays JSON. A step (or workflow) whose input parameter or return is annotated with a
type cattrs can structure (attrs classes, dataclasses, ``datetime``/``date``/``time``, enums,
``UUID``, ``Decimal``, collections of them, pydantic models when pydantic is installed) gets its
input structured into that type before it is called, and its output unstructured into a JSON
value before it is stored or sent. Unannotated (or ``Any``, ``dict``, ``list``, ``str`` ... :
plain JSON annotations) stays exactly as before: the JSON value, untouched.

How values travel (their JSON forms): attrs classes and dataclasses as objects (one key per
field), ``datetime``/``date``/``time`` as ISO 8601 strings, ``UUID`` and ``Decimal`` as strings,
enums as their values, sets, frozensets and tuples as arrays.

The stored JSON is the truth: structuring is a pure function of it and of the annotation, so a
replay structures the very same values.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import functools
import inspect
import sys
import types
import typing
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from .._attrs_shared import shared_eq, shared_hash, shared_repr
from .._errors import PayloadError
from .._json_values import MAX_JSON_DEPTH

if typing.TYPE_CHECKING:
    import decimal

    import cattrs

__all__ = [
    "PLAIN",
    "PayloadTypeError",
    "Signature",
    "converter",
    "payload_converter",
    "signature_of",
    "structure_as",
    "to_json",
    "unstructure_as",
]


class PayloadTypeError(PayloadError):
    """A payload that does not structure into its annotation (or an output that does not
    unstructure as its return annotation): the step (or run) fails, not retryable (code
    ``payload_type``). The message names the field (``$.customer.id``)."""

    code = "payload_type"
    retryable = False


class _Plain:
    __slots__ = ()

    def __repr__(self) -> str:
        return "PLAIN"


#: The annotation of a plain JSON payload: nothing is structured.
PLAIN: Any = _Plain()


def _is_pydantic_model(tp: Any) -> bool:
    pydantic = sys.modules.get("pydantic")
    return pydantic is not None and isinstance(tp, type) and issubclass(tp, pydantic.BaseModel)


@functools.cache
def _converter() -> cattrs.Converter:
    """The project-wide converter of typed payloads, built on first use (cattrs is imported
    only when a typed payload is structured, or when ``payload_converter`` is first named)."""
    from cattrs.preconf.json import make_converter

    conv = make_converter()
    # Scalars are strict, as on the wire (_codec): "5" is not an int, 1.9 not an int (cattrs'
    # default would call int() and lose the .9), true not an int, 5 not a str.
    conv.register_structure_hook(int, _strict(int, (int,)))
    conv.register_structure_hook(float, _strict(float, (int, float)))
    conv.register_structure_hook(str, _strict(str, (str,)))
    conv.register_structure_hook(bool, _strict(bool, (bool,)))
    conv.register_unstructure_hook(uuid.UUID, str)
    conv.register_structure_hook(uuid.UUID, lambda value, _: uuid.UUID(_text(value, "a UUID")))
    import decimal  # (with the converter: an engine's import does not load it)

    conv.register_unstructure_hook(decimal.Decimal, str)
    conv.register_structure_hook(decimal.Decimal, _structure_decimal)
    conv.register_unstructure_hook(datetime.time, datetime.time.isoformat)
    conv.register_structure_hook(
        datetime.time, lambda value, _: datetime.time.fromisoformat(_text(value, "a time"))
    )
    conv.register_structure_hook_func(
        _is_pydantic_model, lambda value, tp: tp.model_validate(value)
    )
    conv.register_unstructure_hook_func(_is_pydantic_model, lambda obj: obj.model_dump(mode="json"))
    return conv


def _strict(kind: type, accepted: tuple[type, ...]) -> Callable[[Any, Any], Any]:
    def structure(value: Any, _: Any) -> Any:
        if type(value) not in accepted:
            raise TypeError(f"expected {kind.__name__}, got {type(value).__name__} {value!r:.40}")
        return kind(value)

    return structure


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected {what} as a string, got {type(value).__name__} {value!r:.40}")
    return value


def _structure_decimal(value: Any, _: Any) -> decimal.Decimal:
    import decimal

    if type(value) is bool or not isinstance(value, (str, int)):
        raise TypeError(
            f"expected a Decimal as a string (or an int), got {type(value).__name__} {value!r:.40}"
        )
    try:
        return decimal.Decimal(value)
    except decimal.InvalidOperation:
        raise ValueError(f"{value!r:.40} is not a decimal number") from None


if typing.TYPE_CHECKING:
    #: The project-wide converter of typed payloads (register hooks for your own types on it).
    converter: cattrs.Converter
    #: The converter as the package exports it (``dt.payload_converter``): register hooks on it.
    payload_converter: cattrs.Converter
else:

    def __getattr__(name: str) -> Any:
        # Both names are the one converter, built on first use (PEP 562).
        if name in ("converter", "payload_converter"):
            return _converter()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------ which annotations are typed

_JSON_LEAVES: frozenset[Any] = frozenset(
    {Any, object, None, type(None), str, int, float, bool, dict, list}
)
_JSON_ORIGINS: frozenset[Any] = frozenset(
    {dict, list, Mapping, Sequence, typing.Union, types.UnionType, typing.Literal}
)


def _plain(tp: Any) -> bool:
    """Whether annotation ``tp`` only names JSON values (nothing to structure)."""
    try:
        if tp in _JSON_LEAVES:
            return True
    except TypeError:  # an unhashable annotation
        return False
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return True
    if origin in _JSON_ORIGINS:
        return all(_plain(arg) for arg in typing.get_args(tp))
    return type(tp).__name__ == "TypeAliasType"  # a `type` alias (JSONValue): plain


@attrs.frozen(repr=False, eq=False)
class Signature:
    """The payload types of a step (``skip=0``) or workflow (``skip=1``, after ``ctx``)."""

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    input: Any = PLAIN
    output: Any = PLAIN

    @property
    def plain(self) -> bool:
        """Both payloads plain JSON: the function is called as it is, nothing converted."""
        return self.input is PLAIN and self.output is PLAIN


_signatures: dict[tuple[Any, int], Signature] = {}


def signature_of(fn: Any, skip: int) -> Signature:
    """The payload types of ``fn``: its input parameter (``skip`` positional parameters in)
    and its return, from its annotations (``PLAIN`` where there is none or it is plain JSON).
    Read once and kept; forward references resolve against the function's module.

    Raises:
        PayloadTypeError: an annotation names a type its module does not define (yet).
    """
    key = (fn, skip)
    found = _signatures.get(key)
    if found is not None:
        return found
    try:
        params = list(inspect.signature(fn).parameters.values())
        hints = typing.get_type_hints(fn)
    except NameError as exc:
        raise PayloadTypeError(f"the annotations of {fn!r} do not resolve: {exc}") from None
    except Exception:  # not introspectable (a builtin, a partial of one): plain JSON
        params, hints = [], {}
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    input_type = hints.get(positional[skip].name, PLAIN) if len(positional) > skip else PLAIN
    output_type = hints.get("return", PLAIN)
    signature = Signature(
        PLAIN if _plain(input_type) else input_type,
        PLAIN if _plain(output_type) else output_type,
    )
    _signatures[key] = signature
    return signature


# ------------------------------------------------------------------ conversions


def structure_as(value: Any, tp: Any, what: str) -> Any:
    """JSON ``value`` structured into ``tp`` (``PLAIN``: ``value`` itself).

    Raises:
        PayloadTypeError: it does not structure; the message names the field path.
    """
    if tp is PLAIN:
        return value
    converter = _converter()
    import cattrs  # (loaded: the converter imported it)

    try:
        return converter.structure(value, tp)
    except cattrs.BaseValidationError as exc:
        problems = cattrs.transform_error(exc, path="$")
        raise PayloadTypeError(
            f"{what} does not structure into {_name(tp)}: {'; '.join(problems)}",
            path=_first_path(problems),
        ) from None
    except Exception as exc:
        errors = getattr(exc, "errors", None)
        if callable(errors):  # pydantic's ValidationError
            problems = [
                f"{e.get('msg')} @ $" + "".join(_step(part) for part in e.get("loc", ()))
                for e in errors()
            ]
            raise PayloadTypeError(
                f"{what} does not structure into {_name(tp)}: {'; '.join(problems)}",
                path=_first_path(problems),
            ) from None
        raise PayloadTypeError(
            f"{what} does not structure into {_name(tp)}: {type(exc).__name__}: {exc} @ $",
            path="$",
        ) from None


def unstructure_as(value: Any, tp: Any, what: str) -> Any:
    """``value`` (of annotation ``tp``) as a JSON value; ``PLAIN``: see :func:`to_json`.

    Raises:
        PayloadTypeError: it does not unstructure as ``tp``.
    """
    if tp is PLAIN:
        return to_json(value)
    try:
        return _converter().unstructure(value, unstructure_as=tp)
    except Exception as exc:
        raise PayloadTypeError(
            f"{what} ({type(value).__name__}) does not unstructure as {_name(tp)}: "
            f"{type(exc).__name__}: {exc}"
        ) from None


_RICH = (datetime.date, datetime.time, uuid.UUID, enum.Enum)


def _is_decimal(value: Any) -> bool:
    # While the decimal module is not loaded, no Decimal exists: the check does not import it.
    decimal = sys.modules.get("decimal")
    return decimal is not None and isinstance(value, decimal.Decimal)


def _rich(value: Any) -> bool:
    return (
        isinstance(value, _RICH)
        or _is_decimal(value)
        or attrs.has(type(value))
        or (dataclasses.is_dataclass(value) and not isinstance(value, type))
        or _is_pydantic_model(type(value))
    )


def to_json(value: Any, depth: int = 0) -> Any:
    """``value`` with its typed parts (attrs and dataclass instances, datetimes, enums, UUIDs,
    Decimals, pydantic models, anywhere in dicts, lists and tuples) unstructured into their
    JSON forms; the rest untouched, so what is not JSON (a set on its own, NaN, an object)
    is still refused, with its path, by the JSON check that follows."""
    kind = type(value)
    if kind is str or kind is int or kind is float or kind is bool or value is None:
        return value
    if depth > MAX_JSON_DEPTH:
        return value  # the JSON check reports the depth
    if kind is dict:
        return {key: to_json(item, depth + 1) for key, item in value.items()}
    if kind is list or kind is tuple:
        return [to_json(item, depth + 1) for item in value]
    if _rich(value):
        return _converter().unstructure(value)
    return value


def _name(tp: Any) -> str:
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if args and origin is not None:
        return f"{_name(origin)}[{', '.join(_name(arg) for arg in args)}]"
    return getattr(tp, "__qualname__", None) or repr(tp)


def _step(part: Any) -> str:
    return f"[{part}]" if isinstance(part, int) else f".{part}"


def _first_path(problems: list[str]) -> str | None:
    for problem in problems:
        if " @ " in problem:
            return problem.rsplit(" @ ", 1)[1]
    return None


async def call_workflow(fn: Callable[..., Any], ctx: Any, value: Any, workflow: str) -> Any:
    """Workflow ``fn`` called with its input structured into its annotation; its return value
    unstructured into JSON.

    Raises:
        PayloadTypeError: the input does not structure (the run fails with it).
    """
    signature = signature_of(fn, 1)
    if signature.plain:
        return to_json(await fn(ctx, value))
    typed = structure_as(value, signature.input, f"the input of workflow {workflow!r}")
    output = await fn(ctx, typed)
    return unstructure_as(output, signature.output, f"the return value of workflow {workflow!r}")
