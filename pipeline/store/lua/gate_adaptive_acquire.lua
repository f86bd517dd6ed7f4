-- gate_adaptive_acquire.lua: take one slot of an adaptive-concurrency gate, or take over a
-- giver's (ARGV[6]), while the gate's in-flight count is under its limit as it is now: the
-- limit is read from the gate's state in the same atomic step, so no slot is ever granted past
-- the limit in force when it was granted. A limit lowered below in-flight admits nothing,
-- hand-overs included, until enough holders have released. Every time is the Redis server's
-- clock (TIME), never a caller's.
-- KEYS[1] holders sorted set: member = holder "<request id>:<token>", score = lease expiry
--         (Unix s, rounded up to a whole second).
-- KEYS[2] info hash: holder -> JSON description (worker, acquired_at, ...).
-- KEYS[3] the gate's state hash: 'limit' (the controller's), 'seen<p>' (Unix s when a
--         request of priority p last asked, kept with priority headroom).
-- KEYS[4] the current window's hash: 'refused' counts acquires refused at the limit.
-- ARGV[1] holder, ARGV[2] lease (s from now), ARGV[3] the limit while the state has none,
-- ARGV[4] info JSON (an object; the script adds "acquired_at", Unix s),
-- ARGV[5] grace (s): as in gate_lease_acquire.lua (purge and key lifetime),
-- ARGV[6] a giver ('' for none): its slot is freed first in the same atomic step; the taker
--         then fits only under the limit like any other,
-- ARGV[7] the request's priority (0-9), ARGV[8] the priority headroom s (0 to 0.5; 0: one
--         ceiling for every priority), ARGV[9] how long a priority that asked counts as
--         present (s), ARGV[10] how long the state and window outlive their last write (s).
-- With headroom s a request of priority p takes a slot only while in-flight is under its
-- band's ceiling, max(1, floor(limit x (1 - s x (top - p) / 9))), top = the highest priority
-- that asked within ARGV[9] s (llm-d-router #1956's graduated ceilings, relative to the
-- work present: a priority alone has the whole limit).
-- Returns 1 when a new slot was taken, 2 when the holder already held one, 0 when refused.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local now_text = t[1] .. '.' .. string.sub('00000' .. t[2], -6)
local lease, grace = math.ceil(now + tonumber(ARGV[2])), tonumber(ARGV[5])
local lease_text = string.format('%d', lease)
local keep_ms = math.floor(tonumber(ARGV[10]) * 1000)

local limit = tonumber(redis.call('HGET', KEYS[3], 'limit') or '') or tonumber(ARGV[3])
local ceiling = limit
local headroom = tonumber(ARGV[8]) or 0
if headroom > 0 then
  local p = math.max(0, math.min(9, math.floor(tonumber(ARGV[7]) or 0)))
  if p > 0 then
    redis.call('HSET', KEYS[3], 'seen' .. p, now_text)
    if redis.call('PTTL', KEYS[3]) < 0 then redis.call('PEXPIRE', KEYS[3], keep_ms) end
  end
  local top = p
  if p < 9 then
    local names = {}
    for q = p + 1, 9 do names[#names + 1] = 'seen' .. q end
    local seen = redis.call('HMGET', KEYS[3], unpack(names))
    local since = now - tonumber(ARGV[9])
    for i = #seen, 1, -1 do
      if seen[i] and tonumber(seen[i]) >= since then
        top = p + i
        break
      end
    end
  end
  ceiling = math.max(1, math.floor(limit * (1 - headroom * (top - p) / 9) + 1e-9))
end

local handed = false
if ARGV[6] ~= '' then
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
local cur = not handed and redis.call('ZSCORE', KEYS[1], ARGV[1])
if cur and tonumber(cur) > now then
  redis.call('ZADD', KEYS[1], 'GT', lease_text, ARGV[1])
  result = 2
else
  if redis.call('ZCOUNT', KEYS[1], '(' .. now_text, '+inf') >= ceiling then
    redis.call('HINCRBY', KEYS[4], 'refused', 1)
    if redis.call('PTTL', KEYS[4]) < 0 then redis.call('PEXPIRE', KEYS[4], keep_ms) end
    return 0
  end
  local head = string.sub(ARGV[4], 1, -2)
  if string.find(head, '^%s*{%s*$') == nil then head = head .. ',' end
  redis.call('ZADD', KEYS[1], lease_text, ARGV[1])
  redis.call('HSET', KEYS[2], ARGV[1], head .. '"acquired_at":' .. now_text .. '}')
end

local ttl = math.ceil((lease - now + grace) * 1000)
for i = 1, 2 do
  if redis.call('PTTL', KEYS[i]) < ttl then redis.call('PEXPIRE', KEYS[i], ttl + 60000) end
end
return result
