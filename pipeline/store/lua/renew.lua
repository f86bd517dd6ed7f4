-- renew.lua: heartbeat of live attempts: extend the lease of each one still current, and name
-- the others (reaped, or cancelled with running 'abort' while the notice was lost: their
-- worker closes their calls).
-- KEYS: pairs per attempt: KEYS[2i-1] its request hash, KEYS[2i] its queue's active set.
-- ARGV[1] lease (s from now by the server's clock), then pairs per attempt: ARGV[2i] its id,
-- ARGV[2i+1] its token.
-- Returns the ids of the attempts no longer current (their leases are not renewed).
local until_ = lease_score(server_now() + tonumber(ARGV[1]))
local stale = {}
for i = 1, #KEYS, 2 do
  local id = ARGV[i + 1]
  if redis.call('HGET', KEYS[i], 'token') == ARGV[i + 2] then
    redis.call('ZADD', KEYS[i + 1], 'XX', until_, id)
  else
    stale[#stale + 1] = id
  end
end
return stale
