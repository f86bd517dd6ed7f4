-- batch_start.lua: a batch's input was validated: it fails, or it starts (in_progress).
-- KEYS: none passed; <prefix>batch:<id> and its :invalid list, derived from the prefix.
-- ARGV[1] prefix, ARGV[2] batch id, ARGV[3] 'ok' or 'failed', ARGV[4] total (lines that are
-- requests, valid or not), ARGV[5] invalid lines (counted failed at once: they go to the error
-- file), ARGV[6] the input's last line number, ARGV[7] errors (JSON list of {code, line,
-- message, param}) when failed, ARGV[8] the model named by the lines ('' when none).
-- (The invalid lines themselves are pushed onto <prefix>batch:<id>:invalid by the caller.)
-- Only a validating batch moves (a batch cancelled while validating stays cancelled).
-- Returns the batch's status afterwards.
local prefix, id = ARGV[1], ARGV[2]
local bk = prefix .. 'batch:' .. id
local status = redis.call('HGET', bk, 'status')
if status ~= 'validating' then return status or 'missing' end
local now = server_now()
if ARGV[3] == 'failed' then
  redis.call('HSET', bk, 'errors', ARGV[7], 'stopped', '1')
  batch_close(prefix, id, 'failed', now)
  return 'failed'
end
local total, invalid = tonumber(ARGV[4]), tonumber(ARGV[5])
redis.call('HSET', bk, 'status', 'in_progress', 'in_progress_at', fmt_time(now), 'total', total,
  'failed', invalid, 'unsubmitted', total - invalid, 'lines', ARGV[6], 'model', ARGV[8])
batch_settle(prefix, id, now)
return redis.call('HGET', bk, 'status')
