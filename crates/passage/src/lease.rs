//! A running turn's fleet lease: held beside its local slot, lent back to the fleet while the
//! turn waits on a person, taken back (or borrowed over the cap) when the wait ends, given
//! back exactly once when the turn ends. Never blocks: lending and reclaiming run as tasks on
//! the runtime the fleet limit lives on ([`LeaseRuntime`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use admitgate_fleet::{FleetLimit, Lease};

/// Where a turn's lease runs its protocol work: the tokio runtime the [`FleetLimit`] was
/// built on (the broker's own; the Python binding's fleet runtime, rebuilt after a fork).
pub trait LeaseRuntime: Send + Sync {
    /// Runs `task` on the runtime; a runtime that cannot take it (shut down) drops it, which
    /// gives back any lease it owns.
    fn spawn(&self, task: Pin<Box<dyn Future<Output = ()> + Send>>);

    /// The runtime's epoch now: a lease taken in another epoch (the parent's, before a fork)
    /// is never given back by this process.
    fn epoch(&self) -> u64 {
        0
    }
}

/// The current tokio runtime, for a front end that runs on one (the broker).
pub struct TokioRuntime(pub tokio::runtime::Handle);

impl LeaseRuntime for TokioRuntime {
    fn spawn(&self, task: Pin<Box<dyn Future<Output = ()> + Send>>) {
        drop(self.0.spawn(task));
    }
}

enum Held {
    /// The turn holds its lease.
    Lease(Lease),
    /// Given back while the turn waits for a person.
    Lent,
    /// Taken back after the wait, not yet answered; `lend_on_arrival`: the turn parked again
    /// meanwhile, so the lease goes straight back when it comes.
    Reclaiming { lend_on_arrival: bool },
    /// The turn ended.
    Closed,
}

struct HeldState {
    held: Held,
    /// Human waits entered and not yet left (the local slot's rule: the first lends, the
    /// first exit takes back).
    waits: u32,
}

/// A running turn's fleet lease. Lock order: its lock is never held while calling the
/// protocol or spawning.
pub struct TurnLease {
    limit: FleetLimit,
    scope: Arc<str>,
    /// Its priority class in the fleet's queue: a reclaimed lease keeps it.
    class: Option<usize>,
    runtime: Arc<dyn LeaseRuntime>,
    /// The runtime's epoch when the lease was taken: after a fork it is the parent's.
    epoch: u64,
    state: Mutex<HeldState>,
}

/// The state, even if a panic elsewhere poisoned the lock (the state is a plain enum that is
/// always valid between statements).
fn locked(state: &Mutex<HeldState>) -> MutexGuard<'_, HeldState> {
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

impl TurnLease {
    /// The lease of a turn that just got it from `limit`, running its lending on `runtime`.
    pub fn new(limit: FleetLimit, lease: Lease, runtime: Arc<dyn LeaseRuntime>) -> Arc<Self> {
        Arc::new(Self {
            scope: Arc::from(lease.scope()),
            class: lease.class(),
            epoch: runtime.epoch(),
            limit,
            runtime,
            state: Mutex::new(HeldState {
                held: Held::Lease(lease),
                waits: 0,
            }),
        })
    }

    fn current(&self) -> bool {
        self.epoch == self.runtime.epoch()
    }

    fn lend(&self, lease: Lease) {
        let limit = self.limit.clone();
        self.runtime
            .spawn(Box::pin(async move { limit.lend(lease).await }));
    }

    /// Enters a human wait: the first of nested waits lends the lease to the fleet.
    pub fn suspend(&self) {
        if !self.current() {
            return;
        }
        let lent = {
            let mut state = locked(&self.state);
            // Nested waits of one turn: 2^32 of them cannot happen, so this never saturates.
            state.waits = state.waits.saturating_add(1);
            if state.waits != 1 {
                None
            } else {
                match std::mem::replace(&mut state.held, Held::Lent) {
                    Held::Lease(lease) => Some(lease),
                    Held::Reclaiming { .. } => {
                        state.held = Held::Reclaiming {
                            lend_on_arrival: true,
                        };
                        None
                    }
                    other => {
                        state.held = other;
                        None
                    }
                }
            }
        };
        if let Some(lease) = lent {
            self.lend(lease);
        }
    }

    /// Leaves a human wait: a lent lease is taken back, or borrowed over the cap when there
    /// is no room (counted in `fleet_borrowed`); the turn does not wait for the answer.
    pub fn resume(self: &Arc<Self>) {
        if !self.current() {
            return;
        }
        {
            let mut state = locked(&self.state);
            state.waits = state.waits.saturating_sub(1);
            match &mut state.held {
                Held::Lent => {
                    state.held = Held::Reclaiming {
                        lend_on_arrival: false,
                    }
                }
                Held::Reclaiming { lend_on_arrival } => {
                    *lend_on_arrival = false;
                    return;
                }
                _ => return,
            }
        }
        let this = self.clone();
        self.runtime.spawn(Box::pin(async move {
            let Ok((lease, _)) = this.limit.reclaim_in(&this.scope, this.class).await else {
                return; // the limit was shut down
            };
            let lend = {
                let mut state = locked(&this.state);
                match std::mem::replace(&mut state.held, Held::Closed) {
                    Held::Reclaiming {
                        lend_on_arrival: false,
                    } => {
                        state.held = Held::Lease(lease);
                        None
                    }
                    Held::Reclaiming {
                        lend_on_arrival: true,
                    } => {
                        state.held = Held::Lent;
                        Some(lease)
                    }
                    // Ended meanwhile: the lease goes back as it is dropped below.
                    other => {
                        state.held = other;
                        drop(state);
                        drop(lease);
                        return;
                    }
                }
            };
            if let Some(lease) = lend {
                this.limit.lend(lease).await;
            }
        }));
    }

    /// The turn ended: the lease goes back (a reclaim still under way gives it back when it
    /// lands). Idempotent. A lease of the parent of a fork is left alone (see `Drop`).
    pub fn close(&self) {
        if !self.current() {
            return;
        }
        let held = std::mem::replace(&mut locked(&self.state).held, Held::Closed);
        drop(held); // a lease is given back on the fleet's runtime
    }
}

impl Drop for TurnLease {
    fn drop(&mut self) {
        if self.current() {
            self.close();
            return;
        }
        // The parent's, before a fork: never given back by the child. Its lock may have been
        // held by one of the parent's runtime threads when the process forked, so it is not
        // taken: `get_mut` needs no lock.
        let state = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        if let Held::Lease(lease) = std::mem::replace(&mut state.held, Held::Closed) {
            std::mem::forget(lease);
        }
    }
}
