"""The Redis scripts behind RedisBudgetStore (budgets.py): one admission (rate limits and budget
reservations, all or nothing) and one settle, each a single round trip, each safe to send twice.
"""

from __future__ import annotations

from gateway.governance.ratelimit import SLACK

# A marker outlives any request (a day); a settle removes it, so only requests in flight, and
# tombstones of blind settles (Redis failed), hold one.
MARKER_SECONDS = 86400
# A counter's seed (KEYS[3] of SETTLE, the last KEYS of ADMIT): a token set with the counter when it
# is seeded from the request log. A marker holds "amount seed": the seed of the counter that took
# the reservation. A counter flushed or evicted while requests were in flight is seeded again from a
# log that has none of them and without their reservations: their settles then add all they owe
# (their seed differs), not the difference to a reservation the counter no longer holds.
# A seed token ends in "@<time>": when its seeder started to read the request log (wall clock, s).
# KEYS: counter, marker, seed. ARGV: target (picodollars the request now owes), mode: `part` (a
# bound, settled again later), `final`, or `blind` (final, the reservation's fate unknown: no marker
# means it never happened; a tombstone is left so that a resend does not count twice), the
# marker's lifetime, and for `blind` the time after which the log has the request's row: a counter
# seeded after it (Redis came back empty, another request seeded it) has the cost already.
# A marker missing for `part` or `final` means this settle ran already (a resend): nothing to do.
# The change goes only on a counter that still exists (an expired one is seeded again from the log);
# never below zero.
SETTLE = """
local held = redis.call('GET', KEYS[2])
if held == 'settled' or (not held and ARGV[2] ~= 'blind') then return false end
local seed = redis.call('GET', KEYS[3]) or ''
local amount, taken = string.match(held or '0', '^(%-?%d+) ?(.*)$')
if taken ~= seed then amount = '0' end
if not held and ARGV[2] == 'blind' then
  local seeded_at = tonumber(string.match(seed, '@([%d.]+)$'))
  if seeded_at and seeded_at > tonumber(ARGV[4]) then
    redis.call('SET', KEYS[2], 'settled', 'EX', ARGV[3])
    return false
  end
end
local delta = tonumber(ARGV[1]) - tonumber(amount)
if ARGV[2] == 'part' then redis.call('SET', KEYS[2], ARGV[1] .. ' ' .. seed, 'KEEPTTL')
elseif ARGV[2] == 'final' then redis.call('DEL', KEYS[2])
else redis.call('SET', KEYS[2], 'settled', 'EX', ARGV[3]) end
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local value = redis.call('INCRBY', KEYS[1], delta)
if value < 0 then redis.call('SET', KEYS[1], 0, 'KEEPTTL') return 0 end
return value
"""

# One round trip for a whole admission: rate limits (GCRA, as in gateway/governance/ratelimit.py) and budgets,
# all or nothing. KEYS: limit counters, then budget counters, their markers, their seeds. ARGV: n_limits,
# n_budgets, then interval_i, cost_i per limit, then limit_j, amount_j per budget, then the markers'
# lifetime. Returns "ok", "missing <j>", "over <j>" or "limit <wait> <i>". An admission sent again
# (its connection lost after Redis ran it) finds its marker and spends nothing twice.
ADMIT = """
local nl, nb = tonumber(ARGV[1]), tonumber(ARGV[2])
if nb > 0 and redis.call('EXISTS', KEYS[nl + nb + 1]) == 1 then return 'ok' end
for j = 1, nb do
  if redis.call('EXISTS', KEYS[nl + j]) == 0 then return 'missing ' .. j end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local new = {}
local wait, culprit = 0, 0
for i = 1, nl do
  local interval, cost = tonumber(ARGV[2 * i + 1]), tonumber(ARGV[2 * i + 2])
  local tat = tonumber(redis.call('GET', KEYS[i]) or '0')
  if tat < now then tat = now end
  new[i] = tat + cost * interval
  local over = new[i] - now - 60
  if over > $SLACK and over > wait then wait, culprit = over, i end
end
if culprit > 0 then return string.format('limit %.6f %d', wait, culprit) end
local base = 2 + 2 * nl
for j = 1, nb do
  local value = tonumber(redis.call('GET', KEYS[nl + j]))
  if value + tonumber(ARGV[base + 2 * j]) > tonumber(ARGV[base + 2 * j - 1]) then return 'over ' .. j end
end
for i = 1, nl do
  redis.call('SET', KEYS[i], string.format('%.6f', new[i]), 'PX', math.ceil((new[i] - now) * 1000) + 1000)
end
for j = 1, nb do
  redis.call('INCRBY', KEYS[nl + j], ARGV[base + 2 * j])
  local seed = redis.call('GET', KEYS[nl + 2 * nb + j]) or ''
  redis.call('SET', KEYS[nl + nb + j], ARGV[base + 2 * j] .. ' ' .. seed, 'EX', ARGV[base + 2 * nb + 1])
end
return 'ok'
""".replace("$SLACK", repr(SLACK))

# KEYS: counter, its seed. ARGV: the spend so far, a new seed token, the lifetime in seconds ('' for
# none: a total budget's counter). The first seeder wins; the seed goes with the counter.
SEED = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if ARGV[3] == '' then
  redis.call('SET', KEYS[1], ARGV[1])
  redis.call('SET', KEYS[2], ARGV[2])
else
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
  redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
end
return 1
"""
