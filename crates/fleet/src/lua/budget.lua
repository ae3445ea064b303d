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
-- contains now starts just after now - W; nothing is recorded after now). Entries with
-- at + W <= now are pruned first (each once, so amortised O(1) per entry). A refusal names the
-- exact time at which the same admission fits: the time the oldest entries leave, until the
-- rest plus the cost fit. Every limit's "fits from" only moves later while nothing is admitted,
-- so the latest of them is the retry time of the whole.
--
-- Time is the server's (TIME); per identity it never goes back (a failover to a server with a
-- slower clock reads as the newest recorded time). Keys expire a window (plus a second) after
-- their newest entry, so an idle identity leaves nothing behind.
--
-- Every op is idempotent per reservation id (a call sent again after a dropped connection may
-- run twice): a reserve that finds its id recorded answers "allowed"; a settle sets what the id
-- keeps (not a difference) and adds its debt entry once; a cancel removes what is there.
--
-- Replies: reserve {1, now_us} allowed, or {0, retry_at_us (-1: never), limit index (0-based),
-- now_us}; settle and cancel {now_us}.
local op, id = ARGV[1], ARGV[2]
local tokens, debt, nlimits = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local KEY_MARGIN_MS = 1000
-- A refusal reads the oldest entries in chunks of this many.
local WALK = 64
-- Expired token entries leave in chunks of this many (unpack's limit is a few thousand).
local PRUNE_CHUNK = 1000

local limits = {}
for i = 1, nlimits do
  local base = 5 + (i - 1) * 3
  local l = {
    kind = ARGV[base + 1],
    amount = tonumber(ARGV[base + 2]),
    window = tonumber(ARGV[base + 3]),
    log = KEYS[2 * i - 1],
    amounts = KEYS[2 * i],
  }
  limits[i] = l
  local newest = redis.call('ZRANGE', l.log, -1, -1, 'WITHSCORES')
  if newest[2] and tonumber(newest[2]) > now then
    now = tonumber(newest[2])
  end
end

local function prune(l)
  local edge = now - l.window
  if l.kind == 'r' then
    redis.call('ZREMRANGEBYSCORE', l.log, '-inf', edge)
    return
  end
  -- In chunks: Lua's unpack takes a few thousand values at most.
  while true do
    local gone = redis.call('ZRANGEBYSCORE', l.log, '-inf', edge, 'LIMIT', 0, PRUNE_CHUNK)
    if #gone == 0 then
      return
    end
    local amounts = redis.call('HMGET', l.amounts, unpack(gone))
    local freed = 0
    for _, a in ipairs(amounts) do
      freed = freed + (tonumber(a) or 0)
    end
    redis.call('HDEL', l.amounts, unpack(gone))
    redis.call('ZREM', l.log, unpack(gone))
    redis.call('HINCRBY', l.amounts, 'sum', -freed)
    if #gone < PRUNE_CHUNK then
      return
    end
  end
end

local function expire(l)
  local ms = math.ceil(l.window / 1000) + KEY_MARGIN_MS
  redis.call('PEXPIRE', l.log, ms)
  if l.kind == 't' then
    redis.call('PEXPIRE', l.amounts, ms)
  end
end

-- 0 if cost fits now, -1 if never, else the time (us) from which it fits.
local function verdict(l, cost)
  if cost > l.amount then
    return -1
  end
  if l.kind == 'r' then
    local count = redis.call('ZCARD', l.log)
    if count + cost <= l.amount then
      return 0
    end
    -- The (count - amount + cost)-th oldest must leave: index count - amount + cost - 1.
    local entry = redis.call('ZRANGE', l.log, count - l.amount + cost - 1, count - l.amount + cost - 1, 'WITHSCORES')
    return tonumber(entry[2]) + l.window
  end
  local left = tonumber(redis.call('HGET', l.amounts, 'sum') or '0')
  local room = l.amount - cost
  if left <= room then
    return 0
  end
  local start = 0
  while true do
    local chunk = redis.call('ZRANGE', l.log, start, start + WALK - 1, 'WITHSCORES')
    if #chunk == 0 then
      return -1
    end
    local ids = {}
    for j = 1, #chunk, 2 do
      ids[#ids + 1] = chunk[j]
    end
    local amounts = redis.call('HMGET', l.amounts, unpack(ids))
    for j, a in ipairs(amounts) do
      left = left - (tonumber(a) or 0)
      if left <= room then
        return tonumber(chunk[2 * j]) + l.window
      end
    end
    start = start + WALK
  end
end

local function add(l, member, cost)
  if cost <= 0 then
    return
  end
  redis.call('ZADD', l.log, now, member)
  if l.kind == 't' then
    redis.call('HINCRBY', l.amounts, member, cost)
    redis.call('HINCRBY', l.amounts, 'sum', cost)
  end
  expire(l)
end

-- Lowers what `member` holds to `keep` (0: removes it; a request limit's entry holds 1).
local function keep_only(l, member, keep)
  if l.kind == 'r' then
    if keep <= 0 then
      redis.call('ZREM', l.log, member)
    end
    return
  end
  local held = tonumber(redis.call('HGET', l.amounts, member) or '0')
  if held <= keep then
    return
  end
  if keep <= 0 then
    redis.call('HDEL', l.amounts, member)
    redis.call('ZREM', l.log, member)
  else
    redis.call('HSET', l.amounts, member, keep)
  end
  redis.call('HINCRBY', l.amounts, 'sum', keep - held)
end

local function cost_of(l, n)
  if l.kind == 'r' then
    return 1
  end
  return n
end

for _, l in ipairs(limits) do
  prune(l)
end

if op == 'reserve' then
  for _, l in ipairs(limits) do
    if redis.call('ZSCORE', l.log, id) then
      return {1, now}
    end
  end
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
    return {0, worst, binding, now}
  end
  for _, l in ipairs(limits) do
    add(l, id, cost_of(l, tokens))
  end
  return {1, now}
elseif op == 'settle' then
  for _, l in ipairs(limits) do
    if l.kind == 't' then
      keep_only(l, id, tokens)
      if redis.call('HEXISTS', l.amounts, id .. '+debt') == 0 then
        add(l, id .. '+debt', debt)
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
