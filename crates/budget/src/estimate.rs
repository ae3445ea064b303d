//! A turn's token estimate learned from what turns report ([`RecentUsage`]): what a turn
//! reserves in its budgets when its caller gives no cost.
//!
//! # Design
//!
//! **The estimate.** Per identity, the larger of its last report and a decayed average of its
//! reports: it rises at once to a larger report and falls back gradually after smaller ones,
//! the gap halving every `half_life` reports. Erring high is the cheaper mistake for a budget:
//! an estimate above the usage is refunded when the turn reports, one below it becomes a debt
//! that delays the identity's next turns. An identity with no report is estimated from the
//! decayed average of every identity's reports, and before any report at all from `initial`.
//!
//! **Identities** are hashed with a per-estimator random key ([`UsageKey`]) before anything
//! is stored, as a [`Budget`](crate::Budget)'s are: the raw identity is never held.
//!
//! **Memory.** At most `max_identities` identities are held, in two generations of at most
//! half that each: a report goes to the young generation (moving its identity there from the
//! old one); when the young one is full it becomes the old one and the old one is forgotten
//! (counted in [`UsageStats::forgotten`]). So an identity is remembered at least until
//! `max_identities / 2` other identities have reported for the first time since it last
//! did; one forgotten is estimated from the global average again, which is harmless. Each
//! generation is a hash table of 24-byte entries (hash, average, last report); both full, the
//! tables hold at most about 58 bytes per identity of the cap (a table's buckets are a power
//! of two at most 7/8 full, plus a control byte each; checked by the tests).
//!
//! **Cost.** One lock and one hash lookup per estimate or report, no allocation except when a
//! generation's table grows. The lock is never held while anything else runs, so a caller
//! holding another lock (or Python's GIL) never waits long for it.
//!
//! **Arithmetic** is in `f64`: an amount is at most [`MAX_AMOUNT`](crate::rate::MAX_AMOUNT)
//! (2^48), exact in a double, and an estimate is the average rounded up, capped at that.

use std::hash::BuildHasher;

use hashbrown::HashMap;
use parking_lot::Mutex;

use crate::error::BudgetError;
use crate::rate::MAX_AMOUNT;

/// The default cap on identities a [`RecentUsage`] holds.
pub const DEFAULT_MAX_IDENTITIES: usize = 1 << 16;

/// The largest cap on identities (`max_identities`).
pub const MAX_IDENTITIES: usize = 1 << 24;

/// The default half-life of the decayed average, in reports.
pub const DEFAULT_HALF_LIFE: u64 = 8;

/// The largest half-life, in reports.
pub const MAX_HALF_LIFE: u64 = 1_000_000;

/// An identity as an estimator holds it: a 64-bit hash keyed per estimator (the raw identity
/// is never stored). Two identities colliding would share an estimate, nothing worse.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct UsageKey(u64);

impl std::fmt::Debug for UsageKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UsageKey({:016x})", self.0)
    }
}

/// What an estimator has done since it was built (no per-identity numbers).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UsageStats {
    /// Identities held now.
    pub identities: u64,
    /// Reports learned from.
    pub reports: u64,
    /// Identities forgotten to keep within the cap.
    pub forgotten: u64,
    /// Bytes its tables hold.
    pub bytes: u64,
}

/// One identity's record: 16 bytes (24 with its key in the table).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Entry {
    /// The decayed average of its reports.
    average: f64,
    /// Its last report.
    last: u64,
}

impl Entry {
    fn first(tokens: u64) -> Self {
        Entry {
            average: tokens as f64,
            last: tokens,
        }
    }

    fn learn(&mut self, tokens: u64, weight: f64) {
        self.average = decay(self.average, tokens, weight);
        self.last = tokens;
    }

    fn estimate(&self) -> u64 {
        round_up(self.average).max(self.last).min(MAX_AMOUNT)
    }
}

/// `average` moved `weight` of the way to `tokens`.
fn decay(average: f64, tokens: u64, weight: f64) -> f64 {
    average + weight * (tokens as f64 - average)
}

/// A token amount from an average: rounded up, within `0..=MAX_AMOUNT`.
fn round_up(value: f64) -> u64 {
    if value.is_nan() || value <= 0.0 {
        return 0;
    }
    // `as` saturates; the average of amounts <= MAX_AMOUNT is itself <= MAX_AMOUNT.
    (value.ceil() as u64).min(MAX_AMOUNT)
}

/// A generation's table. Its keys are already keyed hashes; the fixed hasher only spreads
/// them over the buckets.
type Table = HashMap<u64, Entry, foldhash::fast::FixedState>;

struct State {
    /// Identities that reported since the last rotation.
    young: Table,
    /// Identities that reported in the generation before.
    old: Table,
    /// The decayed average of every identity's reports (`None` before the first).
    global: Option<f64>,
    reports: u64,
    forgotten: u64,
}

impl State {
    fn find(&self, key: u64) -> Option<&Entry> {
        self.young.get(&key).or_else(|| self.old.get(&key))
    }
}

/// Learns a token estimate per identity from what its turns report (see the module docs).
pub struct RecentUsage {
    initial: u64,
    half_life: u64,
    /// The share of each report in the decayed averages: `1 - 2^(-1/half_life)`.
    weight: f64,
    max_identities: usize,
    /// Each generation's cap: `max_identities / 2`.
    generation: usize,
    hasher: foldhash::fast::RandomState,
    state: Mutex<State>,
}

impl std::fmt::Debug for RecentUsage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecentUsage")
            .field("initial", &self.initial)
            .field("half_life", &self.half_life)
            .field("max_identities", &self.max_identities)
            .finish_non_exhaustive()
    }
}

impl RecentUsage {
    /// An estimator that answers `initial` (0 to [`MAX_AMOUNT`]) before any report, halves
    /// the gap to a smaller usage every `half_life` reports (1 to [`MAX_HALF_LIFE`]) and
    /// holds at most `max_identities` identities (2 to [`MAX_IDENTITIES`]).
    pub fn new(initial: u64, half_life: u64, max_identities: u64) -> Result<Self, BudgetError> {
        if initial > MAX_AMOUNT {
            return Err(BudgetError::new(
                "initial",
                initial.to_string(),
                format!("must be 0 to {MAX_AMOUNT} (tokens)"),
            ));
        }
        if half_life == 0 || half_life > MAX_HALF_LIFE {
            return Err(BudgetError::new(
                "half_life",
                half_life.to_string(),
                format!("must be 1 to {MAX_HALF_LIFE} (reports)"),
            ));
        }
        let max_identities = match usize::try_from(max_identities) {
            Ok(max) if (2..=MAX_IDENTITIES).contains(&max) => max,
            _ => {
                return Err(BudgetError::new(
                    "max_identities",
                    max_identities.to_string(),
                    format!("must be 2 to {MAX_IDENTITIES}"),
                ))
            }
        };
        // Exact: half_life <= MAX_HALF_LIFE is far below 2^53.
        let weight = 1.0 - 0.5_f64.powf(1.0 / half_life as f64);
        Ok(RecentUsage {
            initial,
            half_life,
            weight,
            max_identities,
            generation: max_identities / 2,
            hasher: foldhash::fast::RandomState::default(),
            state: Mutex::new(State {
                young: Table::default(),
                old: Table::default(),
                global: None,
                reports: 0,
                forgotten: 0,
            }),
        })
    }

    /// The estimate before any report.
    pub fn initial(&self) -> u64 {
        self.initial
    }

    /// The decayed averages' half-life, in reports.
    pub fn half_life(&self) -> u64 {
        self.half_life
    }

    /// The share of each report in the decayed averages (`1 - 2^(-1/half_life)`).
    pub fn weight(&self) -> f64 {
        self.weight
    }

    /// The most identities held at once.
    pub fn max_identities(&self) -> usize {
        self.max_identities
    }

    /// The key `identity` is held under (a keyed hash: the identity itself is never stored).
    pub fn key(&self, identity: &[u8]) -> UsageKey {
        UsageKey(self.hasher.hash_one(identity))
    }

    /// The tokens a turn of `key` is expected to use.
    pub fn estimate(&self, key: UsageKey) -> u64 {
        let state = self.state.lock();
        match state.find(key.0) {
            Some(entry) => entry.estimate(),
            None => state.global.map_or(self.initial, round_up),
        }
    }

    /// A turn of `key` used `tokens`.
    pub fn report(&self, key: UsageKey, tokens: u64) {
        let tokens = tokens.min(MAX_AMOUNT);
        let mut state = self.state.lock();
        state.reports = state.reports.saturating_add(1);
        state.global = Some(match state.global {
            None => tokens as f64,
            Some(global) => decay(global, tokens, self.weight),
        });
        if let Some(entry) = state.young.get_mut(&key.0) {
            entry.learn(tokens, self.weight);
            return;
        }
        let entry = match state.old.remove(&key.0) {
            Some(mut entry) => {
                entry.learn(tokens, self.weight);
                entry
            }
            None => Entry::first(tokens),
        };
        if state.young.len() >= self.generation {
            // The young generation is full: it becomes the old one, and the old one's
            // identities (none of which reported since) are forgotten.
            let young = std::mem::take(&mut state.young);
            let dropped = std::mem::replace(&mut state.old, young);
            state.forgotten = state.forgotten.saturating_add(dropped.len() as u64);
        }
        state.young.insert(key.0, entry);
    }

    /// Its counters.
    pub fn stats(&self) -> UsageStats {
        let state = self.state.lock();
        let bytes = state
            .young
            .allocation_size()
            .saturating_add(state.old.allocation_size());
        UsageStats {
            identities: state.young.len().saturating_add(state.old.len()) as u64,
            reports: state.reports,
            forgotten: state.forgotten,
            bytes: bytes as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(initial: u64, half_life: u64, max: u64) -> RecentUsage {
        RecentUsage::new(initial, half_life, max).unwrap()
    }

    #[test]
    fn the_arguments_are_checked_by_name() {
        let cases = [
            (MAX_AMOUNT + 1, 8, 10, "initial="),
            (0, 0, 10, "half_life=0"),
            (0, MAX_HALF_LIFE + 1, 10, "half_life="),
            (0, 8, 1, "max_identities=1"),
            (0, 8, MAX_IDENTITIES as u64 + 1, "max_identities="),
        ];
        for (initial, half_life, max, named) in cases {
            let err = RecentUsage::new(initial, half_life, max).unwrap_err();
            assert!(err.to_string().starts_with(named), "{err}");
        }
    }

    #[test]
    fn rises_at_once_and_falls_back_halving_the_gap_every_half_life() {
        let u = usage(500, 2, 100);
        let k = u.key(b"alice");
        assert_eq!(u.estimate(k), 500, "before any report: initial");
        u.report(k, 1000);
        assert_eq!(u.estimate(k), 1000);
        u.report(k, 4000);
        assert_eq!(u.estimate(k), 4000, "a larger report is the next estimate");
        // Smaller reports: the average falls toward 1000, the gap halving every 2 reports.
        let mut average = 1000.0 + (4000.0 - 1000.0) * u.weight();
        for n in 1..=8 {
            u.report(k, 1000);
            average += u.weight() * (1000.0 - average);
            assert_eq!(
                u.estimate(k),
                round_up(average),
                "after {n} reports of 1000"
            );
        }
        // 8 reports = 4 half-lives: the gap from the average before them is down 16-fold.
        let gap = u.estimate(k) - 1000;
        let first_gap = round_up(1000.0 + 3000.0 * u.weight()) - 1000;
        assert!(gap * 16 <= first_gap + 16, "{gap} vs {first_gap}");
    }

    #[test]
    fn a_new_identity_gets_the_global_average() {
        let u = usage(700, 1, 100);
        let (a, b, c) = (u.key(b"a"), u.key(b"b"), u.key(b"c"));
        assert_eq!(u.estimate(c), 700);
        u.report(a, 100);
        assert_eq!(u.estimate(c), 100);
        u.report(b, 300);
        // half_life 1: each report moves the average half way.
        assert_eq!(u.estimate(c), 200);
        assert_eq!(u.estimate(a), 100, "a known identity keeps its own");
    }

    #[test]
    fn identities_are_held_under_a_keyed_hash() {
        let (one, two) = (usage(0, 8, 10), usage(0, 8, 10));
        assert_ne!(one.key(b"alice"), two.key(b"alice"), "keyed per estimator");
        assert_eq!(one.key(b"alice"), one.key(b"alice"));
    }

    #[test]
    fn memory_stays_within_the_cap_and_recent_identities_are_kept() {
        let max = 1000;
        let u = usage(0, 8, max);
        let keep = u.key(b"regular");
        let mut high = 0;
        for i in 0u64..200_000 {
            u.report(u.key(&i.to_le_bytes()), i % 5000);
            if i % 400 == 0 {
                // Reported every 400 new identities (< max / 2): never forgotten.
                u.report(keep, 77_777);
            }
            let s = u.stats();
            assert!(s.identities <= max, "{s:?}");
            high = high.max(s.bytes);
            assert_eq!(u.estimate(keep), 77_777, "forgotten at {i}");
        }
        let s = u.stats();
        assert_eq!(s.reports, 200_000 + 500);
        assert!(s.forgotten >= 200_000 - max, "{s:?}");
        // The documented bound: about 58 bytes per identity of the cap, both tables full.
        assert!(high <= 58 * max + 256, "{high} bytes for {max}");
    }

    #[test]
    fn an_identity_not_reported_for_a_generation_is_forgotten() {
        let u = usage(5, 8, 10);
        let gone = u.key(b"gone");
        u.report(gone, 900);
        for i in 0u64..10 {
            u.report(u.key(&i.to_le_bytes()), 10);
        }
        // 10 new identities with generations of 5: "gone"'s generation was dropped.
        assert_ne!(u.estimate(gone), 900);
        assert!(u.stats().identities <= 10);
    }

    #[test]
    fn reports_beyond_the_largest_amount_are_capped() {
        let u = usage(0, 8, 10);
        let k = u.key(b"k");
        u.report(k, u64::MAX);
        assert_eq!(u.estimate(k), MAX_AMOUNT);
        assert_eq!(round_up(f64::NAN), 0);
        assert_eq!(round_up(-3.0), 0);
    }
}
