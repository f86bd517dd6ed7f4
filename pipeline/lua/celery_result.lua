-- celery_result.lua: store one Celery task result (the result backend of the pipeline's Celery
-- app), without Celery's read-before-write round trip. A RETRY (or other non-final) state never
-- overwrites a final one: a late RETRY write of an earlier attempt cannot hide the SUCCESS or
-- FAILURE of a later attempt of the same request (task id = request id).
-- KEYS[1] the result key (celery-task-meta-<task id>).
-- ARGV[1] the encoded meta (JSON), ARGV[2] TTL in seconds (0 = none), ARGV[3] '1' when the
-- state is final (SUCCESS, FAILURE, REVOKED), else '0'.
-- Publishes the meta on the key's channel (Celery's result consumers listen there), like
-- Celery's own Redis backend. Returns 1 when stored, 0 when a final state was kept.
if ARGV[3] ~= '1' then
  local current = redis.call('GET', KEYS[1])
  if current then
    local ok, meta = pcall(cjson.decode, current)
    if ok and type(meta) == 'table' and (meta.status == 'SUCCESS' or meta.status == 'FAILURE'
        or meta.status == 'REVOKED') then
      return 0
    end
  end
end
if tonumber(ARGV[2]) > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
else
  redis.call('SET', KEYS[1], ARGV[1])
end
redis.call('PUBLISH', KEYS[1], ARGV[1])
return 1
