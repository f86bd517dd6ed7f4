-- gate_lease_transfer.lua: hand one holder's lease-counted slot to another holder in one
-- atomic step (a parked attempt in the same process takes over a slot the moment its
-- holder is done with the server; the slot is never free in between).
-- KEYS[1] holders sorted set: member = holder "<request id>:<token>", score = lease expiry
--         (Unix s).
-- KEYS[2] info hash: holder -> JSON description (worker, acquired_at, ...).
-- ARGV[1] the holder giving the slot up, ARGV[2] the holder taking it, ARGV[3] now (Unix s),
-- ARGV[4] the taker's lease expiry (Unix s), ARGV[5] limit, ARGV[6] the taker's info JSON,
-- ARGV[7] grace (s): both keys live this long past the latest lease they hold.
-- The giver's slot is freed (as gate_lease_release.lua), then the taker takes one (as
-- gate_lease_acquire.lua: only unexpired leases count). Freeing first means the taker always
-- fits unless the giver held nothing (its lease expired and was reaped, or it was never
-- taken) and the pool is full.
-- Returns 1 when the taker now holds a slot (2 when it already held one), 0 when full.
local now, lease, grace = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[7])

redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])

local result = 1
local cur = redis.call('ZSCORE', KEYS[1], ARGV[2])
if cur and tonumber(cur) > now then
  redis.call('ZADD', KEYS[1], 'GT', lease, ARGV[2])
  result = 2
else
  if redis.call('ZCOUNT', KEYS[1], '(' .. ARGV[3], '+inf') >= tonumber(ARGV[5]) then
    return 0
  end
  redis.call('ZADD', KEYS[1], lease, ARGV[2])
  redis.call('HSET', KEYS[2], ARGV[2], ARGV[6])
end

local top = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIRE', KEYS[1], math.ceil((tonumber(top[2]) - now + grace) * 1000))
local ttl = math.ceil((lease - now + grace) * 1000)
if redis.call('PTTL', KEYS[2]) < ttl then
  redis.call('PEXPIRE', KEYS[2], ttl)
end
return result
