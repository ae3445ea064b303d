//! A budget: several limits over one identity space, decided together.

use std::hash::BuildHasher;
use std::time::Duration;

use parking_lot::Mutex;

use crate::error::BudgetError;
use crate::limit::{Limit, LimitState, Meter};
use crate::stats::{BudgetStats, Counters};
use crate::table::Table;
use crate::verdict::Verdict;

/// How many independently locked shards a budget's keys are spread over.
const SHARDS: usize = 16;

/// The default cap on keys a budget remembers (see [`Budget::new`]).
pub const DEFAULT_MAX_KEYS: usize = 1 << 20;

/// An identity as the budget holds it: a 64-bit hash, keyed per budget, so the raw identity
/// (an API key, a user name) is never stored, and cannot be recovered from a dump. Two
/// identities collide with probability about `n² / 2⁶⁵` for `n` live identities (≈ 3·10⁻⁸ at
/// a million); colliding identities would share a budget.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyHash(u64);

impl std::fmt::Debug for KeyHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KeyHash({:016x})", self.0)
    }
}

/// An admission's hold on its budget: given back with [`Budget::cancel`] if the turn never
/// ran, settled with [`Budget::settle`] when it reports what it used. Dropping it keeps the
/// estimate as spent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    key: KeyHash,
    /// When it was recorded (ns, the caller's clock, made monotonic per key).
    at: u64,
    tokens: u64,
}

impl Reservation {
    /// The token estimate it holds.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// The identity it was taken for.
    pub fn key(&self) -> KeyHash {
        self.key
    }

    /// When it was recorded (the caller's clock, made monotonic per identity).
    pub fn at(&self) -> Duration {
        Duration::from_nanos(self.at)
    }
}

/// A refusal: when the budget allows this admission again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limited {
    /// The earliest time (the caller's clock) at which the same admission fits, if nothing
    /// else is admitted for this identity first; `None` if it never fits (its cost is more
    /// than a whole window of a token limit, or than a GCRA limit's burst).
    pub retry_at: Option<Duration>,
    /// Which limit (its index in the budget) refused last: the one whose wait is longest.
    pub limit: usize,
}

impl Limited {
    /// How long from `now` until the retry time (`None`: never).
    pub fn retry_after(&self, now: Duration) -> Option<Duration> {
        self.retry_at.map(|at| at.saturating_sub(now))
    }
}

/// A decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Admitted: the reservation holds its cost in every limit.
    Allowed(Reservation),
    /// Refused: nothing was recorded.
    Limited(Limited),
}

/// What settling did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Settlement {
    /// Tokens given back (the estimate was higher).
    pub refunded: u64,
    /// Tokens added as debt (the estimate was lower), recorded at the settling time.
    pub debt: u64,
}

/// Several limits over one identity space (e.g. 60 requests/min, 1,000/day and 100,000
/// tokens/min), decided together: an admission is allowed only if every limit allows it, and
/// then counts in all of them.
pub struct Budget {
    limits: Box<[Limit]>,
    shards: Box<[Mutex<Table>]>,
    /// Never used: what [`Budget::shard`] returns if its index were ever out of range.
    spare: Mutex<Table>,
    hasher: foldhash::fast::RandomState,
    counters: Counters,
}

fn ns(time: Duration) -> u64 {
    u64::try_from(time.as_nanos()).unwrap_or(u64::MAX)
}

impl Budget {
    /// A budget of `limits` (at least one) remembering at most `max_keys` identities at once
    /// (see the crate docs for what happens past it).
    pub fn new(limits: Vec<Limit>, max_keys: usize) -> Result<Self, BudgetError> {
        if limits.is_empty() {
            return Err(BudgetError::new(
                "requests",
                "None".to_owned(),
                "a budget needs at least one limit (requests= or tokens=)",
            ));
        }
        if max_keys == 0 {
            return Err(BudgetError::new(
                "max_keys",
                "0".to_owned(),
                "must be at least 1",
            ));
        }
        let hasher = foldhash::fast::RandomState::default();
        let per_shard = max_keys.div_ceil(SHARDS);
        let seed = hasher.hash_one(0x00b0_d6e7_u64);
        let shards = (0..SHARDS)
            .map(|i| {
                Mutex::new(Table::new(
                    limits.len(),
                    per_shard,
                    seed.wrapping_add(i as u64),
                ))
            })
            .collect();
        Ok(Budget {
            counters: Counters::new(limits.len()),
            spare: Mutex::new(Table::new(limits.len(), 1, seed)),
            limits: limits.into_boxed_slice(),
            shards,
            hasher,
        })
    }

    /// The limits, in the order given.
    pub fn limits(&self) -> &[Limit] {
        &self.limits
    }

    /// Whether any limit counts tokens.
    pub fn counts_tokens(&self) -> bool {
        self.limits.iter().any(|l| l.meter == Meter::Tokens)
    }

    /// An identity's key (hashed; see [`KeyHash`]).
    pub fn key(&self, identity: &[u8]) -> KeyHash {
        KeyHash(self.hasher.hash_one(identity))
    }

    fn shard(&self, key: KeyHash) -> &Mutex<Table> {
        // The middle bits: hashbrown takes the bucket from the low bits and its tag from the
        // top seven, which must stay varied inside one shard.
        let i = ((key.0 >> 32) as usize) % SHARDS;
        match self.shards.get(i) {
            Some(shard) => shard,
            // Unreachable: there are SHARDS shards. Any shard is correct, only slower.
            None => &self.spare,
        }
    }

    /// Admits one request costing `tokens` for `key` at `now`, or says when it could be.
    pub fn reserve(&self, key: KeyHash, tokens: u64, now: Duration) -> Decision {
        let mut table = self.shard(key).lock();
        let mut now = ns(now);
        let found = table.find(key.0);
        let mut verdict = Verdict::Allowed;
        let mut binding = 0;
        if let Some(slot) = found {
            let states = table.states(slot);
            now = key_clock(states, now);
            for (i, (limit, state)) in self.limits.iter().zip(states.iter_mut()).enumerate() {
                limit.prune(state, now);
                let v = limit.verdict(state, now, limit.cost(tokens));
                let combined = verdict.and(v);
                if combined != verdict {
                    binding = i;
                }
                verdict = combined;
            }
        } else {
            for (i, limit) in self.limits.iter().enumerate() {
                let v = limit.verdict(&limit.fresh(), now, limit.cost(tokens));
                if v != Verdict::Allowed {
                    verdict = v;
                    binding = i;
                }
            }
        }
        match verdict {
            Verdict::Allowed => {
                let slot = match found {
                    Some(slot) => slot,
                    None => table.insert(key.0, &self.limits, now),
                };
                let states = table.states(slot);
                for (limit, state) in self.limits.iter().zip(states.iter_mut()) {
                    limit.add(state, now, limit.cost(tokens));
                }
                drop(table);
                self.counters.allowed(tokens);
                Decision::Allowed(Reservation {
                    key,
                    at: now,
                    tokens,
                })
            }
            Verdict::RetryAt(at) => {
                drop(table);
                self.counters.limited(binding);
                Decision::Limited(Limited {
                    retry_at: Some(Duration::from_nanos(at)),
                    limit: binding,
                })
            }
            Verdict::Never => {
                drop(table);
                self.counters.limited(binding);
                Decision::Limited(Limited {
                    retry_at: None,
                    limit: binding,
                })
            }
        }
    }

    /// Records an admission decided elsewhere (the fleet's Redis allowed it) without deciding:
    /// it then counts here as if this budget had allowed it, so a replica falling back to its
    /// local budget during an outage remembers what it admitted through the fleet.
    pub fn record(&self, key: KeyHash, tokens: u64, now: Duration) -> Reservation {
        let mut table = self.shard(key).lock();
        let mut now = ns(now);
        let slot = match table.find(key.0) {
            Some(slot) => slot,
            None => table.insert(key.0, &self.limits, now),
        };
        let states = table.states(slot);
        now = key_clock(states, now);
        for (limit, state) in self.limits.iter().zip(states.iter_mut()) {
            limit.prune(state, now);
            limit.add(state, now, limit.cost(tokens));
        }
        Reservation {
            key,
            at: now,
            tokens,
        }
    }

    /// Settles a reservation to the tokens its turn really used: the difference is refunded
    /// (taken back where it was recorded) or added as debt at `now`, which delays the
    /// identity's next turns until it leaves the window.
    pub fn settle(&self, reservation: Reservation, used: u64, now: Duration) -> Settlement {
        let settlement = Settlement {
            refunded: reservation.tokens.saturating_sub(used),
            debt: used.saturating_sub(reservation.tokens),
        };
        if self.counts_tokens() && settlement != Settlement::default() {
            let mut table = self.shard(reservation.key).lock();
            let mut now = ns(now);
            let slot = match table.find(reservation.key.0) {
                Some(slot) => Some(slot),
                // Forgotten (idle or evicted): a refund has nothing left to take back from; a
                // debt starts a fresh state.
                None if settlement.debt > 0 => {
                    Some(table.insert(reservation.key.0, &self.limits, now))
                }
                None => None,
            };
            if let Some(slot) = slot {
                let states = table.states(slot);
                now = key_clock(states, now);
                for (limit, state) in self.limits.iter().zip(states.iter_mut()) {
                    if limit.meter != Meter::Tokens {
                        continue;
                    }
                    limit.take_back(state, reservation.at, settlement.refunded);
                    limit.add(state, now, settlement.debt);
                }
            }
        }
        self.counters.settled(settlement.refunded, settlement.debt);
        settlement
    }

    /// Gives a reservation back whole: its turn was refused or cancelled before it ran, so
    /// neither its request nor its tokens count.
    pub fn cancel(&self, reservation: Reservation) {
        let mut table = self.shard(reservation.key).lock();
        if let Some(slot) = table.find(reservation.key.0) {
            let states = table.states(slot);
            for (limit, state) in self.limits.iter().zip(states.iter_mut()) {
                limit.take_back(state, reservation.at, limit.cost(reservation.tokens));
            }
        }
        drop(table);
        self.counters.returned(reservation.tokens);
    }

    /// Forgets every idle key now (they are also reclaimed as new keys arrive).
    pub fn reclaim(&self, now: Duration) {
        for shard in self.shards.iter() {
            shard.lock().sweep(&self.limits, ns(now));
        }
    }

    /// The counters, and the keys held now.
    pub fn stats(&self) -> BudgetStats {
        let mut stats = self.counters.read();
        for shard in self.shards.iter() {
            let table = shard.lock();
            stats.keys = stats.keys.saturating_add(table.len() as u64);
            stats.evicted = stats.evicted.saturating_add(table.evicted);
            stats.reclaimed = stats.reclaimed.saturating_add(table.reclaimed);
        }
        stats
    }

    /// Bytes the keys' state holds now (O(keys): for tests and diagnostics, not the hot path).
    pub fn memory_bytes(&self) -> usize {
        self.shards.iter().map(|s| s.lock().bytes()).sum()
    }
}

/// The key's own clock: never earlier than the newest time it recorded, so a caller's clock
/// that steps back (two threads reading it in one order and locking in the other) never
/// records out of order.
fn key_clock(states: &[LimitState], now: u64) -> u64 {
    states
        .iter()
        .filter_map(LimitState::newest)
        .fold(now, u64::max)
}
