-- dispatch.lua: one dispatcher tick for one worker pool, atomically (so several dispatchers
-- never disagree). Every time is the server's clock.
-- 1. Sweep each queue: due retries re-enter their queue with their original key, requests
--    whose deadline passed while waiting get their terminal result.
-- 2. Free room: the pool's worker slots minus its active requests; per queue, its gate's
--    budget share of that, capped by its capacity minus its own active requests (at least 1
--    when the budget is above 0, both have room and the queue has nothing active).
-- 3. Merge: while the pool has a free slot, the merge policy picks one of the queues with room
--    and something to send (random-robin: a smooth weighted round-robin; tier-priority: the
--    highest lane with something to send, unless a lower one was passed over max_wait times
--    in a row; the weighted round-robin among the lane's queues), and that queue's next request
--    is dispatched. Inside a queue the order is the pending set's (priority, deadline,
--    submission); in an indexed queue (sched.lua) the next tenant is the lowest entry of its
--    ready set (fair share: tenants take turns at the highest priority), and a tenant whose
--    request would exceed a quota key's limit (requests of the key dispatched or running,
--    or the key's live leases) is held back (blocked) until a request of that key leaves.
--    Likewise a tenant whose head request's token estimate does not fit in its token
--    budget's window (a token spec) is held back until a request charged there leaves (its
--    settlement may have made room) or the window has room by the clock (the queue's wakeups
--    set, swept before the queue dispatches); a request it dispatches is charged its estimate
--    there ('d<n>', for its attempt's holder: taken over when the attempt asks the gate).
-- 4. Look-ahead per quota key: with room left, the tenants blocked in this tick get up to
--    `la` more attempts of a key past its limit (at most cfg.lookahead in all): they park at
--    the worker for a release of that key (the key is published when one leaves). Behind a
--    slot gate (acap: its capacity) only while the queue has fewer dispatched and running:
--    once the slot gate is full, its own look-ahead (other tenants' attempts, holding their
--    quota slots) is what a finish hands over to, and the queue's room is kept for tenants
--    that have quota room.
-- Blocked tenants are out of the ready set, so each dispatch costs O(log n) in the number of
-- waiting requests and tenants (a tenant is looked at again only after its key released).
-- Each dispatched request's decision log gets a "dispatched" entry (its dispatch number; with
-- "ahead", the quota key it was sent past), and the head request of a tenant held back a
-- "held" entry (the key).
-- KEYS: per queue of ARGV[1]'s list, in order: pending, delayed, expiry, active, result list
-- (when it keeps none, a key of the slot holding the place: see rl); then the pool's merge
-- hash; the pool's Celery queue list when the broker is this Redis (else a key holding the
-- place: see task); the pool's doorbell when cfg.doorbell (emptied first: every
-- ring pushed so far is answered by this tick); then the key families (lib.lua key_families:
-- records, tenants' and quota keys' sets).
-- ARGV[1] JSON: {cap (the pool's worker slots), lease (s: a dispatched request's lease),
-- ttl (result TTL, s), sweep (limit per sweep), nonce (attempt tokens are <nonce>.<n>),
-- task, origin (Celery message fields; task '' when the script pushes none), doorbell
-- (bool), policy ('random-robin' or 'tier-priority'), max_wait, lookahead (most quota
-- look-ahead attempts this tick), queues:
-- [{name, dispatch (bool: may dispatch), sweep (bool), budget (0..1), cap (-1: none), acap
-- (dispatched and running below which the quota look-ahead is sent; -1: cap), weight,
-- lane (0..5), rand (0..1: a new round-robin counter's start), rl (bool: it keeps a result
-- list), rl_max, rl_ttl (result list),
-- specs: [{k (the quota key up to its value: <the gate's prefix param><attribute>:), attr,
-- limit, la (look-ahead), h (bool: the key's leases are in this Redis)}],
-- tokens (optional): [{log, ch (the token budget's charge log and charges up to its value:
-- <gate>:tokens:<window>:log:<attribute>: and :charges:), attr, limit, window (s),
-- dmt (default_max_tokens)}]}]}.
-- With a Celery queue list, each moved request is also pushed there as a Celery message (protocol 2,
-- kombu's Redis transport envelope, JSON body), so the move and the publish are one step.
-- Returns {moved, expired, next_event, rejected}: moved is a flat list of id, token,
-- dispatch number, priority, queue index (1-based, in ARGV[1]'s order), tenant (JSON
-- {attribute: value} of an indexed queue's request, see tenant_hint; '' for none); expired
-- the number of requests expired per queue; next_event how long until the earliest due retry
-- or deadline of a waiting request, or wake-up of a tenant a token budget holds back (s, as
-- text; -1 if none); rejected, per queue, the malformed members removed.
local K = key_families()
local cfg = cjson.decode(ARGV[1])
local now = server_now()
local ttl = cfg.ttl
local limit = cfg.sweep
local limit_text = string.format('%d', limit)
local lease_until = lease_score(now + cfg.lease)
local Q = cfg.queues
local celery_list = cfg.task ~= '' and KEYS[#Q * 5 + 2] or '' -- else it holds the place
if cfg.doorbell then redis.call('DEL', KEYS[#Q * 5 + 3]) end

for i, q in ipairs(Q) do
  local b = (i - 1) * 5
  q.idx, q.pending, q.delayed, q.expiry, q.active, q.results =
    i, KEYS[b + 1], KEYS[b + 2], KEYS[b + 3], KEYS[b + 4], KEYS[b + 5]
  q.expired, q.rejected, q.allowed, q.sent = 0, {}, 0, 0
  q.tokens = q.tokens or {}
  if not q.rl then q.results = '' end -- its key only holds the place
end

-- A member that is not a dispatchable request of this queue: report it, never drop silently.
local function reject(q, member, id, has_record)
  redis.call('ZREM', q.pending, member)
  q.rejected[#q.rejected + 1] = member
  if not id or not has_record then
    push_result(q.results, cjson.encode({id = id or member, payload =
      '{"error": "malformed queue entry"}', error_code = 'INVALID_REQUEST',
      error_message = 'malformed queue entry: ' .. member}), q.rl_max, q.rl_ttl)
  end
end

-- 1. sweep ------------------------------------------------------------------------------
local function sweep(q)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', q.delayed, '-inf', now_text, 'LIMIT', '0',
      limit_text)) do
    redis.call('ZREM', q.delayed, id)
    local rk = K.req .. id
    local f = redis.call('HMGET', rk, 'member', 'score', 'state')
    if f[3] == 'retry_wait' then
      redis.call('ZADD', q.pending, f[2], f[1])
      redis.call('HSET', rk, 'state', 'queued')
      sched_add(K, q.name, id, f[2], f[1])
    end
  end
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', q.expiry, '-inf', now_text, 'LIMIT', '0',
      limit_text)) do
    local state = redis.call('HGET', K.req .. id, 'state')
    if state == 'queued' or state == 'retry_wait' then
      expire(K, id, now, ttl)
      q.expired = q.expired + 1
    else
      redis.call('ZREM', q.expiry, id)
    end
  end
end

-- An indexed queue whose pending set holds more than its sub-queues (requests queued before it
-- was indexed, or by a writer that did not index them): index the next chunk of pending.
local function reindex(q, c)
  local h = redis.call('HMGET', c.base .. TAIL_SCHED, 'n', 'cursor')
  local total = redis.call('ZCARD', q.pending)
  if total <= (tonumber(h[1]) or 0) then return end
  local cur = tonumber(h[2]) or 0
  if cur >= total then cur = 0 end
  local rows = redis.call('ZRANGE', q.pending, cur, cur + limit - 1, 'WITHSCORES')
  local kept = 0
  for i = 1, #rows, 2 do
    local member = rows[i]
    local id = string.match(member, '^%d+|(.+)$')
    local f = id and redis.call('HMGET', K.req .. id, 'state', 'member') or {}
    if not id or f[1] ~= 'queued' or f[2] ~= member then
      reject(q, member, id, f[1])
    else
      sched_add(K, q.name, id, rows[i + 1], member)
      kept = kept + 1
    end
  end
  cur = cur + kept
  if #rows == 0 or cur >= total then cur = 0 end
  redis.call('HSET', c.base .. TAIL_SCHED, 'cursor', cur)
end

-- Tenants held back by a token budget whose window has room by now (the queue's wakeups).
local function wake_due(q)
  local k = qkey(K, q.name, TAIL_WAKEUPS)
  for _, lk in ipairs(redis.call('ZRANGEBYSCORE', k, '-inf', now_text)) do
    redis.call('ZREM', k, lk)
    sched_wake(K, lk)
  end
end

for _, q in ipairs(Q) do
  if q.sweep then sweep(q) end
  if q.dispatch then
    q.conf = sched_conf(K, q.name)
    if q.conf then
      reindex(q, q.conf)
      if #q.tokens > 0 then wake_due(q) end
    end
  end
end

-- 2. room -------------------------------------------------------------------------------
local in_pool = 0
for _, q in ipairs(Q) do
  q.active_n = redis.call('ZCARD', q.active)
  in_pool = in_pool + q.active_n
end
local n_free = cfg.cap - in_pool
for _, q in ipairs(Q) do
  if q.dispatch then
    -- the budget scales the free worker slots; the queue capacity caps the result on its own
    -- (a capacity gate's budget is its free share already)
    local free, room = math.floor(q.budget * n_free), n_free
    if q.cap >= 0 then
      free = math.min(free, q.cap - q.active_n)
      room = math.min(room, q.cap - q.active_n)
    end
    if free < 1 and q.budget > 0 and room > 0 and q.active_n == 0 then free = 1 end
    q.allowed = free
  end
end

-- 3. dispatch ---------------------------------------------------------------------------
-- The tenant of a request of an indexed queue as {attribute = value}, for its attempt's
-- message (the worker sends its quota acquire with the start: pipeline/worker/process.py), or
-- nil: none, or one whose Python repr (kwargsrepr) would need escapes.
local function tenant_hint(q, tenant)
  local c = q.conf
  if not c or not tenant or tenant == '' then return nil end
  local safe = '^[%w_.:@-]+$'
  if #tenant > 128 or not string.find(tenant, safe) or not string.find(c.attr, safe) then
    return nil
  end
  return {[c.attr] = tenant}
end

-- One Celery task message (what ``Task.apply_async`` would LPUSH through kombu) for attempt
-- `token` of request `id`: args (id, token), kwargs {queue, priority, attempt[, tenant]}.
-- Written as text around the tick's constant parts, not as tables for cjson to encode (fewer
-- instructions: bench/redis_replay.py); tests/integration/test_wire.py holds it to what kombu
-- and Celery read.
local msg_head = ', "content-encoding": "utf-8", "content-type": "application/json", ' ..
  '"headers": {"lang": "py", "task": ' .. json_str(cfg.task) .. ', "id": '
local msg_mid = ', "shadow": null, "eta": null, "expires": null, "group": null, ' ..
  '"group_index": null, "retries": 0, "timelimit": [null, null], "root_id": '
local msg_origin = ', "origin": ' .. json_str(cfg.origin) .. ', "ignore_result": false, ' ..
  '"replaced_task_nesting": 0, "stamped_headers": null, "stamps": {}}, ' ..
  '"properties": {"correlation_id": '
local msg_tail = ', "delivery_mode": 2, "priority": 0, "delivery_info": {"exchange": "", ' ..
  '"routing_key": ' .. json_str(celery_list) .. '}, "delivery_tag": '
local function celery_message(queue_name, id, token, n_text, priority, t, tenant)
  local jid, jq = json_str(id), json_str(queue_name)
  local kwrepr = "{'queue': '" .. queue_name .. "', 'priority': " .. priority ..
    ", 'attempt': " .. n_text
  local kwargs = '{"queue": ' .. jq .. ', "priority": ' .. priority .. ', "attempt": ' .. n_text
  if tenant then
    local a, v = next(tenant)
    kwrepr = kwrepr .. ", 'tenant': {'" .. a .. "': '" .. v .. "'}"
    kwargs = kwargs .. ', "tenant": {' .. json_str(a) .. ': ' .. json_str(v) .. '}'
  end
  local body = '[[' .. jid .. ', ' .. json_str(token) .. '], ' .. kwargs ..
    '}, {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]'
  return '{"body": ' .. json_str(body) .. msg_head .. jid .. msg_mid ..
    jid .. ', "parent_id": null, "argsrepr": ' ..
    json_str("('" .. id .. "', '" .. token .. "')") .. ', "kwargsrepr": ' ..
    json_str(kwrepr .. '}') .. msg_origin .. jid .. msg_tail ..
    json_str(cfg.nonce .. '-' .. t .. '-' .. id) .. '}}'
end

local moved = {}
local t = 0
local quota_used = {} -- quota key -> {sent, live leases} as this tick counted and dispatched

-- Dispatch request `id` (record `rk`, its fields `f` as check() read them) with a new attempt
-- token; `qkeys`: the quota keys it counts against (with their wake counts `wakes`: -1 for a
-- token budget's window, which counts no requests); `ahead`: the key it is sent past, if
-- any; `charges`: its token charges (see quota_keys).
local function dispatch_one(q, id, rk, f, qkeys, ahead, wakes, charges)
  t = t + 1
  local token = cfg.nonce .. '.' .. t
  if charges then
    for _, ch in ipairs(charges) do
      tokens_charge(ch[1], ch[2], ch[3], id .. ':' .. token, 'd', ch[4], now, ch[5])
    end
  end
  local priority = f[4]
  local n = (tonumber(f[7]) or 0) + 1 -- written with the state (no HINCRBY of its own)
  local n_text = string.format('%d', n)
  local note = '"n":' .. n_text
  if ahead then note = note .. ',"ahead":' .. cjson.encode(ahead) end -- past a quota key's limit
  local log = log_with(f[6], id, log_entry(now, 'dispatched', note))
  if qkeys and #qkeys > 0 then
    redis.call('HSET', rk, 'state', 'dispatched', 'token', token, 'dispatches', n_text,
      'qkeys', cjson.encode(qkeys), 'qwake', cjson.encode(wakes), 'log', log)
    for i, qk in ipairs(qkeys) do -- (whole seconds: see lease_score)
      if wakes[i] ~= -1 and redis.call('ZADD', K.gate .. qk .. TAIL_SENT, now_whole, id) == 1
          and quota_used[qk] then
        quota_used[qk][1] = quota_used[qk][1] + 1
      end
    end
  else
    redis.call('HSET', rk, 'state', 'dispatched', 'token', token, 'dispatches', n_text, 'log',
      log)
  end
  redis.call('ZREM', q.expiry, id)
  redis.call('ZADD', q.active, lease_until, id)
  moved[#moved + 1] = id
  moved[#moved + 1] = token
  moved[#moved + 1] = n
  moved[#moved + 1] = priority
  moved[#moved + 1] = q.idx
  local tenant = tenant_hint(q, f[5])
  moved[#moved + 1] = tenant and cjson.encode(tenant) or ''
  if celery_list ~= '' then
    redis.call('LPUSH', celery_list,
      celery_message(q.name, id, token, n_text, string.format('%d', tonumber(priority) or 0), t,
        tenant))
  end
  return true
end

-- The request of pending member `member` if it may be dispatched: id, record key, fields
-- (state, deadline, member, priority, tenant, log, dispatches). Anything else is dealt with
-- here (rejected, an unreadable record resulted, an expired one resulted) and nil returned.
local function check(q, member)
  local id = string.match(member, '^%d+|(.+)$')
  local rk = id and (K.req .. id)
  local f = rk and redis.call('HMGET', rk, 'state', 'deadline', 'member', 'priority', 'tenant',
    'log', 'dispatches') or {}
  if not id or f[1] ~= 'queued' or f[3] ~= member then
    reject(q, member, id, f[1])
  elseif not tonumber(f[2]) then
    terminal(K, id, now, ttl, '', '{"error": "unreadable request record"}',
      'INVALID_REQUEST', 'unreadable request record: deadline is not a number')
  elseif not (f[4] and string.find(f[4], '^%-?%d+$')) then -- another producer wrote it: it
    -- alone ends, never the tick (the moved list's priority is read as an integer)
    terminal(K, id, now, ttl, '', '{"error": "unreadable request record"}',
      'INVALID_REQUEST', 'unreadable request record: priority is not an integer')
  elseif tonumber(f[2]) <= now then
    expire(K, id, now, ttl)
    q.expired = q.expired + 1
  else
    return id, rk, f
  end
  return nil
end

-- Token estimates, the rule of pipeline/gates/tokens.py (which the attempt's own admission
-- applies: this one only decides what the dispatcher sends and holds back).
-- The characters of string `s` (UTF-8 code points, as Python counts them).
local function utf8_len(s)
  if not string.find(s, '[\128-\255]') then return #s end
  local _, cont = string.gsub(s, '[\128-\191]', '')
  return #s - cont
end

-- (characters, token ids) of a prompt or of a message's content.
local function text_chars(v)
  if type(v) == 'string' then return utf8_len(v), 0 end
  if type(v) ~= 'table' then return 0, 0 end
  local chars, ids = 0, 0
  for _, item in ipairs(v) do
    local t_item = type(item)
    if t_item == 'number' then
      if item == math.floor(item) then ids = ids + 1 end
    elseif t_item == 'string' then
      chars = chars + utf8_len(item)
    elseif t_item == 'table' then
      local text = item.text -- a content part (an object); an array has none
      if text == nil then
        local c, i = text_chars(item)
        chars, ids = chars + c, ids + i
      elseif type(text) == 'string' then
        chars = chars + utf8_len(text)
      end
    end
  end
  return chars, ids
end

-- A JSON integer >= 0, else nil.
local function token_count(v)
  if type(v) == 'number' and v >= 0 and v == math.floor(v) then return v end
  return nil
end

-- The estimate of request body `payload` (JSON text): the prompt's characters / 4, rounded
-- up, + its token ids + 4 per chat message, + the completion budget (max_completion_tokens
-- or max_tokens, the larger, else `dmt`) x n.
local function estimate_tokens(payload, dmt)
  local ok, body = pcall(cjson.decode, payload or '')
  if not ok or type(body) ~= 'table' or body[1] ~= nil then return dmt end
  local chars, ids = text_chars(body.prompt)
  local overhead = 0
  if type(body.messages) == 'table' then
    for _, m in ipairs(body.messages) do
      if type(m) == 'table' and m[1] == nil then
        local c, i = text_chars(m.content)
        chars, ids, overhead = chars + c, ids + i, overhead + 4
      end
    end
  end
  local a, b = token_count(body.max_completion_tokens), token_count(body.max_tokens)
  local budget = dmt
  if a and b then budget = math.max(a, b) else budget = a or b or dmt end
  local n = token_count(body.n)
  if not n or n == 0 then n = 1 end
  return math.ceil(chars / 4) + ids + overhead + budget * n
end

local token_windows = {} -- charge log key -> its window (lib.lua tokens_window), this tick

-- The quota keys request `rk` (tenant `tenant`) counts against, the first of them that is at
-- its limit (plus its look-ahead when `ahead`), if any, and for each key the count of its
-- dispatched requests at which the tenants it holds back are woken (sched_leave): its limit
-- plus half its look-ahead (rounded down), so a tick tops the look-ahead up after every
-- second or third leave, not after each one (and never later than the key has room).
-- Then its token budgets' windows (their charge logs, under the gate prefix), each with the
-- wake count -1 (sched_leave): the first where its estimate does not fit is `over` when no
-- quota key is, with `due`, how long until the window has room for it by the clock; else
-- `charges`, what dispatching it charges: {log key, charges key, window, estimate, the
-- window}. An estimate above the whole limit is not charged (the attempt drops it unsent).
local function quota_keys(q, c, rk, tenant, ahead)
  local keys, over, metadata, wakes = {}, nil, nil, {}
  local charges, due = {}, nil
  local function value(attr)
    if attr == c.attr then return tenant or '' end
    metadata = metadata or redis.call('HGET', rk, 'metadata') or ''
    return sched_value(metadata, attr)
  end
  for _, s in ipairs(q.specs) do
    local v = value(s.attr)
    if v ~= '' then
      local qk = s.k .. v
      keys[#keys + 1] = qk
      wakes[#wakes + 1] = s.limit + math.floor(s.la / 2)
      if not over then
        -- counted once a tick: only this tick's dispatches change them (dispatch_one)
        local u = quota_used[qk]
        if not u then
          u = {redis.call('ZCARD', K.gate .. qk .. TAIL_SENT), 0}
          if s.h then -- (leases end on whole seconds: later than now = later than its second)
            u[2] = redis.call('ZCOUNT', K.gate .. qk .. TAIL_HOLDERS,
              '(' .. now_whole, '+inf')
          end
          quota_used[qk] = u
        end
        local used = math.max(u[1], u[2])
        local cap = s.limit
        if ahead then cap = cap + s.la end
        if used >= cap then over = qk end
      end
    end
  end
  local payload = nil
  for _, s in ipairs(q.tokens) do
    local v = value(s.attr)
    if v ~= '' then
      payload = payload or redis.call('HGET', rk, 'payload') or ''
      local est = estimate_tokens(payload, s.dmt)
      if est <= s.limit then
        local lk = s.log .. v
        keys[#keys + 1] = lk
        wakes[#wakes + 1] = -1
        if not over then
          local log_key, charges_key = K.gate .. lk, K.gate .. s.ch .. v
          local w = token_windows[lk]
          if not w then
            tokens_purge(log_key, charges_key, s.window, now)
            w = tokens_window(log_key, charges_key)
            token_windows[lk] = w
          end
          if w.total + est > s.limit then
            over, due = lk, tokens_wait(w, est, s.limit, s.window, now)
          else
            charges[#charges + 1] = {log_key, charges_key, s.window, est, w}
          end
        end
      end
    end
  end
  return keys, over, wakes, charges, due
end

local held = {} -- tenants blocked in this tick: {q, c, tk}, for the quota look-ahead

-- Dispatch the next request of queue q: true, or false when it has nothing (more) to send.
local function take(q)
  local c = q.conf
  if not c then
    while true do
      local head = redis.call('ZPOPMIN', q.pending)
      if #head == 0 then return false end
      local id, rk, f = check(q, head[1])
      if id then return dispatch_one(q, id, rk, f, nil) end
    end
  end
  local ready = c.base .. TAIL_READY
  while true do
    local top = redis.call('ZRANGE', ready, 0, 0)
    if #top == 0 then return false end
    local rm = top[1]
    local hm, tk = string.match(rm, '^(.*)\n([^\n]*)$')
    if not hm then
      redis.call('ZREM', ready, rm) -- not an entry the scripts wrote
    else
      local id, rk, f = check(q, hm)
      if not id then
        -- dealt with; make sure the tenant moves on (the record may be gone or unreadable)
        if not sched_drop(K, c, tk, hm, false) then redis.call('ZREM', ready, rm) end
      else
        local qkeys, over, wakes, charges, due = quota_keys(q, c, rk, f[5], false)
        if over then
          sched_block(K, c, tk, rm, over)
          if due then -- a token budget: also when its window has room by the clock
            redis.call('ZADD', qkey(K, q.name, TAIL_WAKEUPS), 'LT', fmt_time(now + due), over)
          end
          -- once per hold-back, not again after every re-check (its log says since when)
          local note = '"key":' .. cjson.encode(over)
          local tail = '"e":"held",' .. note .. '}'
          if string.sub(f[6] or '', -#tail) ~= tail then
            redis.call('HSET', rk, 'log', log_with(f[6], id, log_entry(now, 'held', note)))
          end
          if not due then held[#held + 1] = {q = q, c = c, tk = tk} end -- (no look-ahead)
        else
          redis.call('ZREM', q.pending, hm)
          sched_pop_ready(c, tk, rm, hm)
          return dispatch_one(q, id, rk, f, qkeys, nil, wakes, charges)
        end
      end
    end
  end
end

-- the merge policy's state (shared by the pool's dispatchers), when there is a choice
local merge_key = KEYS[#Q * 5 + 1]
local tiered = cfg.policy == 'tier-priority'
local choosers, total_w = 0, 0
for _, q in ipairs(Q) do
  if q.allowed > 0 then choosers = choosers + 1 end
  if q.dispatch then total_w = total_w + q.weight end
end
local stateful = choosers > 1 -- one queue with room: nothing to merge, no state to keep
local waited = {}
for l = 0, 5 do waited[l] = 0 end
for _, q in ipairs(Q) do q.c = 0 end
if stateful then
  local fields = {}
  for _, q in ipairs(Q) do fields[#fields + 1] = 'c:' .. q.name end
  for l = 0, 5 do fields[#fields + 1] = 'w:' .. l end
  local vals = redis.call('HMGET', merge_key, unpack(fields))
  for i, q in ipairs(Q) do q.c = tonumber(vals[i]) or (q.rand or 0) * total_w end
  for l = 0, 5 do waited[l] = tonumber(vals[#Q + 1 + l]) or 0 end
end
local merged = false

-- The queue to dispatch from next, the queues it was chosen among, the lanes with something
-- to send and the chosen lane; nil when no queue has room and something to send.
local function choose()
  local cands, lanes, top = {}, {}, nil
  for _, q in ipairs(Q) do
    if q.allowed > 0 and not q.empty then
      cands[#cands + 1] = q
      lanes[q.lane] = true
      if not top or q.lane < top then top = q.lane end
    end
  end
  if #cands == 0 then return nil end
  local lane = top
  if tiered then
    local most = -1
    for l = 0, 5 do
      if lanes[l] and l ~= top and waited[l] >= cfg.max_wait and waited[l] > most then
        lane, most = l, waited[l]
      end
    end
  end
  local set, best, bv = {}, nil, nil
  for _, q in ipairs(cands) do
    if not tiered or q.lane == lane then
      set[#set + 1] = q
      local v = q.c + q.weight
      if not best or v > bv then best, bv = q, v end
    end
  end
  return best, set, lanes, lane
end

while n_free > 0 do
  local q, set, lanes, lane = choose()
  if not q then break end
  if take(q) then
    local w = 0
    for _, s in ipairs(set) do
      s.c = s.c + s.weight
      w = w + s.weight
    end
    q.c = q.c - w
    if tiered then
      for l = 0, 5 do
        if l == lane or not lanes[l] then waited[l] = 0 else waited[l] = waited[l] + 1 end
      end
    end
    merged = true
    n_free = n_free - 1
    q.allowed = q.allowed - 1
    q.sent = q.sent + 1
  else
    q.empty = true
  end
end

if merged and stateful then
  local out = {}
  for _, q in ipairs(Q) do
    out[#out + 1] = 'c:' .. q.name
    out[#out + 1] = string.format('%.17g', q.c)
  end
  if tiered then
    for l = 0, 5 do
      out[#out + 1] = 'w:' .. l
      out[#out + 1] = waited[l]
    end
  end
  redis.call('HSET', merge_key, unpack(out))
end

-- 4. look-ahead past quota limits --------------------------------------------------------
local ahead = 0
for _, b in ipairs(held) do
  local q, c, tk = b.q, b.c, b.tk
  local sub = sched_sub(c, tk)
  while ahead < cfg.lookahead and n_free > 0 and q.allowed > 0
    and (q.acap < 0 or q.active_n + q.sent < q.acap) do
    local past = redis.call('HGET', c.base .. TAIL_BLOCKED, tk) -- (unlisted once it is empty)
    if not past then break end
    local head = redis.call('ZRANGE', sub, 0, 1) -- its head, and whether it has more
    if #head == 0 then break end
    local id, rk, f = check(q, head[1])
    if not id then
      if not sched_drop(K, c, tk, head[1], false) then break end
    else
      local qkeys, over, wakes, charges = quota_keys(q, c, rk, f[5], true)
      if over then break end
      redis.call('ZREM', q.pending, head[1])
      sched_pop_held(K, c, tk, head[1], past, #head > 1)
      dispatch_one(q, id, rk, f, qkeys, past, wakes, charges)
      ahead = ahead + 1
      n_free = n_free - 1
      q.allowed = q.allowed - 1
      q.sent = q.sent + 1
    end
  end
end

-- what is due next ----------------------------------------------------------------------
local next_event = -1
local expired, rejected = {}, {}
for _, q in ipairs(Q) do
  expired[#expired + 1] = q.expired
  rejected[#rejected + 1] = q.rejected
  local timed = {}
  if q.sweep then timed = {q.delayed, q.expiry} end
  if q.conf and #q.tokens > 0 then timed[#timed + 1] = qkey(K, q.name, TAIL_WAKEUPS) end
  for _, k in ipairs(timed) do
    local e = redis.call('ZRANGE', k, 0, 0, 'WITHSCORES')
    if #e > 0 and (next_event < 0 or tonumber(e[2]) < next_event) then
      next_event = tonumber(e[2])
    end
  end
end
if next_event >= 0 then next_event = math.max(0, next_event - now) end
return {moved, expired, fmt_time(next_event), rejected}
