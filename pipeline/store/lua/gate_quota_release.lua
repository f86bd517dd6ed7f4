-- gate_quota_release.lua: free one holder's slot of a redis-quota gate in concurrency mode, in
-- one step: the gate's index says which key's holders set it is in. Idempotent: a holder that
-- holds nothing is a no-op.
-- KEYS[1] the gate's index hash: holder -> JSON {"key": <holders sorted set>, ...}.
-- ARGV[1] holder.
-- The holders set is the whole key the index entry names (written by the gate from
-- Keys.gate_holders when it acquired; not in KEYS: see docs/production.md, "Redis Cluster").
-- Returns 1 when a slot was freed, else 0.
local info = redis.call('HGET', KEYS[1], ARGV[1])
if not info then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
local ok, d = pcall(cjson.decode, info)
if not ok or type(d) ~= 'table' or type(d.key) ~= 'string' or d.key == '' then return 0 end
return redis.call('ZREM', d.key, ARGV[1])
