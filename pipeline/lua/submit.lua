-- submit.lua: accept a batch of requests atomically, item by item.
-- KEYS: none passed; keys are derived from ARGV[1] (the prefix) and each item's id/queue:
--   <prefix>req:<id> (hash), <prefix>q:<queue>:pending / :expiry (zsets), <prefix>seq,
--   <prefix>pool:<pool>:wake.
-- ARGV[1] key prefix, ARGV[2] now (Unix s), ARGV[3] number of items, then 12 fields per item:
--   id, queue, pool, score (ordering key), priority, deadline (Unix s), payload (JSON),
--   metadata (JSON), headers (JSON), endpoint, result_list (key), labels (JSON)
-- Returns one entry per item: 1 when created, else the state of the live request that
-- already holds that id (idempotent submit).
local prefix, now, n = ARGV[1], ARGV[2], tonumber(ARGV[3])
local out = {}
local touched_pools = {}
for i = 0, n - 1 do
  local b = 3 + i * 12
  local id, queue, pool = ARGV[b + 1], ARGV[b + 2], ARGV[b + 3]
  local rk = prefix .. 'req:' .. id
  local state = redis.call('HGET', rk, 'state')
  if state and state ~= 'done' then
    out[#out + 1] = state
  else
    if state then redis.call('DEL', rk) end
    local seq = redis.call('INCR', prefix .. 'seq')
    local member = string.format('%015d', seq) .. '|' .. id
    redis.call('HSET', rk, 'id', id, 'queue', queue, 'pool', pool, 'score', ARGV[b + 4],
      'priority', ARGV[b + 5], 'deadline', ARGV[b + 6], 'payload', ARGV[b + 7],
      'metadata', ARGV[b + 8], 'headers', ARGV[b + 9], 'endpoint', ARGV[b + 10],
      'result_list', ARGV[b + 11], 'labels', ARGV[b + 12], 'member', member,
      'submitted_at', now, 'state', 'queued', 'token', '', 'attempts', 0, 'dispatches', 0)
    redis.call('ZADD', qkey(prefix, queue, 'pending'), ARGV[b + 4], member)
    redis.call('ZADD', qkey(prefix, queue, 'expiry'), ARGV[b + 6], id)
    touched_pools[pool] = true
    out[#out + 1] = 1
  end
end
for pool, _ in pairs(touched_pools) do wake(prefix, pool) end
return out
