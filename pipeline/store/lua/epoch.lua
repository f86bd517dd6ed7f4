-- epoch.lua: the store epoch, the alarm for a Redis that lost its state (restarted without
-- persistence, flushed): a random id written at first use, remembered by every node and
-- client, which each compare it with the one they know (docs/production.md, "A wiped Redis").
-- KEYS[1] the epoch hash (keys.py `epoch`): id, since, and once a loss was noticed
--   lost_at, lost_by, previous.
-- ARGV[1] the id the caller knows ('' for none yet), ARGV[2] a fresh random id (written when
--   there is none), ARGV[3] who asks (a node or client name, for lost_by).
-- When the hash is gone it is written anew with ARGV[2] (the system keeps working for new
-- submissions); when the caller knew another id, the loss is recorded (once per epoch).
-- Returns {id, lost_at or '', lost_by or ''}.
local f = redis.call('HMGET', KEYS[1], 'id', 'lost_at', 'lost_by')
local id, lost_at, lost_by = f[1], f[2], f[3]
local now = server_now()
if not id then
  id = ARGV[2]
  redis.call('HSET', KEYS[1], 'id', id, 'since', fmt_time(now))
end
if ARGV[1] ~= '' and ARGV[1] ~= id and not lost_at then
  lost_at, lost_by = fmt_time(now), ARGV[3]
  redis.call('HSET', KEYS[1], 'lost_at', lost_at, 'lost_by', lost_by, 'previous', ARGV[1])
end
return {id, lost_at or '', lost_by or ''}
