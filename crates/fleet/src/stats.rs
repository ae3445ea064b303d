//! Counters of a fleet limit, read without a round trip.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use crate::scripts::FleetStatus;

/// A reading older than the newest one by more than this is a server clock that stepped back
/// (or a failover to a server with another clock), not a reply handled late: it is taken.
const CLOCK_STEP_US: u64 = 5_000_000;

/// A snapshot of a fleet limit's state. Fleet-wide numbers are the newest ones Redis reported
/// (by the server's clock: every call's reply refreshes them, a reply handled late never
/// overwrites a newer one). An idle replica still heartbeats, so they are at most one
/// heartbeat interval (`lease_ttl / 3` by default) plus a round trip old. The rest are this
/// replica's own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct FleetStats {
    /// Leases held across the fleet, last known.
    pub fleet_in_flight: u64,
    /// Tickets waiting across the fleet, last known.
    pub fleet_waiting: u64,
    /// This replica's cap for the fleet.
    pub max_in_flight: u32,
    /// This replica's per-scope slice (0: off).
    pub max_in_flight_per_scope: u32,
    /// Whether Redis answered the last call.
    pub backend_up: bool,
    /// Leases of this replica lost: a running turn's lease found gone with no room to take it
    /// again (the turn runs over the cap), or a grant that expired before this replica could
    /// claim it (it was paused past the claim window: the turn did not start on it and waits
    /// again with its place in line).
    pub lease_lost: u64,
    /// Leases of this replica found gone and taken again (Redis restarted, or an outage ended).
    pub lease_retaken: u64,
    /// Leases borrowed over the fleet cap by human-approval reclaims, not yet repaid, last known.
    pub borrowed: u64,
    /// Outages this replica has seen.
    pub outages: u64,
    /// Failovers this replica has followed: a new primary named by the sentinels (Sentinel).
    pub failovers: u64,
    /// Calls no replica confirmed within `command_timeout` (`durability = replicated`); each
    /// was taken as a failure of the backend and its grant undone.
    pub unconfirmed: u64,
    /// The topology the URL names: `"single"`, `"sentinel"` or `"cluster"`.
    pub topology: &'static str,
    /// Leases this replica holds (including ones taken locally during an outage).
    pub held: u64,
    /// Turns of this replica waiting for a lease.
    pub waiting: u64,
    /// The fleet's learned limit (`adaptive=` with a fleet), last known; 0: none, only the
    /// caps count.
    pub learned_limit: u64,
}

/// The atomics behind [`FleetStats`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// The newest fleet-wide reading; a plain mutex, never held across an await.
    fleet: Mutex<Option<FleetStatus>>,
    pub(crate) lease_lost: AtomicU64,
    pub(crate) lease_retaken: AtomicU64,
}

impl Counters {
    /// Keeps `status` unless a newer reading (by the server's clock) was kept already: replies
    /// to concurrent calls are handled in any order.
    pub(crate) fn observe(&self, status: FleetStatus) {
        let mut fleet = self.fleet.lock().unwrap_or_else(|e| e.into_inner());
        let newer = match *fleet {
            None => true,
            Some(kept) => {
                status.at_us >= kept.at_us
                    || kept.at_us.saturating_sub(status.at_us) > CLOCK_STEP_US
            }
        };
        if newer {
            *fleet = Some(status);
        }
    }

    /// The newest reading, if any.
    pub(crate) fn newest(&self) -> Option<FleetStatus> {
        *self.fleet.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn fill(&self, stats: &mut FleetStats) {
        if let Some(fleet) = *self.fleet.lock().unwrap_or_else(|e| e.into_inner()) {
            stats.fleet_in_flight = fleet.in_flight;
            stats.fleet_waiting = fleet.waiting;
            stats.borrowed = fleet.borrowed;
            stats.learned_limit = fleet.learned.map_or(0, |l| l.limit);
        }
        stats.lease_lost = self.lease_lost.load(Relaxed);
        stats.lease_retaken = self.lease_retaken.load(Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(in_flight: u64, at_us: u64) -> FleetStatus {
        FleetStatus {
            in_flight,
            borrowed: 0,
            waiting: 0,
            at_us,
            learned: None,
        }
    }

    fn in_flight(counters: &Counters) -> u64 {
        let mut stats = FleetStats::default();
        counters.fill(&mut stats);
        stats.fleet_in_flight
    }

    #[test]
    fn a_reply_handled_late_never_overwrites_a_newer_reading() {
        let counters = Counters::default();
        counters.observe(reading(7, 1_000));
        counters.observe(reading(0, 2_000)); // the last release, handled first...
        counters.observe(reading(7, 1_500)); // ...and an older reply handled after it
        assert_eq!(in_flight(&counters), 0);
        // A server clock that stepped back by more than CLOCK_STEP_US is taken as it is.
        counters.observe(reading(3, 2_000 + CLOCK_STEP_US + 1));
        counters.observe(reading(2, 1));
        assert_eq!(in_flight(&counters), 2);
    }
}
