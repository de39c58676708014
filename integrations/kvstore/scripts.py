"""The Lua scripts of the Redis backends (one shard each: every key they touch carries its hash tag)."""

# Every script takes the keys of one shard, all under its hash tag (one slot):
# KEYS: entry, zset, sizes, bases, total, stats.

# ARGV: member, record, size, base, score, budget (-1: none), entry-key prefix, ttl ms (0: none).
# Sets the entry, then evicts lowest-score members (never ARGV[1]) until total <= budget.
_PUT = """
local old = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0')
if tonumber(ARGV[8]) > 0 then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[8])
else
  redis.call('SET', KEYS[1], ARGV[2])
end
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
redis.call('HSET', KEYS[4], ARGV[1], ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[1])
redis.call('HINCRBY', KEYS[6], 'puts', 1)
local total = redis.call('INCRBY', KEYS[5], tonumber(ARGV[3]) - old)
local budget = tonumber(ARGV[6])
local evicted = 0
if budget >= 0 then
  while total > budget do
    local low = redis.call('ZRANGE', KEYS[2], 0, 1)
    local victim = low[1]
    if victim == ARGV[1] then victim = low[2] end
    if not victim then break end
    local sz = tonumber(redis.call('HGET', KEYS[3], victim) or '0')
    redis.call('DEL', ARGV[7] .. victim)
    redis.call('HDEL', KEYS[3], victim)
    redis.call('HDEL', KEYS[4], victim)
    redis.call('ZREM', KEYS[2], victim)
    total = redis.call('DECRBY', KEYS[5], sz)
    evicted = evicted + 1
  end
  if evicted > 0 then redis.call('HINCRBY', KEYS[6], 'evicted', evicted) end
end
return evicted
"""

# Drops the bookkeeping of a member whose entry is gone (evicted by the server's maxmemory policy,
# expired, lost with a node): shared by the scripts below.
_FORGET = """
local function forget(member)
  local sz = tonumber(redis.call('HGET', KEYS[3], member) or '0')
  redis.call('HDEL', KEYS[3], member)
  redis.call('HDEL', KEYS[4], member)
  redis.call('ZREM', KEYS[2], member)
  if sz > 0 then redis.call('DECRBY', KEYS[5], sz) end
end
"""

# ARGV: member, time term. The record (touching its score), or 1: the entry was indexed but is gone
# (its bookkeeping is dropped here: the whole entry is a miss), or 0: no such entry.
_GET = _FORGET + """
local v = redis.call('GET', KEYS[1])
if v then
  local b = redis.call('HGET', KEYS[4], ARGV[1])
  if b then redis.call('ZADD', KEYS[2], 'XX', tonumber(b) + tonumber(ARGV[2]), ARGV[1]) end
  redis.call('HINCRBY', KEYS[6], 'hits', 1)
  return v
end
redis.call('HINCRBY', KEYS[6], 'misses', 1)
if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then
  forget(ARGV[1])
  redis.call('HINCRBY', KEYS[6], 'lost', 1)
  return 1
end
return 0
"""

# ARGV: member, time term, prefix length. {length, first bytes} of the record (touching its score),
# or 1 / 0 as _GET.
_HEAD = _FORGET + """
local n = redis.call('STRLEN', KEYS[1])
if n > 0 then
  local b = redis.call('HGET', KEYS[4], ARGV[1])
  if b then redis.call('ZADD', KEYS[2], 'XX', tonumber(b) + tonumber(ARGV[2]), ARGV[1]) end
  redis.call('HINCRBY', KEYS[6], 'hits', 1)
  return {n, redis.call('GETRANGE', KEYS[1], 0, tonumber(ARGV[3]) - 1)}
end
redis.call('HINCRBY', KEYS[6], 'misses', 1)
if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then
  forget(ARGV[1])
  redis.call('HINCRBY', KEYS[6], 'lost', 1)
  return 1
end
return 0
"""

# ARGV: member, sha1 hex of the value to drop or '' (any), counter to move a hit to ('' none).
_DELETE = _FORGET + """
local v = redis.call('GET', KEYS[1])
if ARGV[2] ~= '' and (not v or redis.sha1hex(v) ~= ARGV[2]) then return 0 end
local n = redis.call('DEL', KEYS[1])
forget(ARGV[1])
if ARGV[3] ~= '' then
  redis.call('HINCRBY', KEYS[6], ARGV[3], 1)
  redis.call('HINCRBY', KEYS[6], 'hits', -1)
  redis.call('HINCRBY', KEYS[6], 'misses', 1)
end
return n
"""

# ARGV: member, score it had when chosen. Evicts it (the budget across shards) if not touched since.
_EVICT = _FORGET + """
local s = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not s or tonumber(s) ~= tonumber(ARGV[2]) then return -1 end
local sz = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0')
redis.call('DEL', KEYS[1])
forget(ARGV[1])
redis.call('HINCRBY', KEYS[6], 'evicted', 1)
return sz
"""

# ARGV: member. gc of one member: 'orphan' (an entry with no bookkeeping: deleted), 'stale'
# (bookkeeping with no entry: dropped), 'ok'.
_GC_MEMBER = _FORGET + """
local e = redis.call('EXISTS', KEYS[1])
local z = redis.call('ZSCORE', KEYS[2], ARGV[1])
local h = redis.call('HEXISTS', KEYS[3], ARGV[1])
if e == 1 and (not z or h == 0) then
  redis.call('DEL', KEYS[1])
  forget(ARGV[1])
  return 'orphan'
end
if e == 0 and (z or h == 1 or redis.call('HEXISTS', KEYS[4], ARGV[1]) == 1) then
  forget(ARGV[1])
  redis.call('HINCRBY', KEYS[6], 'lost', 1)
  return 'stale'
end
return 'ok'
"""

# Recomputes a shard's total from its sizes hash; returns {old, new}.
_GC_TOTAL = """
local t = 0
local v = redis.call('HVALS', KEYS[3])
for i = 1, #v do t = t + tonumber(v[i]) end
local old = tonumber(redis.call('GET', KEYS[5]) or '0')
if t > 0 then redis.call('SET', KEYS[5], t) else redis.call('DEL', KEYS[5]) end
return {old, t}
"""
