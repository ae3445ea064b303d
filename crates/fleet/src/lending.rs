//! Human-approval lending: a turn parked on a person gives its lease back, and on resume takes
//! one if there is room or borrows one over the cap, never waiting on Redis for more than one
//! bounded round trip.
//!
//! A borrowed lease is counted in `{key}:borrowed`. The fleet's holder count then stands above
//! the cap, so the next departure of any holder anywhere in the fleet repays it (the count drops
//! back to the cap) instead of freeing room, and `borrowed` goes down by one.

use std::sync::Arc;

use crate::error::FleetError;
use crate::lease::Lease;
use crate::limit::{FleetLimit, Inner};
use crate::registry::Grant;

/// How [`FleetLimit::reclaim`] got its lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reclaim {
    /// There was room: a normal lease.
    Taken,
    /// No room: borrowed over the fleet cap (counted in `borrowed`, repaid by the next
    /// release in the fleet).
    Borrowed,
    /// Room in the fleet, but the tenant was at its slice: borrowed over the slice, repaid by
    /// the tenant's next release.
    BorrowedScope,
    /// Redis is down: a local lease, registered when it returns (whatever `on_backend_error`
    /// says, since the turn was admitted already).
    Local,
}

impl FleetLimit {
    /// Gives `lease` back while its turn waits for a person; the room goes to the oldest waiting
    /// turn in the fleet that can run. Resume with [`reclaim`](FleetLimit::reclaim).
    pub async fn lend(&self, lease: Lease) {
        let (inner, id, scope) = lease.disarm();
        inner.give_back(id, scope).await;
    }

    /// A lease for a turn of `scope` resuming after a person answered: taken if there is room,
    /// otherwise borrowed over the cap. Never queues; at most one bounded round trip.
    pub async fn reclaim(&self, scope: &str) -> Result<(Lease, Reclaim), FleetError> {
        self.inner.reclaim(scope, None).await
    }

    /// [`reclaim`](Self::reclaim) for a turn of priority class `class` (its lease's
    /// [`Lease::class`]); the class's `max_share` does not apply to a turn that was running.
    pub async fn reclaim_in(
        &self,
        scope: &str,
        class: Option<usize>,
    ) -> Result<(Lease, Reclaim), FleetError> {
        self.inner.reclaim(scope, class).await
    }
}

impl Inner {
    async fn reclaim(
        self: &Arc<Self>,
        scope: &str,
        class: Option<usize>,
    ) -> Result<(Lease, Reclaim), FleetError> {
        if self.is_closed() {
            return Err(FleetError::Closed);
        }
        self.ensure_started();
        let scope: Arc<str> = Arc::from(scope);
        let position = self.scripts.classes().position(class);
        if !self.backend.is_up() {
            return Ok((self.local_lease(scope, position), Reclaim::Local));
        }
        let id = self.next_id(position);
        // Tracked as a wait until Redis answers, so the heartbeat neither renews nor reports a
        // lease that does not exist yet; a drop of this future gives it back.
        let ended = self
            .registry()
            .insert_waiting(id.clone(), scope.clone(), true);
        let lease = Lease::new(self.clone(), id.clone(), scope.clone());
        let reply = self
            .backend
            .call(|mut con| {
                let (id, scope) = (&id, &scope);
                async move { self.scripts.reclaim(&mut con, id, scope).await }
            })
            .await;
        let how = match reply {
            Ok((status, how)) => {
                self.observe(status);
                self.registry().grant(&id, Grant::Fleet);
                match how {
                    crate::scripts::Reclaimed::Taken => Reclaim::Taken,
                    crate::scripts::Reclaimed::BorrowedFleet => Reclaim::Borrowed,
                    crate::scripts::Reclaimed::BorrowedScope => Reclaim::BorrowedScope,
                }
            }
            Err(failure) => {
                self.backend_failed(failure);
                // A resuming turn always gets a local lease during an outage.
                self.registry()
                    .end_waits_offline(self.config.on_backend_error, Some(&id));
                Reclaim::Local
            }
        };
        match ended.await.unwrap_or(Grant::Closed) {
            Grant::Closed => {
                // Shutdown gave everything back already.
                drop(lease.disarm());
                Err(FleetError::Closed)
            }
            _ => Ok((lease, how)),
        }
    }
}
