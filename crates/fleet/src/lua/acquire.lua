-- Take a lease, or queue a ticket for one. ARGV: 7 id, 8 scope, 9 cap, 10 slice, 11 ttl_ms,
-- 12 wait (1: queue a ticket when there is no room, 0: just say busy), 13 claim_ms, 14 step
-- (fair queuing: how far the tenant's virtual time moves per turn it starts).
-- Returns {status (6 values), code, arrival_us}: code 1 granted, 2 queued, 0 busy, 5 refused:
-- the caller's class configuration is not the fleet's (nothing taken or queued).
local id, scope = ARGV[7], ARGV[8]
local cap, slice, ttl, wait = tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11]), ARGV[12]
local claim, step = tonumber(ARGV[13]), tonumber(ARGV[14])

prune()
-- Tickets that can run go first; whatever is left waiting cannot run now under its own cap,
-- slice and class cap, so a newcomer that fits overtakes nobody who could.
grant_waiting()

local code, arrival = 0, 0
if not conf_agrees(ttl) then
  code = 5
elseif redis.call('ZSCORE', holders, id) then
  -- This call ran before (a retry) and its ticket was granted meanwhile: claimed here.
  claim_holder(id, scope, ttl)
  code = 1
elseif redis.call('ZSCORE', tickets, id) then
  code, arrival = 2, tonumber(redis.call('ZSCORE', tickets, id))
elseif redis.call('ZCARD', holders) < room_under(cap) and scope_has_room(scope, slice)
    and class_has_room(class_of(id), cap) then
  add_holder(id, scope, ttl)
  code = 1
elseif wait == '1' then
  add_ticket(id, now_us, cap, ttl, slice, claim, scope, step)
  code, arrival = 2, now_us
end

local reply = status()
reply[7], reply[8] = code, arrival
return reply
