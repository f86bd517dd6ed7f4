-- gate_tokens_settle.lua: settle one holder's charge in a token budget (redis-quota, tokens
-- mode) when its attempt ends: to what the request consumed (the response's usage), to 0 when
-- nothing was served (a refund: the charge is removed), or to its estimate (ARGV[2] '': the
-- request went out and no answer said what was served). A charge that stays is re-stamped
-- with the settlement time (the Redis server's clock): it then counts for a whole window
-- after the answer came back, so every token the server received before that answer is inside
-- the windows this charge is counted in, however late the request reached the server after
-- its admission. A charge no longer in the window (the request was in flight longer than the
-- window) stays gone. Idempotent in amount (it sets, never adds).
-- With KEYS[3] (estimate_correction: usage) it also learns, in the same step, from the answer's
-- prompt tokens (pipeline/gates/tokens.py Learned.learn is the rule, and the reference): x =
-- the prompt estimate, y = the real prompt tokens capped at slope_max * x + overhead_max; the
-- means of x, y, x*x, x*y, y*y over the samples (plain over the first `weight`, then each new
-- one weighing 1 / weight), the line through them, y = a * x + b (least squares, the slope
-- shrunk toward 1, clamped to [0, slope_max]), and s, the standard deviation of y
-- around it. No sample when x or y is 0. Whether or not the holder still has a charge: the
-- answer came.
-- KEYS[1] charge log, KEYS[2] charges (see gate_tokens_acquire.lua), KEYS[3] (optional) what
-- was learned: hash, n (samples, at most `weight`), mx, my, mxx, mxy, myy, a (slope),
-- b (overhead), s (spread).
-- ARGV[1] holder, ARGV[2] tokens (an integer >= 0), or '' to keep the estimate,
-- ARGV[3] window (s). With KEYS[3]: ARGV[4] real prompt tokens, ARGV[5] the prompt estimate,
-- ARGV[6] slope_max, ARGV[7] overhead_max, ARGV[8] weight, ARGV[9] time to live of KEYS[3]
-- (ms, renewed by each sample), ARGV[10] clip_spreads, ARGV[11] clip_tokens: once `weight`
-- samples are in, y is first brought within clip_spreads * s + clip_tokens of the line.
-- Returns the charge it replaced (tokens), or -1 when the holder had no charge in the window.
if KEYS[3] then
  local real, x = tonumber(ARGV[4]) or 0, tonumber(ARGV[5]) or 0
  if real > 0 and x > 0 then
    local most, over, weight = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
    local got = redis.call('HMGET', KEYS[3], 'n', 'mx', 'my', 'mxx', 'mxy', 'myy', 'a', 'b', 's')
    local n = tonumber(got[1]) or 0
    local mx, my = tonumber(got[2]) or 0, tonumber(got[3]) or 0
    local mxx, mxy, myy = tonumber(got[4]) or 0, tonumber(got[5]) or 0, tonumber(got[6]) or 0
    local y = math.min(real, most * x + over)
    if n >= weight then
      local line = tonumber(got[7]) * x + tonumber(got[8])
      local reach = tonumber(ARGV[10]) * tonumber(got[9]) + tonumber(ARGV[11])
      y = math.min(math.max(y, line - reach), line + reach)
    end
    local k = math.min(n + 1, weight)
    mx = mx + (x - mx) / k
    my = my + (y - my) / k
    mxx = mxx + (x * x - mxx) / k
    mxy = mxy + (x * y - mxy) / k
    myy = myy + (y * y - myy) / k
    local var, cov, shrink = mxx - mx * mx, mxy - mx * my, mx * mx / 1000
    local a = math.min(most, math.max(0.0, (cov + shrink) / (var + shrink)))
    local residual = (myy - my * my) - 2 * a * cov + a * a * var
    local f = '%.17g'
    redis.call('HSET', KEYS[3], 'n', string.format('%d', k), 'mx', string.format(f, mx),
      'my', string.format(f, my), 'mxx', string.format(f, mxx), 'mxy', string.format(f, mxy),
      'myy', string.format(f, myy), 'a', string.format(f, a),
      'b', string.format(f, my - a * mx), 's', string.format(f, math.sqrt(math.max(0.0, residual))))
    redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[9]))
  end
end
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
