-- submit.lua: accept a batch of requests atomically, item by item.
-- KEYS: the key families (lib.lua key_families): each item's keys are derived from its id,
--   queue and pool (its record, its queue's pending and expiry sets, for a queue indexed by
--   tenant its scheduling keys (sched.lua), its pool's doorbell), a batch's from ARGV[2].
-- ARGV[1] the items: a JSON array with one array of 15 strings per item, a RequestRow
--   (pipeline/store/rows.py) in its order: id, queue, pool, priority, deadline, timeout,
--   payload, metadata, headers, endpoint, result_list, result_list_max, result_list_ttl,
--   labels, custom_id. The deadline is Unix s by the server's clock, or '' (then the timeout
--   counts from now); result_list '' for none (see lib.lua); custom_id '' outside a batch.
--   (One argument instead of 15 per item: the client encodes it in one call.)
-- The ordering key (score) is (9 - priority) x 1e13 + the deadline in ms: higher priority
-- first, then earliest deadline; the member's sequence number breaks ties (submission order).
-- With ARGV[2] a batch id, the items are that batch's lines (pipeline/batch/): each item's
-- custom_id is stored with the batch id in the record; the call covers the
-- batch's input lines after ARGV[3] up to ARGV[4] (line numbers) and is fenced: it stores
-- nothing and returns {'stopped', status} unless the batch is validating or in progress and
-- not stopped, or {'fenced', lines covered so far} unless the batch has covered exactly ARGV[3]
-- lines (so no line is ever stored twice, whoever enqueues it and however often).
-- A line's id is <batch id>-<line> (ingest.py), so a live request can hold it when the batch
-- id was chosen: with the same content the line takes that request as its own (its record
-- gets the batch and custom_id: it is counted in the batch when it ends); with other content,
-- or as another batch's line, the line is an error line (idempotency_conflict) at once:
-- counted failed and kept on the batch's invalid list for its error file.
-- Returns one entry per item: 1 when created, else the state of the live request that
-- already holds that id with the same payload, queue, endpoint and headers (idempotent
-- submit), or 'conflict:<those that differ, comma-separated>' (nothing is stored: rows.py
-- CONTENT).
local K = key_families()
local now = server_now()
local CONTENT = {'payload', 'queue', 'endpoint', 'headers'} -- in rows.py CONTENT's order
local batch = ARGV[2] or ''
if batch ~= '' then
  local bk = K.batch .. batch
  local b = redis.call('HMGET', bk, 'status', 'submitted', 'stopped')
  if (b[1] ~= 'validating' and b[1] ~= 'in_progress') or b[3] == '1' then
    return {'stopped', b[1] or 'missing'}
  end
  if tonumber(b[2]) ~= tonumber(ARGV[3]) then return {'fenced', b[2]} end
  redis.call('HSET', bk, 'submitted', ARGV[4])
end
local out = {}
local touched_pools = {}
local memo = sched_memo() -- what sched_add_new learnt of each tenant (sched.lua)
local items = cjson.decode(ARGV[1])
if batch ~= '' then redis.call('HINCRBY', K.batch .. batch, 'unsubmitted', -#items) end
-- one INCRBY reserves a sequence number per item (a duplicate leaves a gap: only order counts)
local seq0 = redis.call('INCRBY', K.seq, #items) - #items
local conflicts = {} -- a batch's error lines (invalid-list records)
for i, r in ipairs(items) do
  local id, queue, pool = r[1], r[2], r[3]
  local rk = K.req .. id
  local live = redis.call('HMGET', rk, 'state', 'payload', 'queue', 'endpoint', 'headers',
    'batch')
  local state, owner = live[1], live[6]
  if state and state ~= 'done' and (batch == '' or owner ~= batch) then
    local differs = {}
    for j, mine in ipairs({r[7], r[2], r[10], r[9]}) do
      if live[j + 1] ~= mine then differs[#differs + 1] = CONTENT[j] end
    end
    -- another batch's line (no two batches' line ids meet: kept for the counts' sake)
    if batch ~= '' and owner then differs[#differs + 1] = 'batch' end
    if #differs > 0 then
      out[#out + 1] = 'conflict:' .. table.concat(differs, ',')
      if batch ~= '' then
        conflicts[#conflicts + 1] = cjson.encode({line = tonumber(string.sub(id, #batch + 2)),
          custom_id = r[15], code = 'idempotency_conflict', differs = differs,
          message = 'line ' .. string.sub(id, #batch + 2) .. ": request '" .. id ..
            "' is live with another " .. table.concat(differs, ' and ') ..
            ': wait for it to end, or give the batch another id'})
      end
    else
      if batch ~= '' then -- the line takes the live request: counted here when it ends
        local entry = log_entry(now, 'joined', '"batch":' .. json_str(batch) .. ',"line":' ..
          string.sub(id, #batch + 2))
        redis.call('HSET', rk, 'batch', batch, 'custom_id', r[15],
          'log', log_with(redis.call('HGET', rk, 'log'), id, entry))
      end
      out[#out + 1] = state
    end
  elseif state and state ~= 'done' then -- this batch's line already (its id recreated)
    out[#out + 1] = state
  else
    if state then drop_record(rk) end
    local member = string.format('%015d', seq0 + i) .. '|' .. id
    local deadline = r[5]
    if deadline == '' then deadline = fmt_time(now + tonumber(r[6])) end
    local score = string.format('%.0f',
      (9 - tonumber(r[4])) * 1e13 + math.floor(tonumber(deadline) * 1000 + 0.5))
    -- the fields every step reads first: a small hash (listpack) finds a field by walking
    -- the fields in the order they were written (bench/redis_replay.py)
    local fields = {'state', 'queued', 'token', '', 'member', member, 'deadline', deadline,
      'dispatches', '0', 'attempts', '0', 'priority', r[4], 'queue', queue, 'id', id,
      'pool', pool, 'submitted_at', fmt_time(now), 'result_list', r[11],
      'result_list_max', r[12], 'result_list_ttl', r[13], 'payload', r[7], 'metadata', r[8],
      'labels', r[14], 'headers', r[9], 'endpoint', r[10], 'score', score}
    local c, tenant = sched_conf(K, queue), nil
    if c then -- an indexed queue: the record says its tenant (sched.lua)
      tenant = sched_value(r[8], c.attr)
      fields[#fields + 1] = 'tenant'
      fields[#fields + 1] = tenant
    end
    if batch ~= '' then
      fields[#fields + 1] = 'batch'
      fields[#fields + 1] = batch
      fields[#fields + 1] = 'custom_id'
      fields[#fields + 1] = r[15]
    end
    redis.call('HSET', rk, unpack(fields))
    redis.call('ZADD', qkey(K, queue, TAIL_PENDING), score, member)
    if c then sched_add_new(c, sched_tkey(tenant), score, member, memo) end
    redis.call('ZADD', qkey(K, queue, TAIL_EXPIRY), deadline, id)
    touched_pools[pool] = true
    out[#out + 1] = 1
  end
end
sched_add_done(memo)
for pool, _ in pairs(touched_pools) do wake(K, pool) end
if #conflicts > 0 then -- error lines: each counted once, here (no request of the batch)
  local bk = K.batch .. batch
  local ik = bk .. TAIL_INVALID
  redis.call('RPUSH', ik, unpack(conflicts))
  local ttl = redis.call('PTTL', bk)
  if ttl > 0 then redis.call('PEXPIRE', ik, ttl) end
  redis.call('HINCRBY', bk, 'failed', #conflicts)
  batch_settle(K, batch, now)
end
return out
