"""The Redis broker: many machines, one Redis (or one Redis Cluster slot per queue).

Open one on a :class:`~durable_trio._redis.RedisClient` and enter it (it owns one background
task, the doorbell listener)::

    async with open_redis(url) as client, RedisBroker(client) as broker:
        await broker.push_on("q", Job("1", b"{}"))

or let it open its own client: ``async with RedisBroker.from_url(url) as broker:``.

Key layout:
    Every key of queue ``Q`` carries the hash tag ``{Q}``, so a queue lives in one Cluster slot
    and every script touches one slot only:

    ======================  ======  ==========================================================
    ``{Q}:seq``             string  ``INCRBY`` counter: internal job ids and FIFO sequence
                                    numbers (damaged: rebuilt from the queue, see ``TAKE_SEQ``)
    ``{Q}:ready``           zset    score = priority, member = ``%016d(seq) .. n``
    ``{Q}:delayed``         zset    score = due time (server seconds), member as in ``ready``
    ``{Q}:active``          zset    score = claimed (or last renewed) at, member = lease token
    ``{Q}:jobs``            hash    ``n`` -> job bytes; ``t`` .. ``n`` -> its push time,
                                    ``"<seconds> <microseconds>"`` as the server's ``TIME``
                                    gives them, kept through retries, reclaims and delays
                                    (``queue_stats``' oldest ready age), written and deleted
                                    with the bytes in the same command
    ``{Q}:meta``            hash    ``n`` -> ``"priority:attempts:stalled_count:id"``
    ``{Q}:stalls``          hash    ``n`` -> stall history, JSON ``[[at, worker], ...]``
                                    (``[at, worker, 0]``: a stall that did not count)
    ``{Q}:claims``          hash    ``n`` -> ``%016d(seq) .. worker`` of the current claim:
                                    the place it had in ``ready``, and who holds it (a byte
                                    ``\x01`` before the worker: popped ahead, not started)
    ``{Q}:failed``          list    failed jobs, newest first, trimmed to ``failed_retention``
                                    (a job with damaged meta too: kept raw, see the scripts)
    ``{Q}:quarantine``      list    stored entries that name no readable job (a member of
                                    ``ready``, ``delayed`` or ``active`` without a job or
                                    meta, a replaced stall history, a rebuilt sequence
                                    counter), each with what was found,
                                    the reason and the server time; newest first, trimmed to
                                    ``quarantine_retention``
    ``{Q}:moved``           zset    score = ``n``, member as in ``ready``: the ready jobs at
                                    another place than their push's (promoted, retried, or
                                    reclaimed after one of those), for ``queue_stats``
    ``{Q}:armed``           string  set by a pop that found nothing: someone may be waiting
    ``{Q}:claimed``         string  set by a claim, cleared by a sweep that leaves none
    ======================  ======  ==========================================================

    Outside the queues, ``{durable-trio}:identity`` and ``{durable-trio}:store-lost``: the
    store's identity and its loss alarm (see :mod:`~durable_trio.brokers._redis_identity`).

    ``n`` is the job's internal id (the ``seq`` value of its push), so two pushes never collide
    even if they reuse a job id. A lease token is ``n:<random>``, 64 random bits per claim
    (drawn with :mod:`secrets` by the client, one slice per claim), so a dead token cannot be
    guessed back to life, and the ``n`` prefix keeps it unique whatever the random part.

Ordering:
    ``ready`` is scored by the priority alone; jobs of one priority are ordered by their member,
    which starts with a zero-padded sequence number (Redis orders equal scores by member, byte
    by byte). So FIFO within a priority needs no timestamp, and the priority range does not eat
    into the sequence's range as a combined ``priority * 2**k + seq`` score would: priorities
    are any integer in ``[MIN_PRIORITY, MAX_PRIORITY]`` (exact as a double score), and the
    sequence runs to 2**53 (Lua's exact integers: three centuries of a million operations a
    second on one queue). A push, a promotion and a counted retry take a new sequence number
    (the back of the priority); a reclaimed job and an immediate attempt-neutral handback get
    back the place they were popped from (kept in ``{Q}:claims``): they waited their turn once.

Scripts:
    One Lua script per multi-key step (push, claim, complete, fail, retry, renew, recover,
    size, peek), registered once with the client and run by ``EVALSHA`` (the client falls back
    to ``EVAL`` on ``NOSCRIPT``, after a restart or ``SCRIPT FLUSH``). Every script reads the
    server's clock (``TIME``); delays and thresholds travel as relative seconds. The claim
    script promotes at most ``promote_batch`` due delayed jobs per call. Claims are indexed by
    age in ``active``, so recovery is ``ZRANGEBYSCORE ... LIMIT``: O(log n + k), never a scan of
    every claim; renewal moves a claim's score.

Wake-up (:meth:`RedisBroker.wait_for_work`):
    A pop that finds nothing sets ``{Q}:armed`` (in the same script, atomically with finding
    nothing). A push, retry or recovery that finds the flag deletes it and ``PUBLISH``\\ es on
    the queue's doorbell channel; when nobody waits, nothing is published, so busy workers are
    not flooded with messages. Each broker keeps ONE subscription connection, subscribing a
    queue's channel the first time a task waits on it, and counts the rings per queue. A
    waiter compares the count with the one taken just before its broker's last empty pop: if
    the subscription was already confirmed when that pop was sent, no push after the pop can
    go unnoticed; otherwise it first subscribes, then re-checks (``peek``, which arms too).
    A waiter also wakes when the earliest delayed job comes due (the claim script returns that
    time). Every ``safety_poll_interval`` seconds (on a grid shared by every waiter, so the
    checks of all idle queues leave together as ONE ``MGET`` of their ``{Q}:armed`` flags) a
    waiter checks its flag: a push, retry or recovery since the flag was set would have
    deleted it, so while it stands
    nothing became ready, whatever happened to the doorbell; once it is gone (or lost to a
    flush or an eviction) the waiter returns and the caller's next pop re-arms. A silent
    subscription is ``PING``\\ ed after ``safety_poll_interval`` seconds. A lost subscription
    is reported (``on_error`` and the log), reopened with a jittered exponential backoff, and
    every queue's waiters are rung once it is back (they re-check). An idle broker therefore
    costs about ``2 / safety_poll_interval`` commands a second (one MGET, one PING), none of
    them a script, whatever the number of queues: 0.07/s at the default 30 s.

Damaged data:
    Whatever is stored, no call raises for it and nothing is dropped (see the scripts'
    conventions): a claim with an unreadable field is handed over flagged
    (:attr:`~durable_trio.brokers.ClaimedJob.damage`, failed unread by the transport, kept raw
    in ``failed``); an entry that names no readable job goes to ``quarantine``; a damaged
    ``{Q}:seq`` is rebuilt from what the queue holds by the script that meets it, which goes on
    (recorded in ``quarantine``, reported once); a key of the wrong type fails its script
    before any write (a :class:`~durable_trio.BrokerError`). Run Redis with
    ``maxmemory-policy noeviction``: entering the broker warns otherwise
    (:class:`EvictionPolicyWarning`).

Errors:
    The client raises the project's own errors: :class:`~durable_trio.BrokerUnavailable` when
    Redis cannot be reached or does not answer in time (or is out of memory, ``-OOM``:
    :class:`~durable_trio._redis.RedisOutOfMemory`, nothing of the refused script written),
    :class:`~durable_trio.BrokerError` for an error reply,
    :class:`~durable_trio.TransportClosed` once the client is closed. A worker's result push
    and its task's acknowledgement are one script (:meth:`RedisBrokerBase.push_and_complete_many`):
    a refused push never leaves its task acknowledged.

Cancellation:
    A call cancelled after its command was sent may still have run on the server (the client
    drains the reply). A cancelled pop may therefore leave a claim nobody tracks; the stalled
    sweep takes it back. The transport shields its pops for this reason.
"""

from __future__ import annotations

import logging
import math
import re
import secrets
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any, ClassVar, Final, Self

import attrs
import orjson
import trio
from trio_util import RepeatedEvent

from .._coalesce import Coalescer
from .._errors import BrokerError, ConfigError, DamagedJob, TransportClosed
from .._failures import report_through
from .._redis import RedisClient, RedisClusterClient, open_redis
from ._contract import (
    ClaimedJob,
    FailedJob,
    Job,
    JobState,
    Lease,
    QuarantinedEntry,
    Recovery,
    RenewOutcome,
    Stall,
)
from ._redis_doorbell import PubSubDoorbell
from ._redis_identity import IdentityWatch, StoreIdentity
from ._redis_repair import MEMBER_ID as _MEMBER_ID
from ._redis_repair import PUSH_KEYS, REQUEUE_FAILED, TAKE_SEQ, FailedJobRepair, scan_queues

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Sequence
    from types import TracebackType

    from .._redis import RedisArg, Script

__all__ = [
    "MAX_PRIORITY",
    "MIN_PRIORITY",
    "PROMOTE_BATCH",
    "EvictionPolicyWarning",
    "RedisBroker",
    "RedisBrokerBase",
    "RedisBrokerStatistics",
]

logger = logging.getLogger("durable_trio.redis")

#: Priorities a job may have: a ``ready`` score is a double, exact for integers up to 2**53.
MIN_PRIORITY: Final = -(2**53)
MAX_PRIORITY: Final = 2**53

#: Due delayed jobs promoted per claim at most, so one pop never does unbounded work.
PROMOTE_BATCH: Final = 100

#: Stalled claims handled per recovery script run (a sweep runs as many as it needs).
RECOVER_BATCH: Final = 1000

#: Leases refreshed per renewal script run.
RENEW_BATCH: Final = 1000

#: Independent random token parts one call draws at most.
_SUFFIXES_MAX: Final = 256

# ------------------------------------------------------------------------------------- scripts
#
# Shared conventions: ``now`` is the server's clock in seconds (``TIME``); a member of ``ready``
# or ``delayed`` is ``string.format('%016d', seq) .. n``, so the digits after its 16th byte are
# the internal id ``n``; a token is ``n .. ':' .. random``. Strings are joined with ``..`` (Lua
# 5.1's ``string.format('%s')`` stops at a NUL byte). Numbers go back to the client as strings
# (a Lua number in a reply is truncated to an integer).
#
# Damaged data (an eviction, a partial restore, another program writing these keys): Redis does
# not undo a script's writes when it fails halfway, so a script that errored on a stored value
# after its first write could leave a job in no structure at all. Every script therefore (1)
# validates what it must parse (``parse_meta``, the member and token patterns) before writing
# and never errors on it, and (2) reads every key it depends on before its first write, writing
# first where a failure costs nothing: a key of the wrong type then fails the script (an error
# reply, reported by the caller) with nothing lost. A path that meets damage also checks the type
# of the keys it is about to write (``writable``): a few commands, on that path only.

_NOW: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""


_PARSE_META: Final = """
-- The fields of a meta value, or nil when it is not "priority:attempts:stalled:id" (a damaged
-- value is never parsed further: no script errors on one halfway through its writes).
local function parse_meta(meta)
  if not meta then
    return nil
  end
  local priority, attempts, stalled, id = string.match(meta, '^(%-?%d+):(%d+):(%d+):(.*)$')
  if priority and #priority <= 17 and #attempts <= 15 and #stalled <= 15 then
    return priority, attempts, stalled, id
  end
  return nil
end
"""

_SET_ASIDE: Final = """
-- One stored field of a quarantine record, labelled (for a person to read; the length shows
-- where binary bytes end).
local function field(label, value)
  if value then
    return label .. ' (' .. #value .. ' bytes): ' .. value .. '\\n'
  end
  return label .. ': (none)\\n'
end
-- Fail the script (before a damage path's first write) if key holds another type than kind.
local function writable(key, kind)
  local found = redis.call('TYPE', key)['ok']
  if found ~= kind and found ~= 'none' then
    error({err = 'WRONGTYPE ' .. key .. ' holds a ' .. found .. ', not a ' .. kind ..
      ' (damaged store)'})
  end
end
-- A quarantine record: "at len(reason)\\n" followed by the reason and the raw fields.
local function quarantine_record(reason, raw)
  return string.format('%.6f', now) .. ' ' .. #reason .. '\\n' .. reason .. raw
end
"""

_FAILED_RECORD: Final = """
-- A failed record: "failed_at attempts stalled len(id) len(error) len(stalls)\\n" followed by
-- id, error, stalls and the job's bytes (last, so it needs no length). When the meta is
-- unreadable the counts are 0, the id is empty, and a seventh length (-1: no meta at all) says
-- how many bytes of raw meta follow the stalls: a damaged job is kept as it was found.
local function failed_record(now, meta, err, stalls, data)
  local _, attempts, stalled, id = parse_meta(meta)
  local raw, tail = '', ''
  if not attempts then
    attempts, stalled, id = '0', '0', ''
    raw = meta or ''
    tail = ' ' .. (meta and #meta or -1)
  end
  return string.format('%.6f', now) .. ' ' .. attempts .. ' ' .. stalled .. ' ' .. #id ..
    ' ' .. #err .. ' ' .. #stalls .. tail .. '\\n' .. id .. err .. stalls .. raw .. data
end
"""

# The sequence counter's keys of a script that starts with PUSH_KEYS (see TAKE_SEQ).
_PUSH_SEQ_KEYS: Final = """{seq = KEYS[1], ready = KEYS[2], delayed = KEYS[3], jobs = KEYS[4],
  meta = KEYS[5], claims = KEYS[7], moved = KEYS[8], active = KEYS[9], quarantine = KEYS[10]}"""

# KEYS: PUSH_KEYS (seq ready delayed jobs meta armed claims moved active quarantine)
# ARGV: id data priority delay channel quarantine_retention
# Returns 1, or the reason the sequence counter was repaired (TAKE_SEQ).
_PUSH: Final = TAKE_SEQ + """
local t = redis.call('TIME')
local seq, repaired = take_seq(PUSH_SEQ_KEYS, 1, ARGV[6])
local n = string.format('%d', seq)
-- (the push time as TIME's two parts, joined: a number format would cost more than the HSET)
redis.call('HSET', KEYS[4], n, ARGV[2], 't' .. n, t[1] .. ' ' .. t[2])
redis.call('HSET', KEYS[5], n, ARGV[3] .. ':0:0:' .. ARGV[1])
local member = string.format('%016d', seq) .. n
local delay = tonumber(ARGV[4])
if delay > 0 then
  local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
  redis.call('ZADD', KEYS[3], now + delay, member)
else
  redis.call('ZADD', KEYS[2], ARGV[3], member)
end
-- Ring only if a pop found nothing since the last ring: busy consumers get no messages.
-- A delayed push rings too: a waiter may need to wake earlier than it planned.
if redis.call('DEL', KEYS[6]) == 1 then
  redis.call('PUBLISH', ARGV[5], '')
end
return repaired or 1
""".replace("PUSH_SEQ_KEYS", _PUSH_SEQ_KEYS)

# KEYS: seq ready delayed active jobs meta stalls claims armed claimed quarantine moved
# ARGV: count worker token_suffixes promote_batch quarantine_retention [started]
# The claims past the first ``started`` are popped ahead: stored not started (a byte 1 before
# the worker in their claim entry). Without ``started`` every claim is started, but for a
# suspect (a job whose meta counts stalls): it is always stored not started.
# Returns {false} or {next_due_in_seconds} when nothing is ready (and arms the doorbell), else
# {drained, meta, data, stalls, token, meta, data, stalls, token, ...} where drained is false,
# or (fewer jobs than asked: the queue is empty now, and armed) "" or next_due_in_seconds.
# An entry with an empty token is a report: {reason, internal id or false, false, ""} for a
# member that names no readable job, already moved to the quarantine. A claim's meta, data and
# stalls are returned as stored (the client validates them; a damaged claim is still claimed).
_CLAIM: Final = (
    _NOW
    + _PARSE_META
    + _SET_ASIDE
    + TAKE_SEQ
    + """
local out = {false}
local set_aside = 0
local function quarantine(reason, raw, n)
  redis.call('LPUSH', KEYS[11], quarantine_record(reason, raw))
  set_aside = set_aside + 1
  out[#out + 1] = reason
  out[#out + 1] = n or false
  out[#out + 1] = false
  out[#out + 1] = ''
end
-- What is stored for the internal id of a member without meta (read before any write; moved
-- to the quarantine with the member: without its meta it is no readable job).
local function remains(n)
  if not n then
    return ''
  end
  return field('job', redis.call('HGET', KEYS[5], n)) ..
    field('stall history', redis.call('HGET', KEYS[7], n)) ..
    field('claim', redis.call('HGET', KEYS[8], n))
end
local function forget(n)
  if n then
    redis.call('HDEL', KEYS[5], n, 't' .. n)
    redis.call('HDEL', KEYS[7], n)
    redis.call('HDEL', KEYS[8], n)
  end
end
local due = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, tonumber(ARGV[4]))
if #due > 0 then
  -- Promote in due-time order, each with a fresh sequence number (after the ready jobs of its
  -- priority, like a push made now). ZRANGEBYSCORE from -inf returns ranks 0..#due-1.
  redis.call('ZCARD', KEYS[12])  -- (a read: a wrong-type key fails here, before any write)
  local promote, lost = {}, {}
  for _, member in ipairs(due) do
    local n = string.match(member, MEMBER_ID)
    local meta = n and redis.call('HGET', KEYS[6], n)
    if meta then
      -- An unreadable meta has no priority: 0 (its claim is handed over flagged, and failed).
      promote[#promote + 1] = {n, string.match(meta, '^(%-?%d+):') or '0'}
    else
      lost[#lost + 1] = {member, n, remains(n)}
    end
  end
  local seq = 0
  if #promote > 0 then
    local repaired
    seq, repaired = take_seq({seq = KEYS[1], ready = KEYS[2], delayed = KEYS[3],
      active = KEYS[4], jobs = KEYS[5], meta = KEYS[6], claims = KEYS[8], quarantine = KEYS[11],
      moved = KEYS[12]}, #promote, ARGV[5])
    seq = seq - #promote
    if repaired then
      -- (its quarantine entry is written: a report, as for the entries below)
      out[#out + 1] = repaired
      out[#out + 1] = false
      out[#out + 1] = false
      out[#out + 1] = ''
    end
  end
  if #lost > 0 then
    -- (and every key the pop below touches: its report must not be lost to a failure there)
    writable(KEYS[11], 'list')
    writable(KEYS[2], 'zset')
    writable(KEYS[4], 'zset')
    writable(KEYS[5], 'hash')
    writable(KEYS[7], 'hash')
    writable(KEYS[8], 'hash')
    for _, entry in ipairs(lost) do
      local reason = entry[2] and 'delayed job without meta' or 'delayed member names no job'
      quarantine(reason, field('delayed member', entry[1]) .. entry[3], entry[2])
      forget(entry[2])
    end
  end
  for _, job in ipairs(promote) do
    seq = seq + 1
    local member = string.format('%016d', seq) .. job[1]
    redis.call('ZADD', KEYS[12], job[1], member)  -- ready at another place than its push's
    redis.call('ZADD', KEYS[2], job[2], member)
  end
  redis.call('ZREMRANGEBYRANK', KEYS[3], 0, #due - 1)
end
local count = tonumber(ARGV[1])
local members = redis.call('ZRANGE', KEYS[2], 0, count - 1)
if #members == 0 then
  redis.call('SET', KEYS[9], '1')
  local first = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
  if #first > 0 then
    out[1] = string.format('%.6f', tonumber(first[2]) - now)
  end
  if set_aside > 0 then
    redis.call('LTRIM', KEYS[11], 0, tonumber(ARGV[5]) - 1)
  end
  return out
end
-- Everything is read before the first write (see the conventions above); a claim's reply
-- fields go straight to out, its writes wait in claims (n, member, token).
local worker = ARGV[2]
local suffixes = ARGV[3]
local claims = {}
local lost = {}
local unmove = {}  -- the claimed members of ``moved``
for _, member in ipairs(members) do
  local n = string.match(member, MEMBER_ID)
  local meta = n and redis.call('HGET', KEYS[6], n)
  if not n or tonumber(string.sub(member, 1, 16)) ~= tonumber(n) then
    unmove[#unmove + 1] = member
  end
  if meta then
    local at = (#claims / 4 % (#suffixes / 16)) * 16
    local token = n .. ':' .. string.sub(suffixes, at + 1, at + 16)
    local _, _, stalled = parse_meta(meta)
    claims[#claims + 1] = n
    claims[#claims + 1] = member
    claims[#claims + 1] = token
    -- A suspect (stalled before, while its handler ran) is stored not started, like a claim
    -- popped ahead: it may wait to run alone in its worker, and that wait is not counted.
    claims[#claims + 1] = stalled ~= nil and tonumber(stalled) > 0
    out[#out + 1] = meta
    out[#out + 1] = redis.call('HGET', KEYS[5], n)
    out[#out + 1] = redis.call('HGET', KEYS[7], n)
    out[#out + 1] = token
  else
    lost[#lost + 1] = {member, n, remains(n)}
  end
end
if #unmove > 0 then
  redis.call('ZCARD', KEYS[12])  -- (a read before the first write, as above)
end
if #lost > 0 then
  writable(KEYS[11], 'list')
  writable(KEYS[8], 'hash')
  writable(KEYS[4], 'zset')
  for _, entry in ipairs(lost) do
    local reason = entry[2] and 'ready job without meta' or 'ready member names no job'
    quarantine(reason, field('ready member', entry[1]) .. entry[3], entry[2])
    forget(entry[2])
  end
end
local started = tonumber(ARGV[6] or '')
for i = 1, #claims, 4 do
  local n = claims[i]
  local holder = worker
  if claims[i + 3] or (started and (i - 1) / 4 >= started) then
    holder = '\\1' .. worker
  end
  -- (the claim first: should the next write fail, a claim entry alone changes nothing)
  redis.call('HSET', KEYS[8], n, string.sub(claims[i + 1], 1, 16) .. holder)
  redis.call('ZADD', KEYS[4], now, claims[i + 2])
end
redis.call('ZREMRANGEBYRANK', KEYS[2], 0, #members - 1)
for _, member in ipairs(unmove) do
  redis.call('ZREM', KEYS[12], member)
end
if #claims > 0 then
  redis.call('SET', KEYS[10], '1')  -- a sweep has something to look at (see queues_with_claims)
end
if set_aside > 0 then
  redis.call('LTRIM', KEYS[11], 0, tonumber(ARGV[5]) - 1)
end
if #members < count then
  -- Drained: arm the doorbell like an empty pop, so the caller may wait without popping again.
  redis.call('SET', KEYS[9], '1')
  local first = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
  out[1] = #first > 0 and string.format('%.6f', tonumber(first[2]) - now) or ''
end
return out
""".replace("MEMBER_ID", _MEMBER_ID)
)

# KEYS: active jobs meta stalls claims
# ARGV: token
_COMPLETE: Final = """
local n = string.match(ARGV[1], '^(%d+):')
if not n or redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then
  return 0
end
redis.call('HDEL', KEYS[2], n, 't' .. n)
redis.call('HDEL', KEYS[3], n)
redis.call('HDEL', KEYS[4], n)
redis.call('HDEL', KEYS[5], n)
return 1
"""

# KEYS: active jobs meta stalls claims
# ARGV: token, token, ...
# Returns 1 or 0 per token (as _COMPLETE's).
_COMPLETE_MANY: Final = """
local out = {}
for i, token in ipairs(ARGV) do
  local n = string.match(token, '^(%d+):')
  if not n or redis.call('ZREM', KEYS[1], token) == 0 then
    out[i] = 0
  else
    redis.call('HDEL', KEYS[2], n, 't' .. n)
    redis.call('HDEL', KEYS[3], n)
    redis.call('HDEL', KEYS[4], n)
    redis.call('HDEL', KEYS[5], n)
    out[i] = 1
  end
end
return out
"""

# KEYS: PUSH_KEYS (as _PUSH's)
# ARGV: channel, quarantine_retention, then (id, data, priority) per job
# Returns the count, or the reason the sequence counter was repaired (TAKE_SEQ).
_PUSH_MANY: Final = TAKE_SEQ + """
local t = redis.call('TIME')
local pushed_at = t[1] .. ' ' .. t[2]
local count = (#ARGV - 2) / 3
local seq, repaired = take_seq(PUSH_SEQ_KEYS, count, ARGV[2])
seq = seq - count
for i = 0, count - 1 do
  seq = seq + 1
  local n = string.format('%d', seq)
  local priority = ARGV[5 + 3 * i]
  redis.call('HSET', KEYS[4], n, ARGV[4 + 3 * i], 't' .. n, pushed_at)
  redis.call('HSET', KEYS[5], n, priority .. ':0:0:' .. ARGV[3 + 3 * i])
  redis.call('ZADD', KEYS[2], priority, string.format('%016d', seq) .. n)
end
if redis.call('DEL', KEYS[6]) == 1 then
  redis.call('PUBLISH', ARGV[1], '')
end
return repaired or count
""".replace("PUSH_SEQ_KEYS", _PUSH_SEQ_KEYS)


# KEYS: the push's (PUSH_KEYS) of the results queue, then the complete's (active jobs meta
# stalls claims) of the task queue.
# ARGV: channel, job count, quarantine_retention, (id data priority) per job, then one token
# per lease.
# Returns 1 or 0 per token (as _COMPLETE's), then the reason the results queue's sequence
# counter was repaired, if it was (TAKE_SEQ). A worker's results and the acknowledgements of
# their tasks: both or neither. The push comes first, and a script refused at its first write
# (Redis out of memory: -OOM) or failing in the push writes nothing after it, so a task is never
# acknowledged without its result; the complete's keys are read first (a wrong type fails the
# script before any write).
_PUSH_AND_COMPLETE_MANY: Final = TAKE_SEQ + """
redis.call('ZCARD', KEYS[11])
redis.call('HEXISTS', KEYS[12], '0')
redis.call('HEXISTS', KEYS[13], '0')
redis.call('HEXISTS', KEYS[14], '0')
redis.call('HEXISTS', KEYS[15], '0')
local count = tonumber(ARGV[2])
local t = redis.call('TIME')
local pushed_at = t[1] .. ' ' .. t[2]
local seq, repaired = take_seq(PUSH_SEQ_KEYS, count, ARGV[3])
seq = seq - count
for i = 0, count - 1 do
  seq = seq + 1
  local n = string.format('%d', seq)
  local priority = ARGV[6 + 3 * i]
  redis.call('HSET', KEYS[4], n, ARGV[5 + 3 * i], 't' .. n, pushed_at)
  redis.call('HSET', KEYS[5], n, priority .. ':0:0:' .. ARGV[4 + 3 * i])
  redis.call('ZADD', KEYS[2], priority, string.format('%016d', seq) .. n)
end
if redis.call('DEL', KEYS[6]) == 1 then
  redis.call('PUBLISH', ARGV[1], '')
end
local out = {}
for i = 4 + 3 * count, #ARGV do
  local token = ARGV[i]
  local n = string.match(token, '^(%d+):')
  if not n or redis.call('ZREM', KEYS[11], token) == 0 then
    out[#out + 1] = 0
  else
    redis.call('HDEL', KEYS[12], n, 't' .. n)
    redis.call('HDEL', KEYS[13], n)
    redis.call('HDEL', KEYS[14], n)
    redis.call('HDEL', KEYS[15], n)
    out[#out + 1] = 1
  end
end
out[#out + 1] = repaired
return out
""".replace("PUSH_SEQ_KEYS", _PUSH_SEQ_KEYS)

# KEYS: active jobs meta stalls claims failed
# ARGV: token error retention
# A job whose meta is unreadable or gone is failed all the same, kept as found (see
# failed_record).
_FAIL: Final = (
    _NOW
    + _PARSE_META
    + _FAILED_RECORD
    + """
local token = ARGV[1]
local n = string.match(token, '^(%d+):')
if not n or not redis.call('ZSCORE', KEYS[1], token) then
  return 0
end
local meta = redis.call('HGET', KEYS[3], n)
local data = redis.call('HGET', KEYS[2], n) or ''
local stalls = redis.call('HGET', KEYS[4], n) or ''
redis.call('HEXISTS', KEYS[5], n)  -- (a read: a wrong-type key fails here, before any write)
redis.call('LPUSH', KEYS[6], failed_record(now, meta, ARGV[2], stalls, data))
redis.call('LTRIM', KEYS[6], 0, tonumber(ARGV[3]) - 1)
redis.call('ZREM', KEYS[1], token)
redis.call('HDEL', KEYS[2], n, 't' .. n)
redis.call('HDEL', KEYS[3], n)
redis.call('HDEL', KEYS[4], n)
redis.call('HDEL', KEYS[5], n)
return 1
"""
)


def _shifted(script: str, keys: int, argv: int) -> str:
    """``script`` reading its KEYS and ARGV from ``keys`` and ``argv`` places further on."""
    script = re.sub(r"KEYS\[(\d+)\]", lambda m: f"KEYS[{int(m[1]) + keys}]", script)
    return re.sub(r"ARGV\[(\d+)\]", lambda m: f"ARGV[{int(m[1]) + argv}]", script)


# KEYS: the fail's (active jobs meta stalls claims failed), then the push's (PUSH_KEYS) of
# another queue. ARGV: the fail's (token error retention), then the push's (id data priority
# delay channel quarantine_retention). Fail, then push, in one script: both or neither (the
# poison bridge's fail and failed result). The push's keys are read before any write. Returns
# as _FAIL's, or the push's reason (its queue's sequence counter repaired, see TAKE_SEQ).
_FAIL_AND_PUSH: Final = (
    _FAIL.removesuffix("return 1\n").replace(
        "local meta = redis.call('HGET', KEYS[3], n)",
        "redis.call('GET', KEYS[7])\nredis.call('ZCARD', KEYS[8])\nredis.call('ZCARD', KEYS[9])\n"
        "redis.call('HEXISTS', KEYS[10], '0')\nredis.call('HEXISTS', KEYS[11], '0')\n"
        "local meta = redis.call('HGET', KEYS[3], n)",
    )
    + "do\n"
    + _shifted(_PUSH, 6, 3)
    + "end\n"
)

# KEYS: seq ready delayed active jobs meta stalls claims armed failed moved quarantine
# ARGV: token delay count_attempt("1"/"0") channel failed_retention quarantine_retention
# Returns 0 (lease lost), 1 (handed back), or 2: the job's meta was unreadable, so it could not
# be put back (no priority, no count): it was failed instead, kept as found; or the reason the
# sequence counter was repaired when it was (handed back, see TAKE_SEQ).
_RETRY: Final = (
    _PARSE_META
    + _FAILED_RECORD
    + TAKE_SEQ
    + """
local token = ARGV[1]
local n = string.match(token, '^(%d+):')
if not n or not redis.call('ZSCORE', KEYS[4], token) then
  return 0
end
local claim = redis.call('HGET', KEYS[8], n)
local meta = redis.call('HGET', KEYS[6], n)
local priority, attempts, stalled, id = parse_meta(meta)
if not priority then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
  local data = redis.call('HGET', KEYS[5], n) or ''
  local stalls = redis.call('HGET', KEYS[7], n) or ''
  local err = 'damaged: stored meta unreadable, the job could not be retried'
  redis.call('LPUSH', KEYS[10], failed_record(now, meta, err, stalls, data))
  redis.call('LTRIM', KEYS[10], 0, tonumber(ARGV[5]) - 1)
  redis.call('ZREM', KEYS[4], token)
  redis.call('HDEL', KEYS[5], n, 't' .. n)
  redis.call('HDEL', KEYS[6], n)
  redis.call('HDEL', KEYS[7], n)
  redis.call('HDEL', KEYS[8], n)
  return 2
end
local delay = tonumber(ARGV[2])
local place, repaired
if delay <= 0 and ARGV[3] ~= '1' and claim and #claim >= 16 then
  place = string.sub(claim, 1, 16)  -- an attempt-neutral handback keeps its place
else
  place, repaired = take_seq({seq = KEYS[1], ready = KEYS[2], delayed = KEYS[3],
    active = KEYS[4], jobs = KEYS[5], meta = KEYS[6], claims = KEYS[8], moved = KEYS[11],
    quarantine = KEYS[12]}, 1, ARGV[6])
  place = string.format('%016d', place)  -- a retry goes to the back
end
-- Queued again before the claim is removed: should a write fail, the job is never in neither.
local member = place .. n
if delay > 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
  redis.call('ZADD', KEYS[3], now + delay, member)
else
  if tonumber(place) ~= tonumber(n) then
    redis.call('ZADD', KEYS[11], n, member)  -- ready at another place than its push's
  end
  redis.call('ZADD', KEYS[2], priority, member)
end
if ARGV[3] == '1' then
  attempts = string.format('%d', tonumber(attempts) + 1)
  redis.call('HSET', KEYS[6], n, priority .. ':' .. attempts .. ':' .. stalled .. ':' .. id)
end
redis.call('ZREM', KEYS[4], token)
redis.call('HDEL', KEYS[8], n)
if redis.call('DEL', KEYS[9]) == 1 then
  redis.call('PUBLISH', ARGV[4], '')
end
return repaired or 1
"""
)

# KEYS: active claims
# ARGV: token...
# Returns 1 or 0 per token: the claim is held (now started and renewed), or was lost.
_MARK_STARTED: Final = (
    _NOW
    + """
local out = {}
for i, token in ipairs(ARGV) do
  local n = string.match(token, '^(%d+):')
  if n and redis.call('ZSCORE', KEYS[1], token) then
    redis.call('ZADD', KEYS[1], now, token)
    local claim = redis.call('HGET', KEYS[2], n)
    if claim and string.byte(claim, 17) == 1 then
      redis.call('HSET', KEYS[2], n, string.sub(claim, 1, 16) .. string.sub(claim, 18))
    end
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""
)

# KEYS: active
# ARGV: token...
# Returns {renewed, {1-based positions of the lost tokens}}.
_RENEW: Final = (
    _NOW
    + """
local renewed = 0
local lost = {}
for i, token in ipairs(ARGV) do
  if redis.call('ZSCORE', KEYS[1], token) then
    redis.call('ZADD', KEYS[1], now, token)
    renewed = renewed + 1
  else
    lost[#lost + 1] = i
  end
end
return {renewed, lost}
"""
)

# KEYS: seq ready active jobs meta stalls claims armed claimed quarantine moved delayed
# ARGV: threshold cutoff("" = now - threshold) max_stalled token_suffixes limit channel
#       quarantine_retention
# Returns {recovered, cutoff, examined, meta, data, stalls, token, ...}: the exceeded jobs, and
# reports as _CLAIM's (an empty token). A claim whose meta is unreadable is re-leased to the
# caller (exceeded, whatever max_stalled), which fails it; one without meta, or an active member
# that is no token, goes to the quarantine; an unreadable stall history is replaced by a fresh
# one, its old text kept in the quarantine.
_RECOVER: Final = (
    _NOW
    + _PARSE_META
    + _SET_ASIDE
    + TAKE_SEQ
    + """
local cutoff = now - tonumber(ARGV[1])
if ARGV[2] ~= '' then
  cutoff = tonumber(ARGV[2])
end
-- The claims older than the cutoff, oldest first: O(log n + k) on the age index.
local stale = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', '(' .. string.format('%.17g', cutoff),
  'LIMIT', 0, tonumber(ARGV[5]))
local max_stalled = tonumber(ARGV[3])
redis.call('ZSCORE', KEYS[11], '')  -- (a read: a wrong-type key fails here, before writes)
local entry_at = '[' .. string.format('%.6f', now) .. ','
local recovered = 0
local set_aside = 0
local out = {0, string.format('%.17g', cutoff), #stale}
local function quarantine(reason, raw, n)
  writable(KEYS[10], 'list')
  redis.call('LPUSH', KEYS[10], quarantine_record(reason, raw))
  set_aside = set_aside + 1
  out[#out + 1] = reason
  out[#out + 1] = n or false
  out[#out + 1] = false
  out[#out + 1] = ''
end
-- Poison (or unreadable): re-leased to the caller (who fails it), still active.
local function lease(n, meta, data, history)
  local at = (#out - 3) / 4 % (#ARGV[4] / 16) * 16
  local new_token = n .. ':' .. string.sub(ARGV[4], at + 1, at + 16)
  redis.call('ZADD', KEYS[3], now, new_token)
  out[#out + 1] = meta
  out[#out + 1] = data
  out[#out + 1] = history
  out[#out + 1] = new_token
end
for _, token in ipairs(stale) do
  local n = string.match(token, '^(%d+):')
  local meta = n and redis.call('HGET', KEYS[5], n)
  local priority, attempts, stalled, id = parse_meta(meta)
  if not meta then
    local raw = field('active member', token)
    if n then
      raw = raw .. field('job', redis.call('HGET', KEYS[4], n)) ..
        field('stall history', redis.call('HGET', KEYS[6], n)) ..
        field('claim', redis.call('HGET', KEYS[7], n))
    end
    quarantine(n and 'claimed job without meta' or 'active member names no claim', raw, n)
    redis.call('ZREM', KEYS[3], token)
    if n then
      redis.call('HDEL', KEYS[4], n, 't' .. n)
      redis.call('HDEL', KEYS[6], n)
      redis.call('HDEL', KEYS[7], n)
    end
  elseif not priority or tonumber(stalled) > max_stalled then
    -- Unreadable meta, or past the limit already: the lease of a sweep that found it exceeded
    -- and died before failing it (no delivery, so no stall: exceeded again, as it was).
    local data = redis.call('HGET', KEYS[4], n)
    local history = redis.call('HGET', KEYS[6], n)
    redis.call('ZREM', KEYS[3], token)
    lease(n, meta, data, history)
  else
    local claim = redis.call('HGET', KEYS[7], n) or ''
    -- Only a claim whose handler started counts: one popped ahead and never started comes
    -- back at once, uncounted (recorded as such in its history).
    local ahead = string.byte(claim, 17) == 1
    local holder = string.sub(claim, ahead and 18 or 17)
    local count = tonumber(stalled) + (ahead and 0 or 1)
    local poison = not ahead and count > max_stalled
    local history = redis.call('HGET', KEYS[6], n)
    local data = false
    if poison then
      data = redis.call('HGET', KEYS[4], n)
    end
    -- Everything read. The writes that may fail (a wrong-type key) come first.
    local place = string.sub(claim, 1, 16)
    if not poison and #place < 16 then
      local taken, repaired = take_seq({seq = KEYS[1], ready = KEYS[2], active = KEYS[3],
        jobs = KEYS[4], meta = KEYS[5], claims = KEYS[7], quarantine = KEYS[10],
        moved = KEYS[11], delayed = KEYS[12]}, 1, ARGV[7])
      place = string.format('%016d', taken)
      if repaired then
        -- (its quarantine entry is written: a report, as _CLAIM's)
        out[#out + 1] = repaired
        out[#out + 1] = false
        out[#out + 1] = false
        out[#out + 1] = ''
      end
    end
    if history and not string.match(history, '^%[.*%]$') then
      writable(KEYS[2], 'zset')
      quarantine('stall history unreadable, replaced by a new one',
        field('active member', token) .. field('stall history', history), n)
      history = false
    end
    if not poison then
      -- A reclaimed job keeps its place: it waited its turn once already.
      if tonumber(place) ~= tonumber(n) then
        redis.call('ZADD', KEYS[11], n, place .. n)  -- ready at another place than its push's
      end
      redis.call('ZADD', KEYS[2], priority, place .. n)
    end
    local entry = entry_at .. cjson.encode(holder) .. (ahead and ',0]' or ']')
    if history and not string.match(history, '^%[%s*%]$') then
      history = string.sub(history, 1, -2) .. ',' .. entry .. ']'
    else
      history = '[' .. entry .. ']'
    end
    redis.call('HSET', KEYS[6], n, history)
    meta = priority .. ':' .. attempts .. ':' .. string.format('%d', count) .. ':' .. id
    redis.call('HSET', KEYS[5], n, meta)
    redis.call('ZREM', KEYS[3], token)
    if poison then
      lease(n, meta, data, history)
    else
      redis.call('HDEL', KEYS[7], n)
      recovered = recovered + 1
    end
  end
end
out[1] = recovered
if recovered > 0 and redis.call('DEL', KEYS[8]) == 1 then
  redis.call('PUBLISH', ARGV[6], '')
end
if redis.call('ZCARD', KEYS[3]) == 0 then
  redis.call('DEL', KEYS[9])  -- nothing claimed: the next sweeps skip this queue
end
if set_aside > 0 then
  redis.call('LTRIM', KEYS[10], 0, tonumber(ARGV[7]) - 1)
end
return out
"""
)

# KEYS: meta claims; ARGV: job id
# Returns {1, worker} (claimed), {0} (waiting) or nil (not on the queue). A scan of the meta
# hash: the job id is stored only there, at the end of each entry (for a rare look, see
# SupportsJobState).
_JOB_STATE: Final = """
local cursor = '0'
repeat
  local page = redis.call('HSCAN', KEYS[1], cursor, 'COUNT', 512)
  cursor = page[1]
  local items = page[2]
  for i = 1, #items, 2 do
    if string.match(items[i + 1], '^[^:]*:[^:]*:[^:]*:(.*)$') == ARGV[1] then
      local claim = redis.call('HGET', KEYS[2], items[i])
      if claim then
        return {1, string.sub(claim, 17)}
      end
      return {0}
    end
  end
until cursor == '0'
return nil
"""


async def _job_state(
    client: RedisClient | RedisClusterClient, queue: str, job_id: str
) -> JobState | None:
    """One run of :data:`_JOB_STATE`, a scan of the queue's meta hash (for a rare look at one
    job: see :class:`~durable_trio.brokers.SupportsJobState`)."""
    found = await client.script(_JOB_STATE)(
        keys=[f"{{{queue}}}:meta", f"{{{queue}}}:claims"], args=[job_id]
    )
    if not found:
        return None
    if int(found[0]) == 1:
        worker = found[1]
        text = worker.decode() if isinstance(worker, bytes) else str(worker)
        return JobState(claimed=True, worker=text)
    return JobState(claimed=False)


# KEYS: meta claims; ARGV: job ids
# Returns one entry per job id, in order: 1 then the worker (claimed), 0 then '' (waiting) or
# -1 then '' (not on the queue). One scan of the meta hash for every id (the loss audit).
_JOB_STATES: Final = """
local wanted = {}
for i = 1, #ARGV do
  wanted[ARGV[i]] = i
end
local out = {}
for i = 1, #ARGV do
  out[2 * i - 1] = -1
  out[2 * i] = ''
end
local cursor = '0'
repeat
  local page = redis.call('HSCAN', KEYS[1], cursor, 'COUNT', 512)
  cursor = page[1]
  local items = page[2]
  for i = 1, #items, 2 do
    local at = wanted[string.match(items[i + 1], '^[^:]*:[^:]*:[^:]*:(.*)$') or '']
    if at then
      local claim = redis.call('HGET', KEYS[2], items[i])
      if claim then
        out[2 * at - 1] = 1
        out[2 * at] = string.sub(claim, 17)
      else
        out[2 * at - 1] = 0
      end
    end
  end
until cursor == '0'
return out
"""


async def _job_states(
    client: RedisClient | RedisClusterClient, queue: str, job_ids: Sequence[str]
) -> list[JobState | None]:
    """One run of :data:`_JOB_STATES` (a scan of the queue's meta hash) for ``job_ids``."""
    if not job_ids:
        return []
    found = await client.script(_JOB_STATES)(
        keys=[f"{{{queue}}}:meta", f"{{{queue}}}:claims"], args=list(job_ids)
    )
    out: list[JobState | None] = []
    for i in range(len(job_ids)):
        flag = int(found[2 * i])
        if flag == 1:
            worker = found[2 * i + 1]
            text = worker.decode() if isinstance(worker, bytes) else str(worker)
            out.append(JobState(claimed=True, worker=text))
        else:
            out.append(JobState(claimed=False) if flag == 0 else None)
    return out


# KEYS: ready delayed
_SIZE: Final = """
return redis.call('ZCARD', KEYS[1]) + redis.call('ZCARD', KEYS[2])
"""

# KEYS: ready delayed armed
# Returns {1} when a job is ready (or due), else {0} or {0, next_due_in_seconds} (and arms).
_PEEK: Final = (
    _NOW
    + """
if redis.call('ZCARD', KEYS[1]) > 0 then
  return {1}
end
local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
if #first > 0 and tonumber(first[2]) <= now then
  return {1}
end
redis.call('SET', KEYS[3], '1')
if #first > 0 then
  return {0, string.format('%.6f', tonumber(first[2]) - now)}
end
return {0}
"""
)


# ------------------------------------------------------------------------------------ helpers


def _suffixes(count: int) -> str:
    """The random parts of the lease tokens one call may issue: 64 bits (16 hex digits) per
    claim, for up to ``count`` claims (capped; a token stays unique past the cap, as it starts
    with the job's internal id, but then shares its random part with another of the call)."""
    return secrets.token_hex(8 * max(1, min(count, _SUFFIXES_MAX)))


#: A meta value: "priority:attempts:stalled_count:id" (ASCII digits only: ``int`` alone would
#: also take spaces, underscores and other scripts' digits, where the Lua scripts do not).
_META = re.compile(rb"(-?[0-9]{1,17}):([0-9]{1,15}):([0-9]{1,15}):(.*)", re.DOTALL)

#: The head of a failed record (see ``_FAILED_RECORD``): six numbers, or seven when the job's
#: meta was unreadable and is kept raw. (Bounded: ``int`` refuses over 4,300 digits.)
_FAILED_HEAD = re.compile(
    rb"([0-9]{1,15}(?:\.[0-9]{1,9})?) ([0-9]{1,15}) ([0-9]{1,15})"
    rb" ([0-9]{1,15}) ([0-9]{1,15}) ([0-9]{1,15})(?: (-1|[0-9]{1,15}))?"
)

#: The head of a quarantine record: "at len(reason)".
_QUARANTINE_HEAD = re.compile(rb"([0-9]{1,15}(?:\.[0-9]{1,9})?) ([0-9]{1,15})")

#: Bytes of a damaged value shown in a damage reason (the whole value stays in the record).
_SHOWN: Final = 60


def _show(value: bytes) -> str:
    """A damaged stored value, short and printable, for a damage reason."""
    text = repr(value[:_SHOWN])
    return text + f"... ({len(value)} bytes)" if len(value) > _SHOWN else text


def _text(raw: bytes) -> tuple[str, bool]:
    """``raw`` as text, and whether it was valid UTF-8 (if not: backslash escapes, readable)."""
    try:
        return raw.decode(), True
    except UnicodeDecodeError:
        return raw.decode(errors="backslashreplace"), False


def _stalls(history: bytes | None) -> tuple[Stall, ...] | None:
    """A stall history (``[[at, worker], ...]``, ``[at, worker, 0]`` for a stall that did not
    count), ``()`` if none, ``None`` if unreadable."""
    if not history:
        return ()
    try:
        entries = orjson.loads(history)
    except orjson.JSONDecodeError:
        return None
    if type(entries) is not list:
        return None
    stalls = []
    for entry in entries:
        if type(entry) is not list or len(entry) not in (2, 3):
            return None
        at, worker, *flag = entry
        if type(at) not in (int, float) or type(worker) is not str:
            return None
        if flag and (type(flag[0]) is not int or flag[0] != 0):  # (only 0: not counted)
            return None
        stalls.append(Stall(at=float(at), worker=worker, counted=not flag))
    return tuple(stalls)


def _claimed(fields: list[Any], start: int, *, ahead: bool = False) -> ClaimedJob:
    """A :class:`ClaimedJob` from four reply fields: meta, data, stall history, token; popped
    ahead of a free slot with ``ahead``. Not started (as the script stored it) if ``ahead`` or
    a suspect (its readable meta counts stalls).

    The one validating decode of a claim: whatever is stored, it returns (never raises). A
    damaged field makes a claim flagged with ``damage`` (data: the raw bytes read); an empty
    token is a report of an entry the script already moved to the quarantine (then ``meta`` is
    the reason and ``data`` the internal id, if any).
    """
    meta, data, history, token = fields[start : start + 4]
    meta = meta if meta is not None else b""
    if not token:
        where = f" (internal id {data.decode(errors='replace')})" if data else ""
        return ClaimedJob(
            id="", data=b"", lease=Lease("", ""), damage=meta.decode(errors="replace") + where
        )
    damage = []
    job_id, priority, attempts, stalled = "", 0, 0, 0
    match = _META.fullmatch(meta)
    if match is None:
        damage.append(f"meta unreadable: {_show(meta)}")
    else:
        priority, attempts, stalled = int(match[1]), int(match[2]), int(match[3])
        job_id, readable = _text(match[4])
        if not readable:
            damage.append(f"job id is not UTF-8: {job_id}")
        if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
            damage.append(f"meta priority out of range: {priority}")
            priority = 0
    if data is None:
        damage.append("job body missing (deleted or evicted)")
        data = b""
    stalls = _stalls(history)
    if stalls is None:
        damage.append(f"stall history unreadable: {_show(history)}")
        stalls = ()
    return ClaimedJob(
        id=job_id,
        data=data,
        lease=Lease(job_id, token.decode()),
        attempts=attempts,
        stalled_count=stalled,
        stalls=stalls,
        priority=priority,
        started=not ahead and stalled == 0,
        damage="; ".join(damage) if damage else None,
    )


def _failed(record: bytes) -> FailedJob:
    """A :class:`FailedJob` from a failed record; never raises. A record that cannot be read
    is returned whole as ``data``, with an ``error`` naming the damage."""
    head, _, rest = record.partition(b"\n")
    match = _FAILED_HEAD.fullmatch(head)
    a = b = c = d = 0
    if match is not None:
        a = int(match[4])
        b = a + int(match[5])
        c = b + int(match[6])
        d = c + max(int(match[7] or 0), 0)
    if match is None or d > len(rest):
        return FailedJob(
            id="", data=record, error=f"damaged failed record: {_show(head)}", failed_at=0.0
        )
    job_id, readable = _text(rest[:a])
    notes = [] if readable else [f"job id is not UTF-8: {job_id}"]
    # (In full: the record is the only place a person can read what was stored.)
    stalls = _stalls(rest[b:c])
    if stalls is None:
        notes.append(f"stored stall history: {rest[b:c]!r}")
        stalls = ()
    if match[7] is not None:
        notes.append("no stored meta" if match[7] == b"-1" else f"stored meta: {rest[c:d]!r}")
    error = rest[a:b].decode(errors="replace")
    return FailedJob(
        id=job_id,
        data=rest[d:],
        error=f"{error} ({'; '.join(notes)})" if notes else error,
        failed_at=float(match[1]),
        attempts=int(match[2]),
        stalled_count=int(match[3]),
        stalls=stalls,
    )


def _quarantined(queue: str, record: bytes) -> QuarantinedEntry:
    """A :class:`QuarantinedEntry` from a quarantine record; never raises."""
    head, _, rest = record.partition(b"\n")
    match = _QUARANTINE_HEAD.fullmatch(head)
    if match is None or int(match[2]) > len(rest):
        return QuarantinedEntry(queue=queue, reason="damaged quarantine record", raw=record, at=0.0)
    length = int(match[2])
    return QuarantinedEntry(
        queue=queue,
        reason=rest[:length].decode(errors="replace"),
        raw=rest[length:],
        at=float(match[1]),
    )


def _claims_in(reply: list[Any], count: int) -> list[ClaimedJob]:
    """The claims (and reports) of a claim script's reply, the first ``count`` CLAIMS started
    as the script stored them (a report, say of a counter repaired while promoting, may come
    before them and is no claim)."""
    claims: list[ClaimedJob] = []
    started = 0
    for i in range(1, len(reply), 4):
        claim = _claimed(reply, i, ahead=started >= count)
        started += bool(claim.lease.token)
        claims.append(claim)
    return claims


def _seconds(value: bytes | None) -> float | None:
    """A duration the claim or peek script returned, ``None`` for none (or an unreadable one)."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) else None


@attrs.define(eq=False)
class _Queue:
    """The key names of one queue, and this broker's doorbell state for it."""

    name: str
    channel: bytes
    push_keys: tuple[str, ...]
    claim_keys: tuple[str, ...]
    complete_keys: tuple[str, ...]
    fail_keys: tuple[str, ...]
    retry_keys: tuple[str, ...]
    active_key: str
    claimed_key: str
    """Set by every claim, cleared by a sweep that leaves no claim: idle queues are skipped."""
    recover_keys: tuple[str, ...]
    size_keys: tuple[str, ...]
    peek_keys: tuple[str, ...]
    failed_key: str
    quarantine_key: str
    armed_key: str
    rings: int = 0
    """Doorbell rings received (plus one per resubscription)."""
    ring: RepeatedEvent = attrs.Factory(RepeatedEvent)
    """Set on every ring (its waiters wake on the next one; ``rings`` counts them)."""
    covered_epoch: int = 0
    """The subscription (epoch) in which this queue's channel was confirmed; 0: none."""
    empty_rings: int = 0
    """``rings`` just before this broker's last empty pop was sent."""
    empty_epoch: int | None = None
    """The subscription that covered that pop, ``None`` if it was not covered (or the last pop
    was not empty): the next wait must re-check instead of trusting the ring count."""
    due_at: float = math.inf
    """Trio time the earliest delayed job comes due, as of that pop."""

    @classmethod
    def make(cls, name: str, db: int) -> _Queue:
        def keys(*parts: str) -> tuple[str, ...]:
            return tuple(f"{{{name}}}:{part}" for part in parts)

        return cls(
            name=name,
            channel=f"{{{name}}}:doorbell@{db}".encode(),
            push_keys=keys(*PUSH_KEYS),
            claim_keys=keys(
                "seq",
                "ready",
                "delayed",
                "active",
                "jobs",
                "meta",
                "stalls",
                "claims",
                "armed",
                "claimed",
                "quarantine",
                "moved",
            ),
            complete_keys=keys("active", "jobs", "meta", "stalls", "claims"),
            fail_keys=keys("active", "jobs", "meta", "stalls", "claims", "failed"),
            retry_keys=keys(
                "seq",
                "ready",
                "delayed",
                "active",
                "jobs",
                "meta",
                "stalls",
                "claims",
                "armed",
                "failed",
                "moved",
                "quarantine",
            ),
            active_key=keys("active")[0],
            recover_keys=keys(
                "seq",
                "ready",
                "active",
                "jobs",
                "meta",
                "stalls",
                "claims",
                "armed",
                "claimed",
                "quarantine",
                "moved",
                "delayed",
            ),
            claimed_key=keys("claimed")[0],
            size_keys=keys("ready", "delayed"),
            peek_keys=keys("ready", "delayed", "armed"),
            failed_key=keys("failed")[0],
            quarantine_key=keys("quarantine")[0],
            armed_key=keys("armed")[0],
        )

    def ring_bell(self) -> None:
        self.rings += 1
        self.ring.set()

    def note_empty(self, rings: int, epoch: int | None, due_in: float | None) -> None:
        """Record an empty pop or peek.

        Args:
            rings: ``rings`` just before it was sent.
            epoch: the subscription that covered it, ``None`` if none did.
            due_in: seconds until the earliest delayed job comes due, ``None`` if none.
        """
        self.empty_rings = rings
        self.empty_epoch = epoch
        self.due_at = math.inf if due_in is None else trio.current_time() + due_in


async def _read_eviction_policy(
    client: RedisClient | RedisClusterClient, bound: float
) -> str | None:
    """The server's ``maxmemory-policy`` (one ``CONFIG GET``, bounded by ``bound``), or
    ``None`` when it cannot be read: a server that refuses ``CONFIG`` (managed Redis often
    does), or cannot be reached yet, is not checked (logged at debug level), and the broker
    starts all the same. A policy other than ``noeviction`` is warned of (log and
    ``on_error``) by the broker: queues are not a cache."""
    reply: Any = None
    try:
        with trio.move_on_after(bound):
            reply = await client.execute("CONFIG", "GET", "maxmemory-policy")
    except (BrokerError, TransportClosed) as exc:
        logger.debug("maxmemory-policy not checked: %s", exc)
        return None
    if isinstance(reply, dict):  # (a RESP3 map)
        reply = [item for pair in reply.items() for item in pair]
    if not isinstance(reply, list) or len(reply) != 2 or not isinstance(reply[1], bytes):
        logger.debug("maxmemory-policy not checked: %r", reply)
        return None
    return reply[1].decode(errors="replace")


@attrs.frozen
class RedisBrokerStatistics:
    """Counters of one :class:`RedisBroker` (a snapshot)."""

    claims_examined: int
    """Claims the recovery scripts looked at: the stalled ones only (never a scan)."""
    subscriptions: int
    """Doorbell subscriptions opened (1 + reconnections)."""
    subscription_failures: int
    """Doorbell subscriptions lost or refused (each reported through ``on_error``)."""
    maxmemory_policy: str | None
    """The server's ``maxmemory-policy`` as read when the broker was entered (anything but
    ``noeviction`` may evict jobs), ``None`` if it could not be read (``CONFIG`` refused)."""


class EvictionPolicyWarning(UserWarning):
    """The Redis server may evict keys (its ``maxmemory-policy`` is not ``noeviction``): a
    job whose key is evicted is lost. Reported once, through the broker's ``on_error`` hook and
    the log, when the broker is entered; not an error (the broker works on)."""


class _FailAndPush:
    """:class:`~durable_trio.brokers.SupportsFailAndPush` of :class:`RedisBroker` (a base
    class of its own, so the broker's class stays under the size limit)."""

    _fail_and_push: Script
    _failed_retention: int
    _quarantine_retention: int

    def _queue(self, name: str) -> _Queue:
        raise NotImplementedError

    def _note_repair(self, queue: str, reply: object) -> None:
        raise NotImplementedError

    async def fail_and_push(
        self, lease: Lease, queue: str, error: str, push_queue: str, job: Job
    ) -> bool:
        """:meth:`fail_job`, then (if the lease held) push ``job`` onto ``push_queue``, in one
        script. ``False``: the lease was lost, nothing changed."""
        q, pq = self._queue(queue), self._queue(push_queue)
        args = (
            lease.token, error, self._failed_retention,
            job.id, job.data, 0, 0, pq.channel, self._quarantine_retention,
        )  # fmt: skip
        done = await self._fail_and_push((*q.fail_keys, *pq.push_keys), args)
        self._note_repair(push_queue, done)
        return bool(done)


class RedisBrokerBase(FailedJobRepair, PubSubDoorbell, IdentityWatch):
    """A :class:`~durable_trio.brokers.QueueBroker` on Redis: what :class:`RedisBroker` (one
    server, every optional capability) and
    :class:`~durable_trio.brokers.redis_cluster.RedisClusterBroker` share.

    Enter it (``async with``) before waiting on queues: it owns the task that listens to the
    doorbell. Every other call works on an entered or unentered broker alike.

    Args:
        client: an entered :class:`~durable_trio._redis.RedisClient` (not closed by the broker).
        failed_retention: failed jobs kept per queue for inspection (oldest dropped first).
        promote_batch: due delayed jobs promoted per claim at most.
        safety_poll_interval: seconds between two safety checks of a waiter (one ``EXISTS``
            of the queue's armed flag), and seconds of silence after which the subscription is
            ``PING``\\ ed; also how long a waiter waits for a subscription before returning.
        ping_timeout: seconds the subscription's ``PING`` may take before the connection is
            deemed dead and reopened.
        resubscribe_backoff: first and largest delay (seconds) between two attempts to reopen a
            lost subscription (doubled per failure, jittered down to half).
        quarantine_retention: entries kept per queue in the quarantine (stored data that names
            no readable job, see :meth:`quarantined`; oldest dropped first).
        store_check_interval: seconds between two checks of the store's identity (one script
            run; also after every reconnection): a store emptied or replaced under this broker
            raises the alarm (see :mod:`~durable_trio.brokers._redis_identity`).
        on_error: called with every error the doorbell listener meets, an
            :class:`EvictionPolicyWarning` when entered on a server that may evict keys, a
            :class:`~durable_trio.DamagedJob` when a retry finds a job's stored meta unreadable
            or a push, retry or requeue rebuilt a damaged sequence counter (a pop, a sweep: a
            report among its claims), a :class:`~durable_trio.StoreLost` (each also logged to
            ``durable_trio.redis``); it must not raise.

    Raises:
        ConfigError: an option out of range.
    """

    #: The command the scripts ring a doorbell with (a Cluster's broker: ``SPUBLISH``).
    _PUBLISH: ClassVar[str] = "PUBLISH"

    def __init__(
        self,
        client: RedisClient | RedisClusterClient,
        *,
        failed_retention: int = 1000,
        promote_batch: int = PROMOTE_BATCH,
        safety_poll_interval: float = 30.0,
        ping_timeout: float = 5.0,
        resubscribe_backoff: tuple[float, float] = (0.1, 5.0),
        quarantine_retention: int = 1000,
        store_check_interval: float = 15.0,
        on_error: Callable[[Exception], object] | None = None,
    ) -> None:
        if failed_retention < 1:
            raise ConfigError(f"failed_retention must be at least 1, not {failed_retention}")
        if quarantine_retention < 1:
            raise ConfigError(
                f"quarantine_retention must be at least 1, not {quarantine_retention}"
            )
        if promote_batch < 1:
            raise ConfigError(f"promote_batch must be at least 1, not {promote_batch}")
        if not safety_poll_interval > 0:
            raise ConfigError(f"safety_poll_interval must be > 0, not {safety_poll_interval}")
        if not ping_timeout > 0 or not store_check_interval > 0:
            raise ConfigError(
                f"ping_timeout and store_check_interval must be > 0, not {ping_timeout}, "
                f"{store_check_interval}"
            )
        first, largest = resubscribe_backoff
        if not 0 < first <= largest:
            raise ConfigError("resubscribe_backoff must be (first, largest), 0 < first <= largest")
        if isinstance(client, RedisClusterClient) and self._PUBLISH == "PUBLISH":
            raise ConfigError("a Redis Cluster client needs a RedisClusterBroker")
        self._client = client
        self._db = client.url.db if isinstance(client, RedisClient) else 0
        self._failed_retention = failed_retention
        self._quarantine_retention = quarantine_retention
        self._maxmemory_policy: str | None = None
        self._promote_batch = promote_batch
        self._safety_poll_interval = safety_poll_interval
        self._safety: Coalescer[str, bool] = Coalescer(self._check_armed)
        self._ping_timeout = ping_timeout
        self._backoff = (first, largest)
        self._on_error = on_error
        self._identity = StoreIdentity(client, store_check_interval, on_error, client.connected)
        self._push: Script = self._script(_PUSH)
        self._requeue_failed: Script = self._script(REQUEUE_FAILED)
        self._claim: Script = self._script(_CLAIM)
        self._complete: Script = self._script(_COMPLETE)
        self._complete_many: Script = self._script(_COMPLETE_MANY)
        self._push_many: Script = self._script(_PUSH_MANY)
        self._push_and_complete: Script = self._script(_PUSH_AND_COMPLETE_MANY)
        self._fail: Script = self._script(_FAIL)
        self._fail_and_push: Script = self._script(_FAIL_AND_PUSH)
        self._retry: Script = self._script(_RETRY)
        self._renew: Script = self._script(_RENEW)
        self._mark_started: Script = self._script(_MARK_STARTED)
        self._recover: Script = self._script(_RECOVER)
        self._size: Script = self._script(_SIZE)
        self._peek: Script = self._script(_PEEK)
        self._queues: dict[str, _Queue] = {}
        # The doorbell: wanted channels, the live subscription and its epoch.
        self._wanted = {}
        self._want = RepeatedEvent()  # a channel was added to _wanted
        self._epoch = 0
        # Set and replaced on every change of a subscription. An Event, not a RepeatedEvent:
        # _cover takes it before its SUBSCRIBE and waits on it after, so a change meanwhile is
        # not missed.
        self._changed = trio.Event()
        self._claims_examined = 0
        self._subscriptions = 0
        self._subscription_failures = 0
        self._stack: AsyncExitStack | None = None
        self._nursery: trio.Nursery | None = None
        self._listener_scope = trio.CancelScope()
        self._entered = False
        self._closed = False

    # -- lifetime ---------------------------------------------------------------------------

    @classmethod
    @asynccontextmanager
    async def from_url(cls, url: str, **options: Any) -> AsyncIterator[Self]:
        """Open a client on ``url`` and a broker on it; close both on leaving the block.

        Args:
            url: a ``redis://`` or ``rediss://`` URL (see :func:`~durable_trio._redis.open_redis`).
            **options: :class:`RedisBroker` options.

        Yields:
            the entered broker.
        """
        async with open_redis(url) as client, cls(client, **options) as broker:
            yield broker

    async def __aenter__(self) -> Self:
        if self._entered:
            raise RuntimeError("a RedisBroker can be entered only once")
        self._entered = True
        stack = AsyncExitStack()
        self._nursery = await stack.enter_async_context(trio.open_nursery())
        self._stack = stack
        try:
            await self._nursery.start(self._doorbell_loop)
            self._nursery.start_soon(self._identity.watch)
            await self._check_eviction_policy()
        except BaseException:  # cancelled while starting: leave the nursery before raising
            self._close_now()
            self._stack = None
            await stack.aclose()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._close_now()  # no checkpoint before the nursery is left, even when cancelled
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    async def aclose(self) -> None:
        """Stop listening to the doorbell (the client stays open: it is the caller's).

        Idempotent, callable from any task; it does not wait (the listener ends at once when
        cancelled, and leaving the ``async with`` waits for it).
        """
        self._close_now()
        await trio.lowlevel.checkpoint()

    def _close_now(self) -> None:
        self._closed = True
        # Only the listener's own scope: the nursery's would cancel the ``async with`` body.
        self._listener_scope.cancel()
        self._identity.stop()
        self._drop_subscriptions()
        self._signal_changed()

    def _script(self, source: str) -> Script:
        """Register ``source``, ringing doorbells with :attr:`_PUBLISH`."""
        return self._client.script(source.replace("'PUBLISH'", f"'{self._PUBLISH}'"))

    @property
    def client(self) -> RedisClient | RedisClusterClient:
        """The Redis client this broker runs on (the run store shares it)."""
        return self._client

    def statistics(self) -> RedisBrokerStatistics:
        """A snapshot of the broker's counters."""
        return RedisBrokerStatistics(
            claims_examined=self._claims_examined,
            subscriptions=self._subscriptions,
            subscription_failures=self._subscription_failures,
            maxmemory_policy=self._maxmemory_policy,
        )

    async def _check_eviction_policy(self) -> None:
        policy = await _read_eviction_policy(self._client, self._ping_timeout)
        if policy is None:
            return
        self._maxmemory_policy = policy
        if policy != "noeviction":
            self._report(
                EvictionPolicyWarning(
                    f"Redis runs with maxmemory-policy {policy!r}: when it reaches maxmemory "
                    "it may evict the keys of queued jobs (lost jobs, or entries moved to the "
                    "quarantine). Run it with maxmemory-policy noeviction."
                ),
                "eviction policy",
            )

    # -- the contract -----------------------------------------------------------------------

    def _queue(self, name: str) -> _Queue:
        q = self._queues.get(name)
        if q is None:
            if not name or "{" in name or "}" in name:
                raise ValueError(f"a Redis queue name is not empty and has no braces: {name!r}")
            q = self._queues[name] = _Queue.make(name, self._db)
        return q

    async def push_on(
        self, queue: str, job: Job, *, priority: int | None = None, delay: float = 0.0
    ) -> None:
        """Enqueue ``job`` (see :class:`~durable_trio.brokers.QueueBroker`).

        Raises:
            ValueError: ``priority`` outside ``[MIN_PRIORITY, MAX_PRIORITY]``, or a queue name
                that is empty or has braces.
        """
        q = self._queue(queue)
        priority = priority or 0
        if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
            raise ValueError(f"priority must be in [-2**53, 2**53], not {priority}")
        delay = delay if delay > 0 else 0
        args = (job.id, job.data, priority, delay, q.channel, self._quarantine_retention)
        self._note_repair(queue, await self._push(q.push_keys, args))

    async def pop_from(self, queue: str, *, worker: str = "") -> ClaimedJob | None:
        """Claim the next ready job (promoting due delayed jobs first), or ``None``."""
        jobs = await self.pop_many(queue, 1, worker=worker)
        return jobs[0] if jobs else None

    async def pop_many(self, queue: str, count: int, *, worker: str = "") -> list[ClaimedJob]:
        """Claim up to ``count`` ready jobs in one round trip (one script run), in pop order."""
        return await self.pop_ahead(queue, count, 0, worker=worker)

    async def pop_ahead(
        self, queue: str, count: int, ahead: int, *, worker: str = ""
    ) -> list[ClaimedJob]:
        """:meth:`pop_many` of ``count + ahead`` jobs in one script run, the last ``ahead``
        stored as not started (see :class:`~durable_trio.brokers.SupportsClaimAhead`)."""
        q = self._queue(queue)
        total = count + ahead
        if total < 1:
            await trio.lowlevel.checkpoint()
            return []
        # Snapshot the doorbell before the command is sent: a ring counted after this may be
        # for an older push (a spurious wake-up), but no push after the pop can be missed.
        rings, epoch = q.rings, (self._live_epoch(q) if self._covers(q) else None)
        reply = await self._claim(q.claim_keys, self._claim_argv(total, count, worker))
        return self._claims_of(q, reply, count, rings, epoch)

    def _claim_argv(self, total: int, count: int, worker: str) -> tuple[Any, ...]:
        return (
            total, worker, _suffixes(total), self._promote_batch, self._quarantine_retention,
            count,
        )

    def _claims_of(
        self, q: _Queue, reply: list[Any], count: int, rings: int, epoch: int | None
    ) -> list[ClaimedJob]:
        """The claims of a claim script's ``reply`` (the first ``count`` started), noting a
        drained queue for the waiters (``rings``, ``epoch``: as of before it was sent)."""
        if len(reply) == 1 or reply[0] is not None:  # (empty; or drained, armed: as good as
            q.note_empty(rings, epoch, _seconds(reply[0]))  # an empty pop for a waiter)
        else:
            q.empty_epoch = None
        return _claims_in(reply, count)

    async def mark_started(self, queue: str, leases: Sequence[Lease]) -> list[bool]:
        """Mark claims popped ahead started, and renew them, in one script run."""
        q = self._queue(queue)
        tokens = [lease.token for lease in leases]
        reply = await self._mark_started((q.active_key, q.claim_keys[7]), tokens) if tokens else []
        return [bool(answer) for answer in reply]

    async def complete_job(self, lease: Lease, queue: str) -> bool:
        """Remove a finished job. ``False``: the lease was lost, nothing changed."""
        q = self._queue(queue)
        return bool(await self._complete(q.complete_keys, (lease.token,)))

    async def complete_many(self, queue: str, leases: Sequence[Lease]) -> list[bool]:
        """``complete_job`` for each lease, in one script run."""
        q = self._queue(queue)
        if not leases:
            await trio.lowlevel.checkpoint()
            return []
        reply = await self._complete_many(q.complete_keys, [lease.token for lease in leases])
        return [bool(answer) for answer in reply]

    async def push_many(
        self, queue: str, jobs: Sequence[Job], priorities: Sequence[int | None]
    ) -> None:
        """``push_on`` (no delay) for each job, in one script run."""
        q = self._queue(queue)
        args: list[Any] = [q.channel, self._quarantine_retention]
        for job, priority in zip(jobs, priorities, strict=True):
            value = priority or 0
            if not MIN_PRIORITY <= value <= MAX_PRIORITY:
                raise ValueError(f"priority must be in [-2**53, 2**53], not {value}")
            args += (job.id, job.data, value)
        if not jobs:
            await trio.lowlevel.checkpoint()
            return
        self._note_repair(queue, await self._push_many(q.push_keys, args))

    async def push_and_complete_many(
        self, push_queue: str, jobs: Sequence[Job], queue: str, leases: Sequence[Lease]
    ) -> list[bool]:
        """Push, then complete: both or neither on one server (one script), the complete only
        once the push landed on a Cluster (see :meth:`_finish_commands`)."""
        if not jobs and not leases:
            await trio.lowlevel.checkpoint()
            return []
        commands = await self._finish_commands(push_queue, jobs, queue, leases)
        replies = await self._client.pipeline(commands)
        return self._finish_answers(push_queue, leases, replies[-1])

    async def _finish_commands(
        self, push_queue: str, jobs: Sequence[Job], queue: str, leases: Sequence[Lease]
    ) -> list[tuple[RedisArg, ...]]:
        """The commands that push ``jobs`` (priority 0) and complete ``leases``, no lease
        completed unless the push landed (a push refused, say by a Redis out of memory, must
        not leave its task acknowledged with no result): ONE script on one server; on a
        Cluster the two queues are two slots, so the push is run first, here, and only the
        complete is returned (a failure after the push leaves the task claimed: its result
        may come twice, which the engine absorbs, never not at all)."""
        push: list[Any] = [job_field for job in jobs for job_field in (job.id, job.data, 0)]
        pq = self._queue(push_queue)
        tokens = [lease.token for lease in leases]
        keys = self._queue(queue).complete_keys if leases else ()
        retention = self._quarantine_retention
        if not leases:
            args = [pq.channel, retention, *push]
            return [self._push_many.command(pq.push_keys, args)] if jobs else []
        if jobs and not isinstance(self._client, RedisClusterClient):
            args = [pq.channel, len(jobs), retention, *push, *tokens]
            return [self._push_and_complete.command((*pq.push_keys, *keys), args)]
        if jobs:
            reply = await self._push_many(pq.push_keys, [pq.channel, retention, *push])
            self._note_repair(push_queue, reply)
        return [self._complete_many.command(keys, tokens)]

    async def finish_and_claim(
        self,
        push_queue: str,
        jobs: Sequence[Job],
        queue: str,
        leases: Sequence[Lease],
        count: int,
        *,
        worker: str = "",
    ) -> tuple[list[bool], list[ClaimedJob]]:
        """:meth:`push_and_complete_many`, then the claim script for ``count`` jobs, in ONE
        pipeline (one round trip; a Cluster's push goes first, alone; see
        :class:`~durable_trio.brokers.SupportsFinishAndClaim`)."""
        if count < 1:
            return await self.push_and_complete_many(push_queue, jobs, queue, leases), []
        q = self._queue(queue)
        commands = await self._finish_commands(push_queue, jobs, queue, leases)
        commands.append(self._claim.command(q.claim_keys, self._claim_argv(count, count, worker)))
        rings, epoch = q.rings, (self._live_epoch(q) if self._covers(q) else None)
        replies = await self._client.pipeline(commands)
        answers = self._finish_answers(push_queue, leases, replies[-2]) if len(replies) > 1 else []
        return answers, self._claims_of(q, replies[-1], count, rings, epoch)

    async def fail_job(self, lease: Lease, queue: str, error: str) -> bool:
        """Fail a job for good, keeping the newest ``failed_retention``. ``False``: lease lost."""
        q = self._queue(queue)
        return bool(await self._fail(q.fail_keys, (lease.token, error, self._failed_retention)))

    async def retry_job(
        self, lease: Lease, queue: str, *, delay: float = 0.0, count_attempt: bool = True
    ) -> bool:
        """Hand a claim back for redelivery after ``delay`` seconds. ``False``: lease lost.

        A counted retry (or any delayed one) goes to the back of its priority; an immediate
        ``count_attempt=False`` handback keeps the place the job was popped from.
        """
        q = self._queue(queue)
        args = (
            lease.token,
            delay if delay > 0 else 0,
            "1" if count_attempt else "0",
            q.channel,
            self._failed_retention,
            self._quarantine_retention,
        )
        answer = await self._retry(q.retry_keys, args)
        self._note_repair(queue, answer)
        if answer == 2:
            self._report(
                DamagedJob(
                    "stored meta unreadable: the job could not be retried, it was failed "
                    "(kept as found in the failed set)",
                    queue=queue,
                    job_id=lease.job_id,
                ),
                "retrying a job",
            )
        return bool(answer)

    async def renew_jobs(self, queue: str, leases: Sequence[Lease]) -> RenewOutcome:
        """Refresh the age of every claim in ``leases`` still held under its token."""
        q = self._queue(queue)
        renewed = 0
        lost: list[Lease] = []
        for start in range(0, len(leases), RENEW_BATCH):
            chunk = leases[start : start + RENEW_BATCH]
            count, positions = await self._renew((q.active_key,), [x.token for x in chunk])
            renewed += count
            lost.extend(chunk[i - 1] for i in positions)
        if not leases:
            await trio.lowlevel.checkpoint()
        return RenewOutcome(renewed=renewed, lost=tuple(lost))

    async def recover_stalled_jobs(
        self, queue: str, threshold: float, max_stalled: int
    ) -> Recovery:
        """Take back claims older than ``threshold`` seconds (server clock), each to the place
        it was popped from.

        Each script run handles at most ``RECOVER_BATCH`` stalled claims, found in O(log n + k)
        on the age index; a sweep runs as many as it needs, all against the cutoff of the first
        (so a job re-leased as poison is never taken back twice in one sweep).
        """
        q = self._queue(queue)
        recovered = 0
        exceeded: list[ClaimedJob] = []
        cutoff = ""
        while True:
            reply = await self._recover(
                q.recover_keys,
                (
                    max(threshold, 0.0),
                    cutoff,
                    max_stalled,
                    _suffixes(16),
                    RECOVER_BATCH,
                    q.channel,
                    self._quarantine_retention,
                ),
            )
            recovered += reply[0]
            cutoff = reply[1].decode()
            examined = reply[2]
            self._claims_examined += examined
            exceeded.extend(_claimed(reply, i) for i in range(3, len(reply), 4))
            if examined < RECOVER_BATCH:
                return Recovery(recovered=recovered, exceeded=tuple(exceeded))

    async def queues_with_claims(self, queues: Sequence[str]) -> list[str]:
        """The queues that may hold claims, in ONE command (an ``MGET`` of the flags the claim
        script sets and a sweep that leaves no claim clears): a worker sweeping ten idle queues
        costs one command, not ten scripts (on a Cluster, one pipeline per master)."""
        if not queues:
            await trio.lowlevel.checkpoint()
            return []
        flags = await self._read_flags([self._queue(q).claimed_key for q in queues])
        return [queue for queue, flag in zip(queues, flags, strict=True) if flag]

    async def _read_flags(self, keys: list[str]) -> list[bool]:
        """Which of ``keys`` exist, in ONE ``MGET`` (one node: the keys' slots do not matter)."""
        values = await self._client.execute("MGET", *keys)
        return [value is not None for value in values]

    async def size_of(self, queue: str) -> int:
        """Jobs waiting to be claimed (ready and delayed)."""
        q = self._queue(queue)
        return int(await self._size(q.size_keys))

    async def waiting_queues(self, prefix: str) -> list[str]:
        """The queues named ``prefix...`` holding ready or delayed jobs: a ``SCAN`` for their
        ``{Q}:ready`` and ``{Q}:delayed`` keys (Redis deletes an empty sorted set, so a key
        found holds jobs), O(keys in the database), for a health read (see
        :class:`~durable_trio.brokers.SupportsQueueListing`)."""
        return await scan_queues(await self._scan_targets(), prefix, ("ready", "delayed"))

    async def job_state(self, queue: str, job_id: str) -> JobState | None:
        """Whether job ``job_id`` waits on ``queue`` or is claimed (see :func:`_job_state`)."""
        return await _job_state(self._client, queue, job_id)

    async def job_states(self, queue: str, job_ids: Sequence[str]) -> list[JobState | None]:
        """:meth:`job_state` of each of ``job_ids``: one script call, one scan of the queue's
        meta hash (see :class:`~durable_trio.brokers.SupportsJobStates`)."""
        return await _job_states(self._client, queue, job_ids)

    async def failed_jobs(self, queue: str, *, limit: int = 100) -> list[FailedJob]:
        """The most recent failed jobs of ``queue``, newest first."""
        q = self._queue(queue)
        if limit < 1:
            await trio.lowlevel.checkpoint()
            return []
        records = await self._client.execute("LRANGE", q.failed_key, 0, limit - 1)
        return [_failed(record) for record in records]

    def _channel(self, queue: str) -> bytes:
        return self._queue(queue).channel

    def _read_failed(self, record: bytes) -> FailedJob:
        return _failed(record)

    async def quarantined(self, queue: str, *, limit: int = 100) -> list[QuarantinedEntry]:
        """The newest entries of ``queue`` that could not be tied to a readable job (a member
        of ``ready``, ``delayed`` or ``active`` naming no job, a job without its meta, a stall
        history replaced, a sequence counter rebuilt), newest first, kept up to
        ``quarantine_retention``."""
        q = self._queue(queue)
        if limit < 1:
            await trio.lowlevel.checkpoint()
            return []
        records = await self._client.execute("LRANGE", q.quarantine_key, 0, limit - 1)
        return [_quarantined(queue, record) for record in records]

    # -- wake-up ----------------------------------------------------------------------------

    async def wait_for_work(self, queue: str) -> None:
        """Return when ``queue`` may have work (see the module docs for how).

        Returns at once if a job is ready; else on a doorbell ring after this broker's last
        empty pop, when the earliest delayed job comes due, when a safety check finds the
        queue's armed flag gone, or when no subscription could be made within
        ``safety_poll_interval``.

        Error handling:
            Never raises :class:`~durable_trio.BrokerError`: a failed check is reported through
            ``on_error`` and the call returns (the caller's next pop meets the error itself).

        Raises:
            RuntimeError: the broker was not entered (``async with``).
        """
        q = self._queue(queue)
        if self._nursery is None:
            raise RuntimeError("enter the RedisBroker (async with) before waiting on it")
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        with trio.move_on_after(self._safety_poll_interval) as covering:
            await self._cover(q)
        if covering.cancelled_caught or self._closed:
            return  # no subscription for that long: let the caller look (and meet the error)
        if q.empty_epoch is None or q.empty_epoch != self._live_epoch(q):
            # The last pop was not covered by this subscription: look (which arms) now that
            # the subscription is in place.
            rings = q.rings
            try:
                reply = await self._peek(q.peek_keys)
            except BrokerError as exc:
                self._report(exc)
                return
            if reply[0]:
                return
            epoch = self._live_epoch(q)
            q.note_empty(rings, epoch, _seconds(reply[1]) if len(reply) > 1 else None)
        with trio.move_on_at(q.due_at):
            while q.rings == q.empty_rings:
                # Safety checks fall on a grid shared by every waiter of this broker, so the
                # checks of all idle queues leave together, as ONE MGET (see _check_armed).
                with trio.move_on_at(self._next_safety_tick()):
                    await q.ring.wait()
                    return
                # The slow safety poll: the empty pop (or peek) set the armed flag, and every
                # push, retry or recovery since then clears it. Still set: nothing was made
                # ready since some consumer last found the queue empty, whatever happened to the
                # doorbell. Gone (a push, or the flag lost to a flush or an eviction): return,
                # and the caller's pop looks and re-arms.
                try:
                    armed = await self._safety.submit(q.armed_key)
                except BrokerError as exc:
                    self._report(exc)
                    return
                if not armed:
                    return

    def _next_safety_tick(self) -> float:
        interval = self._safety_poll_interval
        return (math.floor(trio.current_time() / interval) + 1) * interval

    async def _check_armed(self, keys: list[str]) -> list[bool]:
        """One read of the armed flags of every queue whose safety check fell on this tick
        (see :meth:`_read_flags`)."""
        return await self._read_flags(keys)

    def _report(self, exc: Exception, doing: str = "doorbell") -> None:
        logger.warning("Redis %s: %s", doing, exc, exc_info=exc)
        if self._on_error is not None:
            report_through(self._on_error, exc, logger)


class RedisBroker(RedisBrokerBase, _FailAndPush):
    """A :class:`~durable_trio.brokers.QueueBroker` on one Redis server, with every optional
    capability, the atomic :meth:`fail_and_push` included (a Cluster's queues live on two
    slots: :class:`~durable_trio.brokers.redis_cluster.RedisClusterBroker` has no such call).
    Options as :class:`RedisBrokerBase`'s."""
