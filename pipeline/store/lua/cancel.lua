-- cancel.lua: cancel a request that has not started an attempt (queued, waiting out a
-- retry, or dispatched but not yet started). A running attempt is left to finish.
-- KEYS[1] request hash.
-- ARGV[1] prefix, ARGV[2] result TTL (s).
-- Returns 1 when cancelled, else 0.
local f = redis.call('HMGET', KEYS[1], 'state', 'id')
if f[1] == 'queued' or f[1] == 'retry_wait' or f[1] == 'dispatched' then
  terminal(ARGV[1], f[2], server_now(), ARGV[2], '', '{"error": "cancelled"}', 'CANCELLED',
    'cancelled')
  return 1
end
return 0
