-- start.lua: an attempt begins. Fenced by the attempt token: a stale or duplicate Celery
-- message (older token, cancelled, finished) is refused.
-- KEYS[1] request hash, KEYS[2] active set of its queue.
-- ARGV[1] token, ARGV[2] lease (s from now), ARGV[3] worker name.
-- Returns {0, state} when fenced off, else {1, now, field, value, ...}: the server's clock
-- (Unix s, as text; the attempt measures its deadline against it) and the whole record, as
-- this step leaves it.
local rec = redis.call('HGETALL', KEYS[1])
local state, token, id
for i = 1, #rec, 2 do
  local k = rec[i]
  if k == 'state' then state = rec[i + 1]
  elseif k == 'token' then token = rec[i + 1]
  elseif k == 'id' then id = rec[i + 1] end
end
if state ~= 'dispatched' or token ~= ARGV[1] then
  return {0, state or 'missing'}
end
local now = server_now()
local started = fmt_time(now)
redis.call('HSET', KEYS[1], 'state', 'running', 'started_at', started, 'worker', ARGV[3])
redis.call('ZADD', KEYS[2], fmt_time(now + tonumber(ARGV[2])), id)
local set = {state = 'running', started_at = started, worker = ARGV[3]}
local out = {1, started}
for i = 1, #rec, 2 do
  local k = rec[i]
  out[#out + 1] = k
  local v = set[k]
  if v then
    set[k] = nil
    out[#out + 1] = v
  else
    out[#out + 1] = rec[i + 1]
  end
end
for k, v in pairs(set) do
  out[#out + 1] = k
  out[#out + 1] = v
end
return out
