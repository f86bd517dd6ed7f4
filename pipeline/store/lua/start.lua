-- start.lua: an attempt begins. Fenced by the attempt token: a stale or duplicate Celery
-- message (older token, cancelled, finished) is refused.
-- KEYS[1] request hash, KEYS[2] active set of its queue.
-- ARGV[1] token, ARGV[2] lease (s from now), ARGV[3] worker name.
-- Returns {0, state} when fenced off, else {1, now, field, value, ...}: the server's clock
-- (Unix s, as text; the attempt measures its deadline against it) and the fields of the record
-- an attempt reads (ATTEMPT_FIELDS; absent ones left out; never the decision log), as this step
-- leaves them.
local ATTEMPT_FIELDS = {'id', 'queue', 'deadline', 'payload', 'metadata', 'labels', 'headers',
  'endpoint', 'attempts', 'dispatches', 'submitted_at', 'last_response', 'last_error', 'wire',
  'ref_token', 'priority', 'pfx'}
local f = redis.call('HMGET', KEYS[1], 'state', 'token', unpack(ATTEMPT_FIELDS))
if f[1] ~= 'dispatched' or f[2] ~= ARGV[1] then
  return {0, f[1] or 'missing'}
end
local now = server_now()
local started = fmt_time(now)
redis.call('HSET', KEYS[1], 'state', 'running', 'started_at', started, 'worker', ARGV[3])
redis.call('ZADD', KEYS[2], lease_score(now + tonumber(ARGV[2])), f[3])
local out = {1, started, 'state', 'running', 'started_at', started, 'worker', ARGV[3]}
for i, name in ipairs(ATTEMPT_FIELDS) do
  local v = f[i + 2]
  if v then
    out[#out + 1] = name
    out[#out + 1] = v
  end
end
return out
