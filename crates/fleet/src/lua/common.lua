-- Shared prologue of every admitgate fleet script (prepended to each).
--
-- KEYS[1] holders        sorted set: lease id -> expiry (ms, server time)
-- KEYS[2] tickets        sorted set: ticket id -> arrival (us, server time): every waiting turn
-- KEYS[3] ticket_expiry  sorted set: ticket id -> expiry (ms): tickets expire with their replica
-- KEYS[4] ticket_info    hash: ticket id -> "<cap> <ttl_ms> <slice> <claim_ms> <scope>"
-- KEYS[5] borrowed       integer: leases added over the cap by human-approval reclaims
-- KEYS[6] granted        sorted set: lease id -> claim deadline (ms) of a grant not yet claimed
-- KEYS[7] replicas       sorted set: replica instance -> until when its tickets may get room
-- KEYS[8] classes        sorted set: cap -> cap, the caps of the replicas with waiting tickets
-- ARGV[1] the limit's key prefix "{key}:" (the derived keys below share its hash tag)
-- ARGV[2] channel on which granted ticket ids are published
-- ARGV[3] the calling replica instance ("<replica_id>#<nonce>"), ARGV[4] how long its tickets
--         may get room after it last queued or renewed one (ms)
--
-- Derived keys: "{key}:scope:<scope>" (a tenant's holders, as holders), "{key}:lane:<lane>"
-- (a lane's tickets by arrival; a lane is one replica instance's tickets of one scope, so all
-- of them share one cap and slice) and "{key}:heads:<cap>" (lane -> arrival of its oldest
-- ticket, for the lanes of replicas with that cap).
--
-- Cost: no script walks the tickets. A grant takes the oldest runnable lane head (a few
-- O(log n) reads per lane skipped: lanes whose tenant is at its slice, at most
-- cap / slice tenants times the replicas); expired entries are pruned at most PRUNE_BATCH per
-- kind and call.
--
-- The learned limit ("{key}:learned", a hash: limit, gen, at_us; see learned.rs): present only
-- when a replica with adaptive= moved it. Every script honours it: the fleet holds at most
-- min(caller's cap, learned limit) leases, and no grant is made at or above it. Absent, only
-- the caps count, exactly as before.
--
-- Time is the server's (TIME), never a client's clock. A lease or ticket whose expiry equals
-- the current millisecond is expired.
local holders, tickets, ticket_expiry, ticket_info, borrowed_key, granted, replicas, classes =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local prefix, channel, caller, presence_ms = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local scope_prefix = prefix .. 'scope:'
local clock = redis.call('TIME')
local now_us = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local now = math.floor(now_us / 1000)
-- Keys outlive their newest member by this much, so an idle limit leaves nothing behind.
local KEY_MARGIN_MS = 1000
-- At most this many expired entries of each kind go per call; the rest go in the next calls,
-- so a backlog of expired entries never makes one call expensive.
local PRUNE_BATCH = 100
local learned_key = prefix .. 'learned'
-- The learned limit outlives the last heartbeat or change by this much (an hour: a fleet that
-- restarts within it starts from what it learned).
local LEARNED_TTL_MS = 3600000
-- 0: no learned limit. learn.lua changes it within its call. Anything but a whole number >= 1
-- (a value tampered with: "2.5" would let 3 leases through, a negative one stop every grant)
-- counts as none: the caps alone count until a replica seeds it anew.
local learned_limit = tonumber(redis.call('HGET', learned_key, 'limit') or '0') or 0
if learned_limit < 1 or learned_limit ~= math.floor(learned_limit) or learned_limit > 2^53 then
  learned_limit = 0
end

-- The most leases a caller with `cap` may see held: its cap, or the learned limit below it.
local function room_under(cap)
  cap = tonumber(cap)
  if learned_limit > 0 and learned_limit < cap then
    return learned_limit
  end
  return cap
end

local function keep(key, ttl)
  if redis.call('PTTL', key) < ttl + KEY_MARGIN_MS then
    redis.call('PEXPIRE', key, ttl + KEY_MARGIN_MS)
  end
end

-- "<replica_id>#<nonce>" of an id "<replica_id>#<nonce>#<n>" (replica ids have no '#').
local function instance_of(id)
  return string.match(id, '^(.*)#') or ''
end

local function present(instance)
  local until_ms = redis.call('ZSCORE', replicas, instance)
  return until_ms ~= false and tonumber(until_ms) > now
end

local function parse_info(info)
  if not info then
    return nil
  end
  local cap, ttl, slice, claim, scope = string.match(info, '^(%d+) (%d+) (%d+) (%d+) (.*)$')
  if cap == nil then
    return nil
  end
  return {cap = cap, ttl = tonumber(ttl), slice = tonumber(slice), claim = tonumber(claim),
          scope = scope}
end

local function lane_key(lane)
  return prefix .. 'lane:' .. lane
end

local function heads_key(cap)
  return prefix .. 'heads:' .. cap
end

-- Puts the lane's oldest ticket (or nothing, when it is empty) in its cap's heads.
local function relink(lane, cap, ttl)
  local heads = heads_key(cap)
  local head = redis.call('ZRANGE', lane_key(lane), 0, 0, 'WITHSCORES')
  if #head == 0 then
    redis.call('ZREM', heads, lane)
    if redis.call('ZCARD', heads) == 0 then
      redis.call('ZREM', classes, cap)
    end
  else
    redis.call('ZADD', heads, head[2], lane)
    redis.call('ZADD', classes, cap, cap)
    keep(heads, ttl)
    keep(classes, ttl)
  end
end

-- Live holders of a scope, pruned on first use and then kept up to date in this call.
local scope_counts = {}
local function scope_count(scope)
  local n = scope_counts[scope]
  if n == nil then
    local key = scope_prefix .. scope
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
    n = redis.call('ZCARD', key)
    scope_counts[scope] = n
  end
  return n
end

local function scope_has_room(scope, slice)
  return slice == 0 or scope == '' or scope_count(scope) < slice
end

local function borrowed()
  return tonumber(redis.call('GET', borrowed_key) or '0')
end

-- n holders left: while some leases are borrowed, each departure repays one instead of freeing
-- room (the holder count stays above the cap until the debt is paid, so no room appears).
local function repay(n)
  if n > 0 then
    local owed = borrowed()
    if owed > 0 then
      if owed <= n then
        redis.call('DEL', borrowed_key)
      else
        redis.call('DECRBY', borrowed_key, n)
      end
    end
  end
end

-- A lease expiring `ttl` ms from now (for a grant not yet claimed: its claim window).
local function add_holder(id, scope, ttl)
  redis.call('ZADD', holders, now + ttl, id)
  keep(holders, ttl)
  if scope ~= '' then
    local key = scope_prefix .. scope
    local added = redis.call('ZADD', key, now + ttl, id)
    keep(key, ttl)
    if scope_counts[scope] ~= nil then
      scope_counts[scope] = scope_counts[scope] + added
    end
  end
end

-- The replica took up its grant (or renews a lease): a full lease from now on.
local function claim_holder(id, scope, ttl)
  redis.call('ZREM', granted, id)
  add_holder(id, scope, ttl)
end

local function remove_holder(id, scope)
  local removed = redis.call('ZREM', holders, id)
  redis.call('ZREM', granted, id)
  if scope ~= '' then
    local gone = redis.call('ZREM', scope_prefix .. scope, id)
    if scope_counts[scope] ~= nil then
      scope_counts[scope] = scope_counts[scope] - gone
    end
  end
  repay(removed)
  return removed
end

local function drop_ticket(id)
  local info = parse_info(redis.call('HGET', ticket_info, id))
  local removed = redis.call('ZREM', tickets, id)
  redis.call('ZREM', ticket_expiry, id)
  redis.call('HDEL', ticket_info, id)
  if info then
    local lane = instance_of(id) .. '|' .. info.scope
    redis.call('ZREM', lane_key(lane), id)
    relink(lane, info.cap, info.ttl)
  end
  return removed
end

-- The caller waits for room and is alive: its tickets may get room for presence_ms more.
-- Only callers with tickets renew it, so an idle limit's keys still expire.
local function renew_presence()
  redis.call('ZADD', replicas, now + presence_ms, caller)
  keep(replicas, presence_ms)
end

local function add_ticket(id, arrival, cap, ttl, slice, claim, scope)
  local lane = instance_of(id) .. '|' .. scope
  renew_presence()
  redis.call('ZADD', tickets, arrival, id)
  redis.call('ZADD', ticket_expiry, now + ttl, id)
  redis.call('HSET', ticket_info, id, cap .. ' ' .. ttl .. ' ' .. slice .. ' ' .. claim .. ' ' .. scope)
  redis.call('ZADD', lane_key(lane), arrival, id)
  keep(tickets, ttl)
  keep(ticket_expiry, ttl)
  keep(ticket_info, ttl)
  keep(lane_key(lane), ttl)
  relink(lane, cap, ttl)
end

-- Expired holders and tickets go (their replica stopped renewing them). A grant that went
-- unclaimed past its window says its replica is dead or paused: the replica's tickets get no
-- more room until it calls again (its next heartbeat puts them back in line).
local function prune()
  local unclaimed = redis.call('ZRANGEBYSCORE', granted, '-inf', now, 'LIMIT', 0, PRUNE_BATCH)
  for _, id in ipairs(unclaimed) do
    redis.call('ZREM', granted, id)
    redis.call('ZREM', replicas, instance_of(id))
  end
  repay(redis.call('ZREMRANGEBYSCORE', holders, '-inf', now))
  local expired = redis.call('ZRANGEBYSCORE', ticket_expiry, '-inf', now, 'LIMIT', 0, PRUNE_BATCH)
  for _, id in ipairs(expired) do
    drop_ticket(id)
  end
end

-- The oldest lane of `cap` whose head can run (its replica present, its tenant below its
-- slice) and is older than `before` (an arrival, or nil), as lane, arrival. Lanes of absent
-- replicas leave the heads (put back when their replica calls again); lanes at their slice are
-- skipped and remembered in `blocked` for the rest of the call.
local function first_runnable(cap, before, blocked)
  local heads = heads_key(cap)
  local k = 0
  while true do
    local entry = redis.call('ZRANGE', heads, k, k, 'WITHSCORES')
    if #entry == 0 then
      return nil
    end
    local lane, arrival = entry[1], tonumber(entry[2])
    if before ~= nil and arrival >= before then
      return nil
    end
    local instance, scope = string.match(lane, '^([^|]*)|(.*)$')
    if instance == nil or not present(instance) then
      redis.call('ZREM', heads, lane)
      if redis.call('ZCARD', heads) == 0 then
        redis.call('ZREM', classes, cap)
      end
    elseif blocked[lane] then
      k = k + 1
    else
      local head = redis.call('ZRANGE', lane_key(lane), 0, 0)
      local info = head[1] and parse_info(redis.call('HGET', ticket_info, head[1]))
      if head[1] == nil then
        redis.call('ZREM', heads, lane)
      elseif info == nil then
        -- A ticket whose details are gone (expired between keys): it leaves its lane.
        redis.call('ZREM', lane_key(lane), head[1])
        redis.call('ZREM', tickets, head[1])
        redis.call('ZREM', ticket_expiry, head[1])
        relink(lane, cap, KEY_MARGIN_MS)
      elseif scope_has_room(scope, info.slice) then
        return lane, arrival
      else
        blocked[lane] = true
        k = k + 1
      end
    end
  end
end

-- Free room goes to the oldest tickets whose turns can run: each under its own replica's cap
-- (only the classes of caps above the holder count are looked at), its tenant below its slice,
-- its replica present. A ticket that cannot run is skipped, not dropped. A granted ticket
-- becomes a lease (lease id = ticket id) that expires after its claim window unless its
-- replica claims it; granted ids are published, space-separated.
local function grant_waiting()
  local total = redis.call('ZCARD', holders)
  local given = {}
  local blocked = {}
  while learned_limit == 0 or total < learned_limit do
    local best_lane, best_arrival
    for _, cap in ipairs(redis.call('ZRANGEBYSCORE', classes, '(' .. total, '+inf')) do
      local lane, arrival = first_runnable(cap, best_arrival, blocked)
      if lane ~= nil then
        best_lane, best_arrival = lane, arrival
      end
    end
    if best_lane == nil then
      break
    end
    local id = redis.call('ZRANGE', lane_key(best_lane), 0, 0)[1]
    local info = parse_info(redis.call('HGET', ticket_info, id))
    local expiry = redis.call('ZSCORE', ticket_expiry, id)
    drop_ticket(id)
    -- An expired ticket (its replica stopped renewing it) is dropped, not granted.
    if info and expiry and tonumber(expiry) > now then
      add_holder(id, info.scope, info.claim)
      redis.call('ZADD', granted, now + info.claim, id)
      keep(granted, info.claim)
      total = total + 1
      given[#given + 1] = id
    end
  end
  if #given > 0 then
    redis.call('PUBLISH', channel, table.concat(given, ' '))
  end
end

-- What every script returns first: the fleet's holders, borrowed leases and waiting tickets,
-- the server time (us) they were read at, so a replica keeps only the newest figures, and the
-- learned limit with its generation (0, 0: none).
local function status()
  local gen = tonumber(redis.call('HGET', learned_key, 'gen') or '0') or 0
  if learned_limit == 0 or gen < 0 or gen ~= math.floor(gen) then
    gen = 0
  end
  return {redis.call('ZCARD', holders), borrowed(), redis.call('ZCARD', tickets), now_us,
          learned_limit, gen}
end
