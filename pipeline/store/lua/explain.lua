-- explain.lua: where a request stands and why, read in one step (`pipeline explain`). Reads
-- only. KEYS[1] the request hash (with its decision log, field log), then the key families
-- (lib.lua key_families): the other keys follow from the record: its queue's pending, delayed
-- and active sets; for an indexed queue (sched.lua) its sched hash, the tenant's sub-queue,
-- ready and blocked; for each quota key of the request its sent, holders and blocked sets.
-- ARGV[1] request id, ARGV[2] JSON {queue: [{k (quota key prefix), attr,
-- limit, h (bool: the key's leases are in this Redis)}]}: the queues' blocking concurrency
-- quotas (pipeline/store/sched.py QuotaSpec), ARGV[3] most holders and requests listed per key.
-- Returns false for an unknown id, else a JSON object:
--   now: the server's clock (Unix s, text); log: the decision log (JSON texts, oldest first);
--   record: the record's fields (no payload, metadata or headers; the result and the last
--     response reduced to their codes: result {status_code, error_code, error_message},
--     last_status);
--   position (state queued): rank (requests before it in the pending set, every priority),
--     higher [[priority, count], ...] (requests of each higher priority), and in an indexed
--     queue tenant, fair, tenant_rank (the tenant's own requests before it), tenant_waiting,
--     then held_by (the quota key holding the tenant back) or ready_rank (tenants before it
--     in the ready set) and ready (tenants in it);
--   due (retry_wait: when it re-enters the queue), lease (dispatched / running: its expiry);
--   quotas: [{key, limit, sent (requests of the key dispatched or running), requests (their
--     ids), leases (live leases), holders ([holder, expiry, ...]), blocked (tenants held back)}].
local K, id, limit = key_families(), ARGV[1], tonumber(ARGV[3])
local fields = {'state', 'queue', 'pool', 'priority', 'deadline', 'submitted_at', 'attempts',
  'dispatches', 'token', 'worker', 'started_at', 'finished_at', 'member', 'score', 'tenant',
  'batch', 'custom_id', 'last_error', 'wire', 'qkeys', 'log', 'metadata', 'last_response',
  'result'}
local v = redis.call('HMGET', KEYS[1], unpack(fields))
if not v[1] then return false end
local now = server_now()
local r = {}
for i = 1, #fields - 4 do
  if v[i] then r[fields[i]] = v[i] end
end
local log = {}
for line in string.gmatch(v[#fields - 3] or '', '[^\n]+') do log[#log + 1] = line end
local metadata = v[#fields - 2]
local ok, last = pcall(cjson.decode, v[#fields - 1] or '')
if ok and type(last) == 'table' then r.last_status = last.status_code end
local res
ok, res = pcall(cjson.decode, v[#fields] or '')
if ok and type(res) == 'table' then
  r.result = {status_code = res.status_code, error_code = res.error_code,
    error_message = res.error_message}
end
local out = {now = fmt_time(now), record = r, log = log}
local queue, state = r.queue or '', r.state

if state == 'queued' and r.member and tonumber(r.score) then
  local pending = qkey(K, queue, TAIL_PENDING)
  local pos = {rank = redis.call('ZRANK', pending, r.member), higher = {}}
  for b = 0, sched_band(r.score) - 1 do
    local n = redis.call('ZCOUNT', pending, string.format('%.0f', b * SCHED_BAND),
      '(' .. string.format('%.0f', (b + 1) * SCHED_BAND))
    if n > 0 then pos.higher[#pos.higher + 1] = {9 - b, n} end
  end
  local c = sched_conf(K, queue)
  if c then
    local tk = sched_tkey(r.tenant or '')
    local sub = sched_sub(c, tk)
    pos.tenant, pos.fair = r.tenant or '', c.fair
    pos.tenant_rank = redis.call('ZRANK', sub, r.member)
    pos.tenant_waiting = redis.call('ZCARD', sub)
    local held = redis.call('HGET', c.base .. TAIL_BLOCKED, tk)
    if held then
      pos.held_by = held
    else
      local head = redis.call('ZRANGE', sub, 0, 0)
      if #head > 0 then
        pos.ready_rank = redis.call('ZRANK', c.base .. TAIL_READY, head[1] .. '\n' .. tk)
      end
      pos.ready = redis.call('ZCARD', c.base .. TAIL_READY)
    end
  end
  out.position = pos
elseif state == 'retry_wait' then
  out.due = redis.call('ZSCORE', qkey(K, queue, TAIL_DELAYED), id)
elseif state == 'dispatched' or state == 'running' then
  out.lease = redis.call('ZSCORE', qkey(K, queue, TAIL_ACTIVE), id)
end

local specs = cjson.decode(ARGV[2])[queue]
local quotas = {}
if type(specs) == 'table' then
  local live = '(' .. fmt_time(now)
  for _, s in ipairs(specs) do
    local value = sched_value(metadata, s.attr)
    if value ~= '' then
      local base = K.gate .. s.k .. value
      local q = {key = s.k .. value, limit = s.limit,
        sent = redis.call('ZCARD', base .. TAIL_SENT),
        requests = redis.call('ZRANGE', base .. TAIL_SENT, 0, limit - 1),
        blocked = redis.call('SCARD', base .. TAIL_BLOCKED)}
      if s.h then
        q.leases = redis.call('ZCOUNT', base .. TAIL_HOLDERS, live, '+inf')
        q.holders = redis.call('ZRANGEBYSCORE', base .. TAIL_HOLDERS, live, '+inf', 'WITHSCORES',
          'LIMIT', 0, limit)
      end
      quotas[#quotas + 1] = q
    end
  end
end
out.quotas = quotas
return cjson.encode(out)
