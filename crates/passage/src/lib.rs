//! A turn's passage through admitgate: the local slot from the core [`Gate`](core_api::Gate),
//! then (with a fleet limit) the fleet lease, then the run that holds both, for every front
//! end: the broker's tokio [`Passage`] here, and the Python binding's asyncio awaitables and
//! blocking `admit_sync` (the root crate).
//!
//! # Why this shape
//!
//! The core gate is a state machine that never blocks and never reads a clock: it hands a
//! waiter's [`Waker`](core_api::Waker) back to the caller, who runs it after the lock is
//! released. What a whole turn adds to it (the order of slot, lease and run; which counter
//! moves when; what is returned, exactly once, however the turn ends) is the same for every
//! front end, while *how a turn waits* is not: a tokio future is dropped to cancel it, an
//! asyncio awaitable is thrown into or closed, a blocked thread is interrupted by a signal.
//!
//! So this crate is two layers:
//!
//! * [`turn::Turn`], a second state machine above the core's, as runtime-free as it is:
//!   generic over the core's waker (a oneshot here, an asyncio future or a thread signal in
//!   the binding) through [`turn::Lane`], with the clock, a foreign policy's
//!   [`Decision`](core_api::Decision), the memory pressure, the lease and the provider's
//!   report passed in as data, and the gate's wakes handed back to run once the driver has
//!   released its own locks (the binding never holds one while Python runs). It owns
//!   arrival → local slot (queued, granted, refused, withdrawn) → fleet lease (the core's
//!   deferred admission confirmed, or revoked with the reason the caller saw) → running
//!   ([`turn::Held`]: the slot and the [`TurnLease`], both lent during a human wait and taken
//!   back) → end, and [`turn::Turn::abandon`], the one close path for a turn dropped at any
//!   phase. The fork epoch is checked there too, so a turn of a forked parent never touches
//!   the child's gate.
//! * [`Passage`], a thin tokio driver of it: the waker is a `tokio::sync::oneshot` sender
//!   ([`OneshotWaker`]); the queue wait and the lease wait are `select!`s against the deadline
//!   and [`Passage::close`]; dropping the future drops the turn, which abandons it.
//!
//! The alternative, a tokio front end beside the binding's own turn code, is what this crate
//! replaced: two copies of the counting rules drift (the broker counted a turn waiting for
//! its lease as nothing; the binding as queued, which is what the caller experiences).
//!
//! # A turn of the tokio front end
//!
//! 1. **Local slot**: [`Passage::admit`] arrives at the gate; a queued turn waits on its
//!    oneshot until it is granted, refused (shed, closing) or its wait ends
//!    ([`Gate::expire_for`](core_api::Gate::expire_for) races the grant under the gate's
//!    lock, so a turn is granted or timed out, never both). The wait ends at the queue
//!    timeout or, with the caller's deadline ([`Passage::admit_by`]), once less of the
//!    deadline is left than a turn takes (refused with `deadline`), whichever is first
//!    ([`Turn::wait_deadline`], the binding's `deadline_s` rule); the core refuses at once a
//!    turn that would queue past its deadline.
//! 2. **Fleet lease**: with a [`FleetLimit`], a turn holding its local slot waits for its
//!    lease (same end, same reasons; a [`Passage::close`] ends the wait with `closing`),
//!    refused with `fleet_unavailable`, `timeout`, `deadline` or `closing`. Without a
//!    queue (depth 0, overflow `reject`) the fleet is asked once (`try_acquire`) and a full
//!    fleet refuses at once with `queue_full`, as a full local gate does.
//! 3. **Counters settled as the caller experienced them** (by the [`Turn`]): queued while it
//!    waits (for its slot or its lease), admitted when it may run, rejected with the reason it
//!    is answered with, finished when the permit drops.
//! 4. **Timing**: the first turn that brings a deadline starts timing turns (as the
//!    binding's first `deadline_s` does), so the gate learns the service time it checks
//!    deadlines against; a timed permit reports its turn's end (as served) when it drops.
//!
//! The [`Permit`] is RAII: dropping it ends the turn, releasing the slot and giving the lease
//! back exactly once, whatever ends the request (its body ended, its client left, a panic
//! unwound through it). [`Permit::suspend`] / [`Permit::resume`] lend and take back both the
//! local slot and the fleet lease while a person decides.

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

pub mod budget;
pub mod core_api;
pub mod lease;
pub mod turn;

use std::sync::Arc;
use std::time::{Duration, Instant};

use admitgate_fleet::FleetLimit;
use tokio::sync::{oneshot, watch};

use budget::{BudgetHolds, BudgetTurn, RateLimits};
use core_api::{
    ClassId, ConcurrencyLimit, Decision, Discipline, Gate, Outcome, Overflow, Registered,
    Rejection, Stats, TransportId, Transports, Waker, Wakes,
};
pub use lease::{LeaseRuntime, TokioRuntime, TurnLease};
use turn::{Arrived, Claimed, Lane, Report, WaitEnd};
pub use turn::{Held, Turn};

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
    /// For `rate_limited`: which limit refused (the one whose wait is longest), so a front
    /// door can name it (the broker's `RateLimit` field); `None` for every other reason.
    pub by: Option<RefusedBy>,
}

/// The limit that refused a turn: limiter `limiter` of the passage's rate limits, its limit
/// `limit` (in the order given).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RefusedBy {
    /// The limiter's index in [`budget::RateLimits::limiters`].
    pub limiter: usize,
    /// The limit's index in that limiter's limits.
    pub limit: usize,
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
    /// The budgets every turn passes before its slot ([`budget`]); empty: none.
    pub rate_limits: RateLimits,
}

impl Lane for Passage {
    type Waker = OneshotWaker;

    fn gate(&self) -> &Gate<OneshotWaker> {
        &self.gate
    }

    fn transports(&self) -> &Transports {
        &self.transports
    }
}

/// One gate with its transports, fleet limit and clock: what every turn passes.
pub struct Passage {
    gate: Gate<OneshotWaker>,
    transports: Transports,
    fleet: Option<FleetLimit>,
    queue_timeout: Option<Duration>,
    resource: Option<ResourceCheck>,
    rate_limits: RateLimits,
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
            rate_limits: config.rate_limits,
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

    /// Sets the queue's order: priority classes with shares, fair queuing across tenants
    /// (see the core's `queue` module). Before any turn arrives; afterwards only the shares
    /// may change.
    pub fn set_order(&self, order: core_api::Order) -> Result<(), core_api::PriorityError> {
        run(self.gate.set_order(order)?);
        Ok(())
    }

    /// The classes the queue serves, most important first, and the default one.
    pub fn priorities(&self) -> core_api::Priorities {
        self.gate.order().priorities
    }

    /// The gate's counters and each class's, read together so they add up.
    pub fn stats_and_classes(&self) -> (Stats, Vec<core_api::ClassStats>) {
        self.gate.stats_and_classes(|| self.now())
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

    /// The budgets turns pass before their slot.
    pub fn rate_limits(&self) -> &RateLimits {
        &self.rate_limits
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
        self.admit_as(scope, ClassId::DEFAULT, transport, deadline, None, 0)
            .await
    }

    /// [`Passage::admit_by`] for a turn of priority class `class` ([`ClassId::DEFAULT`]: the
    /// default class; a position past the last class is the default class too) and of
    /// `identity` (its budgets' key; `None`: the scope) estimated at `tokens`: it first passes
    /// the passage's budgets ([`budget`]), refused with `rate_limited` (exact retry time) or,
    /// with `on_limit = "wait"`, waiting within its queue timeout and deadline, so a turn the
    /// budget refuses never takes a slot or a lease. What it reserved is given back if it is
    /// then refused or dropped before it runs; a running turn settles it with
    /// [`Permit::report_usage`].
    pub async fn admit_as(
        self: &Arc<Self>,
        scope: &str,
        class: ClassId,
        transport: TransportId,
        deadline: Option<Instant>,
        identity: Option<&[u8]>,
        tokens: u64,
    ) -> Result<Permit, Refused> {
        // On the passage's clock, as the core takes time.
        let timeout_at = self
            .queue_timeout
            .and_then(|timeout| self.now().checked_add(timeout));
        let holds = if self.rate_limits.is_empty() {
            None
        } else {
            let wait_until = match (
                timeout_at.and_then(|at| self.epoch.checked_add(at)),
                deadline,
            ) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let identity = identity.unwrap_or(scope.as_bytes());
            let step =
                BudgetTurn::with_identity(self.rate_limits.clone(), identity, tokens, wait_until);
            match budget::reserve(step).await {
                Ok(holds) => Some(ReturnUnlessRun(Some(holds))),
                Err(refused) => {
                    self.transports.rejected(transport, refused.reason);
                    return Err(refused);
                }
            }
        };
        let mut permit = self
            .admit_slot(scope, class, transport, deadline, timeout_at)
            .await?;
        permit.budget = holds.and_then(|mut h| h.0.take());
        Ok(permit)
    }

    /// The slot and the lease of a turn (after its budgets).
    async fn admit_slot(
        self: &Arc<Self>,
        scope: &str,
        class: ClassId,
        transport: TransportId,
        deadline: Option<Instant>,
        timeout_at: Option<Duration>,
    ) -> Result<Permit, Refused> {
        let deadline = deadline.map(|at| at.saturating_duration_since(self.epoch));
        if deadline.is_some() && !self.gate.times_turns() {
            // Learn the service time deadlines are checked against (what the binding does).
            self.gate.enable_overload(None, Discipline::Fifo);
        }
        let tenant = (!scope.is_empty()).then_some(scope);
        // Dropped before it became a permit (the future was cancelled), it abandons the turn.
        let mut turn = Abandon {
            passage: self,
            turn: Turn::new(transport, self.fleet.is_some()),
        };
        turn.turn.set_class(class);
        let _ = turn.turn.begin(&**self);
        let (arrived, wakes) =
            turn.turn
                .arrive(&**self, tenant, None, self.resource(), deadline, || {
                    self.now()
                });
        run(wakes);
        match arrived {
            Arrived::Granted => {}
            Arrived::Refused(refused) => return Err(refused),
            Arrived::Queued(_) => {
                let ends = self.wait_ends(&turn.turn, timeout_at, deadline);
                self.wait_local(&mut turn.turn, ends).await?;
            }
        }
        if let Some(fleet) = &self.fleet {
            let ends = self.instant(self.wait_ends(&turn.turn, timeout_at, deadline));
            self.wait_lease(&mut turn.turn, fleet, scope, ends).await?;
        }
        let (_, wakes) = turn.turn.start(&**self, false, || self.now());
        run(wakes);
        let turn = std::mem::replace(&mut turn.turn, Turn::new(transport, false));
        Ok(Permit {
            passage: self.clone(),
            turn,
            budget: None,
        })
    }

    /// When a wait begun now is next looked at, and the reason it is refused for then (see
    /// [`Turn::wait_deadline`]).
    fn wait_ends(
        &self,
        turn: &Turn,
        timeout_at: Option<Duration>,
        deadline: Option<Duration>,
    ) -> Option<WaitEnd> {
        turn.wait_deadline(self, timeout_at, deadline)
    }

    /// `end` on tokio's clock.
    fn instant(&self, end: Option<WaitEnd>) -> Option<(tokio::time::Instant, Rejection)> {
        let end = end?;
        let at = tokio::time::Instant::from_std(self.epoch).checked_add(end.at)?;
        Some((at, end.reason))
    }

    /// Waits for a queued turn's outcome: granted its slot, or refused. At each of the wait's
    /// looks (its deadline, the adaptive queue's cap, its queue timeout) the gate refuses it
    /// if that is due; otherwise it waits on until the next look.
    async fn wait_local(&self, turn: &mut Turn, mut ends: Option<WaitEnd>) -> Result<(), Refused> {
        let (tx, mut rx) = oneshot::channel();
        if turn.register(self, OneshotWaker(tx)) == Registered::Waiting {
            loop {
                let expired = tokio::select! {
                    _ = &mut rx => None,
                    _ = sleep_until(self.instant(ends)) => ends,
                };
                let Some(end) = expired else {
                    break;
                };
                // Exactly one of grant and expiry wins, under the gate's lock.
                run(turn.expire(self, &end, self.now()));
                if !matches!(rx.try_recv(), Err(oneshot::error::TryRecvError::Empty)) {
                    break; // settled (granted or refused): its waker fired
                }
                ends = turn.next_end(self, &end);
            }
        }
        let (claimed, wakes) = turn.claim(self, || self.now());
        run(wakes);
        match claimed {
            Claimed::Granted => Ok(()),
            Claimed::Refused(refused) => Err(refused),
            // Neither can happen after a wake or an expiry; answered as a timeout, never a hang.
            Claimed::Waiting | Claimed::Withdrawn => {
                if let Some(wakes) = turn.withdraw(self) {
                    run(wakes);
                }
                self.transports
                    .rejected(turn.transport(), Rejection::Timeout);
                Err(Refused {
                    reason: Rejection::Timeout,
                    retry_after: None,
                    by: None,
                })
            }
        }
    }

    /// Waits for the fleet lease of a turn holding its local slot (same deadline; a
    /// [`Passage::close`] ends the wait with `closing`). Without a queue (depth 0, overflow
    /// `reject`) the fleet is asked once, never waited on, so a full fleet refuses at once as
    /// a full local gate does.
    async fn wait_lease(
        &self,
        turn: &mut Turn,
        fleet: &FleetLimit,
        scope: &str,
        ends: Option<(tokio::time::Instant, Rejection)>,
    ) -> Result<(), Refused> {
        // The tenant, when the fleet bounds tenants or shares its classes fairly among them.
        let lease_scope = if fleet.config().max_in_flight_per_scope > 0 || fleet.classes().is_fair()
        {
            scope
        } else {
            ""
        };
        // The turn's class orders its ticket in the fleet's queue (ignored without classes).
        let class = Some(usize::from(turn.class().0));
        let mut closing = self.closing.subscribe();
        let limits = self.gate.limits();
        let no_queue = limits.queue_depth == 0 && limits.overflow == Overflow::Reject;
        let acquire = async {
            if no_queue {
                match fleet.try_acquire_in(lease_scope, class).await {
                    Ok(Some(lease)) => Ok(lease),
                    Ok(None) => Err(Rejection::QueueFull),
                    Err(_) => Err(Rejection::FleetUnavailable),
                }
            } else {
                fleet
                    .acquire_in(lease_scope, class)
                    .await
                    .map_err(|_| Rejection::FleetUnavailable)
            }
        };
        let outcome = tokio::select! {
            lease = acquire => lease,
            reason = sleep_until(ends) => Err(reason),
            _ = closing.wait_for(|closed| *closed) => Err(Rejection::Closing),
        };
        match outcome {
            Ok(lease) => {
                let runtime = Arc::new(TokioRuntime(tokio::runtime::Handle::current()));
                let lease = TurnLease::new(fleet.clone(), lease, runtime);
                turn.lease_granted(self, lease).map_err(|_| Refused {
                    reason: Rejection::Closing,
                    retry_after: None,
                    by: None,
                })
            }
            Err(reason) => {
                let hint = match turn.lease_ended(self, Some(reason), || self.now()) {
                    Some((hint, wakes)) => {
                        run(wakes);
                        hint
                    }
                    None => None,
                };
                let hint = match reason {
                    Rejection::FleetUnavailable => Some(fleet.config().probe_interval),
                    _ => hint,
                };
                Err(Refused {
                    reason,
                    retry_after: hint,
                    by: None,
                })
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

/// A turn whose future may be dropped before it became a permit: abandons it (a queued turn
/// withdraws, a turn waiting for its lease hands its slot on and counts as cancelled; the
/// lease future dropped with it withdraws its fleet ticket).
struct Abandon<'a> {
    passage: &'a Arc<Passage>,
    turn: Turn,
}

impl Drop for Abandon<'_> {
    fn drop(&mut self) {
        let passage = &**self.passage;
        if let Some(wakes) = self.turn.abandon(passage, || passage.now()) {
            run(wakes);
        }
    }
}

/// A turn's budget holds until it runs: given back if it is refused or dropped first.
struct ReturnUnlessRun(Option<BudgetHolds>);

impl Drop for ReturnUnlessRun {
    fn drop(&mut self) {
        if let Some(holds) = self.0.take() {
            holds.cancel();
        }
    }
}

/// An admitted turn's slot (and lease): released when dropped, exactly once.
#[must_use = "the turn is admitted only while its permit is held"]
pub struct Permit {
    passage: Arc<Passage>,
    turn: Turn,
    /// What it holds in the passage's budgets (kept as spent unless usage is reported).
    budget: Option<BudgetHolds>,
}

impl Permit {
    /// The turn used `tokens` (its provider's report): each budget refunds the difference from
    /// the estimate or records the excess as debt. Once; later reports are ignored (`false`).
    pub fn report_usage(&mut self, tokens: u64) -> bool {
        match self.budget.take() {
            Some(holds) if !holds.is_empty() => {
                holds.settle(tokens);
                true
            }
            _ => false,
        }
    }

    /// The transport it was admitted through.
    pub fn transport(&self) -> TransportId {
        self.turn.transport()
    }

    /// The turn parks on a person: its local slot is lent to the queue, its fleet lease to
    /// the fleet.
    pub fn suspend(&self) {
        run(self.turn.lend(&*self.passage, self.passage.now()));
    }

    /// The turn resumes: it takes its slot and lease back (borrowing if there is no room).
    pub fn resume(&self) {
        self.turn.take_back(&*self.passage, self.passage.now());
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let passage = &*self.passage;
        // Memory pressure is read on release only when someone waits for the slot.
        let resource = || passage.gate.has_waiters().then(|| passage.resource());
        // A permit does not know how its turn went (a proxy relays the answer without
        // reading it): every timed turn counts as served, for the service time that
        // deadlines are checked against.
        let report = || {
            Some(Report {
                outcome: Outcome::Success,
                remaining: None,
                ended_at: passage.now(),
            })
        };
        if let Some(wakes) = self.turn.end(passage, resource, report) {
            run(wakes);
        }
    }
}

#[cfg(test)]
mod tests;
