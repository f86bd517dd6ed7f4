-- gate_lease_acquire.lua: take one lease-counted slot of a gate (local-/global-max-concurrency,
-- or redis-quota in concurrency mode), or take over a giver's (ARGV[7]). Check and take are
-- one atomic step.
-- KEYS[1] holders sorted set: member = holder "<request id>:<token>", score = lease expiry
--         (Unix s).
-- KEYS[2] info hash: holder -> JSON description (worker, acquired_at, ...).
-- ARGV[1] holder, ARGV[2] now (Unix s), ARGV[3] lease expiry (Unix s), ARGV[4] limit,
-- ARGV[5] info JSON, ARGV[6] grace (s): leases that expired more than this long ago are
--         purged here (their holder is gone for good), and both keys live this long past
--         the latest lease they hold.
-- ARGV[7] (optional) a giver: a holder whose slot is freed first, in the same atomic step, so
--         the slot passes from it to ARGV[1] without ever being free (a hand-over; the taker
--         fits unless the giver held nothing and the pool is full).
-- Only unexpired leases (score > now) count against the limit. A holder that already holds
-- an unexpired lease keeps it (its expiry only ever moves later) and takes no second slot.
-- Returns 1 when a new slot was taken, 2 when the holder already held one, 0 when full.
local now, lease, grace = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[6])

for _, h in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - grace, 'LIMIT', 0, 100)) do
  redis.call('ZREM', KEYS[1], h)
  redis.call('HDEL', KEYS[2], h)
end

if ARGV[7] and ARGV[7] ~= '' then
  redis.call('ZREM', KEYS[1], ARGV[7])
  redis.call('HDEL', KEYS[2], ARGV[7])
end

local result = 1
local cur = redis.call('ZSCORE', KEYS[1], ARGV[1])
if cur and tonumber(cur) > now then
  redis.call('ZADD', KEYS[1], 'GT', lease, ARGV[1])
  result = 2
else
  if redis.call('ZCOUNT', KEYS[1], '(' .. ARGV[2], '+inf') >= tonumber(ARGV[4]) then
    return 0
  end
  redis.call('ZADD', KEYS[1], lease, ARGV[1])
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[5])
end

local top = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIRE', KEYS[1], math.ceil((tonumber(top[2]) - now + grace) * 1000))
local ttl = math.ceil((lease - now + grace) * 1000)
if redis.call('PTTL', KEYS[2]) < ttl then
  redis.call('PEXPIRE', KEYS[2], ttl)
end
return result
