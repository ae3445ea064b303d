//! [`Lease`]: one admitted turn's share of the fleet cap.

use std::sync::Arc;

use crate::limit::Inner;

/// A lease on one slot of the fleet cap, held while a turn runs. Renewed by the replica's
/// heartbeat; given back by [`release`](Lease::release) or, failing that, when dropped (on the
/// limit's runtime), so a lease never leaks past its TTL even if a turn forgets it.
#[must_use = "a lease is given back as soon as it is dropped"]
pub struct Lease {
    inner: Arc<Inner>,
    id: Arc<str>,
    scope: Arc<str>,
    done: bool,
}

impl Lease {
    pub(crate) fn new(inner: Arc<Inner>, id: Arc<str>, scope: Arc<str>) -> Self {
        Lease {
            inner,
            id,
            scope,
            done: false,
        }
    }

    /// The lease id as stored in Redis: `<replica_id>#<instance nonce>#<n>`.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Its priority class (a position, most important first), when the fleet has classes.
    pub fn class(&self) -> Option<usize> {
        crate::classes::class_of_id(&self.id)
    }

    /// The scope (tenant) it counts against; "" when none.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// Whether a heartbeat found this lease gone with no room to take it again: the turn runs
    /// over the fleet cap (counted in `lease_lost`).
    pub fn is_lost(&self) -> bool {
        !self.done && !self.inner.registry().is_live_lease(&self.id)
    }

    /// Gives the lease back (one bounded round trip; owed and sent later while Redis is down).
    /// The room goes to the oldest waiting turn in the fleet that can run.
    pub async fn release(mut self) {
        self.done = true;
        let (id, scope) = (self.id.clone(), self.scope.clone());
        self.inner.give_back(id, scope).await;
    }

    /// Takes the lease out of this value without giving it back: for [`lend`](crate::FleetLimit::lend).
    pub(crate) fn disarm(mut self) -> (Arc<Inner>, Arc<str>, Arc<str>) {
        self.done = true;
        (self.inner.clone(), self.id.clone(), self.scope.clone())
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if !self.done {
            self.inner
                .spawn_give_back(self.id.clone(), self.scope.clone());
        }
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("id", &self.id)
            .field("scope", &self.scope)
            .finish()
    }
}
