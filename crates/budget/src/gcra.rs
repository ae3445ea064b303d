//! GCRA (the generic cell rate algorithm), chosen with `burst`: one timestamp per key.
//!
//! A limit of `amount` per `window` with burst `B` spaces admissions one emission interval
//! `I = window / amount` apart, letting up to `B` through at once. The cell holds the
//! theoretical arrival time `tat`; an admission of cost `c` at `t` is allowed when
//! `max(tat, t) + c·I - B·I <= t`, and sets `tat` to `max(tat, t) + c·I`. All times are kept
//! multiplied by `amount`, so `I·amount = window` is a whole number of nanoseconds and nothing
//! is rounded: the retry time is exact (rounded up to the next nanosecond).
//!
//! **The bound.** In any half-open interval of length `window`, at most `amount + B - 1` units
//! are admitted (`B` at once). Proof: `tat` grows by at least `c·I` per admission and after
//! one at `t` is at most `t + B·I`; for admissions at `t_1 <= ... <= t_k` in one interval,
//! `t_1 + Σc·I <= tat_k <= t_k + B·I`, so `Σc·I <= t_k - t_1 + B·I < window + B·I`, and
//! `Σc < amount + B`. With `B = 1` that is "at most `amount` per window", spaced evenly.

use crate::verdict::Verdict;

/// One key's GCRA state under one limit: `tat`, times `amount`, split in two words so the
/// state stays 8-byte aligned.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Cell {
    tat_hi: u64,
    tat_lo: u64,
}

/// The fixed numbers of one GCRA limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Gcra {
    pub(crate) window: u64,
    pub(crate) amount: u64,
    pub(crate) burst: u64,
}

impl Cell {
    fn tat(&self) -> u128 {
        (u128::from(self.tat_hi) << 64) | u128::from(self.tat_lo)
    }

    fn set_tat(&mut self, tat: u128) {
        self.tat_hi = u64::try_from(tat >> 64).unwrap_or(u64::MAX);
        self.tat_lo = u64::try_from(tat & u128::from(u64::MAX)).unwrap_or(u64::MAX);
    }

    /// Whether `cost` fits at `now`, and if not, from when.
    pub(crate) fn verdict(&self, g: Gcra, now: u64, cost: u64) -> Verdict {
        if cost > g.burst {
            return Verdict::Never;
        }
        let now_s = u128::from(now).saturating_mul(u128::from(g.amount));
        let after = self.tat().max(now_s).saturating_add(units(g, cost));
        let allowed_from = after.saturating_sub(units(g, g.burst));
        if allowed_from <= now_s {
            return Verdict::Allowed;
        }
        // Rounded up: at that nanosecond the condition holds.
        let amount = u128::from(g.amount.max(1));
        let ns = allowed_from.div_ceil(amount);
        Verdict::RetryAt(u64::try_from(ns).unwrap_or(u64::MAX))
    }

    /// Records `cost` at `now` (a debt is the same: more units at `now`).
    pub(crate) fn add(&mut self, g: Gcra, now: u64, cost: u64) {
        let now_s = u128::from(now).saturating_mul(u128::from(g.amount));
        self.set_tat(self.tat().max(now_s).saturating_add(units(g, cost)));
    }

    /// Gives `cost` back (a refund, or a reservation returned). Below `now` it is as if the
    /// key were idle: GCRA never lends more than its burst.
    pub(crate) fn take_back(&mut self, g: Gcra, cost: u64) {
        self.set_tat(self.tat().saturating_sub(units(g, cost)));
    }

    /// When the cell is idle again (as if new), in ns: `tat / amount`, rounded up.
    pub(crate) fn idle_at(&self, g: Gcra) -> u64 {
        let ns = self.tat().div_ceil(u128::from(g.amount.max(1)));
        u64::try_from(ns).unwrap_or(u64::MAX)
    }
}

/// `cost` emission intervals, in the scaled unit (`I·amount = window`).
fn units(g: Gcra, cost: u64) -> u128 {
    u128::from(cost).saturating_mul(u128::from(g.window))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_then_one_per_interval_with_exact_retry_times() {
        // 3 per 30 ns (I = 10), burst 2.
        let g = Gcra {
            window: 30,
            amount: 3,
            burst: 2,
        };
        let mut cell = Cell::default();
        for _ in 0..2 {
            assert_eq!(cell.verdict(g, 100, 1), Verdict::Allowed);
            cell.add(g, 100, 1);
        }
        assert_eq!(cell.verdict(g, 100, 1), Verdict::RetryAt(110));
        assert_eq!(cell.verdict(g, 109, 1), Verdict::RetryAt(110));
        assert_eq!(cell.verdict(g, 110, 1), Verdict::Allowed);
        assert_eq!(cell.verdict(g, 110, 3), Verdict::Never);
        assert_eq!(cell.idle_at(g), 120);
        cell.take_back(g, 1);
        assert_eq!(cell.verdict(g, 100, 1), Verdict::Allowed);
    }

    #[test]
    fn a_window_that_does_not_divide_is_not_rounded() {
        // 3 per 10 ns: I = 3.33 ns. Three at 0 with burst 3; the next at 10/3 rounded up.
        let g = Gcra {
            window: 10,
            amount: 3,
            burst: 3,
        };
        let mut cell = Cell::default();
        cell.add(g, 0, 3);
        assert_eq!(cell.verdict(g, 0, 1), Verdict::RetryAt(4));
        assert_eq!(cell.verdict(g, 4, 1), Verdict::Allowed);
    }
}
