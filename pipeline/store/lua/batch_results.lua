-- batch_results.lua: the results of a range of a batch's lines, in one call (reading a
-- 100,000-line batch's output is 100 of these instead of 100,000 HMGETs).
-- KEYS[1] the root of request hashes (Keys.request_prefix; a line's request id is
-- <batch id>-<line>). Read only.
-- ARGV[1] batch id, ARGV[2] first line, ARGV[3] last line.
-- Returns a flat list: per line its result JSON and custom_id (false where absent).
local batch = ARGV[1]
local out = {}
for n = tonumber(ARGV[2]), tonumber(ARGV[3]) do
  local f = redis.call('HMGET', KEYS[1] .. batch .. '-' .. n, 'result', 'custom_id')
  out[#out + 1] = f[1]
  out[#out + 1] = f[2]
end
return out
