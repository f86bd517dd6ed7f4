-- batch_finalized.lua: a finalizing batch's output and error files are written: close it
-- with the final status its last result decided (completed, expired or cancelled).
-- KEYS: none passed; <prefix>batch:<id> derived from the prefix.
-- ARGV[1] prefix, ARGV[2] batch id, ARGV[3] output file id ('' for none), ARGV[4] error
-- file id ('' for none).
-- Returns the status afterwards (unchanged unless it was finalizing).
local prefix, id = ARGV[1], ARGV[2]
local bk = prefix .. 'batch:' .. id
local f = redis.call('HMGET', bk, 'status', 'final_status')
if f[1] ~= 'finalizing' then return f[1] or 'missing' end
if ARGV[3] ~= '' then redis.call('HSET', bk, 'output_file_id', ARGV[3]) end
if ARGV[4] ~= '' then redis.call('HSET', bk, 'error_file_id', ARGV[4]) end
batch_close(prefix, id, f[2] or 'completed', server_now())
return f[2] or 'completed'
