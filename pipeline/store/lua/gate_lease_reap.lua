-- gate_lease_reap.lua: free the slots whose lease expired (their holder died or stopped
-- renewing). Expired: lease expiry <= the Redis server's clock (TIME).
-- KEYS[1] holders sorted set (member = holder, score = lease expiry, Unix s).
-- KEYS[2] info hash (holder -> JSON description).
-- ARGV[1] mode:
--   'all'    frees every lease in KEYS[1] that expired (at most ARGV[2] of them);
--   'listed' frees only the holders ARGV[2..] that are still in KEYS[2] and whose lease in
--            KEYS[1] expired or is missing (KEYS[1] is shared with other gates, whose
--            holders are theirs to reap).
-- Returns the list of holders freed.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local out = {}
if ARGV[1] == 'all' then
  for _, h in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, ARGV[2])) do
    redis.call('ZREM', KEYS[1], h)
    redis.call('HDEL', KEYS[2], h)
    out[#out + 1] = h
  end
  return out
end
for i = 2, #ARGV do
  local h = ARGV[i]
  if redis.call('HEXISTS', KEYS[2], h) == 1 then
    local s = redis.call('ZSCORE', KEYS[1], h)
    if not s or tonumber(s) <= now then
      redis.call('ZREM', KEYS[1], h)
      redis.call('HDEL', KEYS[2], h)
      out[#out + 1] = h
    end
  end
end
return out
