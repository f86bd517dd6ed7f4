-- sched_recheck.lua: make the tenants of an indexed queue that are held back by a quota key
-- ready again (at most 1000 per call); the next dispatch tick holds back those still at their
-- limit. The dispatcher runs it with its reaper: a safety net for a wake-up that never came
-- (a lease freed by a reaper, a limit raised by a restart). See sched.lua.
-- KEYS: none (derived from ARGV[1] and ARGV[2]).
-- ARGV[1] prefix, ARGV[2] queue name.
-- Returns the number of tenants made ready.
local prefix, queue = ARGV[1], ARGV[2]
local c = sched_conf(prefix, queue)
if not c then return 0 end
local n = 0
for _, tk in ipairs(redis.call('HKEYS', c.base .. 'blocked')) do
  if n >= 1000 then break end
  sched_unblock(prefix, queue, tk)
  n = n + 1
end
return n
