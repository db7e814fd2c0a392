"""Stored strings shown in a terminal: made visible, never interpreted.

A run id, a workflow or step name, an error message, a queue name or a worker id is written
by whoever started the run or ran the worker. Printed raw, an ``ESC`` sequence in it sets the
terminal's title, clears the screen or hides what follows, a ``CR`` or ``LF`` forges a table
row, and a bidi override reverses what the operator reads. :func:`visible` spells such
characters out (``\\x1b``, ``\\n``, ``\\u202e``) and keeps every other character, ordinary
unicode included, as it is; every command that prints a stored string routes it through here.
"""

from __future__ import annotations

__all__ = ["visible"]

#: Unicode categories spelled out: controls (C0, DEL, C1), format characters (bidi overrides
#: and isolates, zero-width joiners, the BOM), the line and paragraph separators, and lone
#: surrogates (which a UTF-8 terminal cannot even be sent: printing one would raise).
_HIDDEN = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})

#: The usual short spellings (as Python's ``repr``), the rest by code point.
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _spelled(char: str) -> str:
    named = _NAMED.get(char)
    if named is not None:
        return named
    point = ord(char)
    if point < 0x100:
        return f"\\x{point:02x}"
    if point < 0x10000:
        return f"\\u{point:04x}"
    return f"\\U{point:08x}"


def visible(text: str) -> str:
    """``text`` with every control, format or separator character spelled out.

    ``ESC`` becomes ``\\x1b``, ``BEL`` ``\\x07``, ``CR`` ``\\r``, ``LF`` ``\\n``, ``DEL``
    ``\\x7f``, a C1 control ``\\x9b``, a bidi override ``\\u202e``; letters, digits,
    punctuation, spaces and symbols of any script are kept. A backslash is kept as it is, so
    an ordinary value prints unchanged (a value that holds the four characters ``\\x1b`` and
    one that holds an ``ESC`` look alike: ``--json`` tells them apart).

    Args:
        text: a string read from the store or the broker.

    Returns:
        the same string when it holds nothing to spell out (the usual case), else a copy
        that prints as one line of inert text.
    """
    if text.isprintable():  # no control, format or separator character but the space: as it is
        return text
    import unicodedata  # (only for what holds something to spell out: not at every import)

    return "".join(
        _spelled(char) if unicodedata.category(char) in _HIDDEN else char for char in text
    )
