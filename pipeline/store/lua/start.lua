-- start.lua: an attempt begins. Fenced by the attempt token: a stale or duplicate Celery
-- message (older token, cancelled, finished) is refused.
-- KEYS[1] request hash, KEYS[2] active set of its queue.
-- ARGV[1] token, ARGV[2] lease (s from now), ARGV[3] worker name.
-- Returns {0, state} when fenced off, else {1, now, field, value, ...}: the server's clock
-- (Unix s, as text; the attempt measures its deadline against it) and the whole record but its
-- decision log.
local f = redis.call('HMGET', KEYS[1], 'state', 'token')
if f[1] ~= 'dispatched' or f[2] ~= ARGV[1] then
  return {0, f[1] or 'missing'}
end
local now = server_now()
redis.call('HSET', KEYS[1], 'state', 'running', 'started_at', fmt_time(now), 'worker', ARGV[3])
redis.call('ZADD', KEYS[2], fmt_time(now + tonumber(ARGV[2])), redis.call('HGET', KEYS[1], 'id'))
local out = {1, fmt_time(now)}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if all[i] ~= 'log' then -- the decision log stays here (up to 50 entries of no use to it)
    out[#out + 1] = all[i]
    out[#out + 1] = all[i + 1]
  end
end
return out
