-- finish.lua: the terminal result of an attempt. Fenced by the attempt token, so a late
-- result of a reaped attempt cannot overwrite a newer attempt's.
-- KEYS[1] request hash; KEYS[2] (optional) the key the attempt stored a large body in
-- (Keys.body), given with ARGV[10] '1'; KEYS[3] (optional) the Celery result key of the
-- attempt's task (KEYS[2] without a body key); then the key families (lib.lua key_families).
-- ARGV[1] token, ARGV[2] result TTL (s),
-- ARGV[3] 1 if this attempt sent an HTTP request, ARGV[4] status code or '',
-- ARGV[5] payload ('' when in the body key), ARGV[6] error code or '', ARGV[7] error message,
-- ARGV[8] '0' when the attempt released its slot (published on the freed channel), '1' when it
-- handed it over (no release to publish), '2' when it handed it over and its worker still has
-- attempts of the queue parked (nor a doorbell to ring: see terminal() in lib.lua),
-- ARGV[9] the attempt's journal for the request's decision log (lib.lua log_journal; ''
-- for none; terminal() adds the "done" entry), ARGV[10] '1' when KEYS[2] holds the body.
-- With the Celery result key (the task's Celery result, written in the same step instead of a
-- second round trip by the result backend): ARGV[11] meta head, ARGV[12] meta tail, ARGV[13]
-- its TTL (s), ARGV[14] '1' to put the result JSON between head and tail (a SUCCESS meta).
-- The body never passes through the script: it costs the same few µs at any size.
-- Returns the result JSON, or false when fenced off (a reaped attempt's, or one whose request
-- was cancelled with running 'abort': cancel.lua; its body key is deleted). A fenced-off
-- attempt that released its slot still publishes the release, so attempts parked on other
-- nodes take the slot at once.
local K = key_families()
local body = ARGV[10] == '1' and KEYS[2]
local at = body and 3 or 2
local celery = #KEYS > KEY_FAMILIES + at - 1 and KEYS[at]
local f = redis.call('HMGET', KEYS[1], unpack(TERMINAL_FIELDS))
local state = f[13]
if state == 'done' or not state or f[14] ~= ARGV[1] then
  if body then redis.call('DEL', body) end
  if ARGV[8] == '0' and f[1] then freed(K, f[1]) end
  return false
end
local now = server_now()
log_journal(f[15], now, ARGV[9])
local json = terminal(K, f[15], now, ARGV[2], ARGV[4], ARGV[5], ARGV[6], ARGV[7],
  ARGV[8] ~= '0', f, ARGV[3] == '1', ARGV[8] == '2', body)
if celery then
  local embedded = ''
  if ARGV[14] == '1' then embedded = json end
  celery_meta(celery, ARGV[11] .. embedded .. ARGV[12], ARGV[13], '1')
end
return json
