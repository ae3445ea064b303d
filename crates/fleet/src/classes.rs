//! Priority classes and fair shares across the fleet: the lease queue orders waiting tickets by
//! class and, within a class, by each tenant's fair share, whichever replica queued them.
//!
//! # Design
//!
//! The local gate (the core's `queue` module) serves a free slot to the most important class
//! below its guarantee, else to the most important class below its `max_share` cap, and within
//! a class to the tenant with the lowest virtual start (start-time fair queuing, deficit round
//! robin with a quantum of one turn). With `fleet=` the same rules hold for the fleet's leases:
//! a replica's gate gives a turn its local slot, and the turn then waits for its fleet lease in
//! a queue that applies those rules fleet-wide, in the same Lua calls as before (one round trip
//! per call, the cap exact at any burst since every grant is still one atomic check-and-add).
//!
//! **What a ticket carries.** Its class is the number after the last `:` of its id
//! (`<replica_id>#<nonce>#<n>:<class>`), so a release, a heartbeat or a claim names the class
//! of a lease without an argument, and its tenant is its scope (with fair queuing the binding
//! passes the tenant as the scope even without per-tenant slices). Every call carries the
//! caller's shares (`"<fair> <min_0> <max_0> ..."`, [`FleetClasses::shares_arg`]).
//!
//! **In-flight counts per class** live beside the holders: `{key}:cls:<c>` is a sorted set of
//! the class's leases scored by expiry, exactly as `{key}:holders` is for all of them. A
//! script prunes it (`ZREMRANGEBYSCORE`) on first use and counts it (`ZCARD`), O(log n) plus the
//! entries it prunes. So a crashed replica's leases leave their class's count when they expire,
//! as they leave the total: a class's guarantee comes back `lease_ttl` after its holder died,
//! and its tickets on live replicas get the room at the next call of any replica. The dead
//! replica's own tickets are reclaimed per class as they are without classes: its presence
//! lapses, so its lanes leave their class's heads at the next grant that meets them (never
//! walked), a grant made to it just before goes unclaimed and leaves its class's count after
//! the claim window, and the tickets themselves expire with their TTL.
//!
//! **One sorted set of lane heads per class** (and per cap, for rolling deploys with
//! different caps): a lane is one replica instance's tickets of one class and one tenant, FIFO
//! by arrival; `{key}:heads:<cap>|<c>` holds each lane's head. Without fair queuing a head's
//! score is its arrival (FIFO within the class, as the fleet always was). With fair queuing it
//! is the lane's **virtual start**: `max(V_c, F_t)`, where `V_c` (`{key}:vt`, per class) is the
//! virtual start of the class's last grant and `F_t` (`{key}:ftag:<c>`, per tenant) is where
//! the tenant's next turn may start: the start of its last grant plus `2^20 / weight`. So the
//! class's first head is the backlogged tenant furthest behind; a tenant that was idle
//! restarts at `V_c` (no banked credit), and one tenant's burst cannot put another tenant's
//! first ticket behind it. A tenant waiting on several replicas has one lane per replica:
//! `{key}:flow:<c>:<tenant>` lists them, and a grant to one moves all of them (at most one per
//! replica instance) to the tenant's new start, so the tenant gets one share, not one per
//! replica. A tenant with nothing left waiting forgets its `F_t` (at most one turn's step
//! forgiven).
//!
//! **A grant** looks at the heads of the caps above the holder count (`{key}:classes` holds
//! the members `<cap>|<c>`, scored by cap), takes each class's first runnable head (replica
//! present, tenant below its slice: a lane whose tenant is at its slice is stepped over, and
//! remembered as such for the rest of the call), and serves the most important class below its
//! guarantee, else the most important class; a class at its `max_share` cap is not looked at.
//! That is O(classes × caps × log n) per grant, plus one O(log n) step per lane stepped over
//! (at most the tenants at their slice), where n counts tickets and leases: no script walks the
//! queue.
//!
//! **Guarantees and caps in slots.** `⌊min_share × room⌋` (at least one when `min_share > 0`)
//! and `⌊max_share × room⌋` (at least one), where the room is the ticket's replica's cap or
//! the fleet's learned limit below it, computed in the script at each grant: when the learned
//! limit moves (`adaptive=` with `fleet=`) the guarantees move with it at the next call, with
//! nothing stored. A class using less than its guarantee lends the rest (a newcomer takes free
//! room directly when no waiting ticket can run); the guarantee is taken back by serving the
//! short class first at each release, never by taking a running turn's lease.
//!
//! **What is not ordered by class.** A running turn comes first: a lease re-taken by a
//! heartbeat (Redis forgot it) and a human-approval reclaim ignore the class's cap, as they
//! ignore the order of waiters today.
//!
//! # The fleet must agree on its classes
//!
//! A ticket's class is a position, and a guarantee is a fraction of a fleet-wide room, so two
//! replicas that disagree on the classes (their names, order, shares or fairness) would each
//! serve the other's tickets by their own rules: guarantees that do not add up, a class number
//! that means "interactive" on one replica and "batch" on another. So the fleet keeps the
//! identity of its configuration in `{key}:conf` (adopted from the first replica that calls,
//! kept while any replica that agrees with it holds a lease or a ticket), and a replica whose
//! configuration differs is **refused**: its acquisitions fail with [`FleetError::Conflict`]
//! (a gate turn is refused with `fleet_unavailable`), one [`FleetEvent::ClassConflict`] is
//! logged, and nothing of it is queued. Its calls never grant room either (a lease it held
//! from before, released, leaves the room to the next call of a replica that agrees), so
//! tickets are only ever ordered by the fleet's shares. Refusing, rather than merging, is the one choice
//! that keeps every guarantee exact; it mirrors how a gate refuses a `reconfigure` that renames
//! classes. To change the classes, deploy under a new `key` (the two fleets then hold a cap
//! each while both run) or stop the old replicas first: `{key}:conf` goes with the last of
//! their keys. A plain fleet (no classes) has the identity `plain`, so a replica with classes
//! joining it is refused too. Tenant weights are not part of the identity: each ticket carries
//! its own step.
//!
//! Kubernetes' API Priority and Fairness was the model to learn from, not to copy: it divides
//! the server's concurrency among priority levels by nominal shares with lending and borrowing,
//! and within a level shuffle-shards flows onto queues served by fair queuing on virtual finish
//! times. Its limits are per API server (each server divides its own concurrency); here the
//! limit is the fleet's, one exact count in Redis, so shares are slots of that count, and fair
//! queuing is exact per tenant (no shuffle sharding: a sorted set orders every tenant in
//! O(log n)).
//!
//! [`FleetError::Conflict`]: crate::FleetError::Conflict
//! [`FleetEvent::ClassConflict`]: crate::FleetEvent::ClassConflict

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;

use admitgate_core::queue::Priorities;

/// A tenant's virtual time moves on by this, divided by its weight, per turn it starts (the
/// core's quantum).
pub const FAIR_QUANTUM: u64 = 1 << 20;

/// The priority classes a fleet orders its tickets by, as every replica of it must configure
/// them (see the module documentation).
#[derive(Clone, Debug, PartialEq)]
pub struct FleetClasses {
    priorities: Priorities,
    fair: bool,
    weights: HashMap<Arc<str>, u32>,
    shares: String,
    identity: String,
}

impl Default for FleetClasses {
    /// No classes: one FIFO class, the protocol as it was without them.
    fn default() -> Self {
        Self {
            priorities: Priorities::default(),
            fair: false,
            weights: HashMap::new(),
            shares: String::new(),
            identity: "plain".to_owned(),
        }
    }
}

impl FleetClasses {
    /// The classes of `priorities` (checked by the core), with fair queuing across tenants
    /// within each class when `fair`, weighted by `weights` (1 for a tenant not named).
    /// A plain configuration (one class, no shares) without fairness is [`Default`].
    pub fn new(priorities: Priorities, fair: bool, weights: HashMap<Arc<str>, u32>) -> Self {
        if priorities.is_plain() && !fair {
            return Self::default();
        }
        let mut shares = String::from(if fair { "1" } else { "0" });
        let mut identity = format!("v1 fair={}", u8::from(fair));
        for class in priorities.classes() {
            // `{:?}` writes the shortest string that reads back as the same f64.
            let _ = write!(shares, " {:?} {:?}", class.min_share, class.max_share);
            let _ = write!(
                identity,
                " {}:{} {:?} {:?}",
                class.name.len(),
                class.name,
                class.min_share,
                class.max_share
            );
        }
        Self {
            priorities,
            fair,
            weights,
            shares,
            identity,
        }
    }

    /// Whether tickets are ordered by class (false: one FIFO class).
    pub fn is_classed(&self) -> bool {
        !self.shares.is_empty()
    }

    /// Whether tenants share each class fairly (the binding then passes the tenant as scope).
    pub fn is_fair(&self) -> bool {
        self.fair
    }

    /// The classes.
    pub fn priorities(&self) -> &Priorities {
        &self.priorities
    }

    /// The class of a ticket: `class` (the core's position; the default class for one past
    /// the last), or none without classes.
    pub fn position(&self, class: Option<usize>) -> Option<usize> {
        if !self.is_classed() {
            return None;
        }
        let last = self.priorities.classes().len();
        let default = usize::from(self.priorities.default_class().0).min(last.saturating_sub(1));
        Some(match class {
            Some(c) if c < last => c,
            _ => default,
        })
    }

    /// The shares as the scripts take them ("" without classes).
    pub(crate) fn shares_arg(&self) -> &str {
        &self.shares
    }

    /// What the fleet compares: names, order, shares and fairness.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// How far `tenant`'s virtual time moves per turn it starts.
    pub(crate) fn step(&self, tenant: &str) -> u64 {
        let weight = self.weights.get(tenant).copied().unwrap_or(1);
        FAIR_QUANTUM
            .checked_div(u64::from(weight))
            .unwrap_or(FAIR_QUANTUM)
    }
}

/// The class of a lease or ticket id (`...#<n>:<class>`), if it has one.
pub(crate) fn class_of_id(id: &str) -> Option<usize> {
    let (_, tail) = id.rsplit_once('#')?;
    let (_, class) = tail.split_once(':')?;
    class.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use admitgate_core::queue::PriorityClass;

    fn two(fair: bool) -> FleetClasses {
        let p = Priorities::new(
            vec![
                PriorityClass::shared("interactive", 0.5, 1.0),
                PriorityClass::shared("batch", 0.2, 0.6),
            ],
            None,
        )
        .unwrap();
        FleetClasses::new(p, fair, HashMap::from([(Arc::from("big"), 4)]))
    }

    #[test]
    fn a_plain_configuration_is_the_protocol_without_classes() {
        let plain = FleetClasses::new(Priorities::default(), false, HashMap::new());
        assert_eq!(plain, FleetClasses::default());
        assert!(!plain.is_classed());
        assert_eq!(plain.shares_arg(), "");
        assert_eq!(plain.identity(), "plain");
        assert_eq!(plain.position(Some(0)), None);
        let fair = FleetClasses::new(Priorities::default(), true, HashMap::new());
        assert!(fair.is_classed(), "fairness alone orders tickets by tenant");
    }

    #[test]
    fn shares_identity_and_steps() {
        let c = two(true);
        assert_eq!(c.shares_arg(), "1 0.5 1.0 0.2 0.6");
        assert_eq!(
            c.identity(),
            "v1 fair=1 11:interactive 0.5 1.0 5:batch 0.2 0.6"
        );
        assert_ne!(c.identity(), two(false).identity());
        assert_eq!(c.position(Some(0)), Some(0));
        assert_eq!(c.position(None), Some(1), "the default is the last class");
        assert_eq!(c.position(Some(9)), Some(1));
        assert_eq!(c.step("big"), FAIR_QUANTUM / 4);
        assert_eq!(c.step("other"), FAIR_QUANTUM);
        assert_eq!(class_of_id("r-1#00ff#12:1"), Some(1));
        assert_eq!(class_of_id("r:1#00ff#12"), None);
    }
}
