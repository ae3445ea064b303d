-- One replica's heartbeat: renews all of its leases and tickets in one call. ARGV: 3 cap,
-- 4 slice, 5 ttl_ms, then groups of 4 from ARGV[6]: kind ('L' lease, 'T' ticket), id, scope,
-- arrival_us (tickets).
-- Returns {total, borrowed, waiting, result per group}:
--   lease:  0 renewed, 1 re-taken (it was gone: Redis restarted or it expired, and there was
--           room), 2 lost (gone and no room)
--   ticket: 0 renewed, 3 granted (it is a lease now), 4 queued again with its old arrival
--           (it was gone: Redis restarted)
local cap, slice, ttl = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])

prune()
local results = {}
local i = 6
while i + 3 <= #ARGV do
  local kind, id, scope = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local result
  if kind == 'L' then
    if redis.call('ZSCORE', holders, id) then
      add_holder(id, scope, ttl)
      result = 0
    elseif redis.call('ZCARD', holders) < cap and scope_has_room(scope, slice) then
      -- Running turns come before waiting tickets: this turn is running already.
      add_holder(id, scope, ttl)
      result = 1
    else
      result = 2
    end
  else
    if redis.call('ZSCORE', tickets, id) then
      redis.call('ZADD', ticket_expiry, now + ttl, id)
      keep(tickets, ttl)
      keep(ticket_expiry, ttl)
      keep(ticket_info, ttl)
      result = 0
    elseif redis.call('ZSCORE', holders, id) then
      add_holder(id, scope, ttl)
      result = 3
    else
      add_ticket(id, ARGV[i + 3], cap, ttl, slice, scope)
      result = 4
    end
  end
  results[#results + 1] = result
  i = i + 4
end
if borrowed() > 0 then
  keep(borrowed_key, ttl)
end

grant_waiting()
-- Tickets granted just now (by the loop above) are reported as granted.
i = 6
for j = 1, #results do
  if ARGV[i] == 'T' and results[j] ~= 3 and redis.call('ZSCORE', holders, ARGV[i + 1]) then
    results[j] = 3
  end
  i = i + 4
end

local reply = status()
for j = 1, #results do
  reply[3 + j] = results[j]
end
return reply
