-- renew.lua: heartbeat of live attempts: extend the lease of each one still current.
-- KEYS: pairs per attempt: KEYS[2i-1] its request hash, KEYS[2i] its queue's active set.
-- ARGV[1] lease (s from now by the server's clock), then pairs per attempt: ARGV[2i] its id,
-- ARGV[2i+1] its token.
-- Returns the number of leases renewed (a stale attempt's is not).
local until_ = lease_score(server_now() + tonumber(ARGV[1]))
local renewed = 0
for i = 1, #KEYS, 2 do
  local id = ARGV[i + 1]
  if redis.call('HGET', KEYS[i], 'token') == ARGV[i + 2] then
    redis.call('ZADD', KEYS[i + 1], 'XX', until_, id)
    renewed = renewed + 1
  end
end
return renewed
