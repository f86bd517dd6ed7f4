-- batch_finalized.lua: a finalizing batch's output and error files are written: close it
-- with the final status its last result decided (completed, expired or cancelled).
-- KEYS[1] the batch hash, then the key families (lib.lua key_families).
-- ARGV[1] batch id, ARGV[2] output file id ('' for none), ARGV[3] error
-- file id ('' for none).
-- Returns the status afterwards (unchanged unless it was finalizing).
local K, id, bk = key_families(), ARGV[1], KEYS[1]
local f = redis.call('HMGET', bk, 'status', 'final_status')
if f[1] ~= 'finalizing' then return f[1] or 'missing' end
if ARGV[2] ~= '' then redis.call('HSET', bk, 'output_file_id', ARGV[2]) end
if ARGV[3] ~= '' then redis.call('HSET', bk, 'error_file_id', ARGV[3]) end
batch_close(K, id, f[2] or 'completed', server_now())
return f[2] or 'completed'
