-- dispatch.lua: one dispatcher tick for one queue. Promotes due retries, expires requests
-- whose deadline passed while waiting, then moves the head of the pending set to the
-- dispatched state, as many as the free capacity allows. Every time is the server's clock.
-- KEYS[1] pending, KEYS[2] delayed, KEYS[3] expiry, KEYS[4] active (this queue),
-- KEYS[5] the queue's result list ('' when it keeps none), KEYS[6..] active sets of the other
-- queues in the pool, after the pool's doorbell list when ARGV[13] is '1' (then KEYS[6] is the
-- doorbell).
-- ARGV[1] prefix, ARGV[2] gate budget (0..1),
-- ARGV[3] queue capacity (max dispatched+running for this queue; -1 = no limit),
-- ARGV[4] pool capacity (worker slots), ARGV[5] lease of a dispatched request (s from now),
-- ARGV[6] result TTL (s), ARGV[7] limit per sweep, ARGV[8] a fresh random nonce: attempt
-- tokens are <nonce>.<n>, unique per tick, ARGV[9] the Redis list of the pool's Celery queue
-- when the broker is this Redis ('' = the caller publishes), ARGV[10] the Celery task name,
-- ARGV[11] the messages' origin (the dispatching node), ARGV[12] the queue's name,
-- ARGV[13] '1' to empty the pool's doorbell first: every ring pushed so far is answered by this
-- tick and the pool's other queues' ticks that follow it in the same dispatcher round,
-- ARGV[14], ARGV[15] the result list's max length and TTL (s) (see lib.lua push_result).
-- With ARGV[9] set, each moved request is also pushed there as a Celery message (protocol 2,
-- kombu's Redis transport envelope, JSON body), so the move and the publish are one atomic
-- step: no request can be dispatched and never sent.
-- Moves min(floor(budget x (pool capacity - active in pool)), queue capacity - active in
-- queue); at least 1 when budget > 0, both have room and the queue has nothing active, so a
-- fractional budget never stalls an idle queue.
-- Returns {moved, expired, next_event, rejected} where moved is a flat list of
-- id, token, dispatch number, priority; next_event is how long until the earliest due retry
-- or deadline of a waiting request (s from now, as text; -1 if none); rejected lists
-- malformed members removed.
local prefix, ttl = ARGV[1], ARGV[6]
local now = server_now()
local limit = tonumber(ARGV[7])
local lease_until = fmt_time(now + tonumber(ARGV[5]))
local others = 6
if ARGV[13] == '1' then
  redis.call('DEL', KEYS[6])
  others = 7
end

for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, limit)) do
  redis.call('ZREM', KEYS[2], id)
  local f = redis.call('HMGET', prefix .. 'req:' .. id, 'member', 'score', 'state')
  if f[3] == 'retry_wait' then
    redis.call('ZADD', KEYS[1], f[2], f[1])
    redis.call('HSET', prefix .. 'req:' .. id, 'state', 'queued')
  end
end

local expired = 0
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, limit)) do
  local state = redis.call('HGET', prefix .. 'req:' .. id, 'state')
  if state == 'queued' or state == 'retry_wait' then
    expire(prefix, id, now, ttl)
    expired = expired + 1
  else
    redis.call('ZREM', KEYS[3], id)
  end
end

local budget = tonumber(ARGV[2])
local active_q = redis.call('ZCARD', KEYS[4])
local in_pool = active_q
for i = others, #KEYS do in_pool = in_pool + redis.call('ZCARD', KEYS[i]) end
local n_free = tonumber(ARGV[4]) - in_pool
-- the budget scales the free worker slots; the queue capacity caps the result on its own (a
-- capacity gate's budget is its free share already: scaling its free room by it again would
-- stall a limit-16 gate until 4 of its slots were free)
local free = math.floor(budget * n_free)
local qcap = tonumber(ARGV[3])
if qcap >= 0 then
  free = math.min(free, qcap - active_q)
  n_free = math.min(n_free, qcap - active_q)
end
if free < 1 and budget > 0 and n_free > 0 and active_q == 0 then free = 1 end

local null = cjson.null
-- One Celery task message (what ``Task.apply_async`` would LPUSH through kombu) for attempt
-- `token` of request `id`: args (id, token), kwargs {queue, priority, attempt}.
local function celery_message(id, token, n, priority, t)
  local queue_name = ARGV[12]
  local body = cjson.encode({{id, token}, {queue = queue_name, priority = priority, attempt = n},
    {callbacks = null, errbacks = null, chain = null, chord = null}})
  return cjson.encode({
    body = body,
    ['content-encoding'] = 'utf-8',
    ['content-type'] = 'application/json',
    headers = {
      lang = 'py', task = ARGV[10], id = id, shadow = null, eta = null, expires = null,
      group = null, group_index = null, retries = 0, timelimit = {null, null},
      root_id = id, parent_id = null,
      argsrepr = "('" .. id .. "', '" .. token .. "')",
      kwargsrepr = "{'queue': '" .. queue_name .. "', 'priority': " .. priority ..
        ", 'attempt': " .. n .. "}",
      origin = ARGV[11], ignore_result = false, replaced_task_nesting = 0,
      stamped_headers = null, stamps = {},
    },
    properties = {
      correlation_id = id, delivery_mode = 2, priority = 0,
      delivery_info = {exchange = '', routing_key = ARGV[9]},
      delivery_tag = ARGV[8] .. '-' .. t .. '-' .. id,
    },
  })
end

local moved, rejected = {}, {}
local t = 0
while free > 0 do
  local head = redis.call('ZPOPMIN', KEYS[1])
  if #head == 0 then break end
  local member = head[1]
  local id = string.match(member, '^%d+|(.+)$')
  local rk = id and (prefix .. 'req:' .. id)
  local f = rk and redis.call('HMGET', rk, 'state', 'deadline', 'member', 'priority') or {}
  if not id or f[1] ~= 'queued' or f[3] ~= member then
    -- not a request this pipeline wrote (or a stale copy): report it, never drop silently
    rejected[#rejected + 1] = member
    if not id or not f[1] then
      push_result(KEYS[5], cjson.encode({id = id or member, payload =
        '{"error": "malformed queue entry"}', error_code = 'INVALID_REQUEST',
        error_message = 'malformed queue entry: ' .. member}), ARGV[14], ARGV[15])
    end
  elseif not tonumber(f[2]) then
    terminal(prefix, id, now, ttl, '', '{"error": "unreadable request record"}',
      'INVALID_REQUEST', 'unreadable request record: deadline is not a number')
  elseif tonumber(f[2]) <= now then
    expire(prefix, id, now, ttl)
    expired = expired + 1
  else
    t = t + 1
    local token = ARGV[8] .. '.' .. t
    local n = redis.call('HINCRBY', rk, 'dispatches', 1)
    redis.call('HSET', rk, 'state', 'dispatched', 'token', token)
    redis.call('ZREM', KEYS[3], id)
    redis.call('ZADD', KEYS[4], lease_until, id)
    moved[#moved + 1] = id
    moved[#moved + 1] = token
    moved[#moved + 1] = n
    moved[#moved + 1] = f[4]
    if ARGV[9] ~= '' then
      redis.call('LPUSH', ARGV[9], celery_message(id, token, n, tonumber(f[4]) or 0, t))
    end
    free = free - 1
  end
end

local next_event = -1
local d = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
if #d > 0 then next_event = tonumber(d[2]) end
local e = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
if #e > 0 and (next_event < 0 or tonumber(e[2]) < next_event) then next_event = tonumber(e[2]) end
if next_event >= 0 then next_event = math.max(0, next_event - now) end
return {moved, expired, fmt_time(next_event), rejected}
