-- deadline_proximity.lua: how close the waiting requests of some queues are to their deadline,
-- for the pipeline_deadline_proximity_millis histogram (read at scrape time). The clock is
-- the Redis server's (TIME). One ZCOUNT per bucket bound: no scan of the sets.
-- KEYS[i] the expiry sorted set of a queue (waiting requests, pending or delayed, scored by
-- their deadline in Unix s).
-- ARGV[j] the bucket bounds in ms of time left (ascending; 0 = already expired).
-- Returns, per key, #ARGV cumulative counts (deadline <= now + bound) then the set's size.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local out = {}
for _, key in ipairs(KEYS) do
  for _, bound in ipairs(ARGV) do
    out[#out + 1] = redis.call('ZCOUNT', key, '-inf', string.format('%.6f', now + tonumber(bound) / 1000))
  end
  out[#out + 1] = redis.call('ZCARD', key)
end
return out
