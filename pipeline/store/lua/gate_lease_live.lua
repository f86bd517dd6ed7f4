-- gate_lease_live.lua: the unexpired leases of one slot pool, by the Redis server's clock.
-- KEYS[1] holders sorted set (member = holder, score = lease expiry, Unix s).
-- KEYS[2] info hash (holder -> JSON description).
-- ARGV[1] 'count' or 'list'.
-- Returns {now, count} for 'count'; for 'list' {now, holder, expiry, info, holder, ...}
-- (earliest expiry first; info '' when missing). Times as text (Unix s).
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local from = '(' .. string.format('%.6f', now)
if ARGV[1] == 'count' then
  return {string.format('%.6f', now), redis.call('ZCOUNT', KEYS[1], from, '+inf')}
end
local out = {string.format('%.6f', now)}
local rows = redis.call('ZRANGEBYSCORE', KEYS[1], from, '+inf', 'WITHSCORES')
for i = 1, #rows, 2 do
  out[#out + 1] = rows[i]
  out[#out + 1] = rows[i + 1]
  out[#out + 1] = redis.call('HGET', KEYS[2], rows[i]) or ''
end
return out
