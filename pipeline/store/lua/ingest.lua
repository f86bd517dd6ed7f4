-- ingest.lua: take requests that a producer of the llm-d-async reference wrote into its sorted
-- set (a queue with "ingest": "llm-d-async") into this queue, atomically and at most once per
-- entry; entries that cannot be served get a terminal result on the reference's result list
-- in its format, never a silent drop. The entries were parsed by the caller
-- (pipeline/store/wire.py); this script decides with the sorted set and the records.
-- KEYS[1] the reference's sorted set (the queue's name, verbatim), KEYS[2] the queue's pending
-- set, KEYS[3] its expiry set, KEYS[4] its pool's doorbell, then the key families (lib.lua
-- key_families: records, the reference's request-cancel / request-active keys, seq). Payload
-- keys are named by the entries.
-- ARGV[1] queue, ARGV[2] pool, ARGV[3] the queue's labels (JSON),
-- ARGV[5] / ARGV[6] the result lists' bounds (max length, TTL in s: see push_result),
-- ARGV[4] the entries: a JSON array of arrays, each one of
--   [member, 'ok', id, token, score, deadline, payload (JSON text, or '' with a payload key),
--    payload key ('' when inline), metadata (JSON), headers (JSON), endpoint, result list]
--   [member, 'bad', id, result list, message, token]
-- Returns one word per entry: 'ingested', 'invalid' (INVALID_REQUEST result pushed),
-- 'cancelled' (the producer cancelled it: CANCELLED result), 'unavailable' (its payload key is
-- gone: PAYLOAD_UNAVAILABLE result), 'duplicate' (this generation is here already: the copy is
-- removed), 'busy' (another generation of the id is still live: left in the sorted set until
-- it ends), 'gone' (another dispatcher took it first).
local K, queue, pool = key_families(), ARGV[1], ARGV[2]
local max_len, list_ttl = ARGV[5], ARGV[6]
local now = server_now()
local entries = cjson.decode(ARGV[4])
local out = {}
local woke = false

-- a terminal result for an entry that never became a request of ours
local function refuse(member, id, list, code, message, token)
  if redis.call('ZREM', KEYS[1], member) == 0 then return 'gone' end
  push_result(list, ref_result(id, '', '', code, message, token), max_len, list_ttl)
  ref_cleanup(K, id, token)
  return nil
end

for i, e in ipairs(entries) do
  local member, verdict = e[1], e[2]
  local word
  if verdict == 'bad' then
    word = refuse(member, e[3], e[4], 'INVALID_REQUEST', e[5], e[6]) or 'invalid'
  else
    local id, token, list = e[3], e[4], e[12]
    local rk = K.req .. id
    local r = redis.call('HMGET', rk, 'state', 'ref_token')
    if r[1] and r[2] == token then
      redis.call('ZREM', KEYS[1], member)
      word = 'duplicate'
    elseif r[1] and r[1] ~= 'done' then
      word = 'busy'
    elseif token ~= '' and redis.call('GET', K.ref_cancel .. id) == token then
      word = refuse(member, id, list, 'CANCELLED', 'cancelled', token) or 'cancelled'
    else
      local payload = e[7]
      if e[8] ~= '' then payload = redis.call('GET', e[8]) end
      if not payload then
        word = refuse(member, id, list, 'PAYLOAD_UNAVAILABLE',
          'payload unavailable: ' .. e[8] .. ' is gone', token) or 'unavailable'
      elseif redis.call('ZREM', KEYS[1], member) == 0 then
        word = 'gone'
      else
        if r[1] then drop_record(rk) end
        if e[8] ~= '' then redis.call('DEL', e[8]) end  -- the record holds the payload now
        local seq = redis.call('INCR', K.seq)
        local m = string.format('%015d', seq) .. '|' .. id
        redis.call('HSET', rk, 'id', id, 'queue', queue, 'pool', pool, 'score', e[5],
          'priority', '0', 'deadline', e[6], 'payload', payload, 'metadata', e[9],
          'headers', e[10], 'endpoint', e[11], 'result_list', list, 'result_list_max', max_len,
          'result_list_ttl', list_ttl, 'labels', ARGV[3],
          'member', m, 'submitted_at', fmt_time(now), 'state', 'queued',
          'token', '', 'attempts', 0, 'dispatches', 0, 'wire', 'llm-d-async',
          'ref_token', token)
        redis.call('ZADD', KEYS[2], e[5], m)
        sched_add(K, queue, id, e[5], m, e[9])  -- its tenant's turn (sched.lua)
        redis.call('ZADD', KEYS[3], e[6], id)
        woke = true
        word = 'ingested'
      end
    end
  end
  out[i] = word
end
if woke then ring(KEYS[4]) end
return out
