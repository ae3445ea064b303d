//! A turn's passage through admitgate, for any async Rust front end: the local slot from the
//! core [`Gate`](core_api::Gate), then (with a fleet limit) the fleet lease, then the
//! [`Permit`] that holds both until it is dropped.
//!
//! # Why this shape
//!
//! The core gate is a state machine that never blocks and never reads a clock: it hands a
//! waiter's [`Waker`](core_api::Waker) back to the caller, who runs it after the lock is
//! released. The Python binding wakes asyncio futures; a Rust front end wants a future it can
//! `.await` and drop. So this crate is a tokio front end *beside* the core, not a second
//! state machine: the waker is a `tokio::sync::oneshot` sender ([`OneshotWaker`]), and every
//! decision (admit, queue, shed, time out, close, hand a slot on) stays in the core.
//!
//! What this layer adds is the order and the bookkeeping of a whole turn, written once:
//!
//! 1. **Local slot**: [`Passage::admit`] arrives at the gate; a queued turn waits on its
//!    oneshot until it is granted, refused (shed, closing) or its wait ends
//!    ([`Gate::expire_for`](core_api::Gate::expire_for) races the grant under the gate's
//!    lock, so a turn is granted or timed out, never both). The wait ends at the queue
//!    timeout or, with the caller's deadline ([`Passage::admit_by`]), once less of the
//!    deadline is left than a turn takes (refused with `deadline`), whichever is first: the
//!    core decides that (and refuses at once a turn that would queue past its deadline), as
//!    it does for the binding's `deadline_s`.
//! 2. **Fleet lease**: with a [`FleetLimit`], the gate defers admission; a turn holding its
//!    local slot waits for its lease (same end, same reasons; a [`Passage::close`] ends the
//!    wait with `closing`), then [`confirm`](core_api::Gate::confirm)s, or
//!    [`revoke`](core_api::Gate::revoke)s with the reason the caller saw
//!    (`fleet_unavailable`, `timeout`, `deadline`, `closing`) or as cancelled when the future
//!    was dropped.
//!    Without a queue (depth 0, overflow `reject`) the fleet is asked once (`try_acquire`)
//!    and a full fleet refuses at once with `queue_full`, as a full local gate does.
//! 3. **Counters settled as the caller experienced them**: the per-transport counters
//!    ([`Transports`](core_api::Transports)) move when the outcome reaches the caller: queued
//!    when it starts waiting, admitted when its permit exists, rejected with the reason it is
//!    answered with, finished when the permit drops.
//! 4. **Timing**: the first turn that brings a deadline starts timing turns (as the
//!    binding's first `deadline_s` does), so the gate learns the service time it checks
//!    deadlines against; a timed permit reports its turn's end when it drops.
//!
//! Cancellation is dropping the future: a queued turn withdraws ([`Gate::cancel`]
//! (core_api::Gate::cancel), which hands on a slot granted in the same instant), a turn
//! waiting for its lease revokes its slot and drops the lease future (which withdraws the
//! fleet ticket). The [`Permit`] is RAII: dropping it releases the slot and gives the lease
//! back, exactly once, whatever ends the request (its body ended, its client left, a panic
//! unwound through it).
//!
//! Human waits (lending the slot and the lease while a person decides) are the binding's
//! today ([`Permit::suspend`] / [`Permit::resume`] lend and take back the local slot; the
//! fleet lease's lending stays in `src/python/fleet/turn.rs` until the binding is ported).

#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::unreachable,
        clippy::todo,
        clippy::unimplemented,
        clippy::indexing_slicing,
        clippy::arithmetic_side_effects
    )
)]

pub mod core_api;

use std::sync::Arc;
use std::time::{Duration, Instant};

use admitgate_fleet::{FleetLimit, Lease};
use tokio::sync::{oneshot, watch};

use core_api::{
    Arrival, Cancelled, Claim, ConcurrencyLimit, Decision, Discipline, Gate, Outcome, Overflow,
    Registered, Rejection, Stats, TransportId, Transports, TurnEnd, TurnSlot, WaiterKey, Waker,
    Wakes,
};

/// Wakes a queued turn's future: the gate's hand-off, as a oneshot message.
pub struct OneshotWaker(oneshot::Sender<()>);

impl Waker for OneshotWaker {
    fn wake(self) -> Wakes<Self> {
        // A receiver gone means its future was dropped; its drop withdraws the turn.
        let _ = self.0.send(());
        Wakes::default()
    }
}

/// Runs the wakes collected under the gate's lock. Ours never panic; should one, the panic
/// is contained here (the others were still woken by `Wakes::run`).
fn run(wakes: Wakes<OneshotWaker>) {
    if wakes.is_empty() {
        drop(wakes);
        return;
    }
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| wakes.run()));
}

/// Why a turn was refused, and when the caller should try again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refused {
    /// The reason (`admitgate.REJECTION_REASONS`).
    pub reason: Rejection,
    /// The gate's hint; `None` where waiting would not help (a policy) or for `closing`.
    pub retry_after: Option<Duration>,
}

/// Memory-aware admission's reading: the decision memory pressure calls for right now.
pub type ResourceCheck = Box<dyn Fn() -> Decision + Send + Sync>;

/// The settings of a [`Passage`].
pub struct PassageConfig {
    /// The local policy: ceiling, queue depth, overflow, per-tenant limit.
    pub limits: ConcurrencyLimit,
    /// How long a turn may wait (for its local slot and its lease together); `None`: forever.
    pub queue_timeout: Option<Duration>,
    /// The fleet-wide limit, if any.
    pub fleet: Option<FleetLimit>,
    /// Memory pressure, if memory-aware admission is on.
    pub resource: Option<ResourceCheck>,
}

/// One gate with its transports, fleet limit and clock: what every turn passes.
pub struct Passage {
    gate: Gate<OneshotWaker>,
    transports: Transports,
    fleet: Option<FleetLimit>,
    queue_timeout: Option<Duration>,
    resource: Option<ResourceCheck>,
    epoch: Instant,
    closing: watch::Sender<bool>,
}

impl Passage {
    /// A passage with `config`.
    pub fn new(config: PassageConfig) -> Arc<Self> {
        let gate = Gate::new(config.limits);
        if config.fleet.is_some() {
            // Admission counts only once the lease came (see the core's deferred admission).
            gate.defer_admission();
        }
        let (closing, _) = watch::channel(false);
        Arc::new(Self {
            gate,
            transports: Transports::default(),
            fleet: config.fleet,
            queue_timeout: config.queue_timeout,
            resource: config.resource,
            epoch: Instant::now(),
            closing,
        })
    }

    /// The caller's clock, as the core takes it.
    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    fn resource(&self) -> Decision {
        self.resource
            .as_ref()
            .map_or(Decision::Admit, |check| check())
    }

    /// The id of transport `name` (registered on first use; at most 16 names).
    pub fn transport(&self, name: &str) -> Result<TransportId, core_api::TransportError> {
        self.transports.resolve(name)
    }

    /// The per-transport counters.
    pub fn transports(&self) -> &Transports {
        &self.transports
    }

    /// The gate's counters.
    pub fn stats(&self) -> Stats {
        self.gate.stats(|| self.now())
    }

    /// How long turns that queued waited before they were admitted.
    pub fn queue_wait(&self) -> core_api::HistogramSnapshot {
        self.gate.queue_wait()
    }

    /// The limits in force.
    pub fn limits(&self) -> ConcurrencyLimit {
        self.gate.limits()
    }

    /// The fleet limit, if any.
    pub fn fleet(&self) -> Option<&FleetLimit> {
        self.fleet.as_ref()
    }

    /// Per tenant with turns running or waiting: `(tenant, in flight, queued)`.
    pub fn scope_stats(&self) -> Vec<(Arc<str>, u64, u64)> {
        self.gate.scope_stats()
    }

    /// Turns still running, and whether the passage is closing.
    pub fn running(&self) -> (u64, bool) {
        self.gate.running()
    }

    /// Stops admitting: newcomers and every queued turn are refused with `closing`, and so
    /// are turns waiting for their lease. Running turns finish. Returns how many queued
    /// turns were refused.
    pub fn close(&self) -> u64 {
        let (refused, wakes) = self.gate.close();
        run(wakes);
        self.closing.send_replace(true);
        refused
    }

    /// Admits one turn of `scope` ("" for none) through `transport`: the permit, or why not.
    /// Waits in the queue (and for the fleet lease) as the policy says; dropping the future
    /// withdraws the turn, leaking nothing.
    pub async fn admit(
        self: &Arc<Self>,
        scope: &str,
        transport: TransportId,
    ) -> Result<Permit, Refused> {
        self.admit_by(scope, transport, None).await
    }

    /// [`Passage::admit`] for a caller who waits until `deadline` at most (its gRPC
    /// deadline, an HTTP deadline header). A turn that would run at once always does; one
    /// that would queue is refused with `deadline` at once when less of its deadline is left
    /// than a turn takes, and later, while it waits (for its slot or its lease), once that
    /// becomes so, unless its queue timeout comes first.
    pub async fn admit_by(
        self: &Arc<Self>,
        scope: &str,
        transport: TransportId,
        deadline: Option<Instant>,
    ) -> Result<Permit, Refused> {
        let timeout_at = self
            .queue_timeout
            .and_then(|timeout| tokio::time::Instant::now().checked_add(timeout));
        let deadline = deadline.map(|at| at.saturating_duration_since(self.epoch));
        if deadline.is_some() && !self.gate.times_turns() {
            // Learn the service time deadlines are checked against (what the binding does).
            self.gate.enable_overload(None, Discipline::Fifo);
        }
        let tenant = (!scope.is_empty()).then_some(scope);
        let (arrival, wakes) = self
            .gate
            .arrive_by(tenant, None, self.resource(), deadline, || self.now());
        run(wakes);
        let granted = match arrival {
            Arrival::Admitted(scope) => scope,
            Arrival::Rejected(reason, retry_after) => {
                return Err(self.refused(transport, reason, retry_after));
            }
            Arrival::Queued(key) => {
                let ends = self.wait_ends(timeout_at, deadline);
                self.wait_local(key, transport, ends).await?
            }
        };
        let Some(fleet) = &self.fleet else {
            self.transports.admitted(transport);
            return Ok(self.permit(granted, None, transport));
        };
        // Held until the lease comes; dropped (the future cancelled), it revokes the slot.
        let mut revoke = Revoke {
            passage: self,
            scope: granted.clone(),
            armed: true,
        };
        let lease_scope = if fleet.config().max_in_flight_per_scope > 0 {
            scope
        } else {
            ""
        };
        let mut closing = self.closing.subscribe();
        // No queue (depth 0, refuse on overflow): the fleet is asked once, never waited on,
        // so a full fleet refuses at once as a full local gate does.
        let limits = self.gate.limits();
        let no_queue = limits.queue_depth == 0 && limits.overflow == Overflow::Reject;
        let acquire = async {
            if no_queue {
                match fleet.try_acquire(lease_scope).await {
                    Ok(Some(lease)) => Ok(lease),
                    Ok(None) => Err(Rejection::QueueFull),
                    Err(_) => Err(Rejection::FleetUnavailable),
                }
            } else {
                fleet
                    .acquire(lease_scope)
                    .await
                    .map_err(|_| Rejection::FleetUnavailable)
            }
        };
        let ends = self.wait_ends(timeout_at, deadline);
        let outcome = tokio::select! {
            lease = acquire => lease,
            reason = sleep_until(ends) => Err(reason),
            _ = closing.wait_for(|closed| *closed) => Err(Rejection::Closing),
        };
        revoke.armed = false;
        match outcome {
            Ok(lease) => {
                self.gate.confirm();
                self.transports.admitted(transport);
                Ok(self.permit(granted, Some(lease), transport))
            }
            Err(reason) => {
                let (hint, wakes) = self
                    .gate
                    .revoke(granted.as_deref(), Some(reason), || self.now());
                run(wakes);
                let hint = match reason {
                    Rejection::FleetUnavailable => Some(fleet.config().probe_interval),
                    _ => hint,
                };
                Err(self.refused(transport, reason, hint))
            }
        }
    }

    fn refused(
        &self,
        transport: TransportId,
        reason: Rejection,
        retry_after: Option<Duration>,
    ) -> Refused {
        self.transports.rejected(transport, reason);
        Refused {
            reason,
            retry_after,
        }
    }

    fn permit(
        self: &Arc<Self>,
        scope: Option<Arc<str>>,
        lease: Option<Lease>,
        transport: TransportId,
    ) -> Permit {
        let started = self.gate.times_turns().then(|| {
            let at = self.now();
            let (in_flight, wakes) = self.gate.turn_started(at);
            run(wakes);
            (at, in_flight)
        });
        Permit {
            passage: self.clone(),
            slot: TurnSlot::new(scope),
            lease,
            transport,
            started,
        }
    }

    /// When a wait begun now ends, and the reason it is refused for then: the queue
    /// timeout (`timeout_at`), or, sooner, the moment less of the caller's `deadline` (on
    /// the passage's clock) is left than a turn takes (`deadline`).
    fn wait_ends(
        &self,
        timeout_at: Option<tokio::time::Instant>,
        deadline: Option<Duration>,
    ) -> Option<(tokio::time::Instant, Rejection)> {
        let epoch = tokio::time::Instant::from_std(self.epoch);
        let too_late = deadline.and_then(|d| epoch.checked_add(self.gate.deadline_timer(d)));
        match (timeout_at, too_late) {
            (Some(timeout), Some(late)) if late < timeout => Some((late, Rejection::Deadline)),
            (None, Some(late)) => Some((late, Rejection::Deadline)),
            (timeout, _) => timeout.map(|at| (at, Rejection::Timeout)),
        }
    }

    /// Waits for a queued turn's outcome; the scope it was granted in, or its refusal.
    async fn wait_local(
        &self,
        key: WaiterKey,
        transport: TransportId,
        ends: Option<(tokio::time::Instant, Rejection)>,
    ) -> Result<Option<Arc<str>>, Refused> {
        self.transports.queued(transport);
        let mut queued = Queued {
            passage: self,
            key,
            transport,
            armed: true,
        };
        let (tx, mut rx) = oneshot::channel();
        let (registered, returned) = self.gate.register(key, OneshotWaker(tx));
        drop(returned);
        if registered == Registered::Waiting {
            let expired = tokio::select! {
                _ = &mut rx => None,
                reason = sleep_until(ends) => Some(reason),
            };
            if let Some(reason) = expired {
                // Exactly one of grant and expiry wins, under the gate's lock.
                let (_, wakes) = self.gate.expire_for(key, reason);
                run(wakes);
            }
        }
        let (claim, wakes) = self.gate.claim(key, || self.now());
        run(wakes);
        queued.armed = false;
        match claim {
            Claim::Admitted(scope) => {
                // `dequeued(.., false)`: the admitted count moves with the permit.
                self.transports.dequeued(transport, false);
                Ok(scope)
            }
            Claim::Refused(reason, retry_after) => {
                self.transports.dequeued(transport, false);
                Err(self.refused(transport, reason, retry_after))
            }
            // Neither can happen after a wake or an expiry; answered as a timeout, never a hang.
            Claim::Waiting | Claim::Unknown => {
                let (_, wakes) = self.gate.cancel(key);
                run(wakes);
                self.transports.dequeued(transport, false);
                Err(self.refused(transport, Rejection::Timeout, None))
            }
        }
    }

    /// Resolves once no turn runs, or at `deadline`; true if drained.
    pub async fn drained(&self, deadline: tokio::time::Instant) -> bool {
        loop {
            if self.gate.running().0 == 0 {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Sleeps until a wait's end, then gives its reason; never ends without one.
async fn sleep_until(ends: Option<(tokio::time::Instant, Rejection)>) -> Rejection {
    match ends {
        Some((at, reason)) => {
            tokio::time::sleep_until(at).await;
            reason
        }
        None => std::future::pending().await,
    }
}

/// A queued turn whose future may be dropped: withdraws it.
struct Queued<'a> {
    passage: &'a Passage,
    key: WaiterKey,
    transport: TransportId,
    armed: bool,
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        if self.armed {
            let (outcome, wakes) = self.passage.gate.cancel(self.key);
            run(wakes);
            debug_assert_ne!(outcome, Cancelled::Unknown);
            self.passage.transports.dequeued(self.transport, false);
        }
    }
}

/// A turn holding its local slot while it waits for its lease: dropped armed (the future was
/// cancelled), it hands the slot on and counts as cancelled.
struct Revoke<'a> {
    passage: &'a Passage,
    scope: Option<Arc<str>>,
    armed: bool,
}

impl Drop for Revoke<'_> {
    fn drop(&mut self) {
        if self.armed {
            let passage = self.passage;
            let (_, wakes) = passage
                .gate
                .revoke(self.scope.as_deref(), None, || passage.now());
            run(wakes);
        }
    }
}

/// An admitted turn's slot (and lease): released when dropped, exactly once.
#[must_use = "the turn is admitted only while its permit is held"]
pub struct Permit {
    passage: Arc<Passage>,
    slot: TurnSlot,
    lease: Option<Lease>,
    transport: TransportId,
    /// When a timed turn started, and the turns running then ([`Gate::turn_started`]
    /// (core_api::Gate::turn_started)); `None` while the gate times no turns.
    started: Option<(Duration, u64)>,
}

impl Permit {
    /// The transport it was admitted through.
    pub fn transport(&self) -> TransportId {
        self.transport
    }

    /// The turn parks on a person: its local slot is lent to the queue.
    pub fn suspend(&self) {
        run(self.slot.suspend(&self.passage.gate));
    }

    /// The turn resumes: it takes its slot back (borrowing one if none is free).
    pub fn resume(&self) {
        self.slot.resume(&self.passage.gate);
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let passage = &self.passage;
        // Memory pressure is read on release only when someone waits for the slot.
        let resource = passage.gate.has_waiters().then(|| passage.resource());
        let wakes = match self.started {
            // A permit does not know how its turn went (a proxy relays the answer without
            // reading it): every timed turn counts as served, for the service time that
            // deadlines are checked against.
            Some((started_at, in_flight)) => {
                let end = TurnEnd {
                    started_at,
                    ended_at: passage.now(),
                    in_flight,
                    outcome: Outcome::Success,
                    remaining: None,
                };
                self.slot.finish(&passage.gate, resource, end)
            }
            None => self.slot.close(&passage.gate, resource),
        };
        run(wakes);
        passage.transports.finished(self.transport);
        // A lease dropped is given back on the fleet's runtime.
        drop(self.lease.take());
    }
}

#[cfg(test)]
mod tests;
