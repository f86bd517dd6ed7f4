-- gate_adaptive_close.lua: close an adaptive-concurrency gate's current window when it is due
-- and start the next one, atomically: of the nodes that ask, exactly one gets the window, and
-- is the one mover of the limit for it (it writes with gate_adaptive_move.lua and the seq
-- returned). Due (knee.window_closes): after ARGV[2] s; or after ARGV[1] s once
-- max(ARGV[3], ceil(in-flight / 2)) requests admitted in it have been answered ('measured'),
-- none while the state's 'quick' is '1' (on the engine's metrics: a reading is of the
-- moment; ARGV[5] before the first move: '1' when the gate reads the engine's metrics).
-- KEYS[1] the current window's hash ('start', Unix s, and the sums of
--         gate_adaptive_observe.lua).
-- KEYS[2] the gate's state hash ('windows' counts the windows closed; 'state' the controller's).
-- KEYS[3] holders sorted set (member = holder, score = lease expiry, Unix s).
-- ARGV[1] least window (s), ARGV[2] longest window (s), ARGV[3] least measured answers,
-- ARGV[4] how long the window and state outlive their last write (s), ARGV[5] 'quick' while
-- the state has none.
-- Returns {} when not due (the first call only starts the first window); else {now, seq,
-- in-flight, elapsed, state JSON ('' none), field, value, field, value, ...} of the window
-- closed (times as text, Unix s).
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local now_text = t[1] .. '.' .. string.sub('00000' .. t[2], -6)
local keep_ms = math.floor(tonumber(ARGV[4]) * 1000)
local start = tonumber(redis.call('HGET', KEYS[1], 'start') or '')
if not start then
  redis.call('HSET', KEYS[1], 'start', now_text)
  redis.call('PEXPIRE', KEYS[1], keep_ms)
  return {}
end
local elapsed = now - start
local count = redis.call('ZCOUNT', KEYS[3], '(' .. now_text, '+inf')
if elapsed < tonumber(ARGV[2]) then
  local measured = tonumber(redis.call('HGET', KEYS[1], 'measured') or '0') or 0
  local want = math.max(tonumber(ARGV[3]), math.ceil(count / 2))
  if (redis.call('HGET', KEYS[2], 'quick') or ARGV[5]) == '1' then want = 0 end
  if elapsed < tonumber(ARGV[1]) or measured < want then return {} end
end
local fields = redis.call('HGETALL', KEYS[1])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'start', now_text)
redis.call('PEXPIRE', KEYS[1], keep_ms)
local seq = redis.call('HINCRBY', KEYS[2], 'windows', 1)
redis.call('PEXPIRE', KEYS[2], keep_ms)
local out = {now_text, seq, count, string.format('%.6f', elapsed),
  redis.call('HGET', KEYS[2], 'state') or ''}
for i = 1, #fields do out[#out + 1] = fields[i] end
return out
