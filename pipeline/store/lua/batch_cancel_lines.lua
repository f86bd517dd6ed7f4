-- batch_cancel_lines.lua: cancel requests of a cancelling batch that have not started an
-- attempt (queued, waiting out a retry, or dispatched but not started: such an attempt holds
-- no gate reservation, and its start is fenced off). A running one, by the batch's
-- `cancel_running` (batch_cancel.lua):
--  - 'finish': it is marked: one still parked at its worker for a gate slot ends CANCELLED
--    unsent at once (the notice published here wakes it), one sent finishes;
--  - 'abort': it ends CANCELLED now, its attempt fenced off, and an abort notice tells the
--    worker running it to close the call's connection (as cancel.lua).
-- Each cancelled line's decision log gets a `cancelled` entry naming who asked.
-- Only the batch's own requests: a line whose id a live request of other content held was
-- never stored (an error line, see submit.lua), and that request is left alone.
-- KEYS: the key families (lib.lua key_families; each request's keys follow from its id).
-- ARGV[1] result TTL (s), ARGV[2] 'finish' or 'abort', ARGV[3] who cancelled ('' unknown),
-- ARGV[4] the batch id, ARGV[5..] request ids.
-- Returns how many this call ended.
local K, ttl, abort, batch = key_families(), ARGV[1], ARGV[2] == 'abort', ARGV[4]
local now = server_now()
local by = ''
if ARGV[3] ~= '' then by = ',"by":' .. json_str(ARGV[3]) end
local n = 0
local marked, aborted = {}, {}
for i = 5, #ARGV do
  local id = ARGV[i]
  local rk = K.req .. id
  local f = redis.call('HMGET', rk, 'state', 'log', 'batch')
  local state = f[1]
  if state and state ~= 'done' and f[3] == batch then
    local entry = log_entry(now, 'cancelled',
      '"was":' .. json_str(state) .. ',"running":' .. json_str(ARGV[2]) .. by)
    if state == 'running' and not abort then  -- parked for a gate slot, or sent: see above
      redis.call('HSET', rk, 'cancel', 'batch cancelled', 'cancel_ttl', ttl,
        'log', log_with(f[2], id, entry))
      marked[#marked + 1] = id
    else
      local message = 'batch cancelled'
      if state == 'running' then
        message = 'batch cancelled (running attempt aborted)'
        aborted[#aborted + 1] = id
      end
      log_note(id, entry)
      terminal(K, id, now, ttl, '', '{"error": "batch cancelled"}', 'CANCELLED', message)
      n = n + 1
    end
  end
end
if #marked > 0 then  -- wake their attempts if parked (pipeline/worker/bell.py)
  publish_freed(K, '!cancel\n' .. table.concat(marked, '\n'))
end
if #aborted > 0 then  -- close their calls (pipeline/worker/bell.py)
  publish_abort(K, aborted)
end
return n
