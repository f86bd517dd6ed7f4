-- cancel.lua: cancel a request that has not started an attempt (queued, waiting out a
-- retry, or dispatched but not yet started). A running attempt is marked (fields cancel and
-- cancel_ttl): if it is still parked at its worker for a gate slot it ends CANCELLED unsent
-- at once (the notice published here wakes it; cancel_asked.lua); if it was sent it
-- finishes, and gets no retry.
-- KEYS[1] request hash, then the key families (lib.lua key_families).
-- ARGV[1] result TTL (s).
-- Returns 1 when cancelled, else 0.
local K = key_families()
local f = redis.call('HMGET', KEYS[1], 'state', 'id')
if f[1] == 'queued' or f[1] == 'retry_wait' or f[1] == 'dispatched' then
  terminal(K, f[2], server_now(), ARGV[1], '', '{"error": "cancelled"}', 'CANCELLED',
    'cancelled')
  return 1
end
if f[1] == 'running' then  -- wake its attempt if parked (pipeline/worker/bell.py)
  redis.call('HSET', KEYS[1], 'cancel', 'cancelled', 'cancel_ttl', ARGV[1])
  publish_freed(K, '!cancel\n' .. f[2])
end
return 0
