-- Take a lease, or queue a ticket for one. ARGV: 5 id, 6 scope, 7 cap, 8 slice, 9 ttl_ms,
-- 10 wait (1: queue a ticket when there is no room, 0: just say busy), 11 claim_ms.
-- Returns {status (6 values), code, arrival_us}: code 1 granted, 2 queued,
-- 0 busy.
local id, scope = ARGV[5], ARGV[6]
local cap, slice, ttl, wait = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]), ARGV[10]
local claim = tonumber(ARGV[11])

prune()
-- Tickets that can run go first; whatever is left waiting cannot run now under its own cap and
-- slice, so a newcomer that fits overtakes nobody who could.
grant_waiting()

local code, arrival = 0, 0
if redis.call('ZSCORE', holders, id) then
  -- This call ran before (a retry) and its ticket was granted meanwhile: claimed here.
  claim_holder(id, scope, ttl)
  code = 1
elseif redis.call('ZSCORE', tickets, id) then
  code, arrival = 2, tonumber(redis.call('ZSCORE', tickets, id))
elseif redis.call('ZCARD', holders) < room_under(cap) and scope_has_room(scope, slice) then
  add_holder(id, scope, ttl)
  code = 1
elseif wait == '1' then
  add_ticket(id, now_us, cap, ttl, slice, claim, scope)
  code, arrival = 2, now_us
end

local reply = status()
reply[7], reply[8] = code, arrival
return reply
