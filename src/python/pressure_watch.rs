//! Re-sampling memory pressure while it holds waiters back.
//!
//! Under memory pressure the gate leaves free slots idle, and only a fresh sample that finds
//! the pressure eased lets the waiters it held back take them. Arrivals and releases sample,
//! but when neither comes (a long turn runs, nobody arrives) the waiters were stranded until
//! their queue timeout, with slots free. So while the core reports waiters held back
//! ([`admitgate_core::Gate::held_back`]), someone re-samples every [`WATCH_INTERVAL`]:
//!
//! * on an event loop, one [`PressureCheck`] per gate, a `call_later` callback that samples,
//!   lets eased pressure start the waiters, and schedules itself again while waiters are still
//!   held back. It runs on the loop of the waiter that found the gate holding it back (or, for
//!   a `reconfigure` on a thread with no loop, of the oldest waiter);
//! * a thread blocked in `admit_sync` re-samples itself, waiting in slices of the interval.
//!
//! Only one check is armed per gate ([`PressureWatch`], this module); one whose loop stopped
//! running it (closed, or blocked for [`STALE_AFTER`]) is replaced by the next waiter that
//! finds the gate holding it back. The check itself is `pressure_check`'s.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::runtime::now;

/// How often held-back waiters are re-checked: a fifth of a typical turn's latency budget
/// and twice the built-in sampler's cache interval, so each check reads a fresh sample.
pub const WATCH_INTERVAL: Duration = Duration::from_millis(10);

/// An armed check that has not run for this long is presumed lost (its loop closed or is
/// blocked), and the next waiter held back arms another.
const STALE_AFTER: Duration = Duration::from_millis(200);

fn nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

/// Whether a gate's pressure check is armed: when it is next due, in nanoseconds on
/// [`now`]'s clock; 0 when unarmed.
#[derive(Debug, Default)]
pub struct PressureWatch {
    due: AtomicU64,
}

impl PressureWatch {
    /// Claims the right to schedule the check: `true` if none was armed, or the armed one is
    /// presumed lost; the caller must then schedule it (or [`disarm`](Self::disarm)).
    pub fn arm(&self) -> bool {
        let now = nanos(now());
        let due = now.saturating_add(nanos(WATCH_INTERVAL));
        self.due
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |current| {
                let live = current != 0 && now < current.saturating_add(nanos(STALE_AFTER));
                (!live).then_some(due)
            })
            .is_ok()
    }

    /// The armed check runs again in [`WATCH_INTERVAL`].
    pub fn rearm(&self) {
        let due = nanos(now()).saturating_add(nanos(WATCH_INTERVAL));
        self.due.store(due.max(1), Ordering::Release);
    }

    /// No check is armed.
    pub fn disarm(&self) {
        self.due.store(0, Ordering::Release);
    }

    /// Forgets the armed check (a forked child: the parent's loops do not run here).
    pub fn reset(&self) {
        self.disarm();
    }
}
