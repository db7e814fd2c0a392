"""The sequence counter of a Redis queue: the Lua helper every script that numbers jobs or
places shares (``take_seq``), which rebuilds a damaged counter from what the queue holds (see
the key layout in :mod:`durable_trio.brokers.redis`)."""

from __future__ import annotations

from typing import Final

__all__ = ["MEMBER_ID", "SEQ_MAX", "TAKE_SEQ"]

#: The internal id of a ``ready`` or ``delayed`` member (a Lua pattern): the digits after its
#: 16-byte place.
MEMBER_ID: Final = "'^" + "." * 16 + "(%d+)$'"

#: The largest sequence number: the scripts' numbers are Lua doubles (exact to 2**53), and a
#: place is 16 digits.
SEQ_MAX: Final = 2**53

# Lua: ``take_seq(k, count, retention)`` takes ``count`` sequence numbers from the counter
# ``k.seq`` and returns the last one, and a damage reason (or nil): every script that numbers
# jobs or places takes them here. ``k`` names the queue's keys (seq ready delayed jobs meta
# claims moved active quarantine). A counter that is not a number (junk, past INCRBY's range),
# negative, past SEQ_MAX, or missing while the queue holds jobs (evicted, deleted) would raise,
# reuse a live job's id or order new work ahead of old: it is rebuilt from the highest number
# the queue holds (internal ids, places), set, and recorded once in the quarantine (what was
# found, the reason, the server time). The rebuild reads the whole queue: O(queue size), only
# on damage (a missing counter on an empty queue, its first push, reads empty keys). Every read
# comes before the first write; a wrong-type counter fails the script (the conventions').
TAKE_SEQ: Final = (
    """
local function take_seq(k, count, retention)
  local taken = redis.pcall('INCRBY', k.seq, count)
  local reason, found
  if type(taken) == 'table' then
    if string.find(taken['err'] or '', 'WRONGTYPE', 1, true) then
      return error(taken)
    end
    reason = 'sequence counter unreadable'
    found = redis.call('GET', k.seq)  -- (INCRBY refused it: unchanged)
  elseif taken > count and taken <= SEQ_MAX then
    return taken  -- (the one test of the hot path)
  elseif taken == count then
    reason = 'sequence counter missing'  -- (or a fresh queue: damage only if it holds jobs)
    found = false
  else
    reason = taken < count and 'sequence counter negative' or 'sequence counter past 2**53'
    found = string.format('%d', taken - count)
  end
  local top = 0
  local function see(value)
    value = tonumber(value)
    if value and value > top and value <= SEQ_MAX then
      top = value
    end
  end
  local function see_ids(hash)
    local cursor = '0'
    repeat
      local page = redis.call('HSCAN', hash, cursor, 'COUNT', 1000)
      cursor = page[1]
      for i = 1, #page[2], 2 do
        local id = page[2][i]
        see(#id <= 16 and string.match(id, '^%d+$'))
        if hash == k.claims then
          see(string.match(page[2][i + 1], PLACE))
        end
      end
    until cursor == '0'
  end
  see_ids(k.jobs)
  see_ids(k.meta)
  see_ids(k.claims)
  for _, zset in ipairs({k.ready, k.delayed, k.moved, k.active}) do
    local total = redis.call('ZCARD', zset)
    for start = 0, total - 1, 1000 do
      for _, member in ipairs(redis.call('ZRANGE', zset, start, start + 999)) do
        if zset == k.active then
          see(string.match(member, '^(%d+):'))  -- a lease token: n:random
        else
          local n = string.match(member, MEMBER_ID)
          see(n and #n <= 16 and n)
          see(string.match(member, PLACE))
        end
      end
    end
  end
  if reason == 'sequence counter missing' and top == 0 then
    return taken  -- a fresh queue
  end
  if top + count > SEQ_MAX then
    return error({err = 'ERR sequence exhausted: ' .. k.seq .. ' would pass 2**53 (damaged store)'})
  end
  local kind = redis.call('TYPE', k.quarantine)['ok']
  if kind ~= 'list' and kind ~= 'none' then
    return error({err = 'WRONGTYPE ' .. k.quarantine .. ' holds a ' .. kind .. ', not a list' ..
      ' (damaged store)'})
  end
  taken = top + count
  redis.call('SET', k.seq, string.format('%d', taken))
  local t = redis.call('TIME')
  local raw = 'sequence counter: (none, or 0)\\n'
  if found then
    raw = 'sequence counter (' .. #found .. ' bytes): ' .. found .. '\\n'
  end
  raw = raw .. 'highest number held by the queue: ' .. string.format('%d', top) .. '\\n'
  reason = reason .. ', rebuilt from the queue'
  redis.call('LPUSH', k.quarantine, t[1] .. '.' .. string.format('%06d', tonumber(t[2])) .. ' ' ..
    #reason .. '\\n' .. reason .. raw)
  redis.call('LTRIM', k.quarantine, 0, tonumber(retention) - 1)
  return taken, reason
end
""".replace("SEQ_MAX", str(SEQ_MAX))
    .replace("PLACE", "'^(" + "%d" * 16 + ")'")
    .replace("MEMBER_ID", MEMBER_ID)
)
