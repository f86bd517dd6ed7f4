-- cancel.lua: cancel a request. One that has not started an attempt (queued, waiting out a
-- retry, or dispatched but not yet started) ends CANCELLED at once. A running one:
--  - running 'finish' (the default): the attempt is marked (fields cancel and cancel_ttl): if
--    it is still parked at its worker for a gate slot it ends CANCELLED unsent at once (the
--    notice published here wakes it; cancel_asked.lua); if it was sent it finishes, and gets
--    no retry;
--  - running 'abort': the request ends CANCELLED now, its attempt fenced off (its late
--    response is discarded), and an abort notice tells the worker running it to close the
--    call's connection (pipeline/worker/bell.py); the attempt releases its gate reservation
--    as it ends, or its lease lapses and the reaper frees it.
-- Either way the decision log gets a `cancelled` entry naming who asked (`by`) and when.
-- KEYS[1] request hash, then the key families (lib.lua key_families).
-- ARGV[1] result TTL (s), ARGV[2] 'finish' or 'abort', ARGV[3] who cancelled ('' unknown).
-- Returns 1 when cancelled (an aborted running attempt included), 0 when not (done already,
-- or running with 'finish'), -1 for an unknown request (no record).
local K = key_families()
local f = redis.call('HMGET', KEYS[1], 'state', 'id', 'log', 'last_response', 'last_error')
local state, id = f[1], f[2]
if not state then return -1 end
if state == 'done' then return 0 end
local now = server_now()
local note = '"was":' .. json_str(state) .. ',"running":' .. json_str(ARGV[2])
if ARGV[3] ~= '' then note = note .. ',"by":' .. json_str(ARGV[3]) end
local entry = log_entry(now, 'cancelled', note)
if state == 'running' and ARGV[2] ~= 'abort' then  -- wake its attempt if parked
  redis.call('HSET', KEYS[1], 'cancel', 'cancelled', 'cancel_ttl', ARGV[1], 'log',
    log_with(f[3], id, entry))
  publish_freed(K, '!cancel\n' .. id)
  return 0
end
local message = 'cancelled'
if state == 'running' then  -- aborted: say what the earlier attempts got
  message = 'cancelled (running attempt aborted)'
  local last = ''
  if f[4] and f[4] ~= '' then
    local ok, r = pcall(cjson.decode, f[4])
    if ok and type(r) == 'table' and r.status_code then last = 'HTTP ' .. tostring(r.status_code) end
  elseif f[5] and f[5] ~= '' then
    last = f[5]
  end
  if last ~= '' then message = message .. '; last attempt: ' .. last end
end
log_note(id, entry)
terminal(K, id, now, ARGV[1], '', '{"error": "cancelled"}', 'CANCELLED', message)
if state == 'running' then publish_abort(K, {id}) end
return 1
