-- sched_index.lua: index the next chunk of an indexed queue's pending set into its tenants'
-- sub-queues (requests that waited before the queue was indexed; see sched.lua). Entries that
-- are not waiting requests are left for the dispatch tick, which rejects them.
-- KEYS[1] the queue's pending set, then the key families (lib.lua key_families).
-- ARGV[1] queue name, ARGV[2] chunk size. Continues at the sched hash's cursor.
-- Returns {1 while there is more to do else 0, requests indexed by this call}.
local K, queue, size = key_families(), ARGV[1], tonumber(ARGV[2])
local c = sched_conf(K, queue)
if not c then return {0, 0} end
local cur = tonumber(redis.call('HGET', c.base .. TAIL_SCHED, 'cursor')) or 0
local rows = redis.call('ZRANGE', KEYS[1], cur, cur + size - 1, 'WITHSCORES')
local added = 0
for i = 1, #rows, 2 do
  local member = rows[i]
  local id = string.match(member, '^%d+|(.+)$')
  local f = id and redis.call('HMGET', K.req .. id, 'state', 'member') or {}
  if f[1] == 'queued' and f[2] == member
      and sched_add(K, queue, id, rows[i + 1], member) then
    added = added + 1
  end
end
local more = 1
cur = cur + #rows / 2
if #rows / 2 < size then
  cur, more = 0, 0
end
redis.call('HSET', c.base .. TAIL_SCHED, 'cursor', cur)
return {more, added}
