-- batch_create.lua: create a batch (pipeline/batch/), or find the one with that id.
-- KEYS[1] the batch hash, KEYS[2] the batches index (zset, score created_at), KEYS[3] the
-- batches' expiry (zset, score = when the record expires), KEYS[4] the active batches (set).
-- ARGV[1] batch id, ARGV[2] completion window (s), ARGV[3] retention (s: how
-- long the batch is kept after it closes), ARGV[4] a JSON object of its other fields (str
-- values: endpoint, completion_window, input_file_id, metadata, files, owner, queue,
-- priority, source, invalid_lines).
-- The batch starts `validating` with created_at = now and expires_at = now + window, both by
-- the server's clock: expires_at is every line's deadline. Its record expires window +
-- retention s from now (it is re-armed to retention when it closes). Batches whose record
-- has expired are pruned from the index first (up to 100 per call).
-- Returns {1 when created / 0 when it existed, created_at, expires_at, status}.
local id = ARGV[1]
local now = server_now()
local index, expiry, active = KEYS[2], KEYS[3], KEYS[4]
for _, old in ipairs(redis.call('ZRANGEBYSCORE', expiry, '-inf', now, 'LIMIT', 0, 100)) do
  redis.call('ZREM', index, old)
  redis.call('ZREM', expiry, old)
  redis.call('SREM', active, old)
end
local bk = KEYS[1]
local f = redis.call('HMGET', bk, 'created_at', 'expires_at', 'status')
if f[1] then return {0, f[1], f[2], f[3]} end
local window, retention = tonumber(ARGV[2]), tonumber(ARGV[3])
local fields = cjson.decode(ARGV[4])
local args = {}
for k, v in pairs(fields) do
  args[#args + 1] = k
  args[#args + 1] = tostring(v)
end
local created, expires = fmt_time(now), fmt_time(now + window)
redis.call('HSET', bk, 'id', id, 'status', 'validating', 'created_at', created,
  'expires_at', expires, 'window_s', ARGV[2], 'retention', ARGV[3], 'total', 0,
  'completed', 0, 'failed', 0, 'submitted', 0, 'unsubmitted', 0, unpack(args))
redis.call('EXPIRE', bk, math.ceil(window + retention))
redis.call('ZADD', index, created, id)
redis.call('ZADD', expiry, fmt_time(now + window + retention), id)
redis.call('SADD', active, id)
return {1, created, expires, 'validating'}
