-- Resume a turn that lent its lease while a person decided: take a lease if there is room,
-- otherwise borrow one (add it over the cap and count it in `borrowed`; the next departure of
-- any holder repays it instead of freeing room). Never queues. ARGV: 3 id, 4 scope, 5 cap,
-- 6 slice, 7 ttl_ms.
-- Returns {total, borrowed, waiting, code}: code 1 taken, 3 borrowed over the fleet cap,
-- 4 over the tenant's slice only (repaid by that tenant's next release).
local id, scope = ARGV[3], ARGV[4]
local cap, slice, ttl = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])

prune()
grant_waiting()

local code = 1
if not redis.call('ZSCORE', holders, id) then
  local total = redis.call('ZCARD', holders)
  local scope_room = scope_has_room(scope, slice)
  add_holder(id, scope, ttl)
  if total >= cap then
    redis.call('INCR', borrowed_key)
    keep(borrowed_key, ttl)
    code = 3
  elseif not scope_room then
    code = 4
  end
end

local reply = status()
reply[4] = code
return reply
