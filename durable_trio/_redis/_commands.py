"""What a Redis command is to this client: its arguments, which commands it refuses, its bytes.

A connection matches each reply to the oldest command awaiting one (a FIFO), so a command that
does not answer exactly once (pub/sub's, ``MONITOR``, ``CLIENT REPLY``) would put every later
reply out of step: :func:`check` refuses those, and remembers the names it passed so that a
name seen before costs one set lookup. :func:`pack` is hiredis's encoder of the RESP protocol.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, TypeAlias, cast

import hiredis

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["ANSWER_ONCE", "RedisArg", "check", "command_name", "pack"]

RedisArg: TypeAlias = str | bytes | int | float
"""One argument of a command; ``str`` is sent UTF-8 encoded, numbers as their decimal text."""

pack = cast("Callable[[tuple[RedisArg, ...]], bytes]", hiredis.pack_command)
"""A command's bytes on the wire."""

# Commands whose replies are not one-per-command: they would desynchronise the FIFO.
_REFUSED: Final = frozenset(
    {"SUBSCRIBE", "PSUBSCRIBE", "SSUBSCRIBE", "UNSUBSCRIBE", "PUNSUBSCRIBE", "SUNSUBSCRIBE"}
    | {"MONITOR", "SYNC", "PSYNC"}
)

#: Command names (as given: str or bytes) already found to answer once: checked in one lookup.
ANSWER_ONCE: set[RedisArg] = set()
_ANSWER_ONCE_MAX: Final = 512


def command_name(arg: RedisArg) -> str:
    """A command's (or subcommand's) name, upper case."""
    if isinstance(arg, bytes):
        return arg.decode("ascii", "replace").upper()
    return str(arg).upper()


def check(command: tuple[RedisArg, ...]) -> None:
    """Refuse an empty command and one that does not answer once (``ValueError``)."""
    if not command:
        raise ValueError("an empty Redis command")
    first = command[0]
    if first in ANSWER_ONCE:
        return
    name = command_name(first)
    if name in _REFUSED or (
        name == "CLIENT" and len(command) > 1 and command_name(command[1]) == "REPLY"
    ):
        raise ValueError(
            f"{name} does not answer one reply per command; use client.subscribe() "
            "for pub/sub and do not use CLIENT REPLY / MONITOR on this client"
        )
    if name != "CLIENT" and len(ANSWER_ONCE) < _ANSWER_ONCE_MAX:
        ANSWER_ONCE.add(first)
