-- node_beat.lua: a worker node's heartbeat in the registry of each pool it serves, judged by
-- the Redis server's clock (a node whose clock is off cannot expire the others). Also drops
-- the slot counts of nodes that stopped beating, so the registry stays bounded however often
-- nodes restart under new names.
-- KEYS: pairs per pool: KEYS[2i-1] the pool's nodes sorted set (member = node, score = liveness
--       expiry, Unix s), KEYS[2i] the pool's slots hash (node -> slots it offers).
-- ARGV[1] node name, ARGV[2] its slots, ARGV[3] liveness (s from now).
-- Returns per pool {sum of the live nodes' slots, number of live nodes}.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local out = {}
for i = 1, #KEYS, 2 do
  local nodes, slots = KEYS[i], KEYS[i + 1]
  redis.call('ZADD', nodes, string.format('%.6f', now + tonumber(ARGV[3])), ARGV[1])
  redis.call('HSET', slots, ARGV[1], ARGV[2])
  redis.call('ZREMRANGEBYSCORE', nodes, '-inf', string.format('%.6f', now))
  local total, live = 0, 0
  local all = redis.call('HGETALL', slots)
  for j = 1, #all, 2 do
    if redis.call('ZSCORE', nodes, all[j]) then
      total = total + (tonumber(all[j + 1]) or 0)
      live = live + 1
    else
      redis.call('HDEL', slots, all[j])
    end
  end
  out[#out + 1] = {total, live}
end
return out
