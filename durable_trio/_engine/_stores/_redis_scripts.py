"""The Redis run store's Lua scripts (:mod:`.redis`): each change of a run, a checkpoint or a
schedule is one script on one slot (every key of a run shares its shard's hash tag)."""

from __future__ import annotations

from typing import Final

from ..._redis._script import writable_lua

__all__ = [
    "PAGE_BUDGET",
    "REBUILD_BATCH",
    "_APPEND_SIGNAL",
    "_BEGIN_STEP",
    "_BEGIN_STEP_UNLESS_FINISHED",
    "_CLAIM",
    "_CREATE_RUN",
    "_CREATE_RUN_BODY",
    "_CREATE_RUN_FUNCTION",
    "_DELETE_SCHEDULE",
    "_FINISH",
    "_LUA_HELPERS",
    "_MARK_DISPATCHED",
    "_MARK_TICK",
    "_PAGE",
    "_PUT_SCHEDULE_STATE",
    "_RELEASE",
    "_RENEW",
    "_REOPEN",
    "_UPDATE_STEP",
]

# Shared Lua helpers: move a run between status sets; is a status unfinished; fail the script
# before its first write when a key it will write holds another type (damaged data: a script
# that failed half-way would leave a run's hash and its indexes apart, docs/deployment.md).
# Every script that changes a run reads first, then checks the keys it will write, then writes.
_LUA_HELPERS: Final = (
    writable_lua("damaged run store: nothing was written")
    + """
local function active(st) return st == 'pending' or st == 'running' end
-- writable(), once per key in a script's run (a claim or a release of many runs meets the
-- same few status and owner keys again and again).
local checked_keys = {}
local function checked(key, kind)
  if not checked_keys[key] then
    checked_keys[key] = true
    writable(key, kind)
  end
end
local function move(prefix, id, from, to, seq)
  if from == to then return end
  if from then redis.call('ZREM', prefix .. ':status:' .. from, id) end
  redis.call('ZADD', prefix .. ':status:' .. to, seq, id)
end
"""
)

# KEYS: schedules, ticks. ARGV: name, tick. The last tick becomes max(last, tick) if it exists.
_MARK_TICK: Final = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
local last = tonumber(redis.call('HGET', KEYS[2], ARGV[1]))
if last == nil or last < tonumber(ARGV[2]) then redis.call('HSET', KEYS[2], ARGV[1], ARGV[2]) end
return 1
"""

# KEYS: schedules, ticks, states. ARGV: name. Deletes the schedule, its last tick and state.
_DELETE_SCHEDULE: Final = """
local gone = redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return gone
"""

# KEYS: schedules, states. ARGV: name, state. Stored if the schedule exists.
_PUT_SCHEDULE_STATE: Final = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
"""

# KEYS: run, seq, all. ARGV: prefix, id, workflow, status, input, output, error, owner, lease, now,
# timeout, trace ('' = none), parent ('' = none), depth, tags ('' = none), then the run's tag
# index keys (issue 34: each a zset of run ids scored by seq, as the status indexes)
# Returns {1} (created), {1, reason} (created, the counter repaired: see below) or {0, fields}.
# A counter that is not a number (junk, past INCR's range), not positive, past 2**53 (Lua's exact
# integers), or missing (evicted, deleted) while runs exist would fail every start or list new
# runs among old ones: it is rebuilt from the highest seq in T:all (O(log n), only then).
_CREATE_RUN_BODY: Final = """
local prefix, id = ARGV[1], ARGV[2]
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {0, redis.call('HGETALL', KEYS[1])}
end
writable(KEYS[3], 'zset')
writable(prefix .. ':status:' .. ARGV[4], 'zset')
for i = 16, #ARGV do writable(ARGV[i], 'zset') end
if active(ARGV[4]) then
  writable(prefix .. ':leases', 'zset')
  if ARGV[8] ~= '' then writable(prefix .. ':owned:' .. ARGV[8], 'set') end
end
local seq = redis.pcall('INCR', KEYS[2])
local repaired
if type(seq) == 'table' and string.find(seq['err'] or '', 'WRONGTYPE', 1, true) then
  return error(seq)
end
if type(seq) == 'table' or seq <= 1 or seq > 9007199254740992 then
  local top = redis.call('ZREVRANGEBYSCORE', KEYS[3], 9007199254740991, 1, 'WITHSCORES',
    'LIMIT', 0, 1)
  top = math.floor(tonumber(top[2] or '0'))
  if seq ~= 1 or top > 0 then
    local found = type(seq) == 'table' and redis.call('GET', KEYS[2]) or
      string.format('%d', seq - 1)
    repaired = 'run sequence counter ' .. KEYS[2] .. ' damaged (found ' .. found ..
      '), rebuilt from the highest run seq: ' .. string.format('%d', top)
    seq = top + 1
    redis.call('SET', KEYS[2], string.format('%d', seq))
  end
end
redis.call('HSET', KEYS[1], 'workflow', ARGV[3], 'status', ARGV[4], 'input', ARGV[5],
  'output', ARGV[6], 'error', ARGV[7], 'owner', ARGV[8], 'lease', ARGV[9],
  'created', ARGV[10], 'updated', ARGV[10], 'seq', seq, 'timeout', ARGV[11], 'trace', ARGV[12],
  'parent', ARGV[13], 'depth', ARGV[14], 'tags', ARGV[15] or '')
redis.call('ZADD', KEYS[3], seq, id)
for i = 16, #ARGV do redis.call('ZADD', ARGV[i], seq, id) end
move(prefix, id, false, ARGV[4], seq)
if active(ARGV[4]) then
  redis.call('ZADD', prefix .. ':leases', ARGV[9] == '' and 0 or ARGV[9], id)
  if ARGV[8] ~= '' then redis.call('SADD', prefix .. ':owned:' .. ARGV[8], id) end
end
return {1, repaired}
"""
_CREATE_RUN: Final = _LUA_HELPERS + _CREATE_RUN_BODY
#: ``create_run(KEYS, ARGV)``: ``_CREATE_RUN`` as a Lua function, for the scripts that create
#: a run with another change (``_redis_starts.py``).
_CREATE_RUN_FUNCTION: Final = (
    _LUA_HELPERS + "local function create_run(KEYS, ARGV)\n" + _CREATE_RUN_BODY + "end\n"
)

#: Status index entries a claim walks at most while it rebuilds a lost ``:leases`` (about 10 ms
#: of the server's time; the caller calls again while the walk goes on).
REBUILD_BATCH: Final = 2000

# ARGV: prefix, owner, lease seconds, include_own (0/1), limit, now. Returns the ids claimed,
# and 1 if a rebuild of :leases is under way (call again), else 0.
_CLAIM: Final = (
    _LUA_HELPERS
    + """
local prefix, owner = ARGV[1], ARGV[2]
local lease, limit, now = tonumber(ARGV[3]), tonumber(ARGV[5]), tonumber(ARGV[6])
-- Every unfinished run has an entry in :leases. Fewer entries than unfinished runs (damaged
-- data: the key deleted, a bad restore) would leave the runs missing never claimed: the status
-- indexes are walked, REBUILD_BATCH entries a call (its place kept in :leases-rebuild, "STATUS
-- SEQ", until the walk ends: ``more`` asks the caller to call again), and each unfinished run
-- missing is put back with its stored lease (0 if none), an entry whose run is gone or finished
-- dropped, one under the other unfinished status moved there (docs/deployment.md).
local function zcard(key)
  if redis.call('TYPE', key)['ok'] ~= 'zset' then return 0 end
  return redis.call('ZCARD', key)
end
local leases, walk = prefix .. ':leases', prefix .. ':leases-rebuild'
local more = 0
local ltype = redis.call('TYPE', leases)['ok']
if ltype == 'zset' or ltype == 'none' then
  local at = redis.call('TYPE', walk)['ok'] == 'string' and redis.call('GET', walk) or nil
  if at or zcard(prefix .. ':status:pending') + zcard(prefix .. ':status:running')
      > zcard(leases) then
    local st, from = 'pending', '-inf'
    local s1, s2 = string.match(at or '', '^(%a+) (%S+)$')
    if active(s1) then st, from = s1, '(' .. s2 end
    local budget = REBUILD_BATCH
    while st and budget > 0 do
      local index = prefix .. ':status:' .. st
      local batch = {}
      if redis.call('TYPE', index)['ok'] == 'zset' then
        batch = redis.call('ZRANGEBYSCORE', index, from, '+inf', 'WITHSCORES', 'LIMIT', 0, budget)
      end
      for i = 1, #batch, 2 do
        local id = batch[i]
        local f = redis.call('HMGET', prefix .. ':run:' .. id, 'status', 'owner', 'lease', 'seq')
        if f[1] ~= st then  -- (indexed under its own status if unfinished, if it can be)
          redis.call('ZREM', index, id)
          if active(f[1]) then redis.pcall('ZADD', prefix .. ':status:' .. f[1], f[4] or 0, id) end
        elseif not redis.call('ZSCORE', leases, id) then
          local held = f[2] and f[2] ~= '' and tonumber(f[3])
          if held ~= held then held = nil end  -- (nan)
          redis.call('ZADD', leases, held or 0, id)
        end
        from = batch[i + 1]
      end
      budget = budget - #batch / 2
      if budget > 0 then  -- this index walked to its end
        st, from = st == 'pending' and 'running' or nil, '-inf'
      else
        from = '(' .. from
      end
    end
    if st then
      redis.call('SET', walk, st .. ' ' .. string.sub(from, 2))
      more = 1
    else
      redis.call('DEL', walk)
    end
  end
end
local ids = redis.call('ZRANGEBYSCORE', prefix .. ':leases', '-inf', '(' .. ARGV[6],
  'LIMIT', 0, limit)
if #ids < limit then  -- a lease of +inf is no time (damaged data): it has expired
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', prefix .. ':leases', '+inf', '+inf',
      'LIMIT', 0, limit - #ids)) do
    ids[#ids + 1] = id
  end
end
if ARGV[4] == '1' and #ids < limit then
  local seen = {}
  for _, id in ipairs(ids) do seen[id] = true end
  for _, id in ipairs(redis.call('SMEMBERS', prefix .. ':owned:' .. owner)) do
    if #ids >= limit then break end
    if not seen[id] then ids[#ids + 1] = id end
  end
end
-- Every read first, then the keys the claims write checked, then the writes: a key of the
-- wrong type fails the claim with nothing written (docs/deployment.md, damaged data).
local runs = {}
for _, id in ipairs(ids) do
  local key = prefix .. ':run:' .. id
  local f = redis.call('HMGET', key, 'status', 'owner', 'seq')
  local st = f[1]
  if st and active(st) then
    checked(prefix .. ':status:' .. st, 'zset')
    if f[2] and f[2] ~= '' then checked(prefix .. ':owned:' .. f[2], 'set') end
  end
  runs[#runs + 1] = {id, key, f}
end
if #runs > 0 then
  checked(prefix .. ':status:running', 'zset')
  checked(prefix .. ':owned:' .. owner, 'set')
end
local out = {}
local until_ = now + lease
for _, run in ipairs(runs) do
  local id, key, st, old = run[1], run[2], run[3][1], run[3][2]
  if st and active(st) then
    if old and old ~= '' then redis.call('SREM', prefix .. ':owned:' .. old, id) end
    redis.call('HSET', key, 'owner', owner, 'lease', tostring(until_), 'status', 'running',
      'updated', ARGV[6])
    move(prefix, id, st, 'running', run[3][3])
    redis.call('ZADD', prefix .. ':leases', until_, id)
    redis.call('SADD', prefix .. ':owned:' .. owner, id)
    out[#out + 1] = id
  else
    redis.call('ZREM', prefix .. ':leases', id)
  end
end
return {out, more}
"""
).replace("REBUILD_BATCH", str(REBUILD_BATCH))

# ARGV: prefix, owner, lease seconds, now, id...
_RENEW: Final = (
    _LUA_HELPERS
    + """
local prefix, owner = ARGV[1], ARGV[2]
local until_ = tonumber(ARGV[4]) + tonumber(ARGV[3])
writable(prefix .. ':leases', 'zset')  -- (the hashes are read before they are written)
local kept = {}
for i = 5, #ARGV do
  local id = ARGV[i]
  local key = prefix .. ':run:' .. id
  local st = redis.call('HGET', key, 'status')
  if st and active(st) and redis.call('HGET', key, 'owner') == owner then
    redis.call('HSET', key, 'lease', tostring(until_))
    redis.call('ZADD', prefix .. ':leases', until_, id)
    kept[#kept + 1] = id
  end
end
return kept
"""
)

# ARGV: prefix, owner, now, id...
_RELEASE: Final = (
    _LUA_HELPERS
    + """
local prefix, owner = ARGV[1], ARGV[2]
-- Every read first, then the keys written checked, then the writes (as a claim).
local runs = {}
for i = 4, #ARGV do
  local id = ARGV[i]
  local key = prefix .. ':run:' .. id
  local f = redis.call('HMGET', key, 'status', 'owner', 'seq')
  if f[1] and active(f[1]) and f[2] == owner then
    checked(prefix .. ':status:' .. f[1], 'zset')
    runs[#runs + 1] = {id, key, f}
  end
end
if #runs > 0 then
  checked(prefix .. ':status:pending', 'zset')
  checked(prefix .. ':leases', 'zset')
  checked(prefix .. ':owned:' .. owner, 'set')
end
for _, run in ipairs(runs) do
  local id, key = run[1], run[2]
  redis.call('HSET', key, 'owner', '', 'lease', '', 'status', 'pending', 'updated', ARGV[3])
  move(prefix, id, run[3][1], 'pending', run[3][3])
  redis.call('ZADD', prefix .. ':leases', 0, id)
  redis.call('SREM', prefix .. ':owned:' .. owner, id)
end
return 1
"""
)

# KEYS: run, cancel mark step, steps. ARGV: prefix, id, status, output, error, now, mark id.
# A run ending completed or failed drops its cancel mark (ended before the cancel reached it).
_FINISH: Final = (
    _LUA_HELPERS
    + """
local prefix, id = ARGV[1], ARGV[2]
local key = prefix .. ':run:' .. id
local f = redis.call('HMGET', key, 'status', 'owner', 'seq', 'workflow')
local st, old = f[1], f[2]
if not st or not (active(st) or st == 'blocked') then return 0 end
local ended = ARGV[3] ~= 'blocked'  -- finished: indexed by its end, per workflow (retention)
local wf = f[4] or ''
local dropped = ARGV[3] == 'completed' or ARGV[3] == 'failed'  -- its cancel mark dropped
-- The keys written checked first: a key of the wrong type fails the settle with nothing
-- written (docs/deployment.md, damaged data).
if old and old ~= '' then checked(prefix .. ':owned:' .. old, 'set') end
checked(prefix .. ':status:' .. st, 'zset')
checked(prefix .. ':status:' .. ARGV[3], 'zset')
checked(prefix .. ':leases', 'zset')
if ended then
  checked(prefix .. ':ended:' .. wf, 'zset')
  checked(prefix .. ':ended-workflows', 'set')
end
if dropped then checked(KEYS[3], 'zset') end
if old and old ~= '' then redis.call('SREM', prefix .. ':owned:' .. old, id) end
redis.call('HSET', key, 'status', ARGV[3], 'output', ARGV[4], 'error', ARGV[5], 'owner', '',
  'lease', '', 'updated', ARGV[6])
move(prefix, id, st, ARGV[3], f[3])
redis.call('ZREM', prefix .. ':leases', id)
if ended then
  redis.call('ZADD', prefix .. ':ended:' .. wf, ARGV[6], id)
  redis.call('SADD', prefix .. ':ended-workflows', wf)
end
if dropped then
  redis.call('DEL', KEYS[2])
  redis.call('ZREM', KEYS[3], ARGV[7])
end
return 1
"""
)

# Issue 18. KEYS: run, signal list, signal names. ARGV: payload, name. The run's signals of one
# name are a list beside the run (same hash tag, so the same slot), its names a set (a prune
# finds the lists there); an unknown or finished run: 0.
_APPEND_SIGNAL: Final = (
    _LUA_HELPERS
    + """
local st = redis.call('HGET', KEYS[1], 'status')
if not st or not active(st) then return 0 end
redis.call('SADD', KEYS[3], ARGV[2])
return redis.call('RPUSH', KEYS[2], ARGV[1])
"""
)

# KEYS: step, steps. ARGV: step_id, position, kind, name, status, attempt, input, output, error,
# retry, wake_at, dispatched, priority, now, heartbeat_timeout, heartbeat ('' = none), attempts
_BEGIN_STEP: Final = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {0, redis.call('HGETALL', KEYS[1])}
end
redis.call('HSET', KEYS[1], 'kind', ARGV[3], 'name', ARGV[4], 'status', ARGV[5],
  'attempt', ARGV[6], 'input', ARGV[7], 'output', ARGV[8], 'error', ARGV[9], 'retry', ARGV[10],
  'wake_at', ARGV[11], 'dispatched', ARGV[12], 'priority', ARGV[13], 'created', ARGV[14],
  'updated', ARGV[14], 'hb_timeout', ARGV[15], 'heartbeat', ARGV[16], 'attempts', ARGV[17])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
return {1}
"""

# KEYS: step, steps, run. ARGV: as _BEGIN_STEP. Nothing written into the history of an unknown
# or finished run: {2}.
_BEGIN_STEP_UNLESS_FINISHED: Final = (
    """
local st = redis.call('HGET', KEYS[3], 'status')
if not st or st == 'completed' or st == 'failed' or st == 'cancelled' then return {2} end
"""
    + _BEGIN_STEP
)

# KEYS: step, run. ARGV: expect_attempt, status, attempt, output, error, wake_at, dispatched, now,
# heartbeat ('' = keep the stored one), attempts
_UPDATE_STEP: Final = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 'missing' end
local run_status = redis.call('HGET', KEYS[2], 'status')
if not run_status then return 'missing' end
if run_status ~= 'pending' and run_status ~= 'running' then return 'run_finished' end
if redis.call('HGET', KEYS[1], 'status') ~= 'pending' then return 'duplicate' end
if redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[1] then return 'stale' end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'attempt', ARGV[3], 'output', ARGV[4],
  'error', ARGV[5], 'wake_at', ARGV[6], 'dispatched', ARGV[7], 'updated', ARGV[8],
  'attempts', ARGV[10])
if ARGV[9] ~= '' then redis.call('HSET', KEYS[1], 'heartbeat', ARGV[9]) end
return 'applied'
"""

# KEYS: step. ARGV: attempt
_MARK_DISPATCHED: Final = """
if redis.call('HGET', KEYS[1], 'status') == 'pending'
   and redis.call('HGET', KEYS[1], 'attempt') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'dispatched', '1')
  return 1
end
return 0
"""


#: Runs one page call examines at most (behind selective filters a page may come back short,
#: with a cursor to go on from).
PAGE_BUDGET: Final = 2000

# KEYS: index. ARGV: prefix, max (exclusive score bound, '+inf' for none), limit, budget,
# workflow, tenant prefix, since, until ('' = no filter); then (issue 34, the index a tag's)
# status ('' = any) and the other tags' index keys (a run must be in each).
# Returns {next ('' = last page), id, fields, id, fields, ...}.
_PAGE: Final = """
local prefix, bound = ARGV[1], ARGV[2]
local limit, budget = tonumber(ARGV[3]), tonumber(ARGV[4])
local wf, tp = ARGV[5], ARGV[6]
local since, until_ = tonumber(ARGV[7]), tonumber(ARGV[8])
local st = ARGV[9] or ''
local out = {''}
local found, examined, last = 0, 0, nil
while examined < budget do
  local chunk = redis.call('ZREVRANGEBYSCORE', KEYS[1], bound, '-inf', 'WITHSCORES',
    'LIMIT', 0, math.min(200, budget - examined))
  if #chunk == 0 then return out end
  for i = 1, #chunk, 2 do
    local id, seq = chunk[i], chunk[i + 1]
    examined = examined + 1
    bound = '(' .. seq
    local ok = tp == '' or string.sub(id, 1, #tp) == tp
    local key = prefix .. ':run:' .. id
    for j = 10, #ARGV do
      if ok and not redis.call('ZSCORE', ARGV[j], id) then ok = false end
    end
    -- A tagged page lists the id only while the entry is its current run's (same seq): one of
    -- an earlier run of the id (whose tags were damaged, so the prune left it) is not.
    if ok and #ARGV >= 9 and redis.call('HGET', key, 'seq') ~= seq then ok = false end
    if ok and st ~= '' and redis.call('HGET', key, 'status') ~= st then ok = false end
    if ok and (wf ~= '' or since or until_) then
      local f = redis.call('HMGET', key, 'workflow', 'created')
      if wf ~= '' and f[1] ~= wf then ok = false end
      local created = tonumber(f[2] or '')
      if ok and since and (not created or created < since) then ok = false end
      if ok and until_ and (not created or created >= until_) then ok = false end
    end
    if ok then
      local fields = redis.call('HGETALL', key)
      if #fields > 0 then
        if found == limit then
          out[1] = last
          return out
        end
        found = found + 1
        last = seq
        out[#out + 1] = id
        out[#out + 1] = fields
      end
    end
  end
end
out[1] = string.sub(bound, 2)
return out
"""

# KEYS: run, cancel mark step, steps, step... ARGV: prefix, id, timeout, now, mark id, then per
# step: status, attempt, error, retry, wake_at, dispatched, attempts. A failed run's cancel mark
# (a stale one of its previous life) is dropped.
_REOPEN: Final = (
    _LUA_HELPERS
    + """
local prefix, id = ARGV[1], ARGV[2]
local st = redis.call('HGET', KEYS[1], 'status')
if st ~= 'failed' and st ~= 'blocked' then return 0 end
writable(prefix .. ':status:' .. st, 'zset')
writable(prefix .. ':status:pending', 'zset')
writable(prefix .. ':leases', 'zset')
if st == 'failed' then
  local ended = prefix .. ':ended:' .. (redis.call('HGET', KEYS[1], 'workflow') or '')
  writable(KEYS[3], 'zset')
  writable(ended, 'zset')
  redis.call('DEL', KEYS[2])
  redis.call('ZREM', KEYS[3], ARGV[5])
  redis.call('ZREM', ended, id)
end
redis.call('HSET', KEYS[1], 'status', 'pending', 'owner', '', 'lease', '', 'output', 'null',
  'error', 'null', 'timeout', ARGV[3], 'updated', ARGV[4])
move(prefix, id, st, 'pending', redis.call('HGET', KEYS[1], 'seq'))
redis.call('ZADD', prefix .. ':leases', 0, id)
for i = 4, #KEYS do
  local a = 6 + (i - 4) * 7
  if redis.call('EXISTS', KEYS[i]) == 1 then
    redis.call('HSET', KEYS[i], 'status', ARGV[a], 'attempt', ARGV[a + 1], 'error', ARGV[a + 2],
      'retry', ARGV[a + 3], 'wake_at', ARGV[a + 4], 'dispatched', ARGV[a + 5],
      'attempts', ARGV[a + 6], 'updated', ARGV[4])
  end
end
return 1
"""
)
