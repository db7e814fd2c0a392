"""The Redis broker's Lua scripts, and their registration with a client (:class:`Scripts`).

One script per multi-key step (push, claim, complete, fail, retry, renew, recover, size, peek,
the operator's requeue and oldest-ready look), each touching the keys of one queue (one Cluster
slot), registered once and run by ``EVALSHA``. The key and argument lists of each are written
above it; the key names come from :class:`~durable_trio.brokers.redis._queue.Queue`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Final

from ..._redis._script import writable_lua
from ._lookups import JOB_STATE, JOB_STATES, OLDEST_READY, REQUEUE_FAILED, SIZE
from ._seq import MEMBER_ID, TAKE_SEQ
from ._slots import FREE_SLOT, PARK, PEEK, READ_LIMIT, SET_LIMIT, WALK_MAX, slot_table

if TYPE_CHECKING:
    from ..._redis import RedisClient, RedisClusterClient, Script

__all__ = ["Scripts"]

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

_SET_ASIDE: Final = (
    """
-- One stored field of a quarantine record, labelled (for a person to read; the length shows
-- where binary bytes end).
local function field(label, value)
  if value then
    return label .. ' (' .. #value .. ' bytes): ' .. value .. '\\n'
  end
  return label .. ': (none)\\n'
end
"""
    # Fail the script (before a damage path's first write) if key holds another type than kind.
    + writable_lua("damaged store")
    + """-- A quarantine record: "at len(reason)\\n" followed by the reason and the raw fields.
local function quarantine_record(reason, raw)
  return string.format('%.6f', now) .. ' ' .. #reason .. '\\n' .. reason .. raw
end
"""
)

_FAILED_RECORD: Final = """
-- A failed record: "failed_at attempts stalled len(id) len(error) len(stalls)\\n" followed by
-- id, error, stalls and the job's bytes (last, so it needs no length). When the meta is
-- unreadable the counts are 0, the id is empty, and a seventh length (-1: no meta at all) says
-- how many bytes of raw meta follow the stalls: a damaged job is kept as it was found. A job
-- with a concurrency key ends the head with " k" and its length, the key after the raw meta.
local function failed_record(now, meta, err, stalls, data, key)
  local _, attempts, stalled, id = parse_meta(meta)
  local raw, tail = '', ''
  if not attempts then
    attempts, stalled, id = '0', '0', ''
    raw = meta or ''
    tail = ' ' .. (meta and #meta or -1)
  end
  key = key or ''
  if key ~= '' then
    tail = tail .. ' k' .. #key
  end
  return string.format('%.6f', now) .. ' ' .. attempts .. ' ' .. stalled .. ' ' .. #id ..
    ' ' .. #err .. ' ' .. #stalls .. tail .. '\\n' .. id .. err .. stalls .. raw .. key .. data
end
"""

# The sequence counter's keys of a script that starts with PUSH_KEYS (see TAKE_SEQ).
_PUSH_SEQ_KEYS: Final = """{seq = KEYS[1], ready = KEYS[2], delayed = KEYS[3], jobs = KEYS[4],
  meta = KEYS[5], claims = KEYS[7], moved = KEYS[8], active = KEYS[9], quarantine = KEYS[10]}"""

# KEYS: PUSH_KEYS (seq ready delayed jobs meta armed claims moved active quarantine)
# ARGV: id data priority delay channel quarantine_retention key
# The job's concurrency key (Job.key, "" for none) is kept as ``k`` .. n in jobs.
# Returns 1, or the reason the sequence counter was repaired (TAKE_SEQ).
_PUSH: Final = (
    TAKE_SEQ
    + """
local t = redis.call('TIME')
local seq, repaired = take_seq(PUSH_SEQ_KEYS, 1, ARGV[6])
local n = string.format('%d', seq)
-- (the push time as TIME's two parts, joined: a number format would cost more than the HSET)
redis.call('HSET', KEYS[4], n, ARGV[2], 't' .. n, t[1] .. ' ' .. t[2])
if ARGV[7] ~= '' then
  redis.call('HSET', KEYS[4], 'k' .. n, ARGV[7])
end
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
)

# KEYS: seq ready delayed active jobs meta stalls claims armed claimed quarantine moved, the
# slot keys (held parked full ready armed), limit
# ARGV: count worker token_suffixes promote_batch quarantine_retention [started]
# Under a fleet-wide limit (``{Q}:limit``, see _slots) only the jobs that fit are claimed:
# queue-wide, ``limit - ZCARD active`` at most (stopped short: ``full`` set, so the next lease
# to end rings); per key, the ready jobs of a full key are parked as they are met (at most
# WALK_MAX looked at: past that, the reply says "due in 0 seconds": look again at once). An
# unreadable limit key is moved to the quarantine (a report): no limit until one is set again.
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
    + PARK
    + READ_LIMIT
    + """
-- Per key: walk ready from its head, choosing the jobs whose key has a free slot and parking
-- the others, until count are chosen (or WALK_MAX looked at: more is then true). A full key's
-- held entries are checked against active once (stray ones dropped: stale). Reads only.
local function walk(count, lim)
  local chosen, prefixes, parked, stale = {}, {}, {}, {}
  local used, checked = {}, {}
  local walked, more = 0, false
  while #chosen < count do
    if walked >= WALK_MAX then
      more = redis.call('ZCARD', KEYS[2]) > walked
      break
    end
    local page = redis.call('ZRANGE', KEYS[2], walked, walked + 99, 'WITHSCORES')
    if #page == 0 then
      break
    end
    for i = 1, #page, 2 do
      local member = page[i]
      walked = walked + 1
      local n = string.match(member, MEMBER_ID)
      local prefix = key_prefix(n and redis.call('HGET', KEYS[5], 'k' .. n))
      local u = used[prefix]
      if not u then
        u = redis.call('ZLEXCOUNT', KEYS[13], key_range(prefix))
      end
      if u >= lim and not checked[prefix] then
        checked[prefix] = true
        u = u - redis.call('ZLEXCOUNT', KEYS[13], key_range(prefix)) +
          live_count(KEYS[13], KEYS[4], prefix, stale)
      end
      used[prefix] = u
      if not n or u < lim then
        -- (a member naming no job goes to the claim below, which quarantines it: no slot)
        chosen[#chosen + 1] = member
        prefixes[#chosen] = prefix
        if n and redis.call('HEXISTS', KEYS[6], n) == 1 then
          used[prefix] = u + 1
        end
        if #chosen == count then
          break
        end
      else
        parked[#parked + 1] = parked_member(prefix, page[i + 1], member)
      end
    end
  end
  -- Ready ran out: one parked key drawn by the clock whose slots are free after all (a lease
  -- that ended without unparking it: damaged data) is unparked (rescue), and more is set.
  local rescue = false
  if #chosen < count and not more then
    local total = redis.call('ZCARD', KEYS[14])
    local at = total > 0 and math.floor(now * 1000003) % total
    local probe = at and redis.call('ZRANGE', KEYS[14], at, at)[1]
    local len = probe and string.match(probe, '^(%d+):')
    local prefix = len and string.sub(probe, 1, #len + tonumber(len) + 2)
    if prefix and (used[prefix] or live_count(KEYS[13], KEYS[4], prefix, stale)) < lim then
      rescue, more = prefix, true
    end
  end
  return chosen, walked, prefixes, parked, stale, more, rescue
end
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
    redis.call('HDEL', KEYS[5], n, 't' .. n, 'k' .. n)
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
local lim, per_key, junk = read_limit(KEYS[18])
if junk then
  writable(KEYS[11], 'list')
  quarantine('limit unreadable, removed (no limit until one is set again)', junk, false)
  redis.call('DEL', KEYS[18])
end
local members, walked, prefixes, parked, stale, more, rescue = {}, 0, {}, {}, {}, false, false
local stopped = false  -- ready jobs left behind by a queue-wide limit
if not lim then
  members = redis.call('ZRANGE', KEYS[2], 0, count - 1)
  walked = #members
elseif not per_key then
  local room = lim - redis.call('ZCARD', KEYS[4])
  if room > 0 then
    members = redis.call('ZRANGE', KEYS[2], 0, math.min(count, room) - 1)
  end
  walked = #members
  stopped = walked < count and redis.call('ZCARD', KEYS[2]) > walked
else
  redis.call('ZCARD', KEYS[13])  -- (reads: a wrong-type key fails here, before any write)
  redis.call('ZCARD', KEYS[14])
  members, walked, prefixes, parked, stale, more, rescue = walk(count, lim)
end
-- Per key: the jobs of full keys parked, stray held entries dropped (every read is done).
local function settle()
  for _, entry in ipairs(parked) do
    redis.call('ZADD', KEYS[14], 0, entry)
  end
  for _, entry in ipairs(stale) do
    redis.call('ZREM', KEYS[13], entry)
  end
  if stopped then
    redis.call('SET', KEYS[15], '1')
  end
end
if #members == 0 then
  settle()
  if walked > 0 then
    redis.call('ZREMRANGEBYRANK', KEYS[2], 0, walked - 1)
  end
  if rescue then  -- (after the walked ranks left ready)
    unpark({parked = KEYS[14], ready = KEYS[2]}, rescue)
  end
  redis.call('SET', KEYS[9], '1')
  local first = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
  if more then
    out[1] = '0'
  elseif #first > 0 then
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
for i, member in ipairs(members) do
  local n = string.match(member, MEMBER_ID)
  local meta = n and redis.call('HGET', KEYS[6], n)
  if not n or tonumber(string.sub(member, 1, 16)) ~= tonumber(n) then
    unmove[#unmove + 1] = member
  end
  if meta then
    local at = (#claims / 5 % (#suffixes / 16)) * 16
    local token = n .. ':' .. string.sub(suffixes, at + 1, at + 16)
    local _, _, stalled = parse_meta(meta)
    claims[#claims + 1] = n
    claims[#claims + 1] = member
    claims[#claims + 1] = token
    -- A suspect (stalled before, while its handler ran) is stored not started, like a claim
    -- popped ahead: it may wait to run alone in its worker, and that wait is not counted.
    claims[#claims + 1] = stalled ~= nil and tonumber(stalled) > 0
    claims[#claims + 1] = prefixes[i] or ''
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
settle()
local started = tonumber(ARGV[6] or '')
for i = 1, #claims, 5 do
  local n = claims[i]
  local holder = worker
  if claims[i + 3] or (started and (i - 1) / 5 >= started) then
    holder = '\\1' .. worker
  end
  -- (the claim first: should the next write fail, a claim entry alone changes nothing)
  redis.call('HSET', KEYS[8], n, string.sub(claims[i + 1], 1, 16) .. holder)
  redis.call('ZADD', KEYS[4], now, claims[i + 2])
  if per_key then
    redis.call('ZADD', KEYS[13], 0, claims[i + 4] .. claims[i + 2])  -- its key's slot
  end
end
redis.call('ZREMRANGEBYRANK', KEYS[2], 0, walked - 1)
if rescue then
  unpark({parked = KEYS[14], ready = KEYS[2]}, rescue)
end
for _, member in ipairs(unmove) do
  redis.call('ZREM', KEYS[12], member)
end
if #claims > 0 then
  redis.call('SET', KEYS[10], '1')  -- a sweep has something to look at (see queues_with_claims)
end
if set_aside > 0 then
  redis.call('LTRIM', KEYS[11], 0, tonumber(ARGV[5]) - 1)
end
if more then
  out[1] = '0'  -- (the walk's bound: look again at once)
elseif #members < count then
  -- Drained (or at the limit): arm the doorbell like an empty pop, so the caller may wait
  -- without popping again.
  redis.call('SET', KEYS[9], '1')
  local first = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
  out[1] = #first > 0 and string.format('%.6f', tonumber(first[2]) - now) or ''
end
return out
""".replace("MEMBER_ID", MEMBER_ID).replace("WALK_MAX", str(WALK_MAX))
)

# KEYS: active jobs meta stalls claims, the slot keys (held parked full ready armed)
# ARGV: channel, token, token, ...
# Returns 1 (completed) or 0 (the lease was lost) per token. Each lease's slot is freed
# (FREE_SLOT: a job parked behind its key ready again, a waiter the limit stopped rung).
_COMPLETE_MANY: Final = (
    FREE_SLOT
    + """
local out = {}
for i = 2, #ARGV do
  local token = ARGV[i]
  local n = string.match(token, '^(%d+):')
  if not n or redis.call('ZREM', KEYS[1], token) == 0 then
    out[i - 1] = 0
  else
    free_slot(SLOTS, n, token, ARGV[1])
    redis.call('HDEL', KEYS[2], n, 't' .. n, 'k' .. n)
    redis.call('HDEL', KEYS[3], n)
    redis.call('HDEL', KEYS[4], n)
    redis.call('HDEL', KEYS[5], n)
    out[i - 1] = 1
  end
end
return out
""".replace("SLOTS", slot_table(6, 2))
)

# KEYS: PUSH_KEYS (as _PUSH's)
# ARGV: channel, quarantine_retention, then (id, data, priority, key) per job
# Returns the count, or the reason the sequence counter was repaired (TAKE_SEQ).
_PUSH_MANY: Final = (
    TAKE_SEQ
    + """
local t = redis.call('TIME')
local pushed_at = t[1] .. ' ' .. t[2]
local count = (#ARGV - 2) / 4
local seq, repaired = take_seq(PUSH_SEQ_KEYS, count, ARGV[2])
seq = seq - count
for i = 0, count - 1 do
  seq = seq + 1
  local n = string.format('%d', seq)
  local priority = ARGV[5 + 4 * i]
  redis.call('HSET', KEYS[4], n, ARGV[4 + 4 * i], 't' .. n, pushed_at)
  if ARGV[6 + 4 * i] ~= '' then
    redis.call('HSET', KEYS[4], 'k' .. n, ARGV[6 + 4 * i])
  end
  redis.call('HSET', KEYS[5], n, priority .. ':0:0:' .. ARGV[3 + 4 * i])
  redis.call('ZADD', KEYS[2], priority, string.format('%016d', seq) .. n)
end
if redis.call('DEL', KEYS[6]) == 1 then
  redis.call('PUBLISH', ARGV[1], '')
end
return repaired or count
""".replace("PUSH_SEQ_KEYS", _PUSH_SEQ_KEYS)
)


# KEYS: the push's (PUSH_KEYS) of the results queue, then the complete's (active jobs meta
# stalls claims, the slot keys) of the task queue.
# ARGV: channel, job count, quarantine_retention, the task queue's channel, (id data priority
# key) per job, then one token per lease.
# Returns 1 or 0 per token (as _COMPLETE_MANY's), then the reason the results queue's sequence
# counter was repaired, if it was (TAKE_SEQ). A worker's results and the acknowledgements of
# their tasks: both or neither. The push comes first, and a script refused at its first write
# (Redis out of memory: -OOM) or failing in the push writes nothing after it, so a task is never
# acknowledged without its result; the complete's keys are read first (a wrong type fails the
# script before any write).
_PUSH_AND_COMPLETE_MANY: Final = (
    TAKE_SEQ
    + FREE_SLOT
    + """
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
  local priority = ARGV[7 + 4 * i]
  redis.call('HSET', KEYS[4], n, ARGV[6 + 4 * i], 't' .. n, pushed_at)
  if ARGV[8 + 4 * i] ~= '' then
    redis.call('HSET', KEYS[4], 'k' .. n, ARGV[8 + 4 * i])
  end
  redis.call('HSET', KEYS[5], n, priority .. ':0:0:' .. ARGV[5 + 4 * i])
  redis.call('ZADD', KEYS[2], priority, string.format('%016d', seq) .. n)
end
if redis.call('DEL', KEYS[6]) == 1 then
  redis.call('PUBLISH', ARGV[1], '')
end
local out = {}
for i = 5 + 4 * count, #ARGV do
  local token = ARGV[i]
  local n = string.match(token, '^(%d+):')
  if not n or redis.call('ZREM', KEYS[11], token) == 0 then
    out[#out + 1] = 0
  else
    free_slot(SLOTS, n, token, ARGV[4])
    redis.call('HDEL', KEYS[12], n, 't' .. n, 'k' .. n)
    redis.call('HDEL', KEYS[13], n)
    redis.call('HDEL', KEYS[14], n)
    redis.call('HDEL', KEYS[15], n)
    out[#out + 1] = 1
  end
end
out[#out + 1] = repaired
return out
""".replace("PUSH_SEQ_KEYS", _PUSH_SEQ_KEYS).replace("SLOTS", slot_table(16, 12))
)

# KEYS: active jobs meta stalls claims failed, the slot keys (held parked full ready armed)
# ARGV: token error retention channel
# A job whose meta is unreadable or gone is failed all the same, kept as found (see
# failed_record). Its slot is freed (FREE_SLOT).
_FAIL: Final = (
    _NOW
    + _PARSE_META
    + _FAILED_RECORD
    + FREE_SLOT
    + """
local token = ARGV[1]
local n = string.match(token, '^(%d+):')
if not n or not redis.call('ZSCORE', KEYS[1], token) then
  return 0
end
local meta = redis.call('HGET', KEYS[3], n)
local data = redis.call('HGET', KEYS[2], n) or ''
local stalls = redis.call('HGET', KEYS[4], n) or ''
local key = redis.call('HGET', KEYS[2], 'k' .. n)
redis.call('HEXISTS', KEYS[5], n)  -- (a read: a wrong-type key fails here, before any write)
redis.call('LPUSH', KEYS[6], failed_record(now, meta, ARGV[2], stalls, data, key))
redis.call('LTRIM', KEYS[6], 0, tonumber(ARGV[3]) - 1)
redis.call('ZREM', KEYS[1], token)
free_slot(SLOTS, n, token, ARGV[4])
redis.call('HDEL', KEYS[2], n, 't' .. n, 'k' .. n)
redis.call('HDEL', KEYS[3], n)
redis.call('HDEL', KEYS[4], n)
redis.call('HDEL', KEYS[5], n)
return 1
""".replace("SLOTS", slot_table(7, 2))
)


def _shifted(script: str, keys: int, argv: int) -> str:
    """``script`` reading its KEYS and ARGV from ``keys`` and ``argv`` places further on."""
    script = re.sub(r"KEYS\[(\d+)\]", lambda m: f"KEYS[{int(m[1]) + keys}]", script)
    return re.sub(r"ARGV\[(\d+)\]", lambda m: f"ARGV[{int(m[1]) + argv}]", script)


# KEYS: the fail's (active jobs meta stalls claims failed, the slot keys), then the push's
# (PUSH_KEYS) of another queue. ARGV: the fail's (token error retention channel), then the
# push's (id data priority delay channel quarantine_retention key). Fail, then push, in one
# script: both or neither (the poison bridge's fail and failed result). The push's keys are
# read before any write. Returns as _FAIL's, or the push's reason (its queue's sequence counter
# repaired, see TAKE_SEQ).
_FAIL_AND_PUSH: Final = (
    _FAIL.removesuffix("return 1\n").replace(
        "local meta = redis.call('HGET', KEYS[3], n)",
        "redis.call('GET', KEYS[12])\nredis.call('ZCARD', KEYS[13])\n"
        "redis.call('ZCARD', KEYS[14])\nredis.call('HEXISTS', KEYS[15], '0')\n"
        "redis.call('HEXISTS', KEYS[16], '0')\nlocal meta = redis.call('HGET', KEYS[3], n)",
    )
    + "do\n"
    + _shifted(_PUSH, 11, 4)
    + "end\n"
)

# KEYS: seq ready delayed active jobs meta stalls claims armed failed moved quarantine, the slot
# keys (held parked full ready armed)
# ARGV: token delay count_attempt("1"/"0") channel failed_retention quarantine_retention
# The lease's slot is freed (FREE_SLOT), the job queued again.
# Returns 0 (lease lost), 1 (handed back), or 2: the job's meta was unreadable, so it could not
# be put back (no priority, no count): it was failed instead, kept as found; or the reason the
# sequence counter was repaired when it was (handed back, see TAKE_SEQ).
_RETRY: Final = (
    _PARSE_META
    + _FAILED_RECORD
    + TAKE_SEQ
    + FREE_SLOT
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
  local key = redis.call('HGET', KEYS[5], 'k' .. n)
  redis.call('LPUSH', KEYS[10], failed_record(now, meta, err, stalls, data, key))
  redis.call('LTRIM', KEYS[10], 0, tonumber(ARGV[5]) - 1)
  redis.call('ZREM', KEYS[4], token)
  free_slot(SLOTS, n, token, ARGV[4])
  redis.call('HDEL', KEYS[5], n, 't' .. n, 'k' .. n)
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
free_slot(SLOTS, n, token, ARGV[4])
redis.call('HDEL', KEYS[8], n)
if redis.call('DEL', KEYS[9]) == 1 then
  redis.call('PUBLISH', ARGV[4], '')
end
return repaired or 1
""".replace("SLOTS", slot_table(13, 5))
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

# KEYS: seq ready active jobs meta stalls claims armed claimed quarantine moved delayed, the
# slot keys (held parked full ready armed)
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
    + FREE_SLOT
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
-- Poison (or unreadable): re-leased to the caller (who fails it), still active (and holding
-- its slot: its held entry follows the new token).
local function lease(n, meta, data, history, token)
  local at = (#out - 3) / 4 % (#ARGV[4] / 16) * 16
  local new_token = n .. ':' .. string.sub(ARGV[4], at + 1, at + 16)
  redis.call('ZADD', KEYS[3], now, new_token)
  move_slot(SLOTS, n, token, new_token)
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
      free_slot(SLOTS, n, token, ARGV[6])
      redis.call('HDEL', KEYS[4], n, 't' .. n, 'k' .. n)
      redis.call('HDEL', KEYS[6], n)
      redis.call('HDEL', KEYS[7], n)
    end
  elseif not priority or tonumber(stalled) > max_stalled then
    -- Unreadable meta, or past the limit already: the lease of a sweep that found it exceeded
    -- and died before failing it (no delivery, so no stall: exceeded again, as it was).
    local data = redis.call('HGET', KEYS[4], n)
    local history = redis.call('HGET', KEYS[6], n)
    redis.call('ZREM', KEYS[3], token)
    lease(n, meta, data, history, token)
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
      lease(n, meta, data, history, token)
    else
      free_slot(SLOTS, n, token, ARGV[6])
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
""".replace("SLOTS", slot_table(13, 4))
)


class Scripts:
    """Every script of the broker, registered with ``client``, ringing doorbells with
    ``publish`` (``PUBLISH``; a Cluster's broker: ``SPUBLISH``, sharded channels).

    Each attribute is a :class:`~durable_trio._redis.Script` (call it with keys and args, or
    take its ``command`` for a pipeline); the comment above each source says what it takes.
    """

    def __init__(self, client: RedisClient | RedisClusterClient, publish: str) -> None:
        def script(source: str) -> Script:
            return client.script(source.replace("'PUBLISH'", f"'{publish}'"))

        self.push = script(_PUSH)
        self.push_many = script(_PUSH_MANY)
        self.push_and_complete = script(_PUSH_AND_COMPLETE_MANY)
        self.claim = script(_CLAIM)
        self.mark_started = script(_MARK_STARTED)
        self.complete_many = script(_COMPLETE_MANY)
        self.fail = script(_FAIL)
        self.fail_and_push = script(_FAIL_AND_PUSH)
        self.retry = script(_RETRY)
        self.renew = script(_RENEW)
        self.recover = script(_RECOVER)
        self.size = script(SIZE)
        self.peek = script(PEEK)
        self.set_limit = script(SET_LIMIT)
        self.job_state = script(JOB_STATE)
        self.job_states = script(JOB_STATES)
        self.requeue_failed = script(REQUEUE_FAILED)
        self.oldest_ready = script(OLDEST_READY)
