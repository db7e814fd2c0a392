"""The Redis broker's Lua scripts for the operator's and the transport's looks (a job's state,
a queue's size, the oldest ready job) and the requeue of a failed job: registered with the
others by :class:`~durable_trio.brokers.redis._scripts.Scripts` (same conventions)."""

from __future__ import annotations

from typing import Final

from ._seq import MEMBER_ID, TAKE_SEQ

__all__ = ["JOB_STATE", "JOB_STATES", "OLDEST_READY", "REQUEUE_FAILED", "SIZE"]

# KEYS: meta claims; ARGV: job id
# Returns {1, worker} (claimed), {0} (waiting) or nil (not on the queue). A scan of the meta
# hash: the job id is stored only there, at the end of each entry (for a rare look, see
# SupportsJobState).
JOB_STATE: Final = """
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


# KEYS: meta claims; ARGV: job ids
# Returns one entry per job id, in order: 1 then the worker (claimed), 0 then '' (waiting) or
# -1 then '' (not on the queue). One scan of the meta hash for every id (the loss audit).
JOB_STATES: Final = """
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


# KEYS: ready delayed parked (the ready jobs parked behind a full key: waiting too)
SIZE: Final = """
return redis.call('ZCARD', KEYS[1]) + redis.call('ZCARD', KEYS[2]) + redis.call('ZCARD', KEYS[3])
"""


# KEYS: PUSH_KEYS, failed
# ARGV: record id data priority channel quarantine_retention key ("": none)
# Requeue one failed record (the exact bytes read by the client): gone meanwhile -> 0; else 1,
# or the reason the sequence counter was repaired (see TAKE_SEQ).
REQUEUE_FAILED: Final = (
    TAKE_SEQ
    + """
if redis.call('LREM', KEYS[11], 1, ARGV[1]) == 0 then
  return 0
end
local t = redis.call('TIME')
local seq, repaired = take_seq({seq = KEYS[1], ready = KEYS[2], delayed = KEYS[3], jobs = KEYS[4],
  meta = KEYS[5], claims = KEYS[7], moved = KEYS[8], active = KEYS[9], quarantine = KEYS[10]},
  1, ARGV[6])
local n = string.format('%d', seq)
-- (pushed now, as a fresh push: its age on the queue starts again)
redis.call('HSET', KEYS[4], n, ARGV[3], 't' .. n, t[1] .. ' ' .. t[2])
if (ARGV[7] or '') ~= '' then
  redis.call('HSET', KEYS[4], 'k' .. n, ARGV[7])
end
redis.call('HSET', KEYS[5], n, ARGV[4] .. ':0:0:' .. ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[4], string.format('%016d', seq) .. n)
if redis.call('DEL', KEYS[6]) == 1 then
  redis.call('PUBLISH', ARGV[5], '')
end
return repaired or 1
"""
)


# KEYS: ready moved
# ARGV: priority cursor ("": from the lowest) heads
# The lowest internal id n among the ready jobs: {n or false, next cursor or false, unreadable}.
# Ids are handed out in push order (INCR), and a job keeps its id and its push time through
# delays, retries and reclaims, so the lowest id is the oldest push (on a server whose clock
# does not step back). A job at its push's place in ``ready`` has its id as its place, so in
# each priority it is behind any job pushed before it: only the head of each priority, and the
# lowest of ``moved`` (the ready jobs at another place), can be the lowest. So a run costs
# O(priorities * log n), never a walk of the queue. ``unreadable``: a head that names no id.
OLDEST_READY: Final = """
local lowest = false
local function consider(n)
  n = tonumber(n)
  if n and (not lowest or n < lowest) then
    lowest = n
  end
end
local first
if ARGV[1] == '' then
  -- (an entry whose member left ready meanwhile is stale: skipped, a bounded number of them)
  for _, member in ipairs(redis.call('ZRANGE', KEYS[2], 0, 99)) do
    if redis.call('ZSCORE', KEYS[1], member) then
      consider(string.match(member, MEMBER_ID))
      break
    end
  end
  first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
else
  first = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. ARGV[1], '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
end
local unreadable = 0
local visited = 0
local cursor = false
while #first > 0 do
  if visited == tonumber(ARGV[2]) then
    break
  end
  local n = string.match(first[1], MEMBER_ID)
  if n then
    consider(n)
  else
    unreadable = unreadable + 1
  end
  visited = visited + 1
  cursor = first[2]
  first = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. cursor, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
end
if #first == 0 then
  cursor = false
end
return {lowest and string.format('%d', lowest) or false, cursor, unreadable}
""".replace("MEMBER_ID", MEMBER_ID)
