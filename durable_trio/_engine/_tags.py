"""A run's tags (issue 34, item 2): a small bounded dict of ``str -> str`` given at the start
(``engine.start(..., tags={"customer": "c1"})``), stored with the run, indexed by every run
store so ``runs list --tag customer=c1`` pages by cursor without reading every run.

Checked at the entry (:func:`check_tags`), with a clear :class:`~durable_trio.ConfigError`:

- at most :data:`MAX_TAGS` tags;
- a key is 1 to :data:`MAX_KEY` characters of ``A-Z a-z 0-9 _ . -`` (so ``key=value`` on a
  command line splits at the first ``=``, and a Redis index key ends at the first ``:``);
- a value is 1 to :data:`MAX_VALUE` printable characters (no control, format or separator
  character: a value is shown in terminals and pages).

Children do not inherit their parent's tags (docs/engine.md, "Tags").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

import orjson

from .._errors import ConfigError

__all__ = [
    "MAX_KEY",
    "MAX_TAGS",
    "MAX_VALUE",
    "check_tags",
    "parse_tag",
    "read_tags",
    "tags_json",
]

#: Tags a run may carry at most.
MAX_TAGS: Final = 16
#: The longest tag key.
MAX_KEY: Final = 64
#: The longest tag value.
MAX_VALUE: Final = 256

_KEY: Final = r"[A-Za-z0-9_.\-]+"  # (re caches it compiled, on first use)


def check_tags(tags: Any, where: str = "tags") -> dict[str, str]:
    """``tags`` as a plain dict, sorted by key (``None``: no tags, ``{}``).

    Raises:
        ConfigError: not a mapping of ``str`` to ``str``, too many tags, a key or a value
            empty, too long or holding a character it may not.
    """
    if tags is None:
        return {}
    if not isinstance(tags, Mapping):
        raise ConfigError(f"{where}: a dict of str -> str, got a {type(tags).__name__}")
    if len(tags) > MAX_TAGS:
        raise ConfigError(f"{where}: at most {MAX_TAGS} tags, got {len(tags)}")
    checked: dict[str, str] = {}
    for key, value in tags.items():
        if type(key) is not str or not re.fullmatch(_KEY, key) or len(key) > MAX_KEY:
            raise ConfigError(
                f"{where}: a tag key is 1 to {MAX_KEY} characters of A-Z a-z 0-9 _ . -,"
                f" got {key!r}"
            )
        if type(value) is not str or not value or len(value) > MAX_VALUE:
            raise ConfigError(
                f"{where}: tag {key!r}: a value is a str of 1 to {MAX_VALUE} characters,"
                f" got {value!r}"[:300]
            )
        if not value.isprintable():
            raise ConfigError(
                f"{where}: tag {key!r}: a value holds no control, format or separator"
                f" character, got {value!r}"[:300]
            )
        checked[key] = value
    return dict(sorted(checked.items()))


def parse_tag(text: str, where: str = "--tag") -> tuple[str, str]:
    """``"key=value"`` (the command line's, the console's filter) as ``(key, value)``.

    Raises:
        ConfigError: no ``=``, or a bad key or value (see :func:`check_tags`).
    """
    key, sep, value = text.partition("=")
    if not sep:
        raise ConfigError(f"{where}: a tag filter is KEY=VALUE, got {text!r}")
    ((key, value),) = check_tags({key: value}, where).items()
    return key, value


def tags_json(tags: Mapping[str, str]) -> str | None:
    """The stored form of ``tags``: JSON text, keys sorted (``None``: no tags)."""
    if not tags:
        return None
    return orjson.dumps(dict(tags), option=orjson.OPT_SORT_KEYS).decode()


def read_tags(raw: str | bytes | None) -> dict[str, str]:
    """Stored tags as a dict; none stored (a run started before tags), or a damaged value
    (tags are an index's copy, advisory): ``{}``."""
    if not raw:
        return {}
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)}
