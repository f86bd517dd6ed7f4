-- gate_rate_acquire.lua: one admission of a sliding-window rate limit (redis-quota,
-- rate-limit mode). Check and record are one atomic step. Admissions are never refunded.
-- The window is judged by the Redis server's clock (TIME).
-- KEYS[1] admission log: sorted set, member = holder "<request id>:<token>" (unique per
--         attempt, so two admissions in the same instant never collide), score = admission
--         time (Unix s). One log per (quota key, window): a short window never purges a
--         longer window's entries.
-- ARGV[1] window (s), ARGV[2] limit, ARGV[3] holder.
-- An entry counts while now - score < window. A holder already in the window is admitted
-- again without a second entry (a parked attempt that asks again consumes nothing more).
-- Returns 1 when admitted and recorded, 2 when the holder was already admitted, 0 when the
-- window is full.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local window = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%.6f', now - window))
if redis.call('ZSCORE', KEYS[1], ARGV[3]) then
  return 2
end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('ZADD', KEYS[1], string.format('%.6f', now), ARGV[3])
redis.call('PEXPIRE', KEYS[1], math.ceil(window * 1000) + 1000)
return 1
