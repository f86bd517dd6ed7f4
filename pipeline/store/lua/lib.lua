-- lib.lua: helpers shared by the other scripts. pipeline/scripts.py prepends this file to
-- each script before registering it, so every script is self-contained on the server.
-- Not a script on its own: it reads no KEYS or ARGV.
--
-- Record fields (hash Keys.request): id, queue, pool, payload, priority, deadline,
-- submitted_at, member, score, metadata, headers, endpoint, labels, result_list (key, '' for
-- none), result_list_max (entries kept, 0 = no trim), result_list_ttl (s, re-armed on every
-- push, 0 = none), state, token, attempts, dispatches, last_response, last_error, result,
-- finished_at, worker, started_at, attempt_span (tracing on: "<token> <traceparent>" of the
-- running attempt), wire ('llm-d-async' for a request a reference producer wrote; see
-- ingest.lua), ref_token (its generation token), for a line of a batch, batch and
-- custom_id (see batch_create.lua), tenant (indexed queues: the tenant attribute's value) and
-- qkeys (JSON list of the quota keys a dispatched attempt counts against; see sched.lua) and
-- qwake (JSON list, per key, the count of the key's dispatched requests at which the tenants it
-- holds back wake),
-- waiter ('1' once a client waits for the result: terminal() then rings notify:<id>; wait.lua),
-- cancel / cancel_ttl (a cancel that came while an attempt ran: its reason and result TTL;
-- the attempt, if still parked for a gate slot, ends CANCELLED unsent, and gets no retry).
-- Times are the server's clock (server_now). log: the decision log (see log_with below).
-- States: queued -> dispatched -> running -> (retry_wait -> queued ...) -> done.

-- The Redis server's clock (Unix s, µs precision). Every "now" a script compares a lease, a due
-- time or a deadline with comes from here, never from a caller: node clocks may disagree.
-- (now_whole: its whole seconds, as text)
local now_s, now_text, now_whole = nil, nil, nil
local function server_now()
  local t = redis.call('TIME')
  now_s = tonumber(t[1]) + tonumber(t[2]) / 1000000
  now_text = t[1] .. '.' .. string.sub('00000' .. t[2], -6)
  now_whole = t[1]
  return now_s
end

-- A time as the text stored in records and sorted-set scores (µs, no exponent).
local function fmt_time(t)
  if t == now_s then return now_text end
  return string.format('%.6f', t)
end

-- `s` as a JSON string (quoted and escaped).
local function json_str(s) return cjson.encode(s) end

-- The score of a lease that runs until `t` (server clock) in a sorted set of leases (a queue's
-- active set, a gate's holders): `t` rounded up to a whole second. A lease lasts up to 1 s
-- longer than asked; in return the set holds integers, which a small (listpack) sorted set
-- compares without parsing text: a fraction cost every ZADD one strtod() per member
-- (bench/redis_replay.py).
local function lease_score(t)
  return string.format('%d', math.ceil(t))
end

-- A script's key families: the last KEY_FAMILIES entries of its KEYS, in the order of
-- pipeline/store/keys.py Keys.families: the roots of the keys it derives from what it reads
-- (completed with an id, or a queue's, pool's or quota key's name and a TAIL_ constant,
-- store/keys.py TAILS), then global keys. Helpers take them as their parameter K.
local KEY_FAMILIES = 13
local function key_families()
  local n = #KEYS - KEY_FAMILIES
  return {req = KEYS[n + 1], notify = KEYS[n + 2], q = KEYS[n + 3], gate = KEYS[n + 4],
    pool = KEYS[n + 5], batch = KEYS[n + 6], ref_active = KEYS[n + 7],
    ref_cancel = KEYS[n + 8], seq = KEYS[n + 9], freed = KEYS[n + 10],
    batches_active = KEYS[n + 11], batches_expiry = KEYS[n + 12], batches_bell = KEYS[n + 13]}
end

-- Publish on the release bell's channel: sharded (SPUBLISH, kept within the slot's shard)
-- when it carries a pool's hash tag, as on a Redis Cluster; keys.py `sharded` says the same.
local function publish_freed(K, message)
  local command = string.find(K.freed, '{', 1, true) and 'SPUBLISH' or 'PUBLISH'
  redis.call(command, K.freed, message)
end

-- Publish an abort notice for request ids `ids` (a list) on the abort channel, the release
-- channel's name with ':abort' (keys.py `abort_channel`), in the same slot on a Redis Cluster.
local function publish_abort(K, ids)
  local command = string.find(K.freed, '{', 1, true) and 'SPUBLISH' or 'PUBLISH'
  redis.call(command, K.freed .. ':abort', '!abort\n' .. table.concat(ids, '\n'))
end

-- Key `tail` (a TAIL_ constant) of `queue`.
local function qkey(K, queue, tail)
  return K.q .. queue .. tail
end

-- The decision log of a request: its record's field `log`, one JSON object per line and event,
-- {"t": server time, "e": event, ...}, oldest first, the last LOG_MAX kept. In the record, it
-- costs no key, no expiry and no command of its own: each writer below adds it to the HMGET /
-- HSET it makes of the record anyway, and it expires with the record.
local LOG_MAX = 50
local LOG_CHECK = 1500 -- bytes: a longer log is counted against LOG_MAX (an entry is >= 31)

-- Entries of this script call for each request id, waiting for its record's next write
-- (log_with). A script runs as one function call: this table starts empty every time.
local log_pending = {}

-- '{"t":<t>,' for time `t` (ms precision; the server's `now` cut from its text, not rounded);
-- the last one formatted is kept (a script stamps most entries with its one `now`).
local log_t, log_t_text = nil, ''
local function log_head(t)
  if t ~= log_t then
    local text = t == now_s and string.sub(now_text, 1, -4) or string.format('%.3f', t)
    log_t, log_t_text = t, '{"t":' .. text .. ','
  end
  return log_t_text
end

-- One entry: event `e` at `t` (server clock) with `rest`, more JSON members ('' for none).
local function log_entry(t, e, rest)
  if rest and rest ~= '' then return log_head(t) .. '"e":"' .. e .. '",' .. rest .. '}' end
  return log_head(t) .. '"e":"' .. e .. '"}'
end

-- Queue an entry for request `id`.
local function log_note(id, entry)
  local p = log_pending[id]
  if not p then
    p = {}
    log_pending[id] = p
  end
  p[#p + 1] = entry
end

-- Queue what an attempt journaled: `text` has one entry per line, "<s ago>\t<JSON object>"
-- (no "t": its time is the server's `now` minus the age, a duration the worker measured).
-- (Plain finds, not a pattern: a pattern tests each character against a class.)
local function log_journal(id, now, text)
  if not text or text == '' then return end
  local pos, len = 1, #text
  while pos <= len do
    local nl = string.find(text, '\n', pos, true) or len + 1
    local tab = string.find(text, '\t{', pos, true)
    if tab and tab < nl and nl > tab + 2 then
      local ago = tonumber(string.sub(text, pos, tab - 1)) or 0
      log_note(id, log_head(now - math.max(0, ago)) .. string.sub(text, tab + 2, nl - 1))
    end
    pos = nl + 1
  end
end

-- The record's log `log` (false or '' for none) with `id`'s queued entries and `entry` (or
-- nil) appended, trimmed to the last LOG_MAX; the caller writes it to the record.
local function log_with(log, id, entry)
  local p = log_pending[id]
  local s = entry
  if p then
    log_pending[id] = nil
    if entry then p[#p + 1] = entry end
    s = table.concat(p, '\n')
  elseif not entry then
    return log or ''
  end
  if log and log ~= '' then s = log .. '\n' .. s end
  if #s > LOG_CHECK then
    local _, lines = string.gsub(s, '\n', '')
    if lines >= LOG_MAX then -- keep what follows the (lines + 1 - LOG_MAX)-th newline
      local at = 0
      for _ = 1, lines + 1 - LOG_MAX do at = string.find(s, '\n', at + 1, true) end
      s = string.sub(s, at + 1)
    end
  end
  return s
end

-- Ring the pool's doorbell unless it is already ringing.
local function wake(K, pool)
  ring(K.pool .. pool .. TAIL_WAKE)
end

-- An attempt of `queue` ended or went back, its gate reservation released just before:
-- wake attempts parked for a slot (pipeline/bell.py subscribes).
-- `also`: more names to ring with it (the quota keys the attempt held, '\n'-separated, or '').
local function freed(K, queue, also)
  if also and also ~= '' then queue = queue .. '\n' .. also end
  publish_freed(K, queue)
end

-- Store a Celery task result meta (JSON) at `key` (TTL `ttl` s, '0' = none) and publish it on
-- the key's channel, as Celery's Redis backend does. A non-final state (`final` ~= '1') never
-- replaces a final one (SUCCESS, FAILURE, REVOKED). Returns 1 when stored, 0 when kept.
local function celery_meta(key, meta, ttl, final)
  if final ~= '1' then
    local current = redis.call('GET', key)
    if current then
      local ok, m = pcall(cjson.decode, current)
      if ok and type(m) == 'table' and (m.status == 'SUCCESS' or m.status == 'FAILURE'
          or m.status == 'REVOKED') then
        return 0
      end
    end
  end
  if tonumber(ttl) > 0 then
    redis.call('SET', key, meta, 'EX', ttl)
  else
    redis.call('SET', key, meta)
  end
  redis.call('PUBLISH', key, meta)
  return 1
end

-- A JSON string the way Go's encoding/json writes it (the llm-d-async reference's wire
-- format): cjson's escapes, but '/' left as is and <, >, &, U+2028, U+2029 as \u escapes.
local function go_json(s)
  local j = cjson.encode(s)
  j = string.gsub(j, '\\/', '/')
  j = string.gsub(j, '<', '\\u003c')
  j = string.gsub(j, '>', '\\u003e')
  j = string.gsub(j, '&', '\\u0026')
  j = string.gsub(j, '\226\128\168', '\\u2028')
  j = string.gsub(j, '\226\128\169', '\\u2029')
  return j
end

-- A result in the reference's format (its ResultMessage plus request_token, fields in its
-- order, empty ones left out): what its consumers BRPOP. An error's payload is
-- {"error":"<message>"}, as the reference writes it. status_code / error_code / token are ''
-- when absent.
local function ref_result(id, status_code, payload, error_code, error_message, token)
  local out = '{"id":' .. go_json(id)
  if status_code ~= '' and tonumber(status_code) ~= 0 then
    out = out .. ',"status_code":' .. tostring(tonumber(status_code))
  end
  if error_code ~= '' then payload = '{"error":' .. go_json(error_message) .. '}' end
  out = out .. ',"payload":' .. go_json(payload)
  if error_code ~= '' then out = out .. ',"error_code":' .. go_json(error_code) end
  if error_message ~= '' then out = out .. ',"error_message":' .. go_json(error_message) end
  if token ~= '' then out = out .. ',"request_token":' .. go_json(token) end
  return out .. '}'
end

-- After a reference-format result is pushed: the producer's generation keys go, but only
-- where they still hold this generation's token (a newer submission of the id keeps its own).
local function ref_cleanup(K, id, token)
  if token == '' then return end
  for _, k in ipairs({K.ref_active .. id, K.ref_cancel .. id}) do
    if redis.call('GET', k) == token then redis.call('DEL', k) end
  end
end

-- Push a terminal result onto a queue's result list (`list` '' or false: the queue keeps none),
-- trimmed to `max_len` entries (0 or absent: no trim) and expiring `ttl` s after the latest
-- push (0 or absent: never), so a list nobody pops stays bounded.
local function push_result(list, json, max_len, ttl)
  if not list or list == '' then return end
  local n = redis.call('LPUSH', list, json)
  max_len = tonumber(max_len) or 0
  if max_len > 0 and n > max_len then redis.call('LTRIM', list, 0, max_len - 1) end
  ttl = tonumber(ttl) or 0
  if ttl > 0 then redis.call('EXPIRE', list, string.format('%d', math.ceil(ttl))) end
end

-- Batches (pipeline/batch/; hash Keys.batch, see batch_create.lua for its fields).
-- Close batch `id` with its final status (completed, expired, cancelled or failed) at `now`:
-- it and its invalid-line list expire `retention` s later, and it leaves the active set.
local function batch_close(K, id, final, now)
  local bk = K.batch .. id
  local retention = tonumber(redis.call('HGET', bk, 'retention')) or 604800
  redis.call('HSET', bk, 'status', final, final .. '_at', fmt_time(now))
  for _, k in ipairs({bk, bk .. TAIL_INVALID}) do redis.call('EXPIRE', k, math.ceil(retention)) end
  redis.call('SREM', K.batches_active, id)
  redis.call('ZADD', K.batches_expiry, fmt_time(now + retention), id)
end

-- When every line of a running or cancelling batch has its result, end it: cancelled if it
-- was cancelled, failed if its lines could not all be stored (gave_up: batch_ingest_failed.lua),
-- expired if its window has passed, else completed. A batch whose files are
-- assembled by `pipeline serve` (field files = '1') goes to finalizing first and rings the
-- finalizers' doorbell; the finalizer closes it (batch_finalized.lua).
local function batch_settle(K, id, now)
  local bk = K.batch .. id
  local b = redis.call('HMGET', bk, 'status', 'total', 'completed', 'failed', 'expires_at',
    'files', 'gave_up')
  if b[1] ~= 'in_progress' and b[1] ~= 'cancelling' then return end
  if (tonumber(b[3]) or 0) + (tonumber(b[4]) or 0) < (tonumber(b[2]) or 0) then return end
  local final = 'completed'
  if b[1] == 'cancelling' then
    final = 'cancelled'
  elseif b[7] == '1' then
    final = 'failed'
  elseif now >= (tonumber(b[5]) or now + 1) then
    final = 'expired'
  end
  redis.call('HSET', bk, 'finalizing_at', fmt_time(now), 'final_status', final)
  if b[6] == '1' then
    redis.call('HSET', bk, 'status', 'finalizing')
    local bell = K.batches_bell
    if redis.call('LLEN', bell) == 0 then redis.call('RPUSH', bell, id) end
  else
    batch_close(K, id, final, now)
  end
end

-- A line of batch `id` got its terminal result (`ok`: a 2xx/3xx response): count it, in the
-- same atomic step as the result, and end the batch when it was the last.
local function batch_count(K, id, ok, now)
  local bk = K.batch .. id
  if redis.call('EXISTS', bk) == 0 then return end
  redis.call('HINCRBY', bk, ok and 'completed' or 'failed', 1)
  batch_settle(K, id, now)
end

-- One terminal write in this many (on average) trims its queue's `recent` set.
local RECENT_TRIM = 16

-- The record fields terminal() reads, in this order: a caller that reads the record first (to
-- fence an attempt) reads these and hands them over.
local TERMINAL_FIELDS = {'queue', 'pool', 'member', 'attempts', 'submitted_at', 'result_list',
  'result_list_max', 'result_list_ttl', 'wire', 'ref_token', 'qkeys', 'batch', 'state', 'token',
  'id', 'log', 'waiter', 'qwake'}

-- Write the terminal result of request `id` and take it out of the sets its state has it in (a
-- dispatched or running request is only in its queue's active set; any other one is looked for
-- in every waiting set too). status_code / error_code are '' when absent. `quiet`: do not
-- publish the release on the freed channel (the attempt handed its slot over: nothing was
-- freed). `f`: the record's TERMINAL_FIELDS, if the caller read them (else read here).
-- `attempted`: the attempt that ends it sent an HTTP request (counted in `attempts`).
-- `nowake`: do not ring the pool's doorbell (a hand-over, and the worker that took the slot
-- still has attempts of the queue parked: the dispatcher is rung when it runs low).
-- `ref`: the key holding the body (finish.lua: an answer longer than PIPELINE_BODY_INLINE_MAX,
-- `payload` then ''): the result carries "payload_ref" instead of "payload", the record keeps
-- the key in its field `body`, and the key expires with the record and the result list.
-- Returns the result JSON.
local function terminal(K, id, now, ttl, status_code, payload, error_code, error_message,
    quiet, f, attempted, nowake, ref)
  local rk = K.req .. id
  f = f or redis.call('HMGET', rk, unpack(TERMINAL_FIELDS))
  local queue, pool, member, state = f[1], f[2], f[3], f[13]
  local attempts = tonumber(f[4]) or 0
  if attempted then attempts = attempts + 1 end
  if state ~= 'dispatched' and state ~= 'running' then
    if redis.call('ZREM', qkey(K, queue, TAIL_PENDING), member) == 1 then
      sched_remove(K, queue, id, member)
    end
    redis.call('ZREM', qkey(K, queue, TAIL_DELAYED), id)
    redis.call('ZREM', qkey(K, queue, TAIL_EXPIRY), id)
  end
  local keys = sched_leave(K, id, f[11], f[18], nowake)
  if state ~= 'queued' and state ~= 'retry_wait' then
    redis.call('ZREM', qkey(K, queue, TAIL_ACTIVE), id)
  end
  local outcome, sc = 'ok', nil
  local finished, attempts_text = fmt_time(now), string.format('%d', attempts)
  local parts = {'{"id":', json_str(id), ',"queue":', json_str(queue), ',"payload":',
    json_str(payload), ',"attempts":', attempts_text}
  if ref then parts[5], parts[6] = ',"payload_ref":', json_str(ref) end
  if f[5] and string.find(f[5], '^%d+%.?%d*$') then
    parts[#parts + 1] = ',"submitted_at":'
    parts[#parts + 1] = f[5]
  end
  parts[#parts + 1] = ',"finished_at":'
  parts[#parts + 1] = finished
  if status_code ~= '' then
    local code = tonumber(status_code)
    sc = string.format('%d', code)
    if code >= 300 then outcome = 'http_' .. sc end
    parts[#parts + 1] = ',"status_code":'
    parts[#parts + 1] = sc
  end
  if error_code ~= '' then
    parts[#parts + 1] = ',"error_code":'
    parts[#parts + 1] = json_str(error_code)
    outcome = error_code
  end
  -- also without an error code: an HTTP result's note (the gateway's drop reason)
  if error_message ~= '' then
    parts[#parts + 1] = ',"error_message":'
    parts[#parts + 1] = json_str(error_message)
  end
  parts[#parts + 1] = '}'
  local json = table.concat(parts)
  local done = '"outcome":"' .. outcome .. '"'
  if sc then done = done .. ',"status":' .. sc end
  local log = log_with(f[16], id, log_entry(now, 'done', done))
  if attempted then
    redis.call('HSET', rk, 'state', 'done', 'result', json, 'finished_at', finished,
      'token', '', 'attempts', attempts_text, 'log', log)
  else
    redis.call('HSET', rk, 'state', 'done', 'result', json, 'finished_at', finished,
      'token', '', 'log', log)
  end
  redis.call('EXPIRE', rk, ttl)
  if ref then
    redis.call('HSET', rk, 'body', ref)
    local list_ttl = (f[6] and f[6] ~= '') and tonumber(f[8]) or 0
    redis.call('EXPIRE', ref, math.ceil(math.max(tonumber(ttl), list_ttl or 0)))
  end
  if f[9] == 'llm-d-async' then  -- it came from a reference producer: its consumer's format
    -- (its consumers know no payload_ref: the body inline, at a copy's cost; the worker stores
    -- such a request's body inline anyway)
    if ref then payload = redis.call('GET', ref) or '' end
    push_result(f[6], ref_result(id, status_code, payload, error_code, error_message,
      f[10] or ''), f[7], f[8])
    ref_cleanup(K, id, f[10] or '')
  else
    push_result(f[6], json, f[7], f[8])
  end
  if f[17] then  -- a client waits on its notify list (wait.lua marked the record)
    local nk = K.notify .. id
    redis.call('RPUSH', nk, '1')
    redis.call('EXPIRE', nk, 300)
  end
  redis.call('HINCRBY', qkey(K, queue, TAIL_STATS), outcome, '1')
  if f[12] then batch_count(K, f[12], outcome == 'ok', now) end
  local recent = qkey(K, queue, TAIL_RECENT)
  redis.call('ZADD', recent, finished, id)
  -- trimmed to its last 5 minutes by one finish in RECENT_TRIM (picked by the server clock's
  -- µs; readers select by score), not by every one
  if math.floor(now * 1000000 + 0.5) % RECENT_TRIM == 0 then
    redis.call('ZREMRANGEBYSCORE', recent, '-inf', now - 300)
  end
  if not nowake then wake(K, pool) end
  if not quiet then freed(K, queue, keys) end
  return json
end

-- Delete a finished request's record `rk` (a new submission takes its id) and the body key
-- it names (field `body`, a large answer's: terminal()); a key read from data, like a
-- record's result list.
local function drop_record(rk)
  local body = redis.call('HGET', rk, 'body')
  if body then redis.call('DEL', body) end
  redis.call('DEL', rk)
end

-- Why request `rk` (its hash) must get no new attempt: it was cancelled while an attempt ran
-- (fields cancel / cancel_ttl, see cancel.lua), or it is a line of a cancelling batch.
-- Returns the reason ('cancelled', 'batch cancelled') and the result TTL (s), or nil.
local function cancel_reason(K, rk)
  local c = redis.call('HMGET', rk, 'batch', 'cancel', 'cancel_ttl')
  if c[2] then return c[2], tonumber(c[3]) or 604800 end
  if c[1] then
    local b = redis.call('HMGET', K.batch .. c[1], 'status', 'result_ttl')
    if b[1] == 'cancelling' then return 'batch cancelled', tonumber(b[2]) or 604800 end
  end
  return nil
end

-- Put a waiting request back into its queue: into the pending set at once, or into the
-- delayed set until `due` (server clock). The original ordering key (score, member) is kept.
-- A request cancelled while its attempt ran, or a line of a cancelling batch, ends CANCELLED
-- instead. `quiet` as in terminal().
local function enqueue(K, id, now, due, quiet)
  local rk = K.req .. id
  local reason, ttl = cancel_reason(K, rk)
  if reason then  -- no new attempt
    terminal(K, id, now, ttl, '', '{"error": "' .. reason .. '"}', 'CANCELLED', reason,
      quiet)
    return
  end
  local f = redis.call('HMGET', rk, 'queue', 'pool', 'member', 'score', 'deadline', 'qkeys',
    'log', 'qwake')
  local queue = f[1]
  redis.call('ZREM', qkey(K, queue, TAIL_ACTIVE), id)
  local keys = sched_leave(K, id, f[6], f[8])
  redis.call('ZADD', qkey(K, queue, TAIL_EXPIRY), f[5], id)
  local log = log_with(f[7], id)
  if due > now then
    redis.call('ZADD', qkey(K, queue, TAIL_DELAYED), fmt_time(due), id)
    redis.call('HSET', rk, 'state', 'retry_wait', 'token', '', 'log', log)
  else
    redis.call('ZADD', qkey(K, queue, TAIL_PENDING), f[4], f[3])
    sched_add(K, queue, id, f[4], f[3])
    redis.call('HSET', rk, 'state', 'queued', 'token', '', 'log', log)
    wake(K, f[2])
  end
  if not quiet then freed(K, queue, keys) end
end

local DEADLINE_PAYLOAD = '{"error": "deadline exceeded"}'

-- Terminal result for a request whose deadline passed while it waited: its last HTTP
-- response if an attempt got one (with its error code when it had one: a 2xx that was not
-- JSON is INVALID_RESPONSE), else DEADLINE_EXCEEDED.
local function expire(K, id, now, ttl)
  local f = redis.call('HMGET', K.req .. id, 'last_response', 'last_error')
  if f[1] and f[1] ~= '' then
    local r = cjson.decode(f[1])
    local note, code = '', ''
    if type(r.dropped_reason) == 'string' and r.dropped_reason ~= '' then
      note = 'HTTP ' .. tostring(r.status_code) .. ' (dropped: ' .. r.dropped_reason .. ')'
    end
    if type(r.error_code) == 'string' and r.error_code ~= '' then
      code = r.error_code
      if type(r.error_message) == 'string' then note = r.error_message end
    end
    return terminal(K, id, now, ttl, tostring(r.status_code), r.payload, code, note)
  end
  local message = 'deadline exceeded'
  if f[2] and f[2] ~= '' then message = message .. ' (last error: ' .. f[2] .. ')' end
  return terminal(K, id, now, ttl, '', DEADLINE_PAYLOAD, 'DEADLINE_EXCEEDED', message)
end

-- Token budgets (redis-quota, tokens mode; the rules: gate_tokens_acquire.lua). One window is
-- a charge log `log_key` (sorted set: holder -> when its charge started to count, server
-- clock) and its charges `charges_key` (hash: holder -> 'e<n>' an admission's estimate, 'd<n>'
-- the estimate the dispatcher charged for an attempt it sent that has not asked yet, '<n>'
-- settled). A charge counts while now - score < window (s); tokens_purge removes the others.
local function tokens_purge(log_key, charges_key, window, now)
  local old = redis.call('ZRANGEBYSCORE', log_key, '-inf', string.format('%.6f', now - window))
  for _, h in ipairs(old) do
    redis.call('ZREM', log_key, h)
    redis.call('HDEL', charges_key, h)
  end
end

-- The window's charges, oldest first: {total, open (the part still estimates, which a
-- settlement may lower), at (their scores), amounts}.
local function tokens_window(log_key, charges_key)
  local log = redis.call('ZRANGE', log_key, 0, -1, 'WITHSCORES')
  local raw = redis.call('HGETALL', charges_key)
  local charge = {}
  for i = 1, #raw, 2 do charge[raw[i]] = raw[i + 1] end
  local w = {total = 0, open = 0, at = {}, amounts = {}}
  for i = 1, #log, 2 do
    local v = charge[log[i]] or '0'
    local kind, n = string.sub(v, 1, 1), nil
    if kind == 'e' or kind == 'd' then
      n = tonumber(string.sub(v, 2)) or 0
      w.open = w.open + n
    else
      n = tonumber(v) or 0
    end
    w.at[#w.at + 1] = tonumber(log[i + 1])
    w.amounts[#w.amounts + 1] = n
    w.total = w.total + n
  end
  return w
end

-- Charge `estimate` tokens to `holder` from `now`, as `kind` ('e' or 'd'), in window `w` too
-- (when given); both keys expire a second after the window.
local function tokens_charge(log_key, charges_key, window, holder, kind, estimate, now, w)
  redis.call('ZADD', log_key, string.format('%.6f', now), holder)
  redis.call('HSET', charges_key, holder, kind .. string.format('%d', estimate))
  local ttl = math.ceil(window * 1000) + 1000
  redis.call('PEXPIRE', log_key, ttl)
  redis.call('PEXPIRE', charges_key, ttl)
  if w then
    w.total, w.open = w.total + estimate, w.open + estimate
    w.at[#w.at + 1] = now
    w.amounts[#w.amounts + 1] = estimate
  end
end

-- How long (s) until enough of window `w`'s charges have expired for `estimate` more tokens
-- to fit under `limit`, if nothing else is charged meanwhile (the oldest expire first).
local function tokens_wait(w, estimate, limit, window, now)
  local need, freed = w.total + estimate - limit, 0
  for i = 1, #w.amounts do
    freed = freed + w.amounts[i]
    if freed >= need then return w.at[i] + window - now end
  end
  return window
end
