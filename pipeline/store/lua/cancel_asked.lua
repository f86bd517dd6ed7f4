-- cancel_asked.lua: was this attempt's request cancelled while the attempt waited at its
-- worker for a gate slot (cancel.lua / batch_cancel_lines.lua mark a running request; a line
-- of a cancelling batch counts too, should the attempt ask before its line was marked)?
-- Asked by a parked attempt when a cancel notice named its request (pipeline/worker/bell.py)
-- or its park timed out without a ring (a notice may have been lost), before it sends.
-- KEYS[1] request hash, then the key families (lib.lua key_families).
-- ARGV[1] the attempt's token.
-- Returns the reason ('cancelled', 'batch cancelled', or 'fenced off': the request is no longer
-- this attempt's, e.g. cancelled with running 'abort' or reaped; it must not send), or false.
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 'fenced off' end
return cancel_reason(key_families(), KEYS[1]) or false
