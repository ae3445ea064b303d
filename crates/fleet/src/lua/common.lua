-- Shared prologue of every admitgate fleet script (prepended to each).
--
-- KEYS[1] holders        sorted set: lease id -> expiry (ms, server time)
-- KEYS[2] tickets        sorted set: ticket id -> arrival (us, server time): the fleet's FIFO
-- KEYS[3] ticket_expiry  sorted set: ticket id -> expiry (ms): tickets expire with their replica
-- KEYS[4] ticket_info    hash: ticket id -> "<cap> <ttl_ms> <slice> <scope>"
-- KEYS[5] borrowed       integer: leases added over the cap by human-approval reclaims
-- ARGV[1] prefix of the per-scope holder sets (scope set = prefix .. scope, same hash tag)
-- ARGV[2] channel on which granted ticket ids are published
--
-- Time is the server's (TIME), never a client's clock. A lease or ticket whose expiry equals
-- the current millisecond is expired.
local holders, tickets, ticket_expiry, ticket_info, borrowed_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local scope_prefix, channel = ARGV[1], ARGV[2]
local clock = redis.call('TIME')
local now_us = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local now = math.floor(now_us / 1000)
-- Keys outlive their newest member by this much, so an idle limit leaves nothing behind.
local KEY_MARGIN_MS = 1000

local function keep(key, ttl)
  if redis.call('PTTL', key) < ttl + KEY_MARGIN_MS then
    redis.call('PEXPIRE', key, ttl + KEY_MARGIN_MS)
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

local function remove_holder(id, scope)
  local removed = redis.call('ZREM', holders, id)
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
  local removed = redis.call('ZREM', tickets, id)
  redis.call('ZREM', ticket_expiry, id)
  redis.call('HDEL', ticket_info, id)
  return removed
end

local function add_ticket(id, arrival, cap, ttl, slice, scope)
  redis.call('ZADD', tickets, arrival, id)
  redis.call('ZADD', ticket_expiry, now + ttl, id)
  redis.call('HSET', ticket_info, id, cap .. ' ' .. ttl .. ' ' .. slice .. ' ' .. scope)
  keep(tickets, ttl)
  keep(ticket_expiry, ttl)
  keep(ticket_info, ttl)
end

-- Expired holders and tickets go (their replica stopped renewing them).
local function prune()
  repay(redis.call('ZREMRANGEBYSCORE', holders, '-inf', now))
  local expired = redis.call('ZRANGEBYSCORE', ticket_expiry, '-inf', now)
  for _, id in ipairs(expired) do
    redis.call('ZREM', tickets, id)
    redis.call('HDEL', ticket_info, id)
  end
  if #expired > 0 then
    redis.call('ZREMRANGEBYSCORE', ticket_expiry, '-inf', now)
  end
end

-- Free room goes to the oldest tickets whose turns can run: each under its own replica's cap
-- and its tenant below its slice. A ticket that cannot run is skipped, not dropped. Granted
-- ids become leases (lease id = ticket id) and are published, space-separated.
local function grant_waiting()
  local queue = redis.call('ZRANGE', tickets, 0, -1)
  if #queue == 0 then
    return
  end
  local total = redis.call('ZCARD', holders)
  local granted = {}
  for _, id in ipairs(queue) do
    local info = redis.call('HGET', ticket_info, id)
    local cap, ttl, slice, scope
    if info then
      cap, ttl, slice, scope = string.match(info, '^(%d+) (%d+) (%d+) (.*)$')
    end
    if cap == nil then
      drop_ticket(id)
    else
      cap, ttl, slice = tonumber(cap), tonumber(ttl), tonumber(slice)
      if total < cap and scope_has_room(scope, slice) then
        drop_ticket(id)
        add_holder(id, scope, ttl)
        total = total + 1
        granted[#granted + 1] = id
      end
    end
  end
  if #granted > 0 then
    redis.call('PUBLISH', channel, table.concat(granted, ' '))
  end
end

-- What every script returns first: the fleet's holders, borrowed leases and waiting tickets.
local function status()
  return {redis.call('ZCARD', holders), borrowed(), redis.call('ZCARD', tickets)}
end
