-- batch_cancel.lua: cancel a batch. A validating batch is cancelled at once (nothing was
-- submitted). A running one becomes `cancelling`: no line is submitted any more (submit.lua
-- checks `stopped`), the lines not yet submitted are counted failed now, and the caller then
-- cancels the submitted lines that have not started (batch_cancel_lines.lua); attempts in
-- flight finish (running 'finish', OpenAI's semantics) or are aborted (running 'abort'), and
-- the last result ends the batch `cancelled` (lib.lua batch_settle). A cancelling batch
-- cancelled again with 'abort' aborts its running lines too (its lines are cancelled again).
-- KEYS[1] the batch hash, then the key families (lib.lua key_families).
-- ARGV[1] batch id, ARGV[2] 'finish' or 'abort', ARGV[3] who cancelled ('' unknown).
-- Returns {status afterwards, lines submitted (the ids to cancel), '1' if the caller should
-- cancel the submitted lines (cancelling, and no canceller finished that yet) else '0'}.
local K, id, bk = key_families(), ARGV[1], KEYS[1]
local f = redis.call('HMGET', bk, 'status', 'submitted', 'unsubmitted', 'cancel_done',
  'cancel_running')
local status = f[1]
if not status then return {'missing', 0, '0'} end
local now = server_now()
if status == 'validating' or status == 'in_progress' then
  redis.call('HSET', bk, 'cancel_running', ARGV[2], 'cancelled_by', ARGV[3])
elseif status == 'cancelling' and ARGV[2] == 'abort' and f[5] ~= 'abort' then
  redis.call('HSET', bk, 'cancel_running', 'abort', 'cancel_done', '0')
  f[4] = '0'
end
if status == 'validating' then
  redis.call('HSET', bk, 'cancelling_at', fmt_time(now), 'stopped', '1')
  batch_close(K, id, 'cancelled', now)
  return {'cancelled', 0, '0'}
end
if status == 'in_progress' then
  redis.call('HSET', bk, 'status', 'cancelling', 'cancelling_at', fmt_time(now), 'stopped', '1',
    'unsubmitted', 0)
  redis.call('HINCRBY', bk, 'failed', tonumber(f[3]) or 0)
  batch_settle(K, id, now)
  status = redis.call('HGET', bk, 'status')
end
local todo = '0'
if status == 'cancelling' and f[4] ~= '1' then todo = '1' end
return {status, tonumber(f[2]) or 0, todo}
