-- submit.lua: accept a batch of requests atomically, item by item.
-- KEYS: none passed; keys are derived from ARGV[1] (the prefix) and each item's id/queue:
--   <prefix>req:<id> (hash), <prefix>q:<queue>:pending / :expiry (zsets), <prefix>seq,
--   <prefix>pool:<pool>:wake.
-- ARGV[1] key prefix, ARGV[2] now (Unix s), ARGV[3] the items: a JSON array with one array of
--   12 strings per item: id, queue, pool, score (ordering key), priority, deadline (Unix s),
--   payload (JSON text), metadata (JSON), headers (JSON), endpoint, result_list (key),
--   labels (JSON). (One argument instead of 12 per item: the client encodes it in one call.)
-- Returns one entry per item: 1 when created, else the state of the live request that
-- already holds that id (idempotent submit).
local prefix, now = ARGV[1], ARGV[2]
local out = {}
local touched_pools = {}
local items = cjson.decode(ARGV[3])
-- one INCRBY reserves a sequence number per item (a duplicate leaves a gap: only order counts)
local seq0 = redis.call('INCRBY', prefix .. 'seq', #items) - #items
for i, r in ipairs(items) do
  local id, queue, pool = r[1], r[2], r[3]
  local rk = prefix .. 'req:' .. id
  local state = redis.call('HGET', rk, 'state')
  if state and state ~= 'done' then
    out[#out + 1] = state
  else
    if state then redis.call('DEL', rk) end
    local member = string.format('%015d', seq0 + i) .. '|' .. id
    redis.call('HSET', rk, 'id', id, 'queue', queue, 'pool', pool, 'score', r[4],
      'priority', r[5], 'deadline', r[6], 'payload', r[7], 'metadata', r[8], 'headers', r[9],
      'endpoint', r[10], 'result_list', r[11], 'labels', r[12], 'member', member,
      'submitted_at', now, 'state', 'queued', 'token', '', 'attempts', 0, 'dispatches', 0)
    redis.call('ZADD', qkey(prefix, queue, 'pending'), r[4], member)
    redis.call('ZADD', qkey(prefix, queue, 'expiry'), r[6], id)
    touched_pools[pool] = true
    out[#out + 1] = 1
  end
end
for pool, _ in pairs(touched_pools) do wake(prefix, pool) end
return out
