-- finish.lua: the terminal result of an attempt. Fenced by the attempt token, so a late
-- result of a reaped attempt cannot overwrite a newer attempt's.
-- KEYS[1] request hash; KEYS[2] (optional) the Celery result key of the attempt's task.
-- ARGV[1] prefix, ARGV[2] token, ARGV[3] result TTL (s),
-- ARGV[4] 1 if this attempt sent an HTTP request, ARGV[5] status code or '',
-- ARGV[6] payload, ARGV[7] error code or '', ARGV[8] error message, ARGV[9] '1' when the
-- attempt handed its slot over (no release to publish on the freed channel), else '0',
-- ARGV[10] the attempt's journal for the request's decision log (lib.lua log_journal; ''
-- for none; terminal() adds the "done" entry).
-- With KEYS[2] (the task's Celery result, written in the same step instead of a second round
-- trip by the result backend): ARGV[11] meta head, ARGV[12] meta tail, ARGV[13] its TTL (s),
-- ARGV[14] '1' to put the result JSON between head and tail (a SUCCESS meta).
-- Returns the result JSON, or false when fenced off.
local f = redis.call('HMGET', KEYS[1], 'state', 'token', 'id')
if f[1] == 'done' or not f[1] or f[2] ~= ARGV[2] then return false end
if ARGV[4] == '1' then redis.call('HINCRBY', KEYS[1], 'attempts', 1) end
local now = server_now()
log_journal(f[3], now, ARGV[10])
local json = terminal(ARGV[1], f[3], now, ARGV[3], ARGV[5], ARGV[6], ARGV[7], ARGV[8],
  ARGV[9] == '1')
if KEYS[2] then
  local body = ''
  if ARGV[14] == '1' then body = json end
  celery_meta(KEYS[2], ARGV[11] .. body .. ARGV[12], ARGV[13], '1')
end
return json
