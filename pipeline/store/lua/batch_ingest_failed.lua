-- batch_ingest_failed.lua: reading or storing a batch's lines raised an unexpected error
-- (pipeline/batch/service.py Batches.ingest): count the try; at the last one allowed, give
-- up. Giving up: a validating batch fails; a running one stops taking lines, counts the lines
-- never stored as failed and ends `failed` once its stored lines have their results (lib.lua
-- batch_settle, field gave_up); either way with the error in `errors`. A batch in any other
-- status is left alone (a cancel or a lapse came first).
-- KEYS[1] the batch hash, then the key families (lib.lua key_families).
-- ARGV[1] batch id, ARGV[2] the error (a JSON object: code, line, message, param), ARGV[3]
-- the tries a batch has (this one counted; '1': give up at once).
-- Returns {status afterwards, tries so far (0 when left alone)}.
local K, id, bk = key_families(), ARGV[1], KEYS[1]
local f = redis.call('HMGET', bk, 'status', 'unsubmitted')
local status = f[1]
if status ~= 'validating' and status ~= 'in_progress' then return {status or 'missing', 0} end
local tries = redis.call('HINCRBY', bk, 'ingest_tries', 1)
if tries < tonumber(ARGV[3]) then return {status, tries} end
local now = server_now()
local errors = '[' .. ARGV[2] .. ']'
if status == 'validating' then
  redis.call('HSET', bk, 'errors', errors, 'stopped', '1')
  batch_close(K, id, 'failed', now)
else
  redis.call('HSET', bk, 'errors', errors, 'stopped', '1', 'unsubmitted', 0, 'gave_up', '1')
  redis.call('HINCRBY', bk, 'failed', tonumber(f[2]) or 0)
  batch_settle(K, id, now)
end
return {redis.call('HGET', bk, 'status'), tries}
