-- requeue.lua: an attempt gives its request back to the queue (retry after backoff, gate
-- refusal, shutdown). Fenced by the attempt token. The ordering key is kept.
-- KEYS[1] request hash; KEYS[2] (optional) the Celery result key of the attempt's task; then
-- the key families (lib.lua key_families).
-- ARGV[1] token, ARGV[2] delay (s from now by the server's clock; <= 0 means
-- straight back to pending), ARGV[3] 1 if this attempt sent an HTTP request,
-- ARGV[4] last HTTP response as JSON {status_code, payload}, or '' to keep the previous one,
-- ARGV[5] last transport error text, or '' to keep the previous one, ARGV[6] '1' when the
-- attempt handed its slot over (no release to publish on the freed channel), else '0',
-- ARGV[7] the attempt's journal for the request's decision log, its last line this requeue
-- (lib.lua log_journal; '' for none).
-- With the Celery result key: ARGV[8] the task's Celery result meta (a RETRY, never replacing
-- a final state), ARGV[9] its TTL (s).
-- Returns the due time (server clock, as text), or 0 when fenced off.
local K = key_families()
local celery = #KEYS > KEY_FAMILIES + 1 and KEYS[2]
local f = redis.call('HMGET', KEYS[1], 'state', 'token', 'id')
if f[1] == 'done' or not f[1] or f[2] ~= ARGV[1] then return 0 end
if ARGV[3] == '1' then redis.call('HINCRBY', KEYS[1], 'attempts', 1) end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'last_response', ARGV[4]) end
if ARGV[5] and ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'last_error', ARGV[5]) end
local now = server_now()
local due = now + math.max(0, tonumber(ARGV[2]))
log_journal(f[3], now, ARGV[7])
enqueue(K, f[3], now, due, ARGV[6] == '1')
if celery then celery_meta(celery, ARGV[8], ARGV[9], '0') end
return fmt_time(due)
