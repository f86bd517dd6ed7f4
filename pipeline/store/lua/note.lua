-- note.lua: add a running attempt's journaled events to its request's decision log before the
-- attempt ends (an attempt parked at its gate for a while says so). Fenced by the attempt
-- token: a stale attempt, or a request that is no longer running, notes nothing.
-- KEYS[1] request hash.
-- ARGV[1] token, ARGV[2] the journal (lib.lua log_journal).
-- Returns 1 when noted, 0 when fenced off.
local f = redis.call('HMGET', KEYS[1], 'state', 'token', 'id', 'log')
if f[1] ~= 'running' or f[2] ~= ARGV[1] then return 0 end
log_journal(f[3], server_now(), ARGV[2])
redis.call('HSET', KEYS[1], 'log', log_with(f[4], f[3]))
return 1
