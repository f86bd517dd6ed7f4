-- sched_recheck.lua: make the tenants of an indexed queue that are held back by a quota key
-- ready again (at most 1000 per call); the next dispatch tick holds back those still at their
-- limit. The dispatcher runs it with its reaper: a safety net for a wake-up that never came
-- (a lease freed by a reaper, a limit raised by a restart). See sched.lua.
-- KEYS: the key families (lib.lua key_families; the queue's keys follow from its name).
-- ARGV[1] queue name.
-- Returns the number of tenants made ready.
local K, queue = key_families(), ARGV[1]
local c = sched_conf(K, queue)
if not c then return 0 end
local n = 0
for _, tk in ipairs(redis.call('HKEYS', c.base .. TAIL_BLOCKED)) do
  if n >= 1000 then break end
  sched_unblock(K, queue, tk)
  n = n + 1
end
return n
