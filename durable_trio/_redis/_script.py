"""Lua scripts run by SHA1 (``EVALSHA``), falling back to ``EVAL`` when the server forgot them."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ._connection import RedisArg

__all__ = ["Script", "writable_lua"]


class _Executor(Protocol):
    async def execute(self, *args: RedisArg, reply_timeout: float | None = None) -> Any: ...


class Script:
    """A Lua script registered with a client (see :meth:`RedisClient.script`).

    Calling it runs ``EVALSHA``; on ``NOSCRIPT`` (a restarted server, ``SCRIPT FLUSH``) the
    connection retries once with ``EVAL``, which runs the script and caches it again. The same
    fallback applies to :meth:`command` tuples inside a pipeline, or on a dedicated connection
    of the same client.

    Attributes:
        source: the script's source, UTF-8 encoded.
        sha: its SHA1, lower-case hex (what ``EVALSHA`` names it by).
    """

    __slots__ = ("_executor", "sha", "source")

    def __init__(self, executor: _Executor, source: str | bytes) -> None:
        self._executor = executor
        self.source = source.encode() if isinstance(source, str) else bytes(source)
        self.sha = hashlib.sha1(self.source).hexdigest()

    def command(
        self, keys: Sequence[RedisArg] = (), args: Sequence[RedisArg] = ()
    ) -> tuple[RedisArg, ...]:
        """The ``EVALSHA`` command for these keys and arguments, for a pipeline.

        Args:
            keys: the ``KEYS`` of the script.
            args: the ``ARGV`` of the script.

        Returns:
            ``("EVALSHA", sha, len(keys), *keys, *args)``.
        """
        return ("EVALSHA", self.sha, len(keys), *keys, *args)

    async def __call__(
        self,
        keys: Sequence[RedisArg] = (),
        args: Sequence[RedisArg] = (),
        *,
        reply_timeout: float | None = None,
    ) -> Any:
        """Run the script through the client's pool.

        Args:
            keys: the ``KEYS`` of the script.
            args: the ``ARGV`` of the script.
            reply_timeout: seconds to wait for the reply (``None``: the client's).

        Returns:
            the script's reply.

        Raises:
            RedisReplyError: the script raised an error (or is not valid Lua).
            BrokerUnavailable: the server cannot be reached.
        """
        command = self.command(keys, args)
        return await self._executor.execute(*command, reply_timeout=reply_timeout)

    def __repr__(self) -> str:
        return f"Script(sha={self.sha!r})"


def writable_lua(damaged: str) -> str:
    """The Lua function ``writable(key, kind)``: it fails the script (an error reply, ``WRONGTYPE
    <key> holds a <type>, not a <kind> (<damaged>)``) when ``key`` holds another type than
    ``kind``. Called before a script's first write: Redis keeps a script's writes when it fails
    halfway, so a key of the wrong type met later would leave the script's change half made."""
    return f"""
local function writable(key, kind)
  local found = redis.call('TYPE', key)['ok']
  if found ~= kind and found ~= 'none' then
    error({{err = 'WRONGTYPE ' .. key .. ' holds a ' .. found .. ', not a ' .. kind ..
      ' ({damaged})'}})
  end
end
"""
