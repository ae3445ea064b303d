-- One decision of the BotOS drop-ins' rule for one key, fleet-wide, by the server's clock:
-- a window anchored at the key's first request, then a lockout (crates/budget's
-- window_lockout module states the rule; this is the same rule in the same float operations).
--
-- KEYS[1] the key's hash, "{<name>:<hash of scope and identity>}" (its own hash tag: one
--   cluster slot), fields s (window start), c (count), l (locked until); times are seconds as
--   written by string.format('%.17g'), so they read back as the same double.
-- ARGV[1] op: "check" (decide and count), "wait" (seconds until allowed, counting nothing)
--   or "reset" (forget the key); ARGV[2] max requests per window (> 0); ARGV[3] the window
--   (seconds); ARGV[4] the lockout (seconds, 0: none).
--
-- Time is TIME as seconds (a double: seconds + microseconds / 10^6), never a replica's clock.
-- The key expires a second after its window ends or its lockout passes, so an idle key leaves
-- nothing behind.
--
-- Replies (strings, so that doubles survive: Redis would truncate a Lua number):
--   check: {now, "1"} allowed, or {now, "0", retry_after}; wait: {now, seconds}; reset: {now}.
local key, op = KEYS[1], ARGV[1]
local max, window, lockout = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local MARGIN_MS = 1000

local function fmt(x)
  return string.format('%.17g', x)
end

local function nonnegative(x)
  if x > 0 then
    return x
  end
  return 0
end

if op == 'reset' then
  redis.call('DEL', key)
  return {fmt(now)}
end

local state = redis.call('HMGET', key, 's', 'c', 'l')
local start, count, locked = tonumber(state[1]), tonumber(state[2]), tonumber(state[3])

if op == 'wait' then
  if locked and now < locked then
    return {fmt(now), fmt(nonnegative(locked - now))}
  end
  if start and count and count > max and now - start < window then
    return {fmt(now), fmt(nonnegative(window - (now - start)))}
  end
  return {fmt(now), '0'}
end

if op ~= 'check' then
  return redis.error_reply('admitgate window_lockout: unknown op ' .. tostring(op))
end

if locked then
  if now < locked then
    return {fmt(now), '0', fmt(nonnegative(locked - now))}
  end
  start = nil
end

if start == nil or now - start >= window then
  redis.call('DEL', key)
  redis.call('HSET', key, 's', fmt(now), 'c', 1)
  redis.call('PEXPIRE', key, math.ceil(window * 1000) + MARGIN_MS)
  return {fmt(now), '1'}
end

count = count + 1
if count > max then
  if lockout > 0 then
    redis.call('DEL', key)
    redis.call('HSET', key, 'l', fmt(now + lockout))
    redis.call('PEXPIRE', key, math.ceil(lockout * 1000) + MARGIN_MS)
    return {fmt(now), '0', fmt(lockout)}
  end
  -- Kept until the window ends (the key's expiry is the window's).
  redis.call('HSET', key, 'c', count)
  return {fmt(now), '0', fmt(nonnegative(window - (now - start)))}
end
redis.call('HSET', key, 'c', count)
return {fmt(now), '1'}
