-- reap.lua: free the attempts of one queue whose lease expired (their worker died or lost
-- its message) and put their requests back in the queue with their ordering key.
-- KEYS[1] active set of the queue, then the key families (lib.lua key_families).
-- ARGV[1] max to reap. Expired: lease expiry <= the server's clock.
-- Returns a flat list of id, token of the reaped attempts (their gate holders). Each reaped
-- request's decision log gets a "reaped" entry (the state it was in, its worker).
local K, now = key_families(), server_now()
local out = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, ARGV[1])) do
  local f = redis.call('HMGET', K.req .. id, 'state', 'token', 'worker')
  if f[1] == 'dispatched' or f[1] == 'running' then
    out[#out + 1] = id
    out[#out + 1] = f[2]
    local was = '"state":"' .. f[1] .. '"'
    if f[1] == 'running' and f[3] then was = was .. ',"worker":' .. cjson.encode(f[3]) end
    log_note(id, log_entry(now, 'reaped', was))
    enqueue(K, id, now, now)
  else
    redis.call('ZREM', KEYS[1], id)
  end
end
return out
