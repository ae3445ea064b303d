//! Taking a lease, and waiting for one in the fleet-wide FIFO.
//!
//! A turn that finds no room holds a ticket in Redis, scored by the server's time of arrival.
//! Whoever frees room (a release, a heartbeat that prunes a dead holder's leases) grants it, in
//! the same Lua call, to the oldest tickets that can run, and publishes their ids; the waiter's
//! replica hears it on pub/sub, or at its next re-check if the message was lost.

use std::sync::Arc;

use crate::error::FleetError;
use crate::lease::Lease;
use crate::limit::Inner;
use crate::registry::Grant;
use crate::scripts::Taken;

/// Withdraws the wait of `id` if the acquiring future is dropped before it returns: the ticket
/// goes, and a lease granted at that very moment goes back to the fleet.
struct WaitGuard<'a> {
    inner: &'a Arc<Inner>,
    id: Arc<str>,
    scope: Arc<str>,
    armed: bool,
}

impl WaitGuard<'_> {
    fn lease(mut self) -> Lease {
        self.armed = false;
        Lease::new(self.inner.clone(), self.id.clone(), self.scope.clone())
    }

    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for WaitGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            // Best effort (the ticket also expires with this replica's heartbeat); the release
            // script removes whichever of ticket and lease exists.
            self.inner
                .spawn_give_back(self.id.clone(), self.scope.clone());
        }
    }
}

impl Inner {
    /// Takes a lease for `scope` in `class` (see [`FleetClasses::position`]); with `wait`,
    /// queues for one (and never returns `None`).
    ///
    /// [`FleetClasses::position`]: crate::FleetClasses::position
    pub(crate) async fn take(
        self: &Arc<Self>,
        scope: &str,
        class: Option<usize>,
        wait: bool,
    ) -> Result<Option<Lease>, FleetError> {
        if self.is_closed() {
            return Err(FleetError::Closed);
        }
        self.ensure_started();
        let scope: Arc<str> = Arc::from(scope);
        let position = self.scripts.classes().position(class);
        if !self.backend.is_up() {
            return self.offline_lease(scope, position).map(Some);
        }
        let id = self.next_id(position);
        // Tracked before the call, so a grant published before the reply arrives finds it.
        let granted = self
            .registry()
            .insert_waiting(id.clone(), scope.clone(), false);
        let guard = WaitGuard {
            inner: self,
            id: id.clone(),
            scope: scope.clone(),
            armed: true,
        };
        let reply = self
            .backend
            .call(|mut con| {
                let (id, scope) = (&id, &scope);
                async move { self.scripts.acquire(&mut con, id, scope, wait).await }
            })
            .await;
        match reply {
            Ok((status, Taken::Granted)) => {
                self.observe(status);
                self.registry().grant(&id, Grant::Fleet);
            }
            Ok((status, Taken::Queued(arrival))) => {
                self.observe(status);
                self.registry().set_arrival(&id, arrival);
                // The heartbeat re-plans: while anything waits it re-checks every
                // recheck_interval.
                self.replan.notify_one();
                if !self.backend.is_up() {
                    // The outage began while the call was in flight, after the waits were
                    // ended: end this one the same way.
                    self.registry()
                        .end_waits_offline(self.config.on_backend_error, Some(&id));
                }
            }
            Ok((status, Taken::Busy)) => {
                self.observe(status);
                self.registry().remove(&id);
                guard.disarm();
                return Ok(None);
            }
            Ok((status, Taken::Conflict)) => {
                self.observe(status);
                self.registry().remove(&id);
                guard.disarm();
                return Err(self.class_conflict());
            }
            Err(failure) => {
                self.backend_failed(failure);
                // The script may have run: a lease is renewed (or re-taken) under the same id by
                // the heartbeat when Redis returns, a refused ticket is withdrawn then.
                self.registry()
                    .end_waits_offline(self.config.on_backend_error, Some(&id));
            }
        }
        let grant = granted.await.unwrap_or(Grant::Closed);
        match grant {
            Grant::Fleet | Grant::Local => Ok(Some(guard.lease())),
            Grant::Unavailable => {
                // The registry owes Redis the withdrawal already.
                guard.disarm();
                Err(FleetError::Unavailable)
            }
            Grant::Closed => {
                guard.disarm();
                Err(FleetError::Closed)
            }
        }
    }
}
