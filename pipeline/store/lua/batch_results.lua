-- batch_results.lua: the results of a range of a batch's lines, in one call (reading a
-- 100,000-line batch's output is 100 of these instead of 100,000 HMGETs).
-- KEYS: none passed; <prefix>req:<batch id>-<line> derived from the prefix. Read only.
-- ARGV[1] prefix, ARGV[2] batch id, ARGV[3] first line, ARGV[4] last line.
-- Returns a flat list: per line its result JSON and custom_id (false where absent).
local prefix, batch = ARGV[1], ARGV[2]
local out = {}
for n = tonumber(ARGV[3]), tonumber(ARGV[4]) do
  local f = redis.call('HMGET', prefix .. 'req:' .. batch .. '-' .. n, 'result', 'custom_id')
  out[#out + 1] = f[1]
  out[#out + 1] = f[2]
end
return out
