-- One replica's heartbeat: renews all of its leases and tickets in one call, and claims the
-- grants it finds. ARGV: 7 cap, 8 slice, 9 ttl_ms, 10 claim_ms, then groups of 5 from ARGV[11]:
-- kind ('L' lease, 'T' ticket), id, scope, arrival_us (tickets), step (tickets). A re-taken
-- lease ignores its class's max_share: its turn is running already.
-- Returns {status (6 values), result per group}:
--   lease:  0 renewed, 1 re-taken (it was gone: Redis restarted or it expired, and there was
--           room), 2 lost (gone and no room)
--   ticket: 0 renewed, 3 granted and claimed (it is a lease now), 4 queued again with its old
--           arrival (it was gone: Redis restarted, or it expired while its replica was away)
local cap, slice, ttl, claim = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]),
  tonumber(ARGV[10])

prune()
-- Keeps the fleet's class configuration while a replica that agrees with it holds a lease or a
-- ticket (adopts the caller's when none is stored, as after a restart of Redis); an idle
-- replica's heartbeat leaves it to expire with the rest.
if #ARGV >= 11 then
  conf_agrees(ttl)
end
local results = {}
local relinked = {}
local renewed = false
local i = 11
while i + 4 <= #ARGV do
  local kind, id, scope = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local result
  if kind == 'L' then
    if redis.call('ZSCORE', holders, id) then
      claim_holder(id, scope, ttl)
      result = 0
    elseif redis.call('ZCARD', holders) < room_under(cap) and scope_has_room(scope, slice) then
      -- Running turns come before waiting tickets: this turn is running already.
      add_holder(id, scope, ttl)
      result = 1
    else
      result = 2
    end
  else
    if not renewed then
      renewed = true
      renew_presence()
    end
    if redis.call('ZSCORE', tickets, id) then
      redis.call('ZADD', ticket_expiry, now + ttl, id)
      local lane = lane_name(instance_of(id), class_of(id), scope)
      if not relinked[lane] then
        -- Back in line if its lane left the heads while this replica was away.
        relinked[lane] = true
        keep(tickets, ttl)
        keep(ticket_expiry, ttl)
        keep(ticket_info, ttl)
        keep(lane_key(lane), ttl)
        relink(lane, cap, ttl)
      end
      result = 0
    elseif redis.call('ZSCORE', holders, id) then
      claim_holder(id, scope, ttl)
      result = 3
    else
      add_ticket(id, ARGV[i + 3], cap, ttl, slice, claim, scope, ARGV[i + 4])
      result = 4
    end
  end
  results[#results + 1] = result
  i = i + 5
end
if borrowed() > 0 then
  keep(borrowed_key, ttl)
end
if learned_limit > 0 then
  -- Kept while any replica of the fleet lives; gone LEARNED_TTL_MS after the last one.
  redis.call('PEXPIRE', learned_key, LEARNED_TTL_MS)
end

grant_waiting()
-- Tickets granted just now (by the loop above) are claimed and reported as granted.
i = 11
for j = 1, #results do
  if ARGV[i] == 'T' and results[j] ~= 3 and redis.call('ZSCORE', holders, ARGV[i + 1]) then
    claim_holder(ARGV[i + 1], ARGV[i + 2], ttl)
    results[j] = 3
  end
  i = i + 5
end

local reply = status()
for j = 1, #results do
  reply[6 + j] = results[j]
end
return reply
