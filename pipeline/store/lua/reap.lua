-- reap.lua: free the attempts of one queue whose lease expired (their worker died or lost
-- its message) and put their requests back in the queue with their ordering key.
-- KEYS[1] active set of the queue.
-- ARGV[1] prefix, ARGV[2] max to reap. Expired: lease expiry <= the server's clock.
-- Returns a flat list of id, token of the reaped attempts (their gate holders).
local prefix, now = ARGV[1], server_now()
local out = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, ARGV[2])) do
  local f = redis.call('HMGET', prefix .. 'req:' .. id, 'state', 'token')
  if f[1] == 'dispatched' or f[1] == 'running' then
    out[#out + 1] = id
    out[#out + 1] = f[2]
    enqueue(prefix, id, now, now)
  else
    redis.call('ZREM', KEYS[1], id)
  end
end
return out
