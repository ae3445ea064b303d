-- Claim grants this replica heard of (over pub/sub) before their turns start: a grant still
-- held and not expired becomes a full lease; one that expired first (the replica was paused
-- past its claim window and the room went elsewhere) is queued again with its old arrival.
-- ARGV: 7 cap, 8 slice, 9 ttl_ms, 10 claim_ms, then groups of 4 from ARGV[11]: id, scope,
-- arrival_us (-1: not known yet), step.
-- Returns {status (6 values), result per group}: 1 claimed, 2 still waiting
-- (the message was older than the ticket's current place in line), 3 the grant had expired:
-- queued again, 4 the grant had expired, and it was granted again at once and claimed.
local cap, slice, ttl, claim = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]),
  tonumber(ARGV[10])

prune()
local results = {}
local i = 11
while i + 3 <= #ARGV do
  local id, scope, arrival = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  local result
  if redis.call('ZSCORE', holders, id) then
    claim_holder(id, scope, ttl)
    result = 1
  elseif redis.call('ZSCORE', tickets, id) or arrival < 0 then
    result = 2
  else
    add_ticket(id, arrival, cap, ttl, slice, claim, scope, ARGV[i + 3])
    result = 3
  end
  results[#results + 1] = result
  i = i + 4
end

grant_waiting()
i = 11
for j = 1, #results do
  if results[j] ~= 1 and redis.call('ZSCORE', holders, ARGV[i]) then
    claim_holder(ARGV[i], ARGV[i + 1], ttl)
    results[j] = results[j] == 3 and 4 or 1
  end
  i = i + 4
end

local reply = status()
for j = 1, #results do
  reply[6 + j] = results[j]
end
return reply
