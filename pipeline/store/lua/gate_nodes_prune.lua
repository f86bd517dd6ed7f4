-- gate_nodes_prune.lua: forget the nodes of a per-node gate (local-max-concurrency) whose slot
-- pool is gone (its keys expired: the node held nothing for an hour, or never will again), so
-- the registry does not grow with every node name a fleet ever used. Atomic with respect to
-- gate_lease_acquire.lua, which lists a node again in the same step as it takes a slot.
-- KEYS[1] the registry set (members: node names), KEYS[2] the root of the nodes' holders keys
-- (Keys.gate_node_prefix: a node's is the root, its name, TAIL_HOLDERS).
-- Returns the nodes dropped.
local out = {}
for _, node in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', KEYS[2] .. node .. TAIL_HOLDERS) == 0 then
    redis.call('SREM', KEYS[1], node)
    out[#out + 1] = node
  end
end
return out
