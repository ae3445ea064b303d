//! A window anchored at a key's first request, then a lockout: the rule of praisonai's
//! `SlidingWindowRateLimitPolicy` and `AuthRateLimiter`, kept exactly so that admitgate's
//! BotOS drop-ins decide as they do.
//!
//! # The rule
//!
//! Per key (a scope and an identity), with `max` requests per `window` seconds and a `lockout`:
//!
//! - A key with no window, or whose window began `window` seconds or more ago, starts a new
//!   window at `now` and is allowed (its first request).
//! - Inside its window, the request is counted; while the count is at most `max` it is allowed.
//! - The request that makes it `max + 1` is refused. With a `lockout`, the window is dropped
//!   and the key is refused until `now + lockout` (retry hint: `lockout`); a request at or after
//!   that starts a new window. Without one, the key stays refused until its window ends (retry
//!   hint: the rest of the window).
//! - `max = 0` switches limiting off (every request allowed, nothing kept).
//!
//! This is not "at most `max` in any `window`": a window starts at a key's first request, so up
//! to `2 × max` pass within `window` across the end of one window and the start of the next.
//! admitgate's own budgets (module `budget`, the exact sliding log) are the stricter choice.
//!
//! **Time** is the caller's, in seconds as an `f64` (the protocol's `now`, or `time.time()`),
//! and every comparison and subtraction is the reference's own floating-point operation, in the
//! same order: so decisions and retry hints are the reference's bit for bit, rounding included.
//! A time that is not finite is refused by the binding before it gets here.
//!
//! **Keys** are hashed (a 64-bit keyed hash of the scope and the identity, random per limiter)
//! before anything is stored; the raw identity is never held.
//!
//! **Memory.** One 24-byte entry per key (8 bytes of hash, the window start or lockout end, the
//! count and a flag) in a `hashbrown` table, about 25 bytes a bucket with its control byte: at
//! most about 57 bytes per key at the table's emptiest after a resize. Idle keys (a window that
//! has ended, a lockout that has passed: state that no decision reads again) are reclaimed in a
//! sweep when a shard has doubled since its last one, so a shard holds at most twice its live
//! keys. At `max_keys` live keys a new key is refused (the reference `AuthRateLimiter`'s
//! fail-closed choice: a flood of fresh identities can neither grow memory nor push a genuine
//! lockout out), with the time at which the soonest key goes idle as its retry hint.

use std::hash::BuildHasher;

use hashbrown::HashTable;
use parking_lot::Mutex;

use crate::error::BudgetError;

/// Keys are spread over this many shards (one when `max_keys` is small, see [`WindowLockout::new`]).
const SHARDS: usize = 16;
/// Below this many keys per shard, one shard holds them all (a small cap stays exact).
const MIN_KEYS_PER_SHARD: usize = 1024;
/// A sweep runs no sooner than at this many keys.
const MIN_SWEEP: usize = 64;

/// The rule's numbers: at most `max_requests` per `window_seconds`, then `lockout_seconds`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WindowLockoutRule {
    max_requests: u64,
    window: f64,
    lockout: f64,
}

impl WindowLockoutRule {
    /// A rule, validated as the reference validates it (`max_requests ≥ 0`, `window_seconds > 0`,
    /// `lockout_seconds ≥ 0`), and finite: the errors name the argument and the value.
    pub fn new(
        max_requests: u64,
        window_seconds: f64,
        lockout_seconds: f64,
    ) -> Result<Self, BudgetError> {
        if !(window_seconds.is_finite() && window_seconds > 0.0) {
            return Err(BudgetError::new(
                "window_seconds",
                format!("{window_seconds:?}"),
                "must be a finite number of seconds > 0",
            ));
        }
        if !(lockout_seconds.is_finite() && lockout_seconds >= 0.0) {
            return Err(BudgetError::new(
                "lockout_seconds",
                format!("{lockout_seconds:?}"),
                "must be a finite number of seconds >= 0",
            ));
        }
        Ok(WindowLockoutRule {
            max_requests,
            window: window_seconds,
            lockout: lockout_seconds,
        })
    }

    /// Requests allowed per window (0: limiting is off).
    pub fn max_requests(&self) -> u64 {
        self.max_requests
    }

    /// The window, in seconds.
    pub fn window_seconds(&self) -> f64 {
        self.window
    }

    /// The lockout after the window's limit is passed, in seconds (0: none).
    pub fn lockout_seconds(&self) -> f64 {
        self.lockout
    }

    /// One decision on a key's state (`None`: no state), returning the decision and the state
    /// to keep. The reference's steps, in its order.
    pub fn decide(&self, state: Option<KeyState>, now: f64) -> (Verdict, Option<KeyState>) {
        if self.max_requests == 0 {
            return (Verdict::Allowed, None);
        }
        let mut state = state;
        if let Some(KeyState::LockedUntil(until)) = state {
            if now < until {
                return (
                    Verdict::Limited {
                        retry_after: (until - now).max(0.0),
                    },
                    state,
                );
            }
            state = None;
        }
        let (start, count) = match state {
            Some(KeyState::Window { start, count }) if now - start < self.window => (start, count),
            _ => {
                return (
                    Verdict::Allowed,
                    Some(KeyState::Window {
                        start: now,
                        count: 1,
                    }),
                )
            }
        };
        let count = count.saturating_add(1);
        if u64::from(count) <= self.max_requests {
            return (Verdict::Allowed, Some(KeyState::Window { start, count }));
        }
        if self.lockout > 0.0 {
            let until = now + self.lockout;
            (
                Verdict::Limited {
                    retry_after: self.lockout,
                },
                Some(KeyState::LockedUntil(until)),
            )
        } else {
            let retry_after = (self.window - (now - start)).max(0.0);
            (
                Verdict::Limited { retry_after },
                Some(KeyState::Window { start, count }),
            )
        }
    }

    /// How long until a key in `state` is allowed again (0 if it is now), without counting.
    pub fn wait(&self, state: Option<KeyState>, now: f64) -> f64 {
        match state {
            Some(KeyState::LockedUntil(until)) if now < until => (until - now).max(0.0),
            Some(KeyState::Window { start, count })
                if self.max_requests > 0
                    && u64::from(count) > self.max_requests
                    && now - start < self.window =>
            {
                (self.window - (now - start)).max(0.0)
            }
            _ => 0.0,
        }
    }

    /// Whether a key in `state` is as if new at `now` (no decision reads it again).
    fn idle(&self, state: KeyState, now: f64) -> bool {
        now >= self.idle_at(state)
    }

    /// When a key in `state` goes idle.
    fn idle_at(&self, state: KeyState) -> f64 {
        match state {
            KeyState::LockedUntil(until) => until,
            KeyState::Window { start, .. } => start + self.window,
        }
    }
}

/// One key's state.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KeyState {
    /// A window that began at `start` (seconds) and has counted `count` requests (saturating).
    Window {
        /// When the window began.
        start: f64,
        /// Requests counted in it (refusals included once it is over the limit, as the
        /// reference counts them; only "above the limit or not" is ever read).
        count: u32,
    },
    /// Refused until this time (seconds).
    LockedUntil(f64),
}

/// A decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    /// Allowed (and counted).
    Allowed,
    /// Refused: retry after this many seconds.
    Limited {
        /// The reference's retry hint, in seconds.
        retry_after: f64,
    },
}

/// One key as stored: its hash and its state, 24 bytes.
#[derive(Clone, Copy)]
struct Entry {
    hash: u64,
    /// The window's start, or the lockout's end.
    at: f64,
    count: u32,
    locked: bool,
}

impl Entry {
    fn state(&self) -> KeyState {
        if self.locked {
            KeyState::LockedUntil(self.at)
        } else {
            KeyState::Window {
                start: self.at,
                count: self.count,
            }
        }
    }

    fn set(&mut self, state: KeyState) {
        match state {
            KeyState::Window { start, count } => {
                self.at = start;
                self.count = count;
                self.locked = false;
            }
            KeyState::LockedUntil(until) => {
                self.at = until;
                self.count = 0;
                self.locked = true;
            }
        }
    }

    fn new(hash: u64, state: KeyState) -> Self {
        let mut entry = Entry {
            hash,
            at: 0.0,
            count: 0,
            locked: false,
        };
        entry.set(state);
        entry
    }
}

struct Shard {
    entries: HashTable<Entry>,
    capacity: usize,
    sweep_at: usize,
    /// The earliest time any key of the shard goes idle, as of the last full sweep: at the cap,
    /// a sweep before then could free nothing.
    next_idle_at: f64,
    reclaimed: u64,
    refused_at_capacity: u64,
}

impl Shard {
    fn new(capacity: usize) -> Self {
        Shard {
            entries: HashTable::new(),
            capacity: capacity.max(1),
            sweep_at: MIN_SWEEP.min(capacity.max(1)),
            next_idle_at: f64::NEG_INFINITY,
            reclaimed: 0,
            refused_at_capacity: 0,
        }
    }

    fn sweep(&mut self, rule: &WindowLockoutRule, now: f64) -> u64 {
        let before = self.entries.len();
        let mut next = f64::INFINITY;
        self.entries.retain(|e| {
            let idle_at = rule.idle_at(e.state());
            let keep = now < idle_at;
            if keep && idle_at < next {
                next = idle_at;
            }
            keep
        });
        let removed = before.saturating_sub(self.entries.len()) as u64;
        self.reclaimed = self.reclaimed.saturating_add(removed);
        self.next_idle_at = next;
        self.sweep_at = self
            .entries
            .len()
            .saturating_mul(2)
            .clamp(MIN_SWEEP.min(self.capacity), self.capacity);
        removed
    }
}

/// What a limiter has done since it was built.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WindowLockoutStats {
    /// Requests allowed.
    pub allowed: u64,
    /// Requests refused by the rule.
    pub limited: u64,
    /// New keys refused because `max_keys` live keys were held.
    pub refused_at_capacity: u64,
    /// Keys held now.
    pub keys: u64,
    /// Idle keys forgotten (no effect on any decision).
    pub reclaimed: u64,
}

/// The rule over many keys, each decided alone (see the module docs).
pub struct WindowLockout {
    rule: WindowLockoutRule,
    shards: Box<[Mutex<Shard>]>,
    hasher: foldhash::fast::RandomState,
    allowed: std::sync::atomic::AtomicU64,
    limited: std::sync::atomic::AtomicU64,
}

impl WindowLockout {
    /// A limiter of `rule` holding at most `max_keys` live keys (≥ 1).
    pub fn new(rule: WindowLockoutRule, max_keys: usize) -> Result<Self, BudgetError> {
        if max_keys == 0 {
            return Err(BudgetError::new(
                "max_keys",
                "0".to_owned(),
                "must be at least 1",
            ));
        }
        let shards = if max_keys < SHARDS.saturating_mul(MIN_KEYS_PER_SHARD) {
            1
        } else {
            SHARDS
        };
        let per_shard = max_keys.div_ceil(shards);
        Ok(WindowLockout {
            rule,
            shards: (0..shards)
                .map(|_| Mutex::new(Shard::new(per_shard)))
                .collect(),
            hasher: foldhash::fast::RandomState::default(),
            allowed: Default::default(),
            limited: Default::default(),
        })
    }

    /// The rule.
    pub fn rule(&self) -> &WindowLockoutRule {
        &self.rule
    }

    /// The key of `identity` in `scope` (hashed; the raw values are never stored).
    pub fn key(&self, scope: &str, identity: &str) -> u64 {
        self.hasher.hash_one((scope, identity))
    }

    fn shard(&self, key: u64) -> Option<&Mutex<Shard>> {
        // The middle bits: hashbrown takes buckets from the low bits and tags from the top.
        let i = ((key >> 32) as usize).checked_rem(self.shards.len())?;
        self.shards.get(i)
    }

    /// Decides one request of `key` at `now` (seconds) and counts it.
    pub fn check(&self, key: u64, now: f64) -> Verdict {
        use std::sync::atomic::Ordering::Relaxed;
        let verdict = self.check_inner(key, now);
        match verdict {
            Verdict::Allowed => self.allowed.fetch_add(1, Relaxed),
            Verdict::Limited { .. } => self.limited.fetch_add(1, Relaxed),
        };
        verdict
    }

    fn check_inner(&self, key: u64, now: f64) -> Verdict {
        if self.rule.max_requests == 0 {
            return Verdict::Allowed;
        }
        let Some(shard) = self.shard(key) else {
            return Verdict::Allowed;
        };
        let mut shard = shard.lock();
        if let Some(entry) = shard.entries.find_mut(key, |e| e.hash == key) {
            let (verdict, next) = self.rule.decide(Some(entry.state()), now);
            if let Some(next) = next {
                entry.set(next);
            }
            return verdict;
        }
        // A new key. The rule never refuses one, so only the cap can.
        let (verdict, next) = self.rule.decide(None, now);
        let Some(next) = next else {
            return verdict;
        };
        let len = shard.entries.len();
        if len >= shard.sweep_at && len < shard.capacity {
            shard.sweep(&self.rule, now);
        }
        if shard.entries.len() >= shard.capacity {
            if now >= shard.next_idle_at {
                shard.sweep(&self.rule, now);
            }
            if shard.entries.len() >= shard.capacity {
                shard.refused_at_capacity = shard.refused_at_capacity.saturating_add(1);
                let retry_after = (shard.next_idle_at - now).max(0.0);
                return Verdict::Limited { retry_after };
            }
        }
        shard
            .entries
            .insert_unique(key, Entry::new(key, next), |e| e.hash);
        verdict
    }

    /// How long until `key` is allowed again at `now` (0 if it is), without counting.
    pub fn wait(&self, key: u64, now: f64) -> f64 {
        let Some(shard) = self.shard(key) else {
            return 0.0;
        };
        let shard = shard.lock();
        let state = shard.entries.find(key, |e| e.hash == key).map(Entry::state);
        self.rule.wait(state, now)
    }

    /// Forgets `key` (a successful login, say): its next request starts a new window.
    pub fn reset(&self, key: u64) {
        if let Some(shard) = self.shard(key) {
            if let Ok(entry) = shard.lock().entries.find_entry(key, |e| e.hash == key) {
                entry.remove();
            }
        }
    }

    /// Forgets every idle key now; how many.
    pub fn reclaim(&self, now: f64) -> u64 {
        self.shards
            .iter()
            .map(|s| s.lock().sweep(&self.rule, now))
            .sum()
    }

    /// Whether `key` is held and idle at `now` (for tests of reclamation).
    pub fn is_idle(&self, key: u64, now: f64) -> Option<bool> {
        let shard = self.shard(key)?.lock();
        let entry = shard.entries.find(key, |e| e.hash == key)?;
        Some(self.rule.idle(entry.state(), now))
    }

    /// The counters and the keys held now.
    pub fn stats(&self) -> WindowLockoutStats {
        use std::sync::atomic::Ordering::Relaxed;
        let mut stats = WindowLockoutStats {
            allowed: self.allowed.load(Relaxed),
            limited: self.limited.load(Relaxed),
            ..WindowLockoutStats::default()
        };
        for shard in self.shards.iter() {
            let shard = shard.lock();
            stats.keys = stats.keys.saturating_add(shard.entries.len() as u64);
            stats.reclaimed = stats.reclaimed.saturating_add(shard.reclaimed);
            stats.refused_at_capacity = stats
                .refused_at_capacity
                .saturating_add(shard.refused_at_capacity);
        }
        stats
    }

    /// Bytes the keys hold now (the tables' allocations).
    pub fn memory_bytes(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().entries.allocation_size())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(max: u64, window: f64, lockout: f64) -> WindowLockoutRule {
        WindowLockoutRule::new(max, window, lockout).unwrap()
    }

    #[test]
    fn an_entry_is_24_bytes() {
        assert_eq!(std::mem::size_of::<Entry>(), 24);
    }

    #[test]
    fn a_window_starts_at_the_first_request_then_locks_out() {
        let limiter = WindowLockout::new(rule(2, 10.0, 30.0), 100).unwrap();
        let k = limiter.key("login", "alice");
        assert_eq!(limiter.check(k, 100.0), Verdict::Allowed);
        assert_eq!(limiter.check(k, 105.0), Verdict::Allowed);
        assert_eq!(
            limiter.check(k, 106.0),
            Verdict::Limited { retry_after: 30.0 }
        );
        assert_eq!(
            limiter.check(k, 120.0),
            Verdict::Limited { retry_after: 16.0 }
        );
        assert_eq!(limiter.wait(k, 130.0), 6.0);
        assert_eq!(limiter.check(k, 136.0), Verdict::Allowed);
        // Another scope, another key.
        assert_eq!(
            limiter.check(limiter.key("other", "alice"), 106.0),
            Verdict::Allowed
        );
    }

    #[test]
    fn without_a_lockout_the_key_waits_for_its_window_to_end() {
        let limiter = WindowLockout::new(rule(1, 10.0, 0.0), 100).unwrap();
        let k = limiter.key("s", "i");
        assert_eq!(limiter.check(k, 0.0), Verdict::Allowed);
        assert_eq!(limiter.check(k, 4.0), Verdict::Limited { retry_after: 6.0 });
        assert_eq!(limiter.check(k, 9.0), Verdict::Limited { retry_after: 1.0 });
        assert_eq!(limiter.check(k, 10.0), Verdict::Allowed);
    }

    #[test]
    fn two_times_n_pass_across_a_window_end() {
        let limiter = WindowLockout::new(rule(3, 10.0, 0.0), 100).unwrap();
        let k = limiter.key("s", "i");
        let times = [0.0, 9.0, 9.5, 9.9, 10.0, 10.1, 10.2];
        let allowed = times
            .iter()
            .filter(|&&t| limiter.check(k, t) == Verdict::Allowed)
            .count();
        // 0.0 starts a window; 9.x are its 2nd and 3rd and a refusal; 10.0 starts the next.
        assert_eq!(allowed, 6);
    }

    #[test]
    fn zero_max_switches_limiting_off_and_keeps_nothing() {
        let limiter = WindowLockout::new(rule(0, 1.0, 5.0), 1).unwrap();
        for i in 0..100 {
            let k = limiter.key("s", &i.to_string());
            assert_eq!(limiter.check(k, 1.0), Verdict::Allowed);
        }
        assert_eq!(limiter.stats().keys, 0);
    }

    #[test]
    fn bad_rules_name_the_argument() {
        for (w, l, arg) in [
            (0.0, 0.0, "window_seconds"),
            (f64::NAN, 0.0, "window_seconds"),
            (1.0, -1.0, "lockout_seconds"),
            (1.0, f64::INFINITY, "lockout_seconds"),
        ] {
            assert_eq!(WindowLockoutRule::new(1, w, l).unwrap_err().argument(), arg);
        }
        assert!(WindowLockout::new(rule(1, 1.0, 0.0), 0).is_err());
    }

    #[test]
    fn idle_keys_are_reclaimed_and_live_ones_capped() {
        let limiter = WindowLockout::new(rule(1, 10.0, 100.0), 4).unwrap();
        let keys: Vec<u64> = (0..4).map(|i| limiter.key("s", &i.to_string())).collect();
        for &k in &keys {
            assert_eq!(limiter.check(k, 0.0), Verdict::Allowed);
        }
        // At the cap: a new key is refused until the soonest key goes idle (t = 10).
        let new = limiter.key("s", "new");
        assert_eq!(
            limiter.check(new, 5.0),
            Verdict::Limited { retry_after: 5.0 }
        );
        // A lockout is never pushed out by new keys.
        assert!(matches!(
            limiter.check(keys[0], 6.0),
            Verdict::Limited { .. }
        ));
        // keys 1..4 go idle at 10: room again.
        assert_eq!(limiter.check(new, 10.0), Verdict::Allowed);
        assert_eq!(limiter.stats().refused_at_capacity, 1);
        assert!(matches!(
            limiter.check(keys[0], 7.0),
            Verdict::Limited { .. }
        ));
        assert!(limiter.stats().reclaimed >= 3);
        assert_eq!(limiter.reclaim(200.0), 2);
        assert_eq!(limiter.stats().keys, 0);
    }

    #[test]
    fn random_keys_hold_memory_bounded() {
        let limiter = WindowLockout::new(rule(5, 1.0, 0.0), 1 << 20).unwrap();
        // 200,000 distinct keys, 1,000 per simulated second: at most ~1,000 live at a time.
        for i in 0..200_000u64 {
            let k = limiter.key("s", &i.to_string());
            limiter.check(k, i as f64 / 1000.0);
        }
        let keys = limiter.stats().keys;
        assert!(keys <= 2 * 16 * 1024, "{keys}");
        // And at 100,000 live keys, at most 64 bytes each.
        let limiter = WindowLockout::new(rule(5, 1e9, 0.0), 1 << 20).unwrap();
        for i in 0..100_000u64 {
            limiter.check(limiter.key("s", &i.to_string()), 0.0);
        }
        let per_key = limiter.memory_bytes() / 100_000;
        assert!(per_key <= 64, "{per_key} bytes per key");
    }
}
