//! The exact sliding log: one key's admissions under one limit within the last window.
//!
//! "At most `limit` in any half-open interval of length `window`" holds after an admission at
//! `now` if and only if it held before and the amounts admitted in `(now - window, now]`, plus
//! the new cost, are at most `limit`: the only intervals that gain are those that contain
//! `now`, and the fullest of them starts just after `now - window` (nothing was admitted after
//! `now`). So the log keeps exactly the entries with `at + window > now` and their total; the
//! next admission of `cost` is allowed at the time the oldest entries leave the window until
//! the rest plus `cost` fit, which is exact because nothing else changes the log meanwhile.
//!
//! Entries at the same instant are merged, so a burst answered in one clock tick costs one
//! entry. Memory is 16 bytes per distinct admission time in the window; an exact answer for
//! every interval needs the times of the last `limit` admissions in general (an adversary
//! can place them anywhere in the window, and each one's exit time is a different next-allowed
//! time), so no exact structure is asymptotically smaller.

use std::collections::VecDeque;

use crate::verdict::Verdict;

/// Amount admitted at one instant (ns, the caller's clock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    at: u64,
    amount: u64,
}

/// One key's admissions within the last window, oldest first, and their total.
#[derive(Debug, Default, Clone)]
pub(crate) struct SlidingLog {
    entries: VecDeque<Entry>,
    total: u64,
}

impl SlidingLog {
    /// Forgets the entries that left the window by `now`: those with `at + window <= now`.
    pub(crate) fn prune(&mut self, now: u64, window: u64) {
        while let Some(oldest) = self.entries.front() {
            if oldest.at.saturating_add(window) > now {
                break;
            }
            self.total = self.total.saturating_sub(oldest.amount);
            self.entries.pop_front();
        }
    }

    /// Whether `cost` more fits at `now` (pruned to `now` first), and if not, from when.
    pub(crate) fn verdict(&self, window: u64, limit: u64, cost: u64) -> Verdict {
        if cost > limit {
            return Verdict::Never;
        }
        let room = limit.saturating_sub(cost);
        if self.total <= room {
            return Verdict::Allowed;
        }
        let mut left = self.total;
        for entry in &self.entries {
            left = left.saturating_sub(entry.amount);
            if left <= room {
                return Verdict::RetryAt(entry.at.saturating_add(window));
            }
        }
        // Unreachable: `left` reaches 0 <= room at the last entry at the latest.
        Verdict::Never
    }

    /// Records `amount` at `at` (never earlier than the newest entry: the caller's clock for
    /// one key is made monotonic before it gets here).
    pub(crate) fn add(&mut self, at: u64, amount: u64) {
        if amount == 0 {
            return;
        }
        self.total = self.total.saturating_add(amount);
        if let Some(newest) = self.entries.back_mut() {
            if newest.at >= at {
                newest.amount = newest.amount.saturating_add(amount);
                return;
            }
        }
        self.entries.push_back(Entry { at, amount });
    }

    /// Takes back up to `amount` recorded at `at` (a refund, or a reservation given back).
    /// Nothing to take back once that entry left the window: the past cannot be changed, and
    /// no future interval contains it.
    pub(crate) fn take_back(&mut self, at: u64, amount: u64) {
        let i = self.entries.partition_point(|e| e.at < at);
        let Some(entry) = self.entries.get_mut(i) else {
            return;
        };
        if entry.at != at {
            return;
        }
        let taken = entry.amount.min(amount);
        entry.amount = entry.amount.saturating_sub(taken);
        self.total = self.total.saturating_sub(taken);
        if entry.amount == 0 {
            self.entries.remove(i);
        }
    }

    /// The newest entry's time, if any.
    pub(crate) fn newest(&self) -> Option<u64> {
        self.entries.back().map(|e| e.at)
    }

    /// When the log will be empty (the newest entry leaves the window); `None` if it is.
    pub(crate) fn empty_at(&self, window: u64) -> Option<u64> {
        self.newest().map(|at| at.saturating_add(window))
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Heap bytes held (the entries' buffer).
    pub(crate) fn heap_bytes(&self) -> usize {
        self.entries
            .capacity()
            .saturating_mul(std::mem::size_of::<Entry>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn n_per_window_then_the_exact_exit_time_of_the_oldest() {
        let mut log = SlidingLog::default();
        for t in [0, 10, 20] {
            log.prune(t, 100);
            assert_eq!(log.verdict(100, 3, 1), Verdict::Allowed);
            log.add(t, 1);
        }
        log.prune(50, 100);
        assert_eq!(log.verdict(100, 3, 1), Verdict::RetryAt(100));
        // Half-open: at 100 the entry at 0 is out of [1, 101).
        log.prune(100, 100);
        assert_eq!(log.verdict(100, 3, 1), Verdict::Allowed);
    }

    #[test]
    fn a_large_cost_waits_for_several_entries_and_too_large_never_fits() {
        let mut log = SlidingLog::default();
        log.add(0, 40);
        log.add(10, 40);
        log.add(20, 20);
        assert_eq!(log.verdict(100, 100, 50), Verdict::RetryAt(110));
        assert_eq!(log.verdict(100, 100, 101), Verdict::Never);
        log.take_back(10, 30);
        assert_eq!(log.verdict(100, 100, 50), Verdict::RetryAt(100));
        log.take_back(10, 1000);
        assert_eq!(log.entries.len(), 2);
        assert_eq!(log.verdict(100, 100, 40), Verdict::Allowed);
    }

    #[test]
    fn same_instant_merges_and_pruning_frees_the_buffer_total() {
        let mut log = SlidingLog::default();
        log.add(5, 1);
        log.add(5, 1);
        assert_eq!(log.entries.len(), 1);
        log.prune(105, 100);
        assert!(log.is_empty());
        assert_eq!(log.total, 0);
    }
}
