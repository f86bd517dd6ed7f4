-- gate_adaptive_move.lua: write what an adaptive-concurrency gate's controller decided for
-- the window it closed (gate_adaptive_close.lua), unless a later window was closed since (a
-- mover that stalled past its window writes nothing).
-- KEYS[1] the gate's state hash ('windows', 'limit', 'state', 'signal', 'reason', 'moved_at').
-- ARGV[1] the seq the close returned, ARGV[2] how long the state outlives this write (s),
-- ARGV[3..] field, value, field, value, ...
-- Returns 1 when written, 0 when stale.
if redis.call('HGET', KEYS[1], 'windows') ~= ARGV[1] then return 0 end
local pairs_ = {}
for i = 3, #ARGV do pairs_[#pairs_ + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(pairs_))
redis.call('PEXPIRE', KEYS[1], math.floor(tonumber(ARGV[2]) * 1000))
return 1
