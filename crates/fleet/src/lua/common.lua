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
-- ARGV[5] the caller's priority classes as the scripts use them: "" (none: one FIFO class,
--         exactly the protocol without classes), or "<fair> <min_0> <max_0> <min_1> <max_1> ..."
--         (fair 1: fair queuing across tenants within each class; shares most important first)
-- ARGV[6] the caller's class configuration's identity (names, shares, fairness; "plain" without
--         classes): the fleet's is kept in "{key}:conf", and a caller whose identity differs
--         is refused new leases (acquire's code 5). Each script's own arguments start at ARGV[7].
--
-- Priority classes (see crates/fleet/src/classes.rs for the design and why): a ticket's class is
-- the number after the last ':' of its id ("<replica_id>#<nonce>#<n>:<class>"), so a release,
-- a heartbeat or a claim names it without another argument. With classes:
--   * "{key}:cls:<c>" holds class c's leases (as holders: id -> expiry), so a crashed
--     replica's leases leave their class's count when they expire, as they leave the total;
--   * a lane is "<instance>|<c>|<scope>", its heads set "{key}:heads:<cap>|<c>", and
--     "{key}:classes" holds the members "<cap>|<c>" scored by cap;
--   * the heads are scored by arrival (FIFO within the class), or, with fair queuing, by the
--     lane's virtual start: max(the class's virtual time "{key}:vt"[c], the tenant's finish
--     "{key}:ftag:<c>"[scope]); "{key}:flow:<c>:<scope>" holds the tenant's lanes (one per
--     replica instance) so a grant moves all of them on together;
--   * a grant serves the first class (most important first) below its guarantee with a
--     runnable ticket, else the first class with one; a class at its max_share cap is skipped.
--     Guarantee and cap are slots of the room the ticket's replica sees (its cap, or the
--     learned limit below it): floor(min_share * room), at least 1 when min_share > 0;
--     floor(max_share * room), at least 1.
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
local conf_id = ARGV[6]
-- The caller's classes: ncls 0 without any. Shares are indexed from 1 (class c is c + 1).
local ncls, fair, min_shares, max_shares = 0, false, {}, {}
do
  local words = {}
  for word in string.gmatch(ARGV[5], '%S+') do
    words[#words + 1] = tonumber(word) or 0
  end
  if #words >= 3 then
    fair = words[1] == 1
    ncls = math.floor((#words - 1) / 2)
    for c = 1, ncls do
      min_shares[c], max_shares[c] = words[2 * c], words[2 * c + 1]
    end
  end
end
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

-- "<replica_id>#<nonce>" of an id "<replica_id>#<nonce>#<n>[:<class>]" (replica ids have no
-- '#').
local function instance_of(id)
  return string.match(id, '^(.*)#') or ''
end

-- The class of an id (a number below ncls), or nil in a fleet without classes.
local function class_of(id)
  if ncls == 0 then
    return nil
  end
  local c = tonumber(string.match(id, '#%d+:(%d+)$') or '')
  if c == nil or c >= ncls then
    return nil
  end
  return c
end

local conf_key = prefix .. 'conf'
-- Whether the fleet's class configuration is the caller's. None stored (the first replica, or
-- every replica of the last one gone for longer than its keys live): the caller's is adopted.
-- Kept as long as the keys of a replica that agrees with it.
local function conf_agrees(ttl)
  local stored = redis.call('GET', conf_key)
  if stored == false then
    redis.call('SET', conf_key, conf_id, 'PX', ttl + KEY_MARGIN_MS)
    return true
  end
  if stored ~= conf_id then
    return false
  end
  keep(conf_key, ttl)
  return true
end

-- Slots of `room` a class's share comes to (the core's rule: floor, forgiving float rounding).
local function share_slots(share, room)
  return math.min(room, math.floor(share * room + 1e-9))
end

local function class_guarantee(c, room)
  local share = min_shares[c + 1]
  local slots = share_slots(share, room)
  if slots == 0 and share > 0 then
    return 1
  end
  return slots
end

local function class_cap(c, room)
  return math.max(1, share_slots(max_shares[c + 1], room))
end

-- Live holders of class c, pruned on first use and then kept up to date in this call.
local class_counts = {}
local function class_count(c)
  local n = class_counts[c]
  if n == nil then
    local key = prefix .. 'cls:' .. c
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
    n = redis.call('ZCARD', key)
    class_counts[c] = n
  end
  return n
end

-- Whether a turn of class c (nil: no classes) may take room under `cap`: its class below its
-- max_share cap of that room.
local function class_has_room(c, cap)
  return c == nil or class_count(c) < class_cap(c, room_under(cap))
end

local function lane_name(instance, c, scope)
  if c == nil then
    return instance .. '|' .. scope
  end
  return instance .. '|' .. c .. '|' .. scope
end

-- instance, class (nil without classes), scope of a lane.
local function lane_parts(lane)
  if ncls == 0 then
    local instance, scope = string.match(lane, '^([^|]*)|(.*)$')
    return instance, nil, scope
  end
  local instance, c, scope = string.match(lane, '^([^|]*)|(%d+)|(.*)$')
  return instance, tonumber(c), scope
end

-- The member of "{key}:classes" (and suffix of its heads key) for a cap and a class.
local function member_of(cap, c)
  if c == nil then
    return tostring(cap)
  end
  return cap .. '|' .. c
end

local function member_parts(member)
  local cap, c = string.match(member, '^(%d+)|?(%d*)$')
  return cap, tonumber(c)
end

local vt_key = prefix .. 'vt'
local function ftag_key(c)
  return prefix .. 'ftag:' .. c
end
local function flow_key(c, scope)
  return prefix .. 'flow:' .. c .. ':' .. scope
end

-- Where a lane stands in its heads: its head's arrival, or with fair queuing its virtual start.
local function lane_score(c, scope, head_arrival)
  if c == nil or not fair then
    return head_arrival
  end
  local v = tonumber(redis.call('HGET', vt_key, c) or '0') or 0
  local f = tonumber(redis.call('HGET', ftag_key(c), scope) or '0') or 0
  return math.max(v, f)
end

local function present(instance)
  local until_ms = redis.call('ZSCORE', replicas, instance)
  return until_ms ~= false and tonumber(until_ms) > now
end

-- "<cap> <ttl_ms> <slice> <claim_ms> <scope>" without classes (the format of the releases
-- before classes, so plain replicas of both read each other's tickets during a rolling
-- upgrade), "<cap> <ttl_ms> <slice> <claim_ms> @<class>,<step> <scope>" with them (step: how
-- far the tenant's virtual time moves per turn it starts, under fair queuing).
local function parse_info(info)
  if not info then
    return nil
  end
  local cap, ttl, slice, claim, c, step, scope
  if ncls > 0 then
    cap, ttl, slice, claim, c, step, scope =
      string.match(info, '^(%d+) (%d+) (%d+) (%d+) @(%d+),(%d+) (.*)$')
  end
  if cap == nil then
    cap, ttl, slice, claim, scope = string.match(info, '^(%d+) (%d+) (%d+) (%d+) (.*)$')
    if cap == nil then
      return nil
    end
  end
  c = tonumber(c)
  if c ~= nil and c >= ncls then
    c = nil
  end
  return {cap = cap, ttl = tonumber(ttl), slice = tonumber(slice), claim = tonumber(claim),
          class = c, step = tonumber(step) or 0, scope = scope}
end

local function lane_key(lane)
  return prefix .. 'lane:' .. lane
end

local function heads_key(cap)
  return prefix .. 'heads:' .. cap
end

-- Puts the lane's oldest ticket (or nothing, when it is empty) in its cap's (and class's) heads.
local function relink(lane, cap, ttl)
  local _, c, scope = lane_parts(lane)
  local member = member_of(cap, c)
  local heads = heads_key(member)
  local head = redis.call('ZRANGE', lane_key(lane), 0, 0, 'WITHSCORES')
  local flow = fair and c ~= nil and flow_key(c, scope)
  if #head == 0 then
    redis.call('ZREM', heads, lane)
    if redis.call('ZCARD', heads) == 0 then
      redis.call('ZREM', classes, member)
    end
    if flow then
      redis.call('SREM', flow, lane)
      if redis.call('EXISTS', flow) == 0 then
        -- The tenant has nothing waiting in this class: its finish goes (it banks no credit,
        -- and owes at most one turn's step, which is forgiven).
        redis.call('HDEL', ftag_key(c), scope)
      end
    end
  else
    redis.call('ZADD', heads, lane_score(c, scope, head[2]), lane)
    redis.call('ZADD', classes, cap, member)
    keep(heads, ttl)
    keep(classes, ttl)
    if flow then
      redis.call('SADD', flow, lane)
      keep(flow, ttl)
      keep(ftag_key(c), ttl)
      keep(vt_key, ttl)
    end
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
  local c = class_of(id)
  if c ~= nil then
    local key = prefix .. 'cls:' .. c
    local added = redis.call('ZADD', key, now + ttl, id)
    keep(key, ttl)
    if class_counts[c] ~= nil then
      class_counts[c] = class_counts[c] + added
    end
  end
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
  local c = class_of(id)
  if c ~= nil then
    local gone = redis.call('ZREM', prefix .. 'cls:' .. c, id)
    if class_counts[c] ~= nil then
      class_counts[c] = class_counts[c] - gone
    end
  end
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
    local lane = lane_name(instance_of(id), info.class, info.scope)
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

local function add_ticket(id, arrival, cap, ttl, slice, claim, scope, step)
  local c = class_of(id)
  local lane = lane_name(instance_of(id), c, scope)
  renew_presence()
  redis.call('ZADD', tickets, arrival, id)
  redis.call('ZADD', ticket_expiry, now + ttl, id)
  local classed = ''
  if c ~= nil then
    classed = '@' .. c .. ',' .. (tonumber(step) or 0) .. ' '
  end
  redis.call('HSET', ticket_info, id,
    cap .. ' ' .. ttl .. ' ' .. slice .. ' ' .. claim .. ' ' .. classed .. scope)
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

-- The first lane of the heads `member` ("<cap>" or "<cap>|<class>") whose head can run (its
-- replica present, its tenant below its slice) and stands before `before` (a score, or nil),
-- as lane, score. Lanes of absent replicas leave the heads (put back when their replica calls
-- again); lanes at their slice are skipped and remembered in `blocked` for the rest of the call.
local function first_runnable(member, before, blocked)
  local heads = heads_key(member)
  local cap = member_parts(member)
  local k = 0
  while true do
    local entry = redis.call('ZRANGE', heads, k, k, 'WITHSCORES')
    if #entry == 0 then
      return nil
    end
    local lane, score = entry[1], tonumber(entry[2])
    if before ~= nil and score >= before then
      return nil
    end
    local instance, _, scope = lane_parts(lane)
    if instance == nil or not present(instance) then
      redis.call('ZREM', heads, lane)
      if redis.call('ZCARD', heads) == 0 then
        redis.call('ZREM', classes, member)
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
        return lane, score
      else
        blocked[lane] = true
        k = k + 1
      end
    end
  end
end

-- The lane to serve next without classes: the oldest runnable head under the caps above the
-- holder count.
local function next_plain(members, blocked)
  local best_lane, best_arrival
  for _, member in ipairs(members) do
    local lane, arrival = first_runnable(member, best_arrival, blocked)
    if lane ~= nil then
      best_lane, best_arrival = lane, arrival
    end
  end
  return best_lane
end

-- The lane to serve next with classes: each class's first runnable head (lowest score) under
-- the caps above the holder count, for the classes below their max_share cap of that room;
-- then the most important class below its guarantee, else the most important class.
local function next_classed(members, blocked)
  local best = {}
  for _, member in ipairs(members) do
    local cap, c = member_parts(member)
    if c ~= nil and c < ncls then
      local room = room_under(cap)
      if class_count(c) < class_cap(c, room) then
        local current = best[c]
        local lane, score = first_runnable(member, current and current.score, blocked)
        if lane ~= nil then
          best[c] = {lane = lane, score = score, room = room}
        end
      end
    end
  end
  for c = 0, ncls - 1 do
    local pick = best[c]
    if pick ~= nil and class_count(c) < class_guarantee(c, pick.room) then
      return pick.lane, c, pick.score
    end
  end
  for c = 0, ncls - 1 do
    local pick = best[c]
    if pick ~= nil then
      return pick.lane, c, pick.score
    end
  end
  return nil
end

-- Fair queuing: class c serves a turn of `scope` whose lane stood at virtual time `start`: the
-- class's virtual time becomes it, the tenant's next turn starts `step` later, and the tenant's
-- other lanes (its tickets on other replicas) move to that start too. A lane that stood behind
-- the class's virtual time (its tenant was at its slice while others were served) starts at
-- the class's virtual time: it catches up one turn at most, banking no credit for the wait.
local function advance(c, scope, start, step, served_lane)
  local v = tonumber(redis.call('HGET', vt_key, c) or '0') or 0
  if start > v then
    redis.call('HSET', vt_key, c, string.format('%.0f', start))
  else
    start = v
  end
  redis.call('HSET', ftag_key(c), scope, string.format('%.0f', start + step))
  for _, lane in ipairs(redis.call('SMEMBERS', flow_key(c, scope))) do
    if lane ~= served_lane and present(lane_parts(lane)) then
      local head = redis.call('ZRANGE', lane_key(lane), 0, 0)
      local info = head[1] and parse_info(redis.call('HGET', ticket_info, head[1]))
      if info then
        relink(lane, info.cap, info.ttl)
      end
    end
  end
end

-- Free room goes to the tickets whose turns can run: each under its own replica's cap (only
-- the heads of caps above the holder count are looked at), its tenant below its slice, its
-- replica present, its class below its max_share cap. Without classes the oldest such ticket
-- goes first; with classes the class is chosen first (next_classed), then within it the
-- oldest ticket or, with fair queuing, the tenant with the lowest virtual start. A ticket that
-- cannot run is skipped, not dropped. A granted ticket becomes a lease (lease id = ticket id)
-- that expires after its claim window unless its replica claims it; granted ids are
-- published, space-separated.
local function grant_waiting()
  local stored_conf = redis.call('GET', conf_key)
  if stored_conf ~= false and stored_conf ~= conf_id then
    -- The fleet orders its tickets by another class configuration than the caller's: the
    -- caller's shares must not decide (a replica that agrees grants at its next call).
    return
  end
  local total = redis.call('ZCARD', holders)
  local given = {}
  local blocked = {}
  while learned_limit == 0 or total < learned_limit do
    local members = redis.call('ZRANGEBYSCORE', classes, '(' .. total, '+inf')
    local lane, c, score
    if ncls == 0 then
      lane = next_plain(members, blocked)
    else
      lane, c, score = next_classed(members, blocked)
    end
    if lane == nil then
      break
    end
    local id = redis.call('ZRANGE', lane_key(lane), 0, 0)[1]
    local info = parse_info(redis.call('HGET', ticket_info, id))
    local expiry = redis.call('ZSCORE', ticket_expiry, id)
    -- An expired ticket (its replica stopped renewing it) is dropped, not granted.
    local live = info and expiry and tonumber(expiry) > now
    if live and fair and c ~= nil then
      advance(c, info.scope, score, info.step, lane)
    end
    drop_ticket(id)
    if live then
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
