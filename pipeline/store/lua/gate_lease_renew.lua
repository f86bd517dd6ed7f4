-- gate_lease_renew.lua: extend the leases of live holders (the attempt's heartbeat).
-- A lease that already expired is NOT revived: its slot may have been given to someone
-- else, so reviving it could over-admit; the reaper frees it instead. Every time is the Redis
-- server's clock (TIME).
-- KEYS[1] holders sorted set (member = holder, score = lease expiry, Unix s, a whole second).
-- KEYS[2] info hash (holder -> JSON description).
-- ARGV[1] lease (s from now), ARGV[2] grace (s, see gate_lease_acquire.lua),
-- ARGV[3..] holders.
-- Expiries only move later. Returns the number of leases renewed.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
-- rounded up to a whole second, as gate_lease_acquire.lua writes it
local lease, grace = math.ceil(now + tonumber(ARGV[1])), tonumber(ARGV[2])
local n = 0
for i = 3, #ARGV do
  local cur = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if cur and tonumber(cur) > now then
    redis.call('ZADD', KEYS[1], 'XX', 'GT', string.format('%d', lease), ARGV[i])
    n = n + 1
  end
end
if n > 0 then
  local ttl = math.ceil((lease - now + grace) * 1000)
  if redis.call('PTTL', KEYS[1]) < ttl then redis.call('PEXPIRE', KEYS[1], ttl) end
  if redis.call('PTTL', KEYS[2]) < ttl then redis.call('PEXPIRE', KEYS[2], ttl) end
end
return n
