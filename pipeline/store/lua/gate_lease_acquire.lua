-- gate_lease_acquire.lua: take one lease-counted slot of a gate (local-/global-max-concurrency,
-- or redis-quota in concurrency mode), or take over a giver's (ARGV[6]). Check and take are
-- one atomic step. Every time is the Redis server's clock (TIME), never a caller's.
-- KEYS[1] holders sorted set: member = holder "<request id>:<token>", score = lease expiry
--         (Unix s, rounded up to a whole second).
-- KEYS[2] info hash: holder -> JSON description (worker, acquired_at, ...).
-- KEYS[3] (optional) a registry set to list ARGV[7] in when a slot is taken (a per-node gate's
--         nodes: reapers elsewhere find a dead node's pool through it; see
--         gate_nodes_prune.lua, which drops nodes whose pool is gone).
-- ARGV[1] holder, ARGV[2] lease (s from now), ARGV[3] limit,
-- ARGV[4] info JSON (an object; the script adds "acquired_at", Unix s),
-- ARGV[5] grace (s): leases that expired more than this long ago are purged here (their
--         holder is gone for good), and both keys live at least this long past the latest
--         lease they hold (re-armed to a minute more when they would expire sooner, so most
--         calls only read their TTLs).
-- ARGV[6] (optional) a giver: a holder whose slot is freed first, in the same atomic step, so
--         the slot passes from it to ARGV[1] without ever being free (a hand-over; the taker
--         fits unless the giver held nothing and the pool is full).
-- ARGV[7] (with KEYS[3]) the registry member (the node).
-- Only unexpired leases (score > now) count against the limit. A holder that already holds
-- an unexpired lease keeps it (its expiry only ever moves later) and takes no second slot.
-- Returns 1 when a new slot was taken, 2 when the holder already held one, 0 when full.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local now_text = t[1] .. '.' .. string.sub('00000' .. t[2], -6)
-- the lease's expiry rounded up to a whole second: the set holds integers, which a small
-- (listpack) sorted set compares without parsing text (see lease_score in lib.lua)
local lease, grace = math.ceil(now + tonumber(ARGV[2])), tonumber(ARGV[5])
local lease_text = string.format('%d', lease)

-- a hand-over whose giver still held an unexpired lease: its slot is the taker's, with no
-- count to check, no purge (every other acquire purges), no lease of the taker's to look for
-- (it was parked, holding none) and no registry entry to add (the giver's, on the same gate
-- and node, is there: its pool never emptied)
local handed = false
if ARGV[6] and ARGV[6] ~= '' then
  local g = redis.call('ZSCORE', KEYS[1], ARGV[6])
  if g then
    redis.call('ZREM', KEYS[1], ARGV[6])
    handed = tonumber(g) > now
  end
  redis.call('HDEL', KEYS[2], ARGV[6])
end

if not handed then
  for _, h in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf',
      string.format('%d', math.floor(now - grace)), 'LIMIT', '0', '100')) do
    redis.call('ZREM', KEYS[1], h)
    redis.call('HDEL', KEYS[2], h)
  end
end

local result = 1
-- (a taker that was handed a slot held none: it was parked for one)
local cur = not handed and redis.call('ZSCORE', KEYS[1], ARGV[1])
if cur and tonumber(cur) > now then
  redis.call('ZADD', KEYS[1], 'GT', lease_text, ARGV[1])
  result = 2
else
  if not handed and redis.call('ZCOUNT', KEYS[1], '(' .. now_text, '+inf')
      >= tonumber(ARGV[3]) then
    return 0
  end
  -- ARGV[4] with "acquired_at" added (spliced in: the caller's JSON object is kept as sent)
  local head = string.sub(ARGV[4], 1, -2)
  if string.find(head, '^%s*{%s*$') == nil then head = head .. ',' end
  local info = head .. '"acquired_at":' .. now_text .. '}'
  redis.call('ZADD', KEYS[1], lease_text, ARGV[1])
  redis.call('HSET', KEYS[2], ARGV[1], info)
  if KEYS[3] and not handed then redis.call('SADD', KEYS[3], ARGV[7]) end
end

-- every lease written (here and by gate_lease_renew.lua) leaves both keys at least `grace`
-- past it, so they outlive the latest lease they hold by that much
local ttl = math.ceil((lease - now + grace) * 1000)
for i = 1, 2 do
  if redis.call('PTTL', KEYS[i]) < ttl then redis.call('PEXPIRE', KEYS[i], ttl + 60000) end
end
return result
