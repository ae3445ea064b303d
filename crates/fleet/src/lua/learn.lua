-- Move the fleet's learned limit (the controller runs in each replica, in Rust: learned.rs; this
-- script only applies a proposal, so that concurrent proposals from every replica compose).
-- ARGV: 7 op ('seed', 'lower' or 'raise'), 8 the proposed limit, 9 the generation the proposer last
-- saw, 10 min_limit, 11 max_limit (the proposer's max_in_flight), 12 spacing_us, 13 hold_us (a
-- provider's Retry-After the proposer saw, 0: none). With classes, the guarantees are slots of
-- the learned limit, so a move here moves them at the next grant.
-- Rules, and why they are all the Lua there is:
--   none yet (first proposal, or Redis restarted): the proposal seeds it, its generation the
--     server time in us, above every generation of before, so no replica mistakes it for old;
--   'seed' with a value present: nothing (a replica that starts adopts what the fleet learned);
--   'lower' below the current value: taken at once, whatever the generation (a throttle is a
--     measurement: two of them compose as their minimum, in any order);
--   'raise' above it: taken only if the proposer saw the current generation (nobody moved it
--     since: a compare-and-set) and at least spacing_us passed since the last change by the
--     server's clock, so the whole fleet grows at most one step per round trip, however many
--     replicas propose it, and only once every hold has passed;
--   hold_us > 0 (sent with a 'lower', which may change nothing else): no raise until the server's
--     now + hold_us (the later of two holds), whoever proposes it. A Retry-After is the provider's
--     word to the whole fleet, so it is kept here, beside the value, by the server's clock.
-- A value that is not a whole number >= 1 (tampered with) counts as none: it is seeded anew.
-- A raise gives the new room to waiting tickets at once. Returns the status (6 values).
local op, value, base_gen = ARGV[7], tonumber(ARGV[8]), tonumber(ARGV[9])
local min_limit, max_limit, spacing = tonumber(ARGV[10]), tonumber(ARGV[11]), tonumber(ARGV[12])
local hold = tonumber(ARGV[13]) or 0

value = math.max(min_limit, math.min(max_limit, value))
local current = redis.call('HMGET', learned_key, 'limit', 'gen', 'at_us', 'hold_us')
local limit, gen, at = tonumber(current[1]), tonumber(current[2]), tonumber(current[3])
local held_until = tonumber(current[4]) or 0
if learned_limit == 0 then
  limit = nil -- absent, or not a whole number >= 1 (see common.lua): seeded anew
end
local changed = true
if limit == nil or gen == nil or at == nil then
  gen = now_us
  held_until = 0
elseif op == 'lower' and value < limit then
  gen = gen + 1
elseif op == 'raise' and value > limit and gen == base_gen and now_us - at >= spacing
    and now_us >= held_until then
  gen = gen + 1
else
  changed = false
end
if changed then
  -- %.0f: Lua would write these 16-digit numbers with 14 significant digits.
  redis.call('HSET', learned_key, 'limit', value, 'gen', string.format('%.0f', gen), 'at_us',
    string.format('%.0f', now_us))
  learned_limit = value
end
if hold > 0 and now_us + hold > held_until then
  redis.call('HSET', learned_key, 'hold_us', string.format('%.0f', now_us + hold))
end
redis.call('PEXPIRE', learned_key, LEARNED_TTL_MS)

prune()
grant_waiting()
return status()
