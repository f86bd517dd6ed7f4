-- gate_tokens_acquire.lua: one admission of a token budget (redis-quota, tokens mode): at most
-- ARGV[2] tokens charged per sliding window of ARGV[1] s per key. Check and charge are one
-- atomic step. The window is judged by the Redis server's clock (TIME), never a caller's.
-- KEYS[1] charge log: sorted set, member = holder "<request id>:<token>", score = admission
--         time (Unix s). One per (quota key, window).
-- KEYS[2] charges: hash, holder -> "e<n>" (the admission's estimate, not settled yet) or "<n>"
--         (settled by the response's usage; see gate_tokens_settle.lua). Same members as
--         KEYS[1].
-- ARGV[1] window (s), ARGV[2] limit (tokens), ARGV[3] holder, ARGV[4] estimate (tokens).
-- A charge counts while now - score < window; older ones are purged here. A holder already
-- charged in the window is admitted again without a second charge (it asks again).
-- Returns {code, delay_ms, open}:
--   {1, 0, 0}  admitted, the estimate charged;
--   {2, 0, 0}  the holder was already charged in this window;
--   {3, 0, 0}  the estimate alone is more than the limit: it can never fit (nothing charged);
--   {0, delay_ms, open} refused: the window holds too much. delay_ms: how long until enough
--              of the charges now in the window have expired for the estimate to fit (if
--              nothing else is charged meanwhile); open: 1 when the charges still to be
--              settled (estimates of requests in flight) are enough that a settlement could
--              make room sooner, else 0.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local window, limit = tonumber(ARGV[1]), tonumber(ARGV[2])
local holder, estimate = ARGV[3], tonumber(ARGV[4])

local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('%.6f', now - window))
for _, h in ipairs(old) do
  redis.call('ZREM', KEYS[1], h)
  redis.call('HDEL', KEYS[2], h)
end
if redis.call('ZSCORE', KEYS[1], holder) then
  return {2, 0, 0}
end
if estimate > limit then
  return {3, 0, 0}
end

-- the window's charges, oldest first
local log = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local raw = redis.call('HGETALL', KEYS[2])
local charge = {}
for i = 1, #raw, 2 do charge[raw[i]] = raw[i + 1] end
local total, open = 0, 0
local amounts = {}
for i = 1, #log, 2 do
  local v = charge[log[i]] or '0'
  local n
  if string.sub(v, 1, 1) == 'e' then
    n = tonumber(string.sub(v, 2)) or 0
    open = open + n
  else
    n = tonumber(v) or 0
  end
  amounts[#amounts + 1] = n
  total = total + n
end

if total + estimate <= limit then
  redis.call('ZADD', KEYS[1], string.format('%.6f', now), holder)
  redis.call('HSET', KEYS[2], holder, 'e' .. string.format('%d', estimate))
  local ttl = math.ceil(window * 1000) + 1000
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('PEXPIRE', KEYS[2], ttl)
  return {1, 0, 0}
end

-- refused: the oldest charges expire first; find when enough of them have
local need, freed, delay = total + estimate - limit, 0, window
for i = 1, #amounts do
  freed = freed + amounts[i]
  if freed >= need then
    delay = tonumber(log[2 * i]) + window - now
    break
  end
end
local settle = 0
if total - open + estimate <= limit then settle = 1 end
return {0, math.max(1, math.ceil(delay * 1000)), settle}
