-- pending_oldest.lua: the earliest submission among the first members of a pending set (for
-- `pipeline status`: the age of a queue's oldest waiting request). Members are "<seq>|<id>"
-- with a zero-padded submission sequence, so the smallest string is the earliest submission.
-- KEYS[1] the pending set.
-- ARGV[1] how many members (in queue order) to examine.
-- Returns the smallest member, or false when the set is empty.
local best = false
for _, m in ipairs(redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)) do
  if not best or m < best then best = m end
end
return best
