"""Which Cluster slot a key (and a command) belongs to: CRC16 with ``{hash tag}`` rules.

A Redis Cluster splits the key space in 16384 slots: ``CRC16(key) mod 16384``, where ``key`` is
only the part between the first ``{`` and the next ``}`` when that part is not empty (the *hash
tag*: ``{queue}:ready`` and ``{queue}:active`` share a slot). CRC16 is the XMODEM variant
(polynomial 0x1021, initial value 0), as in the Cluster specification.

Which arguments of a command are keys comes from a table of the commands this project and its
users send (:data:`_POSITIONS`, :data:`_NUMKEYS`); a command in neither table has no known keys
and the cluster client asks the server (``COMMAND GETKEYS``) instead of guessing.
"""

from __future__ import annotations

import binascii
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ._connection import RedisArg

__all__ = ["SLOTS", "command_keys", "key_slot", "keyless", "to_bytes"]

SLOTS: Final = 16384


def _crc16(data: bytes) -> int:
    # binascii's CRC-CCITT (polynomial 0x1021) from an initial value of 0 is the XMODEM
    # variant the Cluster specification uses, computed in C.
    return binascii.crc_hqx(data, 0)


def to_bytes(arg: RedisArg) -> bytes:
    """An argument as the bytes the server receives (``str`` UTF-8, numbers as decimal text, as
    ``hiredis.pack_command`` sends them)."""
    if isinstance(arg, bytes):
        return arg
    return (arg if isinstance(arg, str) else repr(arg)).encode()


#: Slots of the keys seen lately: a run's or a queue's keys come back with every command on it
#: (a workflow's steps hit the same few keys dozens of times), and a dict lookup costs a tenth
#: of encoding, finding the tag and the CRC. Emptied when full, so it stays bounded.
_SLOT_CACHE: dict[RedisArg, int] = {}
_SLOT_CACHE_SIZE: Final = 16384


def key_slot(key: RedisArg) -> int:
    """The Cluster slot of ``key`` (what ``CLUSTER KEYSLOT`` answers).

    Args:
        key: the key; ``str`` is UTF-8 encoded.

    Returns:
        the slot, ``0 <= slot < 16384``.
    """
    slot = _SLOT_CACHE.get(key)
    if slot is None:
        slot = _key_slot(key)
        if len(_SLOT_CACHE) >= _SLOT_CACHE_SIZE:
            _SLOT_CACHE.clear()
        _SLOT_CACHE[key] = slot
    return slot


def _key_slot(key: RedisArg) -> int:
    data = to_bytes(key)
    start = data.find(b"{")
    if start >= 0:
        end = data.find(b"}", start + 1)
        if end > start + 1:  # an empty tag ("{}") hashes the whole key
            data = data[start + 1 : end]
    return _crc16(data) % SLOTS


#: Command names as sent -> upper case (a handful of names, each seen on every command).
_NAMES: dict[RedisArg, str] = {}


def _upper(arg: RedisArg) -> str:
    name = _NAMES.get(arg)
    if name is None:
        name = to_bytes(arg).decode("ascii", "replace").upper()
        if len(_NAMES) < 1024:  # names, not arguments: bounded all the same
            _NAMES[arg] = name
    return name


#: Commands without keys, served by any master: never worth a round trip to ask.
_KEYLESS: Final = frozenset(
    {
        "PING", "ECHO", "INFO", "TIME", "DBSIZE", "FLUSHALL", "FLUSHDB", "SCRIPT", "CLUSTER",
        "CLIENT", "CONFIG", "COMMAND", "SCAN", "RANDOMKEY", "KEYS", "PUBLISH", "FUNCTION",
        "LASTSAVE", "WAIT", "ROLE", "SLOWLOG", "LATENCY", "ACL", "HELLO", "AUTH", "SELECT",
        "SAVE", "BGSAVE", "BGREWRITEAOF", "DEBUG", "READONLY", "READWRITE", "ASKING",
        "PUBSUB", "SWAPDB", "LOLWUT", "MULTI", "EXEC", "DISCARD", "UNWATCH",
    }
)  # fmt: skip

#: ``name -> (first, last, step)`` key positions, as ``COMMAND`` reports them (``last`` counts
#: from the end when negative: ``-1`` is the last argument, ``-2`` the one before).
_POSITIONS: Final[dict[str, tuple[int, int, int]]] = {
    **dict.fromkeys(
        (
            "GET", "SET", "SETNX", "SETEX", "PSETEX", "GETSET", "GETDEL", "GETEX", "APPEND",
            "STRLEN", "INCR", "INCRBY", "INCRBYFLOAT", "DECR", "DECRBY", "GETRANGE", "SETRANGE",
            "GETBIT", "SETBIT", "BITCOUNT", "BITPOS", "BITFIELD", "BITFIELD_RO", "EXPIRE",
            "PEXPIRE", "EXPIREAT", "PEXPIREAT", "EXPIRETIME", "PEXPIRETIME", "TTL", "PTTL",
            "PERSIST", "TYPE", "DUMP", "RESTORE", "SORT", "SORT_RO", "HSET", "HSETNX", "HGET",
            "HMSET", "HMGET", "HDEL", "HEXISTS", "HLEN", "HKEYS", "HVALS", "HGETALL", "HINCRBY",
            "HINCRBYFLOAT", "HSCAN", "HSTRLEN", "HRANDFIELD", "LPUSH", "RPUSH", "LPUSHX",
            "RPUSHX", "LPOP", "RPOP", "LLEN", "LRANGE", "LINDEX", "LSET", "LREM", "LTRIM",
            "LINSERT", "LPOS", "SADD", "SREM", "SMEMBERS", "SISMEMBER", "SMISMEMBER", "SCARD",
            "SPOP", "SRANDMEMBER", "SSCAN", "ZADD", "ZREM", "ZSCORE", "ZMSCORE", "ZINCRBY",
            "ZCARD", "ZCOUNT", "ZRANGE", "ZRANGEBYSCORE", "ZREVRANGEBYSCORE", "ZRANGEBYLEX",
            "ZREVRANGEBYLEX", "ZREVRANGE", "ZRANK", "ZREVRANK", "ZREMRANGEBYSCORE",
            "ZREMRANGEBYRANK", "ZREMRANGEBYLEX", "ZPOPMIN", "ZPOPMAX", "ZSCAN", "ZLEXCOUNT",
            "ZRANDMEMBER", "XADD", "XLEN", "XRANGE", "XREVRANGE", "XDEL", "XTRIM", "XACK",
            "XCLAIM", "XAUTOCLAIM", "XPENDING", "XSETID", "PFADD", "GEOADD", "GEOPOS",
            "GEODIST", "GEOHASH", "GEOSEARCH", "SPUBLISH",
        ),
        (1, 1, 1),
    ),
    **dict.fromkeys(
        (
            "DEL", "UNLINK", "EXISTS", "TOUCH", "MGET", "SDIFF", "SINTER", "SUNION", "WATCH",
            "PFCOUNT", "PFMERGE", "SDIFFSTORE", "SINTERSTORE", "SUNIONSTORE", "SSUBSCRIBE",
        ),
        (1, -1, 1),
    ),
    **dict.fromkeys(("BLPOP", "BRPOP", "BZPOPMIN", "BZPOPMAX"), (1, -2, 1)),
    **dict.fromkeys(
        (
            "RENAME", "RENAMENX", "SMOVE", "RPOPLPUSH", "LMOVE", "BRPOPLPUSH", "BLMOVE", "COPY",
            "GEOSEARCHSTORE", "ZRANGESTORE",
        ),
        (1, 2, 1),
    ),
    **dict.fromkeys(("MSET", "MSETNX"), (1, -1, 2)),
    # Container commands whose key follows the subcommand (XINFO STREAM key, OBJECT ENCODING
    # key); their keyless subcommands (XINFO HELP) have fewer arguments.
    **dict.fromkeys(("XINFO", "XGROUP", "OBJECT", "MEMORY"), (2, 2, 1)),
}  # fmt: skip

#: ``name -> (where the key count is, keys before it)``: ``EVAL script numkeys key...``.
_NUMKEYS: Final[dict[str, tuple[int, int]]] = {
    **dict.fromkeys(("EVAL", "EVALSHA", "EVAL_RO", "EVALSHA_RO", "FCALL", "FCALL_RO"), (2, 0)),
    **dict.fromkeys(
        ("ZUNION", "ZINTER", "ZDIFF", "SINTERCARD", "ZINTERCARD", "LMPOP", "ZMPOP"), (1, 0)
    ),
    **dict.fromkeys(("BLMPOP", "BZMPOP"), (2, 0)),
    **dict.fromkeys(("ZUNIONSTORE", "ZINTERSTORE", "ZDIFFSTORE"), (2, 1)),
}


def keyless(command: Sequence[RedisArg]) -> bool:
    """Whether ``command`` is known to have no keys (any master can serve it)."""
    name = _upper(command[0])
    if name in _KEYLESS:
        return True
    return name in ("XINFO", "XGROUP", "OBJECT", "MEMORY") and len(command) < 3


def command_keys(command: Sequence[RedisArg]) -> list[RedisArg] | None:
    """The keys of ``command``, from the tables above.

    Args:
        command: the command and its arguments.

    Returns:
        its keys (``[]`` for a command known to have none), or ``None`` when the command is not
        in the tables (ask the server) or its arguments are too short to say.
    """
    name = _upper(command[0])
    if name in _KEYLESS or (
        name in ("XINFO", "XGROUP", "OBJECT", "MEMORY") and len(command) < 3
    ):
        return []
    position = _POSITIONS.get(name)
    if position is not None:
        first, last, step = position
        stop = len(command) + last + 1 if last < 0 else last + 1
        if first >= len(command) or stop > len(command):
            return None  # too few arguments: let the server say what is wrong
        return list(command[first:stop:step])
    counted = _NUMKEYS.get(name)
    if counted is not None:
        at, before = counted
        try:
            raw = command[at]
            count = raw if type(raw) is int else int(to_bytes(raw))  # a script's: an int
        except (IndexError, ValueError):
            return None
        if count < 0 or at + 1 + count > len(command):
            return None
        return [*command[at - before : at], *command[at + 1 : at + 1 + count]]
    if name in ("XREAD", "XREADGROUP"):
        for index, arg in enumerate(command):
            if to_bytes(arg).upper() == b"STREAMS":
                rest = command[index + 1 :]
                return list(rest[: len(rest) // 2])
        return None
    return None
