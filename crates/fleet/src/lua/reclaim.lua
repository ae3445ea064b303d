-- Resume a turn that lent its lease while a person decided: take a lease if there is room,
-- otherwise borrow one (add it over the cap and count it in `borrowed`; the next departure of
-- any holder repays it instead of freeing room). Never queues. ARGV: 7 id, 8 scope, 9 cap,
-- 10 slice, 11 ttl_ms. A class's caps do not apply: the turn was running already.
-- Returns {status (6 values), code}: code 1 taken, 3 borrowed over the fleet
-- cap, 4 over the tenant's slice only (repaid by that tenant's next release).
local id, scope = ARGV[7], ARGV[8]
local cap, slice, ttl = tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])

prune()
grant_waiting()

local code = 1
if redis.call('ZSCORE', holders, id) then
  claim_holder(id, scope, ttl)
else
  local total = redis.call('ZCARD', holders)
  local scope_room = scope_has_room(scope, slice)
  add_holder(id, scope, ttl)
  if total >= room_under(cap) then
    redis.call('INCR', borrowed_key)
    keep(borrowed_key, ttl)
    code = 3
  elseif not scope_room then
    code = 4
  end
end

local reply = status()
reply[7] = code
return reply
