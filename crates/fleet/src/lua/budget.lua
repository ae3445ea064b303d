-- A budget decision for one identity: several limits, exact sliding windows, one call.
--
-- KEYS: two per limit, all sharing the identity's hash tag "{<name>:<identity hash>}":
--   KEYS[2i-1] sorted set: reservation id -> time recorded (us, server time)
--   KEYS[2i]   hash (token limits only): reservation id -> tokens, and "sum" -> their total
-- ARGV[1] op: "reserve", "settle" or "cancel"; ARGV[2] the reservation id;
-- ARGV[3] tokens (reserve: the estimate; settle: what the reservation keeps, the smaller of
-- estimate and use; cancel: the tokens reserved); ARGV[4] the debt (settle); ARGV[5] how many limits; then per limit:
--   kind ("r" requests, "t" tokens), amount per window, window (us).
--
-- "At most N in any half-open interval of length W": an admission at now is allowed if the
-- amounts recorded in (now - W, now] plus its cost are at most N (the fullest interval that
-- contains now starts just after now - W; nothing is recorded after now). A refusal names the
-- exact time at which the same admission fits: the time the oldest entries leave, until the
-- rest plus the cost fit. Every limit's "fits from" only moves later while nothing is admitted,
-- so the latest of them is the retry time of the whole.
--
-- Time is the server's (TIME); per identity it never goes back (a failover to a server with a
-- slower clock reads as the newest recorded time). Keys expire at least a window plus a second
-- (at most a window plus 1.5 s) after their newest entry, by that time (PEXPIREAT), so an idle
-- identity leaves nothing behind and a clock gone back cannot expire an entry early.
--
-- Every op is idempotent per reservation id (a call sent again after a dropped connection may
-- run twice): a reserve that finds its id recorded answers "allowed"; a settle sets what the id
-- keeps (not a difference) and adds its debt entry once; a cancel removes what is there.
--
-- Cost: this runs on Redis's one thread for every fleet decision, so it makes as few calls as
-- it can, and passes strings (Redis 7.0 formats a Lua number argument with "%.17g", which costs
-- more than most calls). Time is cut into half-second cells: a log whose newest entry is in the
-- current cell has been pruned and given its expiry in this cell already, so a decision there
-- only reads the newest entry and the count (requests) or sum (tokens) and records. Expired
-- entries are otherwise pruned (each once, so amortised O(1) per entry) at the first decision of
-- a cell, and always before a refusal: counting an expired entry can only refuse, so a decision
-- that fits with them fits without them, and one that does not is decided again on the pruned
-- log. A log holds at most a window plus a cell of entries. Lua's own work counts as much as a
-- call: the common reserve (below) indexes KEYS and ARGV directly, with no table per limit and
-- no helper closures (the general path after it has both), and converts each numeric string
-- once, by "x + 0".
--
-- Replies: reserve {1, now_us} allowed, or {0, retry_at_us (-1: never), limit index (0-based),
-- now_us}; settle and cancel {now_us}.
local call = redis.call
local op, id = ARGV[1], ARGV[2]
-- `x + 0` converts a numeric string once; `tonumber(x)` runs strtod twice (it checks first).
local nlimits = ARGV[5] + 0
local KEY_MARGIN_MS = 1000
-- A cell of time (us): see "Cost" above.
local CELL = 500000
-- A refusal reads the oldest entries in chunks of this many.
local WALK = 64

-- An integer as an argument: tostring keeps 14 digits (a time has 16), "%d" is exact.
local function int(n)
  return string.format('%d', n)
end

local clock = call('TIME')
local now = clock[1] * 1000000 + clock[2]
local usec = clock[2]
if #usec < 6 then
  usec = string.rep('0', 6 - #usec) .. usec
end
local now_arg = clock[1] .. usec

-- Per limit i, by index (no table per limit on the common path): the newest entry's time
-- (false: an empty log). KEYS[2i-1] is the log, KEYS[2i] the amounts, ARGV[3i+3] the kind,
-- ARGV[3i+4] the amount, ARGV[3i+5] the window.
-- (Made with four slots: a table grown one slot at a time reallocates each time.)
local newest = {false, false, false, false}
for i = 1, nlimits do
  local score = call('ZRANGE', KEYS[2 * i - 1], '-1', '-1', 'WITHSCORES')[2]
  if score then
    score = score + 0
    if score > now then
      now, now_arg = score, int(score)
    end
    newest[i] = score
  else
    newest[i] = false
  end
end
local cell_start = now - now % CELL
local cell = cell_start / CELL

-- Removes limit i's entries that left its window (at or before t - window), or both its keys
-- when all did; returns the log's newest time n, or false when it went. (No upvalues: a closure
-- that captures locals costs an allocation per captured local on every call.)
local function prune_log(i, n, t)
  if not n then
    return n
  end
  local log, amounts = KEYS[2 * i - 1], KEYS[2 * i]
  local edge = t - ARGV[3 * i + 5]
  if n <= edge then
    -- Everything left the window (an identity back after a pause): both keys go in one call.
    if ARGV[3 * i + 3] == 'r' then
      redis.call('DEL', log)
    else
      redis.call('DEL', log, amounts)
    end
    return false
  end
  -- The newest entry stays, so the keys (and their expiry) stay.
  local edge_arg = string.format('%d', edge)
  if ARGV[3 * i + 3] == 'r' then
    redis.call('ZREMRANGEBYSCORE', log, '-inf', edge_arg)
    return n
  end
  -- In chunks of 1000: Lua's unpack takes a few thousand values at most.
  while true do
    local gone = redis.call('ZRANGEBYSCORE', log, '-inf', edge_arg, 'LIMIT', '0', '1000')
    if #gone == 0 then
      return n
    end
    local held_by = redis.call('HMGET', amounts, unpack(gone))
    local freed = 0
    for _, a in ipairs(held_by) do
      freed = freed + (tonumber(a) or 0)
    end
    redis.call('HDEL', amounts, unpack(gone))
    redis.call('ZREM', log, unpack(gone))
    redis.call('HINCRBY', amounts, 'sum', string.format('%d', -freed))
    if #gone < 1000 then
      return n
    end
  end
end

-- The common reserve: per limit, a log not recorded in this cell yet is pruned (a log recorded
-- in it was pruned and given its expiry by the cell's first record), then the count or the sum
-- is read; every limit fitting, the reservation is recorded. Anything else (a refusal, an id
-- recorded already) goes on to the general path below, which is handed what was read and
-- pruned here (`held`, `pruned`), so it does nothing twice.
local held = {false, false, false, false}
local pruned = false
if op == 'reserve' then
  -- Read only where a token limit needs it (each conversion costs a strtod).
  local tokens
  local fast = true
  for i = 1, nlimits do
    local b = 3 * i + 3
    local amount, cost = ARGV[b + 1] + 0, 1
    if ARGV[b] ~= 'r' then
      tokens = tokens or ARGV[3] + 0
      cost = tokens
    end
    if cost > amount then
      -- Never fits: the general path answers (as it would, without pruning first).
      fast = false
      break
    end
    local n = newest[i]
    if n and n < cell_start then
      pruned = pruned or {}
      pruned[i] = true
      n = prune_log(i, n, now)
      newest[i] = n
    end
    local have = 0
    if n then
      if ARGV[b] == 'r' then
        have = call('ZCARD', KEYS[2 * i - 1])
      else
        have = (call('HGET', KEYS[2 * i], 'sum') or 0) + 0
      end
    end
    held[i] = have
    if have + cost > amount then
      fast = false
      break
    end
  end
  if fast then
    local added = 0
    for i = 1, nlimits do
      if ARGV[3 * i + 3] == 'r' or tokens > 0 then
        if call('ZADD', KEYS[2 * i - 1], 'NX', now_arg, id) == 0 then
          -- Recorded already: undone here, and the general path tells a resend.
          for j = 1, added do
            if ARGV[3 * j + 3] == 'r' or tokens > 0 then
              call('ZREM', KEYS[2 * j - 1], id)
            end
          end
          fast = false
          break
        end
        added = i
      end
    end
    if fast then
      for i = 1, nlimits do
        local kind = ARGV[3 * i + 3]
        if kind == 'r' or tokens > 0 then
          if kind == 't' then
            -- The sum was read above: one write sets both.
            call('HSET', KEYS[2 * i], id, ARGV[3], 'sum', int(held[i] + tokens))
          end
          if not newest[i] or newest[i] < cell_start then
            -- A log's first record in this cell: its keys' expiry, as expire() below.
            local at = int(
              math.ceil((cell_start + CELL + ARGV[3 * i + 5]) / 1000) + KEY_MARGIN_MS
            )
            call('PEXPIREAT', KEYS[2 * i - 1], at)
            if kind == 't' then
              call('PEXPIREAT', KEYS[2 * i], at)
            end
          end
        end
      end
      return {1, now}
    end
  end
end

-- The general path: a table per limit.
local tokens, debt = ARGV[3] + 0, ARGV[4] + 0
local limits = {}
for i = 1, nlimits do
  local base = 5 + (i - 1) * 3
  limits[i] = {
    kind = ARGV[base + 1],
    amount = ARGV[base + 2] + 0,
    window = ARGV[base + 3] + 0,
    log = KEYS[2 * i - 1],
    amounts = KEYS[2 * i],
    index = i,
    newest = newest[i] or nil,
    pruned = pruned and pruned[i] or nil,
    -- What the log holds, read above (after any prune there).
    known = held[i] or nil,
  }
end

-- Recorded in this cell already: pruned and given its expiry in it (the cell's first record did
-- both; an emptied log has no newest entry).
local function fresh(l)
  return l.newest ~= nil and math.floor(l.newest / CELL) == cell
end

local function prune(l)
  if l.pruned then
    return
  end
  l.pruned = true
  l.known = nil
  l.newest = prune_log(l.index, l.newest or false, now) or nil
  newest[l.index] = l.newest or false
end

-- What the log holds: requests counted, tokens summed (expired entries too unless pruned).
local function held(l)
  if l.newest == nil then
    return 0
  end
  if l.kind == 'r' then
    return call('ZCARD', l.log)
  end
  return (call('HGET', l.amounts, 'sum') or 0) + 0
end

-- The keys live until the end of this cell plus a window and the margin (by `now`, which is
-- never behind the server's clock): longer than any entry recorded in the cell needs.
local function expire(l, always)
  if fresh(l) and not always then
    return
  end
  local at = int(math.ceil(((cell + 1) * CELL + l.window) / 1000) + KEY_MARGIN_MS)
  call('PEXPIREAT', l.log, at)
  if l.kind == 't' then
    call('PEXPIREAT', l.amounts, at)
  end
end

-- 0 if cost fits now, -1 if never, else the time (us) from which it fits. Leaves what the log
-- holds in l.held.
local function verdict(l, cost)
  if cost > l.amount then
    return -1
  end
  if not fresh(l) then
    prune(l)
  end
  local have = l.known
  if have == nil then
    have = held(l)
  end
  if have + cost > l.amount and not l.pruned then
    prune(l)
    have = held(l)
  end
  l.held = have
  if have + cost <= l.amount then
    return 0
  end
  if l.kind == 'r' then
    -- The (count - amount + cost)-th oldest must leave: index count - amount + cost - 1.
    local index = int(have - l.amount + cost - 1)
    local entry = call('ZRANGE', l.log, index, index, 'WITHSCORES')
    return entry[2] + l.window
  end
  local left, room = have, l.amount - cost
  local start = 0
  while true do
    local chunk = call('ZRANGE', l.log, int(start), int(start + WALK - 1), 'WITHSCORES')
    if #chunk == 0 then
      return -1
    end
    local ids = {}
    for j = 1, #chunk, 2 do
      ids[#ids + 1] = chunk[j]
    end
    local amounts = call('HMGET', l.amounts, unpack(ids))
    for j, a in ipairs(amounts) do
      left = left - (tonumber(a) or 0)
      if left <= room then
        return chunk[2 * j] + l.window
      end
    end
    start = start + WALK
  end
end

-- Lowers what `member` holds to `keep` (0: removes it; a request limit's entry holds 1).
local function keep_only(l, member, keep)
  if l.kind == 'r' then
    if keep <= 0 then
      call('ZREM', l.log, member)
    end
    return
  end
  local held_by = (call('HGET', l.amounts, member) or 0) + 0
  if held_by <= keep then
    return
  end
  if keep <= 0 then
    call('HDEL', l.amounts, member)
    call('ZREM', l.log, member)
  else
    call('HSET', l.amounts, member, int(keep))
  end
  call('HINCRBY', l.amounts, 'sum', int(keep - held_by))
end

local function cost_of(l, n)
  if l.kind == 'r' then
    return 1
  end
  return n
end

-- Whether `id` is recorded in any log, every log pruned first (a reserve sent again).
local function recorded()
  for _, l in ipairs(limits) do
    prune(l)
  end
  for _, l in ipairs(limits) do
    if call('ZSCORE', l.log, id) then
      return true
    end
  end
  return false
end

-- Records the reservation in every limit it costs something in; false (and nothing recorded)
-- if a log holds `id` already.
local function record()
  local added = {}
  for _, l in ipairs(limits) do
    if cost_of(l, tokens) > 0 then
      if call('ZADD', l.log, 'NX', now_arg, id) == 0 then
        for _, a in ipairs(added) do
          call('ZREM', a.log, id)
        end
        return false
      end
      added[#added + 1] = l
    end
  end
  for _, l in ipairs(added) do
    if l.kind == 't' then
      -- The sum was read (after any prune) by the verdict: one write sets both.
      call('HSET', l.amounts, id, ARGV[3], 'sum', int(l.held + tokens))
    end
    expire(l, false)
  end
  return true
end

if op == 'reserve' then
  local worst, binding = 0, 0
  for i, l in ipairs(limits) do
    local v = verdict(l, cost_of(l, tokens))
    if v == -1 then
      if worst ~= -1 then
        binding = i - 1
      end
      worst = -1
    elseif v > 0 and worst ~= -1 and v > worst then
      worst, binding = v, i - 1
    end
  end
  if worst ~= 0 then
    -- Sent again after it was allowed: its own entry counts against it.
    if recorded() then
      return {1, now}
    end
    return {0, worst, binding, now}
  end
  if not record() then
    -- A log holds the id: sent again, unless the entry had only expired (unpruned), when it is
    -- recorded anew (pruning only lowers what a log holds, so it still fits).
    if recorded() then
      return {1, now}
    end
    for _, l in ipairs(limits) do
      l.held = held(l)
    end
    record()
  end
  return {1, now}
elseif op == 'settle' then
  for _, l in ipairs(limits) do
    if l.kind == 't' then
      if not fresh(l) then
        prune(l)
      end
      keep_only(l, id, tokens)
      local member = id .. '+debt'
      if debt > 0 and call('HEXISTS', l.amounts, member) == 0 then
        call('ZADD', l.log, now_arg, member)
        call('HINCRBY', l.amounts, member, ARGV[4])
        call('HINCRBY', l.amounts, 'sum', ARGV[4])
        -- keep_only may have emptied (so deleted) the log, and ZADD made it anew.
        expire(l, true)
      end
    end
  end
  return {now}
elseif op == 'cancel' then
  for _, l in ipairs(limits) do
    keep_only(l, id, 0)
  end
  return {now}
end
return redis.error_reply('admitgate budget: unknown op ' .. tostring(op))
