-- gate_tokens_acquire.lua: one admission of a token budget (redis-quota, tokens mode): at most
-- ARGV[2] tokens charged per sliding window of ARGV[1] s per key. Check and charge are one
-- atomic step. The window is judged by the Redis server's clock (TIME), never a caller's.
-- KEYS[1] charge log: sorted set, member = holder "<request id>:<token>", score = admission
--         time (Unix s). One per (quota key, window).
-- KEYS[2] charges: hash, holder -> "e<n>" (the admission's estimate, not settled yet), "<n>"
--         (settled by the response's usage; see gate_tokens_settle.lua) or "d<n>" (charged
--         by the dispatcher when it sent the attempt, which has not asked yet: dispatch.lua).
--         Same members as KEYS[1]. (The window's helpers, tokens_*: lib.lua.)
-- KEYS[3] (optional, estimate_correction: usage) what the answers taught: hash, a (slope),
--         b (overhead), s (spread), see gate_tokens_settle.lua; absent: the plain estimate.
-- ARGV[1] window (s), ARGV[2] limit (tokens), ARGV[3] holder, ARGV[4] estimate (tokens).
-- With KEYS[3]: ARGV[5] the prompt's part of the estimate. Its charge is then a * prompt + b + s,
-- rounded up (less a millionth), never below the prompt's part (pipeline/gates/tokens.py
-- Learned.charge), and the whole charge at most the limit when the plain estimate fits it
-- (a guess never makes a request impossible).
-- A charge counts while now - score < window; older ones are purged here. A holder already
-- charged in the window is admitted again without a second charge (it asks again); a charge
-- the dispatcher made for it is taken back and the holder asks as any other (charged its
-- own estimate from now, or refused).
-- Returns {code, delay_ms, open, charge}:
--   {1, 0, 0, c}  admitted, c charged;
--   {2, 0, 0, c}  the holder was already charged in this window;
--   {3, 0, 0, c}  the estimate alone is more than the limit: it can never fit (nothing charged);
--   {0, delay_ms, open, c} refused: the window holds too much. delay_ms: how long until enough
--              of the charges now in the window have expired for c to fit (if nothing else
--              is charged meanwhile); open: 1 when the charges still to be settled (estimates
--              of requests in flight) are enough that a settlement could make room sooner.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local window, limit = tonumber(ARGV[1]), tonumber(ARGV[2])
local holder, estimate = ARGV[3], tonumber(ARGV[4])
if KEYS[3] and estimate <= limit then
  local got = redis.call('HMGET', KEYS[3], 'a', 'b', 's')
  local a, b, sd = tonumber(got[1]), tonumber(got[2]), tonumber(got[3])
  local prompt = tonumber(ARGV[5])
  if a and b and sd and prompt > 0 then
    local line = math.max(prompt, math.ceil(a * prompt + b + sd - 1e-6))
    estimate = math.min(limit, estimate - prompt + line)
  end
end

tokens_purge(KEYS[1], KEYS[2], window, now)
local prior = redis.call('HGET', KEYS[2], holder)
if prior and string.sub(prior, 1, 1) == 'd' then
  redis.call('ZREM', KEYS[1], holder)
  redis.call('HDEL', KEYS[2], holder)
elseif prior and redis.call('ZSCORE', KEYS[1], holder) then
  return {2, 0, 0, estimate}
end
if estimate > limit then
  return {3, 0, 0, estimate}
end

local w = tokens_window(KEYS[1], KEYS[2])
if w.total + estimate <= limit then
  tokens_charge(KEYS[1], KEYS[2], window, holder, 'e', estimate, now)
  return {1, 0, 0, estimate}
end

-- refused: the oldest charges expire first; find when enough of them have
local delay = tokens_wait(w, estimate, limit, window, now)
local settle = 0
if w.total - w.open + estimate <= limit then settle = 1 end
return {0, math.max(1, math.ceil(delay * 1000)), settle, estimate}
