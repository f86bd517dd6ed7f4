-- sched.lua: the scheduling structures of indexed queues (fair share by tenant, quota-aware
-- dispatch), kept by every request-state script: pipeline/store/luatext.py prepends this file
-- (before lib.lua) to each of them. Not a script on its own: it reads no KEYS or ARGV.
--
-- Keys: K is the script's key families (lib.lua key_families, store/keys.py Keys.families);
-- a queue's keys are K.q .. <queue> .. TAIL_<NAME> (store/keys.py TAILS).
-- A queue is *indexed* while its sched hash exists (attr = the tenant attribute, fair = '1'
-- for fair share, pool, rr, n, cursor; docs/internals.md, "Redis keys", has every key below). For an indexed queue every waiting request is, besides
-- pending, in its tenant's sub-queue (Keys.tenant_queue; same score and member). A tenant with
-- waiting requests is either
--   ready:   <its head member>\n<tenant key> is in the queue's ready set, or
--   blocked: a field of the queue's blocked hash (tenant key -> the quota key it waits for),
--            listed as <queue>\n<tenant key> in that key's set (Keys.quota_blocked). A
--            token budget's window holds tenants back the same way, named by its charge
--            log under the gate root; the queue's wakeups set says when its room comes by
--            the clock (dispatch.lua).
-- Ready scores: without fair share the head's ordering score (the ready set's order is the
-- pending order among ready tenants, ties by member: submission order); with fair share
-- (9 - priority) x 2^49 + a ticket from the queue's counter rr: tenants at the highest
-- priority take turns, and a tenant takes a new (last) ticket when it joins, when one of its
-- requests is dispatched and when its head's priority changes.
-- A dispatched request of a blocking concurrency quota key is listed in the key's sent set
-- (Keys.quota_sent: what the dispatch script counts against the key's limit) and
-- its record's qkeys field (JSON list of quota keys) says so, until it leaves the active state:
-- then sched_leave() takes it out and, once the key is down to its wake count (its limit plus
-- half its look-ahead: the record's qwake), makes the key's blocked tenants ready again and
-- rings their pools' doorbells; lib.lua publishes the keys with the queue's release on the
-- freed channel, one message "<queue>\n<key>..." (attempts parked for a key wake).
-- Every function here is a no-op for a queue that is not indexed.

local SCHED_SPAN = 562949953421312 -- 2^49 ring tickets per priority band (fair share)
local SCHED_BAND = 1e13 -- the ordering score's priority band: (9 - priority) x 1e13 + ms

local sched_confs = {} -- queue -> its sched hash as a table, or false (one script run)

local function sched_conf(K, queue)
  local c = sched_confs[queue]
  if c == nil then
    local base = K.q .. queue
    local f = redis.call('HMGET', base .. TAIL_SCHED, 'attr', 'fair', 'pool')
    c = false
    if f[1] then
      c = {attr = f[1], fair = f[2] == '1', pool = f[3] or 'default', base = base,
        queue = queue}
    end
    sched_confs[queue] = c
  end
  return c
end

-- The tenant's name in keys and members: itself when short, printable and without a newline.
local function sched_tkey(tenant)
  if #tenant <= 128 and not string.find(tenant, '[%c]') then return tenant end
  return 'sha1:' .. redis.sha1hex(tenant)
end

-- The value of metadata attribute `attr` in a record's metadata JSON ('' when absent).
local function sched_value(metadata, attr)
  if not metadata or metadata == '' then return '' end
  local ok, m = pcall(cjson.decode, metadata)
  if not ok or type(m) ~= 'table' then return '' end
  local v = m[attr]
  if type(v) == 'string' then return v end
  return ''
end

local function sched_band(score)
  return math.floor(tonumber(score) / SCHED_BAND)
end

local function sched_sub(c, tk)
  return c.base .. TAIL_TENANT .. tk
end

-- The tenant `tk` becomes ready with `member` (score `score`) at its head: the back of its
-- priority's ring (fair share), else at the head's own score.
local function sched_ready_add(c, tk, member, score)
  local s = score
  if c.fair then
    s = string.format('%.0f', sched_band(score) * SCHED_SPAN
      + redis.call('HINCRBY', c.base .. TAIL_SCHED, 'rr', 1))
  end
  redis.call('ZADD', c.base .. TAIL_READY, s, member .. '\n' .. tk)
end

-- Ring doorbell `k` (a pool's wake list) unless it is already ringing.
local function ring(k)
  if redis.call('LLEN', k) == 0 then redis.call('RPUSH', k, '1') end
end

-- The tenant `tk` no longer waits for a quota key (it has nothing left, or was woken).
local function sched_unlist(K, c, tk)
  local qk = redis.call('HGET', c.base .. TAIL_BLOCKED, tk)
  if not qk then return false end
  redis.call('HDEL', c.base .. TAIL_BLOCKED, tk)
  redis.call('SREM', K.gate .. qk .. TAIL_BLOCKED, c.queue .. '\n' .. tk)
  return true
end

-- The head (`member`, its ready entry `rm`) of tenant `tk` left the tenant's sub-queue (already
-- removed from it): the next one takes its place. `dispatched`: the tenant goes to the back of
-- the ring; otherwise it keeps its turn while its head's priority stays the same.
local function sched_next_head(K, c, tk, rm, dispatched)
  local r = redis.call('ZSCORE', c.base .. TAIL_READY, rm)
  if r then redis.call('ZREM', c.base .. TAIL_READY, rm) end
  local nxt = redis.call('ZRANGE', sched_sub(c, tk), 0, 0, 'WITHSCORES')
  if #nxt == 0 then
    sched_unlist(K, c, tk)
    return
  end
  if not r then
    -- not ready: blocked (it stays so, its next request at the head), or lost (made ready)
    if redis.call('HEXISTS', c.base .. TAIL_BLOCKED, tk) == 1 then return end
    sched_ready_add(c, tk, nxt[1], nxt[2])
  elseif c.fair and not dispatched
      and sched_band(nxt[2]) == math.floor(tonumber(r) / SCHED_SPAN) then
    redis.call('ZADD', c.base .. TAIL_READY, r, nxt[1] .. '\n' .. tk)
  else
    sched_ready_add(c, tk, nxt[1], nxt[2])
  end
end

-- The head `member` of ready tenant `tk` (its ready entry `rm`) is dispatched: it leaves the
-- tenant's sub-queue and the tenant goes to the back of the ring with its next request (or
-- leaves the ready set with none). What sched_drop + sched_next_head do, without reading what
-- the caller knows: the ready entry names the head, and a ready tenant is not held back.
-- Returns true when `member` was in the sub-queue.
local function sched_pop_ready(c, tk, rm, member)
  local sub = sched_sub(c, tk)
  if redis.call('ZREM', sub, member) == 0 then return false end
  redis.call('HINCRBY', c.base .. TAIL_SCHED, 'n', -1)
  redis.call('ZREM', c.base .. TAIL_READY, rm)
  local nxt = redis.call('ZRANGE', sub, 0, 0, 'WITHSCORES')
  if #nxt > 0 then sched_ready_add(c, tk, nxt[1], nxt[2]) end
  return true
end

-- The head `member` of tenant `tk`, held back by quota key `qk`, is dispatched past the key's
-- limit (the look-ahead): it leaves the sub-queue; the tenant stays held with its next request
-- at its head (`more`: it has one), else it is unlisted. A held tenant is not in the ready set.
-- Returns true when `member` was in the sub-queue.
local function sched_pop_held(K, c, tk, member, qk, more)
  if redis.call('ZREM', sched_sub(c, tk), member) == 0 then return false end
  redis.call('HINCRBY', c.base .. TAIL_SCHED, 'n', -1)
  if not more then
    redis.call('HDEL', c.base .. TAIL_BLOCKED, tk)
    redis.call('SREM', K.gate .. qk .. TAIL_BLOCKED, c.queue .. '\n' .. tk)
  end
  return true
end

-- `member` (ordering `score`) joined the sub-queue of tenant `tk`, which is not held back;
-- `old`, `old_score`: its head before (nil: it had none). The ready set follows its head.
-- Returns true when `member` is its new head.
local function sched_new_head(c, tk, member, score, old, old_score)
  if not old then
    sched_ready_add(c, tk, member, score)
    return true
  end
  local ns, os = tonumber(score), tonumber(old_score)
  if ns > os or (ns == os and member > old) then return false end -- not its new head
  local rm = old .. '\n' .. tk
  local r = redis.call('ZSCORE', c.base .. TAIL_READY, rm)
  redis.call('ZREM', c.base .. TAIL_READY, rm)
  if c.fair and r and sched_band(score) == math.floor(tonumber(r) / SCHED_SPAN) then
    redis.call('ZADD', c.base .. TAIL_READY, r, member .. '\n' .. tk) -- same priority: its turn
  else
    sched_ready_add(c, tk, member, score)
  end
  return true
end

-- A waiting request (`member`, ordering `score`) entered the pending set of `queue`: add it to
-- its tenant's sub-queue. `metadata`: its metadata JSON when the record was just written (its
-- tenant is computed from it), else nil (read from the record).
-- Returns true when it was added (false: not indexed, or already there).
local function sched_add(K, queue, id, score, member, metadata)
  local c = sched_conf(K, queue)
  if not c then return false end
  local rk = K.req .. id
  local tenant
  if not metadata then tenant = redis.call('HGET', rk, 'tenant') end
  if not tenant then
    tenant = sched_value(metadata or redis.call('HGET', rk, 'metadata'), c.attr)
    redis.call('HSET', rk, 'tenant', tenant)
  end
  local tk = sched_tkey(tenant)
  local sub = sched_sub(c, tk)
  local old = redis.call('ZRANGE', sub, 0, 0, 'WITHSCORES')
  if redis.call('ZADD', sub, score, member) == 0 then return false end
  redis.call('HINCRBY', c.base .. TAIL_SCHED, 'n', 1)
  if redis.call('HEXISTS', c.base .. TAIL_BLOCKED, tk) == 0 then
    sched_new_head(c, tk, member, score, old[1], old[2])
  end
  return true
end

-- sched_add for many new requests in one script run (submit), whose records were just written
-- with their tenant (key `tk`). `memo` (from sched_memo) keeps what was read of each tenant
-- (held back or not, its head; nothing else changes them while the script adds) and how many
-- joined each queue, added to its count once by sched_add_done
-- (fewer commands per submitted request: bench/redis_replay.py).
local function sched_memo()
  return {tenants = {}, added = {}}
end

local function sched_add_new(c, tk, score, member, memo)
  local sub = sched_sub(c, tk)
  local t = memo.tenants[sub]
  if not t then
    local old = redis.call('ZRANGE', sub, 0, 0, 'WITHSCORES')
    t = {held = redis.call('HEXISTS', c.base .. TAIL_BLOCKED, tk) == 1, head = old[1],
      score = old[2]}
    memo.tenants[sub] = t
  end
  if redis.call('ZADD', sub, score, member) == 0 then return false end
  memo.added[c] = (memo.added[c] or 0) + 1
  if not t.held and sched_new_head(c, tk, member, score, t.head, t.score) then
    t.head, t.score = member, score
  end
  return true
end

local function sched_add_done(memo)
  for c, n in pairs(memo.added) do redis.call('HINCRBY', c.base .. TAIL_SCHED, 'n', n) end
end

-- Take `member` out of tenant `tk`'s sub-queue (whatever state the record is in). Returns
-- true when it was there.
local function sched_drop(K, c, tk, member, dispatched)
  local sub = sched_sub(c, tk)
  local head = redis.call('ZRANGE', sub, 0, 0)
  if redis.call('ZREM', sub, member) == 0 then return false end
  redis.call('HINCRBY', c.base .. TAIL_SCHED, 'n', -1)
  if head[1] == member then
    sched_next_head(K, c, tk, member .. '\n' .. tk, dispatched)
  end
  return true
end

-- A request left the pending set of `queue` without being dispatched (cancelled, expired,
-- rejected): take it out of its tenant's sub-queue.
local function sched_remove(K, queue, id, member)
  local c = sched_conf(K, queue)
  if not c then return end
  local tenant = redis.call('HGET', K.req .. id, 'tenant')
  if not tenant then return end
  sched_drop(K, c, sched_tkey(tenant), member, false)
end

-- Make tenant `tk` of `queue` ready again (a request of the quota key it waited for left) and
-- ring its pool's doorbell, unless `nowake` (as in terminal(): the leave was a hand-over's, and
-- the dispatcher is rung when the parked attempts run low; its next tick sends the tenant).
local function sched_unblock(K, queue, tk, nowake)
  local c = sched_conf(K, queue)
  if not c or not sched_unlist(K, c, tk) then return end
  local head = redis.call('ZRANGE', sched_sub(c, tk), 0, 0, 'WITHSCORES')
  if #head > 0 then
    sched_ready_add(c, tk, head[1], head[2])
    if not nowake then ring(K.pool .. c.pool .. TAIL_WAKE) end
  end
end

-- Hold tenant `tk` (ready entry `rm`) back until a request of quota key `qk` leaves.
local function sched_block(K, c, tk, rm, qk)
  redis.call('ZREM', c.base .. TAIL_READY, rm)
  redis.call('HSET', c.base .. TAIL_BLOCKED, tk, qk)
  redis.call('SADD', K.gate .. qk .. TAIL_BLOCKED, c.queue .. '\n' .. tk)
end

-- Make the tenants quota key `qk` holds back ready again (in any queue).
local function sched_wake(K, qk, nowake)
  local reg = K.gate .. qk .. TAIL_BLOCKED
  local members = redis.call('SMEMBERS', reg)
  redis.call('DEL', reg)
  for _, m in ipairs(members) do
    local q, tk = string.match(m, '^([^\n]*)\n(.*)$')
    if q then sched_unblock(K, q, tk, nowake) end
  end
end

-- Request `id` left the active state (finished, requeued, reaped, cancelled): it no longer
-- counts against its quota keys, and tenants waiting for them become ready. Returns the keys
-- ('\n'-separated, '' for none), which the caller publishes with its queue's release on the
-- freed channel (attempts parked for them wake) unless its attempt handed its slot over.
-- `qkeys`: the record's qkeys field (read by the caller with the rest of the record), `qwake`
-- its qwake field: per key, the count of dispatched requests at which the key's held tenants
-- wake (see quota_keys in dispatch.lua; absent: at every leave; -1: the key is a token
-- budget's window, which counts no requests: its tenants wake at every leave, whose
-- settlement may have made room, and it is not published, no attempt parks on it). `nowake`:
-- tenants made ready ring no doorbell (sched_unblock).
local function sched_leave(K, id, qkeys, qwake, nowake)
  if not qkeys or qkeys == '' then return '' end
  redis.call('HDEL', K.req .. id, 'qkeys', 'qwake')
  local ok, list = pcall(cjson.decode, qkeys)
  if not ok or type(list) ~= 'table' then return '' end
  local wok, wakes = pcall(cjson.decode, qwake or '')
  if not wok or type(wakes) ~= 'table' then wakes = {} end
  local released = {}
  for i, qk in ipairs(list) do
    local at = tonumber(wakes[i])
    if at == -1 then
      sched_wake(K, qk, nowake)
    else
      local sent = K.gate .. qk .. TAIL_SENT
      redis.call('ZREM', sent, id)
      if not at or redis.call('ZCARD', sent) <= at then sched_wake(K, qk, nowake) end
      released[#released + 1] = qk
    end
  end
  return table.concat(released, '\n')
end
