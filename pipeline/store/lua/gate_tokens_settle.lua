-- gate_tokens_settle.lua: settle one holder's charge in a token budget (redis-quota, tokens
-- mode) to what the request consumed: the response's usage, or 0 when nothing was served (a
-- refund). Idempotent (it sets, never adds). A charge no longer in the window (expired) stays
-- gone: it no longer counts anyway.
-- KEYS[1] charge log, KEYS[2] charges (see gate_tokens_acquire.lua).
-- ARGV[1] holder, ARGV[2] tokens (an integer >= 0; 0 removes the charge).
-- Returns the charge it replaced (tokens), or -1 when the holder had no charge in the window.
local old = redis.call('HGET', KEYS[2], ARGV[1])
if not old or not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  return -1
end
local n = tonumber(ARGV[2])
if n <= 0 then
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
else
  redis.call('HSET', KEYS[2], ARGV[1], string.format('%d', n))
end
if string.sub(old, 1, 1) == 'e' then old = string.sub(old, 2) end
return tonumber(old) or 0
