//! One turn's passage as a state machine that never waits and never reads a clock: the part
//! of a turn that is the same whoever drives it (tokio's [`Passage::admit`](crate::Passage),
//! the Python binding's asyncio awaitables, its blocking `admit_sync`).
//!
//! ```text
//! Fresh ─begin─▶ Arriving ─arrive─▶ Queued ─claim─▶ Granted ─start─▶ Running ─end─▶ Done
//!                   │                  │   ╲            ▲
//!                   │                  │    ╲(fleet)    │ lease_granted
//!                   │                  │     ▶ Leasing ─┘  (lease_ended ─▶ Done)
//!                   ├─pass_through─▶ PassThrough ─end─▶ Done
//!                   └─(refused)──────────────────────────────────────────────▶ Done
//! ```
//!
//! Every transition moves the gate and the per-transport counters together, once: a turn is
//! counted queued while it waits (for its slot, and with a fleet limit for its lease too),
//! admitted when it may run, rejected with the reason its caller is answered with, finished
//! when it ends. [`Turn::abandon`] is the one close path for a turn dropped anywhere on the
//! way (its slot handed on, its lease given back, its wait withdrawn).
//!
//! What the driver supplies as data, never as a callback made under a lock: the clock
//! (`now`), a foreign policy's [`Decision`] (the binding asks Python before arriving), the
//! memory pressure, the lease once it came, how the turn's provider call went. Wakes the gate
//! collects are returned for the driver to run once it has released its own locks.
//!
//! The fork epoch ([`Lane::epoch`]) is checked here too: a turn of the parent of a fork that
//! ends in the child leaves the child's gate and counters alone.

use std::sync::Arc;
use std::time::Duration;

use admitgate_core::gate::TurnEnd;
use admitgate_core::overload::Outcome;
use admitgate_core::passthrough::PassTicket;
use admitgate_core::transport::{TransportId, Transports};
use admitgate_core::{
    Arrival, Claim, ClassId, Decision, Entrant, Gate, Registered, Rejection, TurnSlot, WaiterKey,
    Waker, Wakes,
};

use crate::lease::TurnLease;
use crate::Refused;

/// What a turn passes: a core gate and its per-transport counters.
pub trait Lane {
    /// How the gate wakes a queued turn of this lane.
    type Waker: Waker;

    /// The gate.
    fn gate(&self) -> &Gate<Self::Waker>;

    /// The per-transport counters.
    fn transports(&self) -> &Transports;

    /// Bumped when a forked child empties the gate; turns of another epoch are the parent's.
    fn epoch(&self) -> u64 {
        0
    }
}

/// What a running turn holds and lends during a human wait: its local slot and, with a fleet
/// limit, its fleet lease.
pub struct Held {
    slot: TurnSlot,
    lease: Option<Arc<TurnLease>>,
    /// Time spent waiting for a person: not the provider's, so not in the turn's duration
    /// as the adaptive ceiling and the service-time estimate see it.
    away: std::sync::Mutex<Away>,
}

/// How long a running turn has waited for people (nested waits count once).
#[derive(Clone, Copy, Debug, Default)]
struct Away {
    depth: u32,
    since: Duration,
    total: Duration,
}

impl Held {
    fn away(&self) -> std::sync::MutexGuard<'_, Away> {
        // Plain data, consistent between statements: a panic elsewhere leaves it usable.
        self.away.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A person is waited for from `now`: the slot is lent to the queue and the lease to the
    /// fleet (the first of nested waits lends).
    pub fn lend<W>(&self, gate: &Gate<W>, now: Duration) -> Wakes<W> {
        {
            let mut away = self.away();
            if away.depth == 0 {
                away.since = now;
            }
            away.depth = away.depth.saturating_add(1);
        }
        let wakes = self.slot.suspend(gate);
        if let Some(lease) = &self.lease {
            lease.suspend();
        }
        wakes
    }

    /// The wait is over at `now`: both are taken back (borrowed if there is no room), never
    /// waiting.
    pub fn take_back<W>(&self, gate: &Gate<W>, now: Duration) {
        {
            let mut away = self.away();
            if away.depth == 1 {
                away.total = away.total.saturating_add(now.saturating_sub(away.since));
            }
            away.depth = away.depth.saturating_sub(1);
        }
        self.slot.resume(gate);
        if let Some(lease) = &self.lease {
            lease.resume();
        }
    }

    /// The time spent waiting for people up to `now` (a wait still open counts to `now`).
    fn time_away(&self, now: Duration) -> Duration {
        let away = *self.away();
        if away.depth > 0 {
            away.total.saturating_add(now.saturating_sub(away.since))
        } else {
            away.total
        }
    }

    /// Whether the slot is held (not lent, not returned).
    pub fn holds_slot(&self) -> bool {
        self.slot.is_held()
    }
}

/// The held slot and lease: the turn's own, or shared with a human-wait hook (which never
/// holds the turn itself, so a turn dropped unfinished still ends).
enum HeldRef {
    Own(Held),
    Shared(Arc<Held>),
}

impl std::ops::Deref for HeldRef {
    type Target = Held;

    fn deref(&self) -> &Held {
        match self {
            HeldRef::Own(held) => held,
            HeldRef::Shared(held) => held,
        }
    }
}

/// When a queued turn's wait is next looked at ([`Turn::wait_deadline`]), and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WaitEnd {
    /// When, on the caller's clock.
    pub at: Duration,
    /// The refusal due then (`timeout` or `deadline`), if it is still true then.
    pub reason: Rejection,
    /// The queue timeout: refused then whatever happens (not a look).
    hard: bool,
    timeout_at: Option<Duration>,
    deadline: Option<Duration>,
}

impl WaitEnd {
    /// The wait's queue timeout (counted from the arrival), if it has one.
    pub fn timeout_at(&self) -> Option<Duration> {
        self.timeout_at
    }
}

enum Phase {
    Fresh,
    /// Deciding (between [`Turn::begin`] and the gate's answer).
    Arriving,
    /// Let through by a gate with nothing to enforce (see [`admitgate_core::passthrough`]).
    PassThrough(PassTicket),
    /// Waiting for a local slot under this key.
    Queued(WaiterKey),
    /// Holding its local slot, waiting for its fleet lease; the core counts it as admitted
    /// only once the lease comes (the core's deferred admission).
    Leasing(Option<Arc<str>>),
    /// May run, not yet started.
    Granted {
        scope: Option<Arc<str>>,
        lease: Option<Arc<TurnLease>>,
    },
    Running {
        held: HeldRef,
        /// When it started and how many turns ran then, for a gate that times turns.
        started: Option<(Duration, u64)>,
    },
    Done,
}

/// How an arrival turned out.
#[derive(Debug, PartialEq)]
pub enum Arrived {
    /// It holds its local slot: [`Turn::start`] it, or, with a fleet limit, wait for its
    /// lease first.
    Granted,
    /// It waits under this key: register a waker, then claim when woken.
    Queued(WaiterKey),
    /// Refused (counted).
    Refused(Refused),
}

/// What claiming a queued turn's outcome found.
#[derive(Debug, PartialEq)]
pub enum Claimed {
    /// It holds its local slot (see [`Arrived::Granted`]).
    Granted,
    /// Refused while it waited (shed, timed out, closing); counted.
    Refused(Refused),
    /// Still waiting.
    Waiting,
    /// Its record was gone (withdrawn by the gate, e.g. its event loop closed); the turn is over.
    Withdrawn,
}

/// Why a turn cannot take its lease.
#[derive(Debug, PartialEq, Eq)]
pub enum NotLeasing {
    /// It was not waiting for one.
    NotWaiting,
    /// It belongs to the parent of a fork.
    Forked,
}

/// How a turn's provider call went, for a gate that times turns (an adaptive ceiling).
#[derive(Clone, Copy, Debug)]
pub struct Report {
    /// How the call ended.
    pub outcome: Outcome,
    /// The provider's `x-ratelimit-remaining-requests`, if reported.
    pub remaining: Option<u64>,
    /// When it ended, on the caller's clock.
    pub ended_at: Duration,
}

/// The turn was entered twice.
#[derive(Debug, PartialEq, Eq)]
pub struct AlreadyEntered;

/// One turn's passage (see the module documentation).
pub struct Turn {
    transport: TransportId,
    /// Its priority class (resolved by the driver; the default class when not set).
    class: ClassId,
    /// A fleet lease follows the local slot.
    lease_follows: bool,
    /// The lane's epoch when the turn began.
    epoch: u64,
    /// It parked in the queue (was not granted a slot on arrival or at registration).
    waited: bool,
    phase: Phase,
}

impl Turn {
    /// A turn through `transport`; `lease_follows`: the lane has a fleet limit.
    pub fn new(transport: TransportId, lease_follows: bool) -> Self {
        Self {
            transport,
            class: ClassId::DEFAULT,
            lease_follows,
            epoch: 0,
            waited: false,
            phase: Phase::Fresh,
        }
    }

    /// The transport it passes through.
    pub fn transport(&self) -> TransportId {
        self.transport
    }

    /// Puts the turn in priority class `class` (before it arrives; a concrete class, so a
    /// later change of the gate's default does not move a turn already counted in one).
    pub fn set_class(&mut self, class: ClassId) {
        self.class = class;
    }

    /// Its priority class.
    pub fn class(&self) -> ClassId {
        self.class
    }

    /// Whether it had to wait in the queue for its slot.
    pub fn waited(&self) -> bool {
        self.waited
    }

    /// Its key, while it waits for a local slot.
    pub fn queued_key(&self) -> Option<WaiterKey> {
        match self.phase {
            Phase::Queued(key) => Some(key),
            _ => None,
        }
    }

    /// Whether it waits for its fleet lease.
    pub fn is_leasing(&self) -> bool {
        matches!(self.phase, Phase::Leasing(_))
    }

    /// Whether it is running (holding, or having lent to a human wait, its slot).
    pub fn is_running(&self) -> bool {
        matches!(self.phase, Phase::Running { .. })
    }

    /// Whether anything is left to release or withdraw (it is queued, leasing, granted,
    /// running or let through).
    pub fn holds_anything(&self) -> bool {
        !matches!(self.phase, Phase::Fresh | Phase::Arriving | Phase::Done)
    }

    /// Takes the turn out, leaving an ended one in its place: a driver that keeps the turn
    /// behind a lock ends it outside, where the pressure and the report may call foreign code.
    pub fn take(&mut self) -> Turn {
        let ended = Turn {
            transport: self.transport,
            class: self.class,
            lease_follows: self.lease_follows,
            epoch: self.epoch,
            waited: self.waited,
            phase: Phase::Done,
        };
        std::mem::replace(self, ended)
    }

    fn current<L: Lane>(&self, lane: &L) -> bool {
        self.epoch == lane.epoch()
    }

    /// Starts arriving; a turn enters once.
    pub fn begin<L: Lane>(&mut self, lane: &L) -> Result<(), AlreadyEntered> {
        if !matches!(self.phase, Phase::Fresh) {
            return Err(AlreadyEntered);
        }
        self.epoch = lane.epoch();
        self.phase = Phase::Arriving;
        Ok(())
    }

    /// Let through without the gate's lock (a gate with nothing to enforce): admitted.
    pub fn pass_through<L: Lane>(&mut self, lane: &L, ticket: PassTicket) {
        lane.transports().admitted(self.transport);
        self.phase = Phase::PassThrough(ticket);
    }

    /// The turn holds its slot: it may start, or waits for its lease first.
    fn granted<L: Lane>(&mut self, lane: &L, scope: Option<Arc<str>>, waited: bool) {
        let transports = lane.transports();
        if self.lease_follows {
            // Waits for its lease: still queued for its transport until it comes.
            if !waited {
                transports.queued(self.transport);
            }
            self.phase = Phase::Leasing(scope);
        } else {
            if waited {
                transports.dequeued(self.transport, true);
            } else {
                transports.admitted(self.transport);
            }
            self.phase = Phase::Granted { scope, lease: None };
        }
    }

    fn refused<L: Lane>(
        &mut self,
        lane: &L,
        reason: Rejection,
        retry: Option<Duration>,
    ) -> Refused {
        lane.transports().rejected(self.transport, reason);
        self.phase = Phase::Done;
        Refused {
            reason,
            retry_after: retry,
            by: None,
        }
    }

    /// Arrives at the gate of `lane` as tenant `scope`, with a foreign policy's decision if
    /// any, the memory pressure, and the caller's deadline (refused once less of it is left
    /// than a turn takes).
    pub fn arrive<L: Lane>(
        &mut self,
        lane: &L,
        scope: Option<&str>,
        decided: Option<Decision>,
        resource: Decision,
        deadline: Option<Duration>,
        now: impl FnOnce() -> Duration,
    ) -> (Arrived, Wakes<L::Waker>) {
        let entrant = Entrant {
            scope,
            class: self.class,
            deadline,
        };
        let (arrival, wakes) = lane.gate().arrive_as(entrant, decided, resource, now);
        let arrived = match arrival {
            Arrival::Admitted(scope) => {
                self.granted(lane, scope, false);
                Arrived::Granted
            }
            Arrival::Rejected(reason, retry) => Arrived::Refused(self.refused(lane, reason, retry)),
            Arrival::Queued(key) => {
                lane.transports().queued(self.transport);
                self.phase = Phase::Queued(key);
                Arrived::Queued(key)
            }
        };
        (arrived, wakes)
    }

    /// When the queued turn's wait is next looked at, and for which refusal: at `timeout_at`
    /// (its queue timeout, on the caller's clock) with `timeout`, whatever happens; or,
    /// when it comes first, at the gate's next look ([`Gate::next_check`]): once less of the
    /// caller's `deadline` is left than a turn takes (`deadline`), or once it will have
    /// waited the adaptive queue's cap (`timeout`). A look that refuses nothing is followed by
    /// the next one ([`Turn::next_end`]): the estimate it used may have moved. For a turn
    /// not queued (its fleet lease wait), the deadline is checked against the estimate now.
    pub fn wait_deadline<L: Lane>(
        &self,
        lane: &L,
        timeout_at: Option<Duration>,
        deadline: Option<Duration>,
    ) -> Option<WaitEnd> {
        let check = match self.phase {
            Phase::Queued(key) if self.current(lane) => lane.gate().next_check(key, deadline),
            _ => deadline.map(|d| (lane.gate().deadline_timer(d), Rejection::Deadline)),
        };
        let (at, reason, hard) = match (timeout_at, check) {
            (Some(t), Some((at, reason))) if at < t => (at, reason, false),
            (None, Some((at, reason))) => (at, reason, false),
            (t, _) => (t?, Rejection::Timeout, true),
        };
        Some(WaitEnd {
            at,
            reason,
            hard,
            timeout_at,
            deadline,
        })
    }

    /// The look after `end`, which refused nothing (the turn still waits): `None` if none.
    /// The queue timeout is the last: nothing follows it, nor a turn no longer queued.
    pub fn next_end<L: Lane>(&self, lane: &L, end: &WaitEnd) -> Option<WaitEnd> {
        if end.hard || self.queued_key().is_none() {
            return None;
        }
        self.wait_deadline(lane, end.timeout_at, end.deadline)
    }

    /// Registers the queued turn's waker. [`Registered::Settled`]: claim now.
    pub fn register<L: Lane>(&mut self, lane: &L, waker: L::Waker) -> Registered {
        let Phase::Queued(key) = self.phase else {
            return Registered::Unknown;
        };
        let (registered, returned) = lane.gate().register(key, waker);
        drop(returned);
        if registered == Registered::Waiting {
            self.waited = true;
        }
        registered
    }

    /// The queued turn's wait reached `end` at `now`: refused at its queue timeout, or, at
    /// the gate's look, if its deadline no longer fits or it waited past the adaptive queue's
    /// cap; unless it was granted a slot first (exactly one of the two wins, under the gate's
    /// lock). Claim next; a turn still waiting waits on until [`Turn::next_end`].
    pub fn expire<L: Lane>(&self, lane: &L, end: &WaitEnd, now: Duration) -> Wakes<L::Waker> {
        match self.phase {
            Phase::Queued(key) if self.current(lane) && end.hard => {
                lane.gate().expire_for(key, end.reason).1
            }
            Phase::Queued(key) if self.current(lane) => {
                lane.gate().recheck(key, end.deadline, now).1
            }
            _ => Wakes::default(),
        }
    }

    /// What became of the queued turn.
    pub fn claim<L: Lane>(
        &mut self,
        lane: &L,
        now: impl FnOnce() -> Duration,
    ) -> (Claimed, Wakes<L::Waker>) {
        let Phase::Queued(key) = self.phase else {
            return (Claimed::Withdrawn, Wakes::default());
        };
        if !self.current(lane) {
            self.phase = Phase::Done;
            return (Claimed::Withdrawn, Wakes::default());
        }
        let (claim, wakes) = lane.gate().claim(key, now);
        let claimed = match claim {
            Claim::Waiting => Claimed::Waiting,
            Claim::Admitted(scope) => {
                self.granted(lane, scope, true);
                Claimed::Granted
            }
            Claim::Refused(reason, retry) => {
                lane.transports().dequeued(self.transport, false);
                Claimed::Refused(self.refused(lane, reason, retry))
            }
            Claim::Unknown => {
                lane.transports().dequeued(self.transport, false);
                self.phase = Phase::Done;
                Claimed::Withdrawn
            }
        };
        (claimed, wakes)
    }

    /// Leaves the queue (a slot granted meanwhile goes to the next waiter). `None` if the
    /// turn was not queued.
    pub fn withdraw<L: Lane>(&mut self, lane: &L) -> Option<Wakes<L::Waker>> {
        let Phase::Queued(key) = self.phase else {
            return None;
        };
        self.phase = Phase::Done;
        if !self.current(lane) {
            return Some(Wakes::default());
        }
        lane.transports().dequeued(self.transport, false);
        Some(lane.gate().cancel(key).1)
    }

    /// The turn waiting for its lease got it: it counts as admitted, and may start.
    pub fn lease_granted<L: Lane>(
        &mut self,
        lane: &L,
        lease: Arc<TurnLease>,
    ) -> Result<(), NotLeasing> {
        if !self.is_leasing() {
            lease.close();
            return Err(NotLeasing::NotWaiting);
        }
        let Phase::Leasing(scope) = std::mem::replace(&mut self.phase, Phase::Done) else {
            return Err(NotLeasing::NotWaiting);
        };
        if !self.current(lane) {
            lease.close();
            return Err(NotLeasing::Forked);
        }
        lane.gate().confirm_in(self.class);
        lane.transports().dequeued(self.transport, true);
        self.phase = Phase::Granted {
            scope,
            lease: Some(lease),
        };
        Ok(())
    }

    /// Ends the wait for the lease: the local slot is handed on, and the turn counts as
    /// rejected for `reason` (`fleet_unavailable`, `timeout`, `closing`), or as cancelled
    /// (`None`). Returns the gate's retry hint, or `None` if the turn was not leasing.
    pub fn lease_ended<L: Lane>(
        &mut self,
        lane: &L,
        reason: Option<Rejection>,
        now: impl FnOnce() -> Duration,
    ) -> Option<(Option<Duration>, Wakes<L::Waker>)> {
        if !self.is_leasing() {
            return None;
        }
        let Phase::Leasing(scope) = std::mem::replace(&mut self.phase, Phase::Done) else {
            return None;
        };
        if !self.current(lane) {
            return None;
        }
        let (retry, wakes) = lane
            .gate()
            .revoke_in(scope.as_deref(), self.class, reason, now);
        lane.transports().dequeued(self.transport, false);
        if let Some(reason) = reason {
            lane.transports().rejected(self.transport, reason);
        }
        Some((retry, wakes))
    }

    /// The granted turn starts running. `share`: its slot and lease are also handed to a
    /// human-wait hook (returned). `None` if the turn was not granted.
    pub fn start<L: Lane>(
        &mut self,
        lane: &L,
        share: bool,
        now: impl FnOnce() -> Duration,
    ) -> (Option<Arc<Held>>, Wakes<L::Waker>) {
        if !matches!(self.phase, Phase::Granted { .. }) {
            return (None, Wakes::default());
        }
        let Phase::Granted { scope, lease } = std::mem::replace(&mut self.phase, Phase::Done)
        else {
            return (None, Wakes::default());
        };
        let gate = lane.gate();
        let mut wakes = Wakes::default();
        let started = gate.times_turns().then(|| {
            let at = now();
            let (in_flight, started_wakes) = gate.turn_started(at);
            wakes = started_wakes;
            (at, in_flight)
        });
        let held = Held {
            slot: TurnSlot::in_class(scope, self.class),
            away: std::sync::Mutex::new(Away::default()),
            lease,
        };
        let (held, shared) = if share {
            let shared = Arc::new(held);
            (HeldRef::Shared(shared.clone()), Some(shared))
        } else {
            (HeldRef::Own(held), None)
        };
        self.phase = Phase::Running { held, started };
        (shared, wakes)
    }

    /// The running turn lends its slot and lease while a person decides, from `now` (see
    /// [`Held::lend`]).
    pub fn lend<L: Lane>(&self, lane: &L, now: Duration) -> Wakes<L::Waker> {
        match &self.phase {
            Phase::Running { held, .. } if self.current(lane) => held.lend(lane.gate(), now),
            _ => Wakes::default(),
        }
    }

    /// The running turn takes back what it lent, at `now` (see [`Held::take_back`]).
    pub fn take_back<L: Lane>(&self, lane: &L, now: Duration) {
        if let Phase::Running { held, .. } = &self.phase {
            if self.current(lane) {
                held.take_back(lane.gate(), now);
            }
        }
    }

    /// The turn ends, exactly once: its lease goes back, its slot is returned (and handed
    /// on) and it counts as finished. `resource` is the memory pressure now (read only when
    /// needed); `report`, how its provider call went, for a gate that times turns. Returns
    /// the wakes, or `None` when nothing was returned to this process's gate (the turn was
    /// not running, or belongs to the parent of a fork).
    pub fn end<L: Lane>(
        &mut self,
        lane: &L,
        resource: impl FnOnce() -> Option<Decision>,
        report: impl FnOnce() -> Option<Report>,
    ) -> Option<Wakes<L::Waker>> {
        if !matches!(
            self.phase,
            Phase::Running { .. } | Phase::PassThrough(_) | Phase::Granted { .. }
        ) {
            return None;
        }
        let phase = std::mem::replace(&mut self.phase, Phase::Done);
        let current = self.current(lane);
        let gate = lane.gate();
        match phase {
            Phase::Running { held, started } => {
                if let Some(lease) = &held.lease {
                    lease.close(); // a no-op for a lease of the parent of a fork
                }
                if !current {
                    return None;
                }
                lane.transports().finished(self.transport);
                let pressure = resource();
                // Asked only of a timed turn: the report may cost the driver (a foreign call).
                Some(
                    match started.and_then(|started| Some((started, report()?))) {
                        Some(((started_at, in_flight), report)) => {
                            // Time waiting for a person is not the provider's: the turn is
                            // timed as if it had started that much later.
                            let away = held.time_away(report.ended_at);
                            let end = TurnEnd {
                                started_at: started_at.saturating_add(away).min(report.ended_at),
                                ended_at: report.ended_at,
                                in_flight,
                                outcome: report.outcome,
                                remaining: report.remaining,
                            };
                            held.slot.finish(gate, pressure, end)
                        }
                        None => held.slot.close(gate, pressure),
                    },
                )
            }
            Phase::Granted { scope, lease } => {
                if let Some(lease) = lease {
                    lease.close();
                }
                if !current {
                    return None;
                }
                lane.transports().finished(self.transport);
                Some(TurnSlot::in_class(scope, self.class).close(gate, resource()))
            }
            Phase::PassThrough(ticket) if current => {
                lane.transports().finished(self.transport);
                Some(gate.end_pass_through(ticket, resource()))
            }
            _ => None,
        }
    }

    /// The turn is dropped wherever it stands: a queued turn withdraws, a turn waiting for
    /// its lease hands its slot on (counted as cancelled), a granted, running or passed turn
    /// ends without a report. Returns the wakes, or `None` if nothing was released.
    pub fn abandon<L: Lane>(
        &mut self,
        lane: &L,
        now: impl FnOnce() -> Duration,
    ) -> Option<Wakes<L::Waker>> {
        match self.phase {
            Phase::Queued(_) => self.withdraw(lane),
            Phase::Leasing(_) => self.lease_ended(lane, None, now).map(|(_, wakes)| wakes),
            Phase::Running { .. } | Phase::PassThrough(_) | Phase::Granted { .. } => {
                self.end(lane, || None, || None)
            }
            Phase::Fresh | Phase::Arriving | Phase::Done => {
                self.phase = Phase::Done;
                None
            }
        }
    }
}

#[cfg(test)]
mod tests;
