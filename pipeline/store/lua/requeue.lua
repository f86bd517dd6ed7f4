-- requeue.lua: an attempt gives its request back to the queue (retry after backoff, gate
-- refusal, shutdown). Fenced by the attempt token. The ordering key is kept.
-- KEYS[1] request hash; KEYS[2] (optional) the Celery result key of the attempt's task.
-- ARGV[1] prefix, ARGV[2] token, ARGV[3] delay (s from now by the server's clock; <= 0 means
-- straight back to pending), ARGV[4] 1 if this attempt sent an HTTP request,
-- ARGV[5] last HTTP response as JSON {status_code, payload}, or '' to keep the previous one,
-- ARGV[6] last transport error text, or '' to keep the previous one, ARGV[7] '1' when the
-- attempt handed its slot over (no release to publish on the freed channel), else '0',
-- ARGV[8] the attempt's journal for the request's decision log, its last line this requeue
-- (lib.lua log_journal; '' for none).
-- With KEYS[2]: ARGV[9] the task's Celery result meta (a RETRY, never replacing a final
-- state), ARGV[10] its TTL (s).
-- Returns the due time (server clock, as text), or 0 when fenced off.
local f = redis.call('HMGET', KEYS[1], 'state', 'token', 'id')
if f[1] == 'done' or not f[1] or f[2] ~= ARGV[2] then return 0 end
if ARGV[4] == '1' then redis.call('HINCRBY', KEYS[1], 'attempts', 1) end
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'last_response', ARGV[5]) end
if ARGV[6] and ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'last_error', ARGV[6]) end
local now = server_now()
local due = now + math.max(0, tonumber(ARGV[3]))
log_journal(f[3], now, ARGV[8])
enqueue(ARGV[1], f[3], now, due, ARGV[7] == '1')
if KEYS[2] then celery_meta(KEYS[2], ARGV[9], ARGV[10], '0') end
return fmt_time(due)
