-- batch_lapse.lua: a batch whose completion window has passed while nobody holds its lease
-- (whoever validated or enqueued it stopped before the end): a validating batch fails; a
-- running one stops taking lines, counts the lines never submitted as failed, and ends
-- `expired` once its submitted lines have their results (lib.lua batch_settle).
-- KEYS[1] the batch hash, KEYS[2] its lease, then the key families (lib.lua key_families).
-- ARGV[1] batch id.
-- Returns the status afterwards.
local K, id, bk = key_families(), ARGV[1], KEYS[1]
local f = redis.call('HMGET', bk, 'status', 'expires_at', 'unsubmitted')
if not f[1] then return 'missing' end
local now = server_now()
if now < (tonumber(f[2]) or now + 1) or redis.call('EXISTS', KEYS[2]) == 1 then
  return f[1]
end
if f[1] == 'validating' then
  redis.call('HSET', bk, 'stopped', '1', 'errors', cjson.encode({{code = 'batch_expired',
    message = 'the input was not validated within the completion window'}}))
  batch_close(K, id, 'failed', now)
elseif f[1] == 'in_progress' and (tonumber(f[3]) or 0) > 0 then
  redis.call('HSET', bk, 'stopped', '1', 'unsubmitted', 0)
  redis.call('HINCRBY', bk, 'failed', tonumber(f[3]))
  batch_settle(K, id, now)
end
return redis.call('HGET', bk, 'status')
