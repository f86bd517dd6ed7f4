-- requeue.lua: an attempt gives its request back to the queue (retry after backoff, gate
-- refusal, shutdown). Fenced by the attempt token. The ordering key is kept.
-- KEYS[1] request hash; KEYS[2] (optional) the Celery result key of the attempt's task.
-- ARGV[1] prefix, ARGV[2] token, ARGV[3] now (Unix s), ARGV[4] due (Unix s; <= now means
-- straight back to pending), ARGV[5] 1 if this attempt sent an HTTP request,
-- ARGV[6] last HTTP response as JSON {status_code, payload}, or '' to keep the previous one,
-- ARGV[7] last transport error text, or '' to keep the previous one, ARGV[8] '1' when the
-- attempt handed its slot over (no release to publish on the freed channel), else '0'.
-- With KEYS[2]: ARGV[9] the task's Celery result meta (a RETRY, never replacing a final
-- state), ARGV[10] its TTL (s).
-- Returns 1, or 0 when fenced off.
local f = redis.call('HMGET', KEYS[1], 'state', 'token', 'id')
if f[1] == 'done' or not f[1] or f[2] ~= ARGV[2] then return 0 end
if ARGV[5] == '1' then redis.call('HINCRBY', KEYS[1], 'attempts', 1) end
if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'last_response', ARGV[6]) end
if ARGV[7] and ARGV[7] ~= '' then redis.call('HSET', KEYS[1], 'last_error', ARGV[7]) end
enqueue(ARGV[1], f[3], ARGV[3], ARGV[4], ARGV[8] == '1')
if KEYS[2] then celery_meta(KEYS[2], ARGV[9], ARGV[10], '0') end
return 1
