-- renew.lua: heartbeat of live attempts: extend the lease of each one still current.
-- KEYS: none passed; derived from ARGV[1] (prefix) and each attempt's id and queue.
-- ARGV[1] prefix, ARGV[2] lease (s from now by the server's clock), then triples: id, token,
-- queue.
-- Returns the number of leases renewed (a stale attempt's is not).
local prefix, until_ = ARGV[1], lease_score(server_now() + tonumber(ARGV[2]))
local renewed = 0
for i = 3, #ARGV, 3 do
  local id, token, queue = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if redis.call('HGET', prefix .. 'req:' .. id, 'token') == token then
    redis.call('ZADD', qkey(prefix, queue, 'active'), 'XX', until_, id)
    renewed = renewed + 1
  end
end
return renewed
