//! Arithmetic on the core's `u64` counters, none of which can panic.
//!
//! No counter can realistically reach `u64::MAX`. Live counts (turns in flight, waiters, a
//! lane's length) are bounded by the records and slots that exist, and running totals
//! (admitted, shed, slots freed, arrival numbers) grow by one per event: 2^64 events take 584
//! years at a billion a second. So [`increment`] saturates, and the saturation never happens.
//! Saturating rather than wrapping because a total stuck at its maximum misleads less than one
//! that restarts at zero.
//!
//! Going below zero is another matter: it means an accounting bug (a slot returned twice, a
//! waiter unlinked twice). [`decrement`] and [`difference`] check for it with `debug_assert!`,
//! so debug builds and `cargo test` stop at the bug. In release builds they stop at zero,
//! because a count wrapped to 2^64 - 1 (that many turns in flight) would shut the gate for good.

/// Adds one to `count`, saturating (see the module documentation).
#[inline]
pub(crate) fn increment(count: &mut u64) {
    *count = count.saturating_add(1);
}

/// Takes one from `count`, which must be positive; `what` names it for a failed check.
#[inline]
#[track_caller]
pub(crate) fn decrement(count: &mut u64, what: &str) {
    debug_assert!(*count > 0, "{what} went below zero");
    *count = count.saturating_sub(1);
}

/// `total - part`, where `part` counts a subset of `total`; `what` names it for a failed check.
#[inline]
#[track_caller]
pub(crate) fn difference(total: u64, part: u64, what: &str) -> u64 {
    debug_assert!(part <= total, "{what}: {part} of {total}");
    total.saturating_sub(part)
}
