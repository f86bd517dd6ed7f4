-- batch_start.lua: a batch's input was validated: it fails, or it starts (in_progress).
-- KEYS[1] the batch hash, then the key families (lib.lua key_families).
-- ARGV[1] batch id, ARGV[2] 'ok' or 'failed', ARGV[3] total (lines that are
-- requests, valid or not), ARGV[4] invalid lines (counted failed at once: they go to the error
-- file), ARGV[5] the input's last line number, ARGV[6] errors (JSON list of {code, line,
-- message, param}) when failed, ARGV[7] the model named by the lines ('' when none).
-- (The invalid lines themselves are pushed onto the batch's invalid list by the caller.)
-- Only a validating batch moves (a batch cancelled while validating stays cancelled).
-- Returns the batch's status afterwards.
local K, id, bk = key_families(), ARGV[1], KEYS[1]
local status = redis.call('HGET', bk, 'status')
if status ~= 'validating' then return status or 'missing' end
local now = server_now()
if ARGV[2] == 'failed' then
  redis.call('HSET', bk, 'errors', ARGV[6], 'stopped', '1')
  batch_close(K, id, 'failed', now)
  return 'failed'
end
local total, invalid = tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('HSET', bk, 'status', 'in_progress', 'in_progress_at', fmt_time(now), 'total', total,
  'failed', invalid, 'unsubmitted', total - invalid, 'lines', ARGV[5], 'model', ARGV[7])
batch_settle(K, id, now)
return redis.call('HGET', bk, 'status')
