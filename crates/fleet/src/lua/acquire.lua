-- Take a lease, or queue a ticket for one. ARGV: 3 id, 4 scope, 5 cap, 6 slice, 7 ttl_ms,
-- 8 wait (1: queue a ticket when there is no room, 0: just say busy).
-- Returns {total, borrowed, waiting, code, arrival_us}: code 1 granted, 2 queued, 0 busy.
local id, scope = ARGV[3], ARGV[4]
local cap, slice, ttl, wait = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8]

prune()
-- Tickets that can run go first; whatever is left waiting cannot run now under its own cap and
-- slice, so a newcomer that fits overtakes nobody who could.
grant_waiting()

local code, arrival = 0, 0
if redis.call('ZSCORE', holders, id) then
  code = 1
elseif redis.call('ZSCORE', tickets, id) then
  code, arrival = 2, tonumber(redis.call('ZSCORE', tickets, id))
elseif redis.call('ZCARD', holders) < cap and scope_has_room(scope, slice) then
  add_holder(id, scope, ttl)
  code = 1
elseif wait == '1' then
  add_ticket(id, now_us, cap, ttl, slice, scope)
  code, arrival = 2, now_us
end

local reply = status()
reply[4], reply[5] = code, arrival
return reply
