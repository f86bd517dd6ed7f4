-- gate_tokens_settle.lua: settle one holder's charge in a token budget (redis-quota, tokens
-- mode) when its attempt ends: to what the request consumed (the response's usage), to 0 when
-- nothing was served (a refund: the charge is removed), or to its estimate (ARGV[2] '': the
-- request went out and no answer said what was served). A charge that stays is re-stamped
-- with the settlement time (the Redis server's clock): it then counts for a whole window
-- after the answer came back, so every token the server received before that answer is inside
-- the windows this charge is counted in, however late the request reached the server after
-- its admission. A charge no longer in the window (the request was in flight longer than the
-- window) stays gone. Idempotent in amount (it sets, never adds).
-- KEYS[1] charge log, KEYS[2] charges (see gate_tokens_acquire.lua).
-- ARGV[1] holder, ARGV[2] tokens (an integer >= 0), or '' to keep the estimate,
-- ARGV[3] window (s).
-- Returns the charge it replaced (tokens), or -1 when the holder had no charge in the window.
local old = redis.call('HGET', KEYS[2], ARGV[1])
if not old or not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  return -1
end
local kind = string.sub(old, 1, 1)
if kind == 'e' or kind == 'd' then old = string.sub(old, 2) end
old = tonumber(old) or 0
local n = old
if ARGV[2] ~= '' then n = tonumber(ARGV[2]) end
if n <= 0 then
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
  return old
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZADD', KEYS[1], string.format('%.6f', now), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], string.format('%d', n))
local ttl = math.ceil(tonumber(ARGV[3]) * 1000) + 1000
for i = 1, 2 do
  if redis.call('PTTL', KEYS[i]) < ttl then redis.call('PEXPIRE', KEYS[i], ttl) end
end
return old
