-- Give back a lease, or withdraw a ticket (a cancelled wait), whichever the id is; a ticket
-- granted at the moment of its cancellation is a lease by now and is given back too. The room
-- goes to the oldest ticket that can run. ARGV: 7 id, 8 scope.
-- Returns {status (6 values), removed}: removed 1 when a lease or ticket went.
local id, scope = ARGV[7], ARGV[8]

prune()
local removed = drop_ticket(id) + remove_holder(id, scope)
grant_waiting()

local reply = status()
reply[7] = removed
return reply
