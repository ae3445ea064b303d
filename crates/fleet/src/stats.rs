//! Counters of a fleet limit, read without a round trip.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::scripts::FleetStatus;

/// A snapshot of a fleet limit's state. Fleet-wide numbers are the last ones Redis reported (every
/// call and heartbeat refreshes them); the rest are this replica's own.
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
    /// Leases of this replica found gone with no room to take them again.
    pub lease_lost: u64,
    /// Leases of this replica found gone and taken again (Redis restarted, or an outage ended).
    pub lease_retaken: u64,
    /// Leases borrowed over the fleet cap by human-approval reclaims, not yet repaid, last known.
    pub borrowed: u64,
    /// Outages this replica has seen.
    pub outages: u64,
    /// Leases this replica holds (including ones taken locally during an outage).
    pub held: u64,
    /// Turns of this replica waiting for a lease.
    pub waiting: u64,
}

/// The atomics behind [`FleetStats`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    fleet_in_flight: AtomicU64,
    fleet_waiting: AtomicU64,
    borrowed: AtomicU64,
    pub(crate) lease_lost: AtomicU64,
    pub(crate) lease_retaken: AtomicU64,
}

impl Counters {
    pub(crate) fn observe(&self, status: FleetStatus) {
        self.fleet_in_flight.store(status.in_flight, Relaxed);
        self.fleet_waiting.store(status.waiting, Relaxed);
        self.borrowed.store(status.borrowed, Relaxed);
    }

    pub(crate) fn fill(&self, stats: &mut FleetStats) {
        stats.fleet_in_flight = self.fleet_in_flight.load(Relaxed);
        stats.fleet_waiting = self.fleet_waiting.load(Relaxed);
        stats.borrowed = self.borrowed.load(Relaxed);
        stats.lease_lost = self.lease_lost.load(Relaxed);
        stats.lease_retaken = self.lease_retaken.load(Relaxed);
    }
}
