-- gate_leased_rate.lua: one admission (or a look) of the redis-leased-rate gate: a pool-wide
-- admission rate that an external planner leases in a hash, enforced as one token bucket
-- shared by every node. The clock is the Redis server's (TIME), never a caller's.
-- KEYS[1] the planner's control hash: api_version, pool_id, max_admission_rps,
--         valid_until_unix_ms, decision_id (all required, non-empty).
-- KEYS[2] the bucket state hash: tokens, last_ms (created full on first use; PEXPIREd to the
--         lease's end + 1 s, at least 1 s).
-- ARGV[1] the api_version the gate accepts, ARGV[2] the gate's pool id,
-- ARGV[3] burst_seconds (> 0), ARGV[4] 'take' (admit one: consumes a token) or 'peek' (only
-- validate the lease; the bucket is not touched).
-- Returns {verdict, rate, valid_until_ms, decision_id, reason}: verdict 1 = admitted (peek:
-- the lease is valid and the rate > 0), 0 = no token left, -1 = paused (rate 0), -2 = no
-- valid lease (missing, expired, mismatched, malformed: reason says which). rate and
-- valid_until_ms are strings ('' when the lease is invalid). A malformed lease never creates
-- state.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function invalid(reason)
  return {-2, '', '', '', reason}
end

-- a plain decimal number ("4.5", "0", "1e3"): no hex, no inf/nan, no spaces
local function decimal(s)
  if type(s) ~= 'string' then return nil end
  if not (string.match(s, '^%d+%.?%d*$') or string.match(s, '^%d*%.%d+$')
      or string.match(s, '^%d+%.?%d*[eE][+-]?%d+$') or string.match(s, '^%d*%.%d+[eE][+-]?%d+$')) then
    return nil
  end
  local n = tonumber(s)
  if n == nil or n ~= n or n == math.huge then return nil end
  return n
end

local f = redis.call('HMGET', KEYS[1], 'api_version', 'pool_id', 'max_admission_rps',
  'valid_until_unix_ms', 'decision_id')
if not f[1] and not f[2] and not f[3] and not f[4] and not f[5] then
  return invalid('no lease at ' .. KEYS[1])
end
local names = {'api_version', 'pool_id', 'max_admission_rps', 'valid_until_unix_ms', 'decision_id'}
for i = 1, 5 do
  if not f[i] or f[i] == '' then return invalid('lease field ' .. names[i] .. ' is missing') end
end
if f[1] ~= ARGV[1] then return invalid('api_version is ' .. f[1] .. ', not ' .. ARGV[1]) end
if f[2] ~= ARGV[2] then return invalid('lease is for pool ' .. f[2] .. ', not ' .. ARGV[2]) end
local rate = decimal(f[3])
if rate == nil then return invalid('max_admission_rps is not a finite number >= 0') end
if not string.match(f[4], '^%d+$') then
  return invalid('valid_until_unix_ms is not an integer')
end
local valid_until = tonumber(f[4])
if valid_until == nil or valid_until == math.huge or valid_until <= now then
  return invalid('lease expired')
end
local burst = tonumber(ARGV[3])
local capacity = math.max(1, rate * burst)
if capacity ~= capacity or capacity == math.huge then return invalid('rate x burst overflows') end

local out_rate, out_until = f[3], f[4]
if rate == 0 then return {-1, out_rate, out_until, f[5], 'paused'} end
if ARGV[4] ~= 'take' then return {1, out_rate, out_until, f[5], ''} end

local s = redis.call('HMGET', KEYS[2], 'tokens', 'last_ms')
local tokens, last = tonumber(s[1]), tonumber(s[2])
if tokens == nil or last == nil then
  tokens, last = capacity, now
end
if now > last then
  tokens = math.min(capacity, tokens + (now - last) / 1000 * rate)
  last = now
else
  tokens = math.min(capacity, tokens)  -- the clock went back: no refill, keep last_ms
end
local verdict = 0
if tokens >= 1 then
  tokens = tokens - 1
  verdict = 1
end
redis.call('HSET', KEYS[2], 'tokens', string.format('%.17g', tokens), 'last_ms',
  string.format('%d', last), 'decision_id', f[5])
redis.call('PEXPIRE', KEYS[2], math.max(1000, valid_until - now + 1000))
return {verdict, out_rate, out_until, f[5], ''}
