"""The Redis broker's fleet-wide concurrency limits (``SupportsQueueLimits``): the Lua helpers
every script that claims, or ends a lease, shares, and the scripts that set a limit and peek
under one (see the key layout and "Fleet-wide limits" in :mod:`durable_trio.brokers.redis`).

A slot is a live lease, never a counter: the queue-wide count is ``ZCARD {Q}:active`` (the
lease tokens themselves), so a lease frees its slot by leaving ``active``, however it ends. Per
key, ``{Q}:held`` holds one member per live lease of a limited queue, ``<key prefix><token>``
(score 0, counted by ``ZLEXCOUNT`` on the prefix: O(log n)); an entry whose token left
``active`` without its script removing it (damage) is found and dropped by the claim that would
be held back by it, so a stray entry can never hold a key full. Ready jobs of a full key are
*parked* (``{Q}:parked``, one ordered run per key) by the claim that meets them, and one goes
back to ``ready`` each time a lease of its key ends: a claim never walks them again.
"""

from __future__ import annotations

from typing import Final

from ._seq import MEMBER_ID

__all__ = [
    "FREE_SLOT",
    "KEY_PREFIX",
    "PARK",
    "PEEK",
    "READ_LIMIT",
    "SET_LIMIT",
    "WALK_MAX",
    "slot_table",
]

#: Ready members one claim of a per-key limited queue looks at, at most (claimed or parked):
#: past that it returns what it has and tells its caller to look again at once.
WALK_MAX: Final = 1000


def slot_table(first: int, jobs: int) -> str:
    """The Lua table of the slot keys (``SLOT_KEYS``) of a script that takes them from
    ``KEYS[first]`` on, and its ``jobs`` hash at ``KEYS[jobs]``."""
    names = ("held", "parked", "full", "ready", "armed")
    fields = [f"{name} = KEYS[{first + i}]" for i, name in enumerate(names)]
    return "{" + ", ".join([*fields, f"jobs = KEYS[{jobs}]"]) + "}"


# Lua: the prefix of a concurrency key in ``held`` and ``parked``: its byte length first, so no
# key's prefix is the start of another's (a job without a key counts under '').
KEY_PREFIX: Final = """
local function key_prefix(key)
  key = key or ''
  return #key .. ':' .. key .. ':'
end
local function key_range(prefix)
  return '[' .. prefix, '(' .. prefix .. '\\255'
end
"""

# Lua: a parked member: the key prefix, the job's priority (sortable as text: '0' and
# 2**53 + priority below 0, '1' and the priority from 0, 16 digits each), its ready member.
PARK: Final = (
    KEY_PREFIX
    + """
local function parked_member(prefix, score, member)
  local p = tonumber(score) or 0
  if p < 0 then
    return prefix .. '0' .. string.format('%016d', p + 2^53) .. member
  end
  return prefix .. '1' .. string.format('%016d', p) .. member
end
-- The first job parked behind the key of prefix back to ready; whether there was one. (A
-- damaged entry goes back as found: the claim that meets it quarantines it.)
local function unpark(s, prefix)
  local first = redis.call('ZRANGEBYLEX', s.parked, '[' .. prefix, '(' .. prefix .. '\\255',
    'LIMIT', 0, 1)[1]
  if not first then
    return false
  end
  local rest = string.sub(first, #prefix + 1)
  local priority = tonumber(string.sub(rest, 2, 17)) or 0
  if string.sub(rest, 1, 1) == '0' then
    priority = priority - 2^53
  end
  redis.call('ZREM', s.parked, first)
  redis.call('ZADD', s.ready, string.format('%d', priority), string.sub(rest, 18))
  return true
end
"""
)

# Lua: ``free_slot(s, n, token, channel)``: the lease ``token`` of job ``n`` ends (call it
# before the job's fields are deleted: it reads the job's key). Its entry in ``held`` goes, the
# first job parked behind its key is ready again, and a waiter stopped by the limit (``full``)
# or waiting for that job is rung. ``s``: :func:`slot_table`. Without a limit: one ``DEL`` and
# one ``EXISTS``.
FREE_SLOT: Final = (
    PARK
    + """
local function free_slot(s, n, token, channel)
  local wake = redis.call('DEL', s.full) == 1
  if redis.call('EXISTS', s.held) == 1 then
    local prefix = key_prefix(redis.call('HGET', s.jobs, 'k' .. n))
    if redis.call('ZREM', s.held, prefix .. token) == 0 then
      -- (damage: the job's key is gone or changed; its entry is found by its token)
      local tail = ':' .. token
      for _, entry in ipairs(redis.call('ZRANGE', s.held, 0, 9999)) do
        if string.sub(entry, -#tail) == tail then
          redis.call('ZREM', s.held, entry)
          prefix = string.sub(entry, 1, #entry - #token)
          break
        end
      end
    end
    if unpark(s, prefix) then
      wake = true
    end
  end
  if wake and redis.call('DEL', s.armed) == 1 then
    redis.call('PUBLISH', channel, '')
  end
end
-- A poison claim re-leased under a new token keeps its slot: its held entry follows it.
local function move_slot(s, n, token, new_token)
  if redis.call('EXISTS', s.held) == 1 then
    local prefix = key_prefix(redis.call('HGET', s.jobs, 'k' .. n))
    if redis.call('ZREM', s.held, prefix .. token) == 1 then
      redis.call('ZADD', s.held, 0, prefix .. new_token)
    end
  end
end
"""
)

# Lua: ``read_limit(key)``: the queue's limit and whether it holds per key, or nil; a third
# value describes a limit key that cannot be read (another type, a ``max`` that is not an
# integer >= 1, a ``per_key`` that is not 0 or 1): no limit (the claim quarantines it).
READ_LIMIT: Final = """
local function read_limit(key)
  local got = redis.pcall('HMGET', key, 'max', 'per_key')
  if got['err'] then
    return nil, false, 'limit key: a ' .. redis.call('TYPE', key)['ok'] .. ', not a hash\\n'
  end
  local max, per_key = got[1], got[2]
  if not max and not per_key then
    return nil, false, nil
  end
  local lim = max and #max <= 15 and string.match(max, '^%d+$') and tonumber(max)
  if lim and lim >= 1 and (per_key == '1' or per_key == '0' or not per_key) then
    return lim, per_key == '1', nil
  end
  local function shown(label, value)
    return value and (label .. ' (' .. #value .. ' bytes): ' .. value .. '\\n') or
      (label .. ': (none)\\n')
  end
  return nil, false, shown('limit max', max) .. shown('limit per_key', per_key)
end
-- The live leases of the key of prefix: its held entries whose token is still in active
-- (stale ones are added to stale, for the caller to drop).
local function live_count(held, active, prefix, stale)
  local from, to = '[' .. prefix, '(' .. prefix .. '\\255'
  local live = 0
  for _, entry in ipairs(redis.call('ZRANGEBYLEX', held, from, to)) do
    if redis.call('ZSCORE', active, string.sub(entry, #prefix + 1)) then
      live = live + 1
    elseif stale then
      stale[#stale + 1] = entry
    end
  end
  return live
end
"""

# KEYS: limit held parked full ready armed active jobs
# ARGV: max ("": none) per_key ("1"/"0") channel
# Returns 0 when the limit stored is this one already (nothing done), else 1: the limit is
# stored (or deleted), ``held`` rebuilt from the live leases (per key) or deleted, every parked
# job ready again (the next claim looks anew), and the waiters rung (they look again).
SET_LIMIT: Final = (
    KEY_PREFIX
    + READ_LIMIT
    + """
local lim, per_key, junk = read_limit(KEYS[1])
local want = tonumber(ARGV[1])
if not junk and lim == want and (not want or per_key == (ARGV[2] == '1')) then
  return 0
end
local held = {}
if want and ARGV[2] == '1' then
  for _, token in ipairs(redis.call('ZRANGE', KEYS[7], 0, -1)) do
    local n = string.match(token, '^(%d+):')
    held[#held + 1] = key_prefix(n and redis.call('HGET', KEYS[8], 'k' .. n)) .. token
  end
end
local parked = redis.call('ZRANGE', KEYS[3], 0, -1)
redis.call('DEL', KEYS[1], KEYS[2], KEYS[4])
if want then
  redis.call('HSET', KEYS[1], 'max', ARGV[1], 'per_key', ARGV[2])
end
for _, entry in ipairs(held) do
  redis.call('ZADD', KEYS[2], 0, entry)
end
for _, entry in ipairs(parked) do
  local prefix = string.match(entry, '^(%d+):')
  local rest = string.sub(entry, #(prefix or '') + tonumber(prefix or 0) + 3)
  local priority = tonumber(string.sub(rest, 2, 17)) or 0
  if string.sub(rest, 1, 1) == '0' then
    priority = priority - 2^53
  end
  redis.call('ZADD', KEYS[5], string.format('%d', priority), string.sub(rest, 18))
end
redis.call('DEL', KEYS[3])
if redis.call('DEL', KEYS[6]) == 1 then
  redis.call('PUBLISH', ARGV[3], '')
end
return 1
"""
)

# KEYS: ready delayed armed limit active jobs held full
# Returns {1} when a job is ready (or due) that fits the queue's limit, else {0} or
# {0, next_due_in_seconds} (and arms; at a queue-wide limit it also sets ``full``, so the next
# lease to end rings). Per key, the first 100 ready jobs are looked at: one of a key not full is
# work; so is a ready queue longer than that (a claim parks what does not fit, then waits).
PEEK: Final = (
    """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""
    + KEY_PREFIX
    + READ_LIMIT
    + """
local lim, per_key = read_limit(KEYS[4])
local ready = redis.call('ZCARD', KEYS[1])
local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
local due = #first > 0 and tonumber(first[2]) <= now
if not lim then
  if ready > 0 or due then
    return {1}
  end
elseif not per_key then
  if redis.call('ZCARD', KEYS[5]) < lim then
    if ready > 0 or due then
      return {1}
    end
  elseif ready > 0 or due then
    redis.call('SET', KEYS[8], '1')
    due = false
  end
else
  if due or ready > 100 then
    return {1}
  end
  local seen = {}
  for _, member in ipairs(redis.call('ZRANGE', KEYS[1], 0, 99)) do
    local n = string.match(member, MEMBER_ID)
    local prefix = key_prefix(n and redis.call('HGET', KEYS[6], 'k' .. n))
    if not n then
      return {1}  -- (a damaged member: a claim quarantines it)
    end
    if not seen[prefix] then
      seen[prefix] = true
      if live_count(KEYS[7], KEYS[5], prefix) < lim then
        return {1}
      end
    end
  end
end
redis.call('SET', KEYS[3], '1')
if #first > 0 then
  return {0, string.format('%.6f', math.max(tonumber(first[2]) - now, due and 0 or 0.001))}
end
return {0}
""".replace("MEMBER_ID", MEMBER_ID)
)
