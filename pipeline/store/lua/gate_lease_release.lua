-- gate_lease_release.lua: free one holder's lease-counted slot. Idempotent: a holder that
-- holds nothing is a no-op.
-- KEYS[1] holders sorted set (member = holder, score = lease expiry, Unix s).
-- KEYS[2] info hash (holder -> JSON description).
-- ARGV[1] holder.
-- Returns 1 when a slot was freed, else 0.
local n = redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return n
