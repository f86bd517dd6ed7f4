-- cancel.lua: cancel a request that has not started an attempt (queued, waiting out a
-- retry, or dispatched but not yet started). A running attempt is marked (fields cancel and
-- cancel_ttl): if it is still parked at its worker for a gate slot it ends CANCELLED unsent
-- at once (the notice published here wakes it; cancel_asked.lua); if it was sent it
-- finishes, and gets no retry.
-- KEYS[1] request hash.
-- ARGV[1] prefix, ARGV[2] result TTL (s).
-- Returns 1 when cancelled, else 0.
local f = redis.call('HMGET', KEYS[1], 'state', 'id')
if f[1] == 'queued' or f[1] == 'retry_wait' or f[1] == 'dispatched' then
  terminal(ARGV[1], f[2], server_now(), ARGV[2], '', '{"error": "cancelled"}', 'CANCELLED',
    'cancelled')
  return 1
end
if f[1] == 'running' then  -- wake its attempt if parked (pipeline/worker/bell.py)
  redis.call('HSET', KEYS[1], 'cancel', 'cancelled', 'cancel_ttl', ARGV[2])
  redis.call('PUBLISH', ARGV[1] .. 'freed', '!cancel\n' .. f[2])
end
return 0
