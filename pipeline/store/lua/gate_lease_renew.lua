-- gate_lease_renew.lua: extend the leases of live holders (the attempt's heartbeat).
-- A lease that already expired is NOT revived: its slot may have been given to someone
-- else, so reviving it could over-admit; the reaper frees it instead.
-- KEYS[1] holders sorted set (member = holder, score = lease expiry, Unix s).
-- KEYS[2] info hash (holder -> JSON description).
-- ARGV[1] now (Unix s), ARGV[2] new lease expiry (Unix s), ARGV[3] grace (s, see
--         gate_lease_acquire.lua), ARGV[4..] holders.
-- Expiries only move later. Returns the number of leases renewed.
local now, lease, grace = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local n = 0
for i = 4, #ARGV do
  local cur = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if cur and tonumber(cur) > now then
    redis.call('ZADD', KEYS[1], 'XX', 'GT', lease, ARGV[i])
    n = n + 1
  end
end
if n > 0 then
  local ttl = math.ceil((lease - now + grace) * 1000)
  if redis.call('PTTL', KEYS[1]) < ttl then redis.call('PEXPIRE', KEYS[1], ttl) end
  if redis.call('PTTL', KEYS[2]) < ttl then redis.call('PEXPIRE', KEYS[2], ttl) end
end
return n
