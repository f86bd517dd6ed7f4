-- batch_cancel_lines.lua: cancel requests of a cancelling batch that have not started an
-- attempt (queued, waiting out a retry, or dispatched but not started: such an attempt holds
-- no gate reservation, and its start is fenced off). A running attempt is marked: one still
-- parked at its worker for a gate slot ends CANCELLED unsent at once (the notice published
-- here wakes it), one sent finishes.
-- KEYS: the key families (lib.lua key_families; each request's keys follow from its id).
-- ARGV[1] result TTL (s), ARGV[3..] request ids.
-- Returns how many this call cancelled.
local K, ttl = key_families(), ARGV[1]
local now = server_now()
local n = 0
local running = {}
for i = 2, #ARGV do
  local id = ARGV[i]
  local state = redis.call('HGET', K.req .. id, 'state')
  if state == 'queued' or state == 'retry_wait' or state == 'dispatched' then
    terminal(K, id, now, ttl, '', '{"error": "batch cancelled"}', 'CANCELLED',
      'batch cancelled')
    n = n + 1
  elseif state == 'running' then  -- parked for a gate slot, or sent: see cancel.lua
    redis.call('HSET', K.req .. id, 'cancel', 'batch cancelled', 'cancel_ttl', ttl)
    running[#running + 1] = id
  end
end
if #running > 0 then  -- wake their attempts if parked (pipeline/worker/bell.py)
  publish_freed(K, '!cancel\n' .. table.concat(running, '\n'))
end
return n
