-- gate_adaptive_observe.lua: add one answer to an adaptive-concurrency gate's current window
-- (sent in the round trip of the attempt's finish / requeue, before its release: O(1)).
-- KEYS[1] holders sorted set (member = holder, score = lease expiry, Unix s).
-- KEYS[2] info hash (holder -> JSON description with "acquired_at", Unix s).
-- KEYS[3] the current window's hash ('start', Unix s, and the sums below).
-- ARGV[1] holder, ARGV[2] latency (s), ARGV[3] completion tokens (0: the answer named none),
-- ARGV[4] kind: 'ok' | 'over' | 'ttl' | 'evict' | 'err', ARGV[5] Retry-After (s, '' none),
-- ARGV[6] '1' when an earlier attempt of the request was retried, ARGV[7] how long the window
-- outlives its last write (s).
-- Every answer counts in 'answered' and adds the in-flight count (its own holder included) to
-- 'in_flight_sum' and 'peak'. A 2xx counts in 'ok', 'ok_latency_s' and 'retried'; when its
-- holder was admitted after the window began it is "measured": 'measured', 'latency_s',
-- 'tokens' (at least 1), 'tokens_sq', 'latency_tokens'. An overload counts in 'overload',
-- keeps the least in-flight at one ('overload_in_flight') and the longest Retry-After; 'ttl',
-- 'evicted' and 'errors' count the rest. (The names are knee.Window's fields.)
-- Returns 1.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local count = redis.call('ZCOUNT', KEYS[1], '(' .. string.format('%.6f', now), '+inf')
local w = KEYS[3]
local start = tonumber(redis.call('HGET', w, 'start') or '')
local latency = math.max(0, tonumber(ARGV[2]) or 0)
local kind = ARGV[4]

redis.call('HINCRBY', w, 'answered', 1)
redis.call('HINCRBY', w, 'in_flight_sum', count)
if count > (tonumber(redis.call('HGET', w, 'peak') or '0') or 0) then
  redis.call('HSET', w, 'peak', count)
end

if kind == 'ok' then
  redis.call('HINCRBY', w, 'ok', 1)
  redis.call('HINCRBYFLOAT', w, 'ok_latency_s', latency)
  if ARGV[6] == '1' then redis.call('HINCRBY', w, 'retried', 1) end
  local info = redis.call('HGET', KEYS[2], ARGV[1])
  local at = info and tonumber(string.match(info, '"acquired_at":%s*([%d%.]+)'))
  if start and at and at >= start then
    local tok = math.max(1, tonumber(ARGV[3]) or 0)
    redis.call('HINCRBY', w, 'measured', 1)
    redis.call('HINCRBYFLOAT', w, 'latency_s', latency)
    redis.call('HINCRBYFLOAT', w, 'tokens', tok)
    redis.call('HINCRBYFLOAT', w, 'tokens_sq', tok * tok)
    redis.call('HINCRBYFLOAT', w, 'latency_tokens', latency * tok)
  end
elseif kind == 'over' then
  redis.call('HINCRBY', w, 'overload', 1)
  local least = tonumber(redis.call('HGET', w, 'overload_in_flight') or '')
  if not least or count < least then redis.call('HSET', w, 'overload_in_flight', count) end
  local ra = tonumber(ARGV[5])
  if ra and ra > (tonumber(redis.call('HGET', w, 'retry_after_s') or '0') or 0) then
    redis.call('HSET', w, 'retry_after_s', ra)
  end
elseif kind == 'ttl' then
  redis.call('HINCRBY', w, 'ttl', 1)
elseif kind == 'evict' then
  redis.call('HINCRBY', w, 'evicted', 1)
else
  redis.call('HINCRBY', w, 'errors', 1)
end
if redis.call('PTTL', w) < 0 then redis.call('PEXPIRE', w, math.floor(tonumber(ARGV[7]) * 1000)) end
return 1
