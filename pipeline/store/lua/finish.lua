-- finish.lua: the terminal result of an attempt. Fenced by the attempt token, so a late
-- result of a reaped attempt cannot overwrite a newer attempt's.
-- KEYS[1] request hash; KEYS[2] (optional) the Celery result key of the attempt's task.
-- ARGV[1] prefix, ARGV[2] token, ARGV[3] result TTL (s),
-- ARGV[4] 1 if this attempt sent an HTTP request, ARGV[5] status code or '',
-- ARGV[6] payload, ARGV[7] error code or '', ARGV[8] error message, ARGV[9] '0' when the
-- attempt released its slot (published on the freed channel), '1' when it handed it over (no
-- release to publish), '2' when it handed it over and its worker still has attempts of the
-- queue parked (nor a doorbell to ring: see terminal() in lib.lua),
-- ARGV[10] the attempt's journal for the request's decision log (lib.lua log_journal; ''
-- for none; terminal() adds the "done" entry).
-- With KEYS[2] (the task's Celery result, written in the same step instead of a second round
-- trip by the result backend): ARGV[11] meta head, ARGV[12] meta tail, ARGV[13] its TTL (s),
-- ARGV[14] '1' to put the result JSON between head and tail (a SUCCESS meta).
-- Returns the result JSON, or false when fenced off.
local f = redis.call('HMGET', KEYS[1], unpack(TERMINAL_FIELDS))
local state = f[13]
if state == 'done' or not state or f[14] ~= ARGV[2] then return false end
local now = server_now()
log_journal(f[15], now, ARGV[10])
local json = terminal(ARGV[1], f[15], now, ARGV[3], ARGV[5], ARGV[6], ARGV[7], ARGV[8],
  ARGV[9] ~= '0', f, ARGV[4] == '1', ARGV[9] == '2')
if KEYS[2] then
  local body = ''
  if ARGV[14] == '1' then body = json end
  celery_meta(KEYS[2], ARGV[11] .. body .. ARGV[12], ARGV[13], '1')
end
return json
