-- wait.lua: a client is about to wait for a request's terminal result. Unless it is done
-- already, its record is marked (field `waiter`) so that the script writing the result also
-- rings the request's notify list (lib.lua terminal()); requests nobody waits for get no
-- notify key. Check and mark are one atomic step: no result is written between them.
-- KEYS[1] request hash. No ARGV.
-- Returns {state, result} (nil for an absent field); nothing is written when the record is
-- missing or done.
local f = redis.call('HMGET', KEYS[1], 'state', 'result')
if f[1] and f[1] ~= 'done' then redis.call('HSET', KEYS[1], 'waiter', '1') end
return f
