//! The gate: one lock around a small state machine that admits, queues and sheds turns.
//!
//! # Implementation details
//!
//! All state lives in [`GateState`], a plain struct whose methods take `&mut self` and the
//! current time as an argument (the core never reads a clock). [`Gate`] puts it behind one
//! mutex. Every operation runs to completion under the lock and never blocks, allocates at
//! most a queue record, and never calls out: wakers of the waiters it hands slots to (or
//! sheds) are collected into a [`Wakes`] list that the caller runs after the lock is
//! released, as tokio's batch semaphore does. A waker that is dropped (a cancelled waiter's)
//! is also handed out, because dropping one may run foreign code (a Python finaliser).
//!
//! Slots are counted, not held as permits: `in_flight` is the number of turns holding a slot
//! (including turns granted a slot whose owner has not yet woken up to claim it). A slot is
//! free when `in_flight` is below the ceiling and, for a scoped turn, its scope's count is
//! below the per-scope limit (and its priority class is below its cap). Which waiter a freed
//! slot goes to, and which one a full queue sheds, is the [`crate::queue`]'s decision: FIFO
//! for a gate without classes (the oldest *eligible* waiter: a tenant at its sub-limit is
//! skipped, not dropped), classes with guaranteed and capped shares, fair queuing across
//! tenants, the adaptive discipline's newest-first rule; each grant in O(log tenants). A
//! newcomer never overtakes a waiter that could take a free slot.
//!
//! Memory pressure: the last resource decision is remembered. Under soft or hard pressure
//! a release hands its slot to a waiter (concurrency stays level) but the free slots that
//! pressure left idle are not filled, except when nothing runs at all (so the gate always
//! makes progress). Once a decision under no pressure is seen, waiters fill the free slots
//! in order before any newcomer is considered. Such a decision may come with nobody arriving
//! or leaving: while waiters are held back with slots free ([`GateState::held_back`], also
//! published lock-free by [`Gate::held_back`]) the binding re-samples on a timer and reports
//! it ([`GateState::note_pressure`]); a reconfigure passes the pressure under its new
//! configuration.
//!
//! Turns a gate with nothing to enforce lets through are counted lock-free
//! ([`super::passthrough`]) and adopted into `in_flight` when the gate enforces something (a
//! reconfigure, an enforced arrival, a close), so a ceiling set while they run holds.
//!
//! A waiter's record stays in the slab after it is granted a slot or shed, until its owner
//! claims the outcome ([`Gate::claim`]) or withdraws ([`Gate::cancel`]): a cancellation that
//! races a grant finds the grant under the lock and hands the slot to the next waiter, so a
//! slot is never lost. Human-approval waits lend a slot back ([`TurnSlot::suspend`]) and
//! take one on resume even when none is free ([`TurnSlot::resume`]): `in_flight` may then
//! exceed the ceiling, and the excess is repaid by not refilling the next releases.
//!
//! Deferred admission (a fleet-wide limit): a turn granted its slot must still get a lease
//! elsewhere before it runs. With [`GateState::defer_admission`] on, a grant does not count
//! the turn as admitted; the caller then either [`confirm`](GateState::confirm)s it (the lease
//! came) or [`revoke`](GateState::revoke)s it (the lease was refused, or the caller gave up):
//! its slot is handed on and it counts as rejected or cancelled, as the caller experienced.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::count::{decrement, difference, increment};
use super::histogram::{Histogram, HistogramSnapshot};
use super::passthrough::{PassEnd, PassThroughTurns, PassTicket};
use super::policy::{ConcurrencyLimit, Decision, Facts, Overflow};
use super::queue::waiters::{WaiterKey, WaiterState};
use super::queue::{ClassId, ClassStats, Order, Outcome, PriorityError, Queue};
use super::retry::{ReleaseRate, MEMORY_PRESSURE_RETRY};
use super::sync::Mutex;
use crate::overload::QueueMode;
pub use crate::rejection::Rejection;

mod overload;
pub use overload::TurnEnd;

/// How a waiting turn is woken. The gate calls [`Waker::wake`] outside its lock; the owner
/// then asks [`Gate::claim`] what happened (a slot, or eviction).
pub trait Waker: Send + Sized {
    /// Wakes the waiter. A waker that finds its owner gone for good (its event loop has
    /// closed) withdraws the turn and returns the wakes that withdrawal caused; they are run
    /// by the same loop rather than recursively, so a cascade through thousands of
    /// abandoned waiters uses constant stack.
    fn wake(self) -> Wakes<Self>;
}

/// Wakers to run, and wakers to drop, once the gate's lock is released.
#[must_use = "the waiters must be woken after the lock is released"]
pub struct Wakes<W> {
    wake: Vec<W>,
    drop: Vec<W>,
}

impl<W> Default for Wakes<W> {
    fn default() -> Self {
        Self {
            wake: Vec::new(),
            drop: Vec::new(),
        }
    }
}

impl<W: Waker> Wakes<W> {
    /// Wakes every collected waiter (and any a failed wake hands on), in order, then drops
    /// the discarded wakers.
    ///
    /// A waker is foreign code (the binding's runs Python). If one panics, the waiters
    /// behind it are still woken and the discarded wakers still dropped, and only then is the
    /// first panic resumed: the gate's state was settled before the lock was released, so a
    /// panic here can strand at most the waiter whose own waker failed, never the others.
    pub fn run(self) {
        let mut pending: std::collections::VecDeque<W> = self.wake.into();
        let mut discarded = self.drop;
        let mut first_panic = None;
        while let Some(waker) = pending.pop_front() {
            match super::unwind::catch_panic(|| waker.wake()) {
                Ok(more) => {
                    pending.extend(more.wake);
                    discarded.extend(more.drop);
                }
                Err(payload) => {
                    first_panic.get_or_insert(payload);
                }
            }
        }
        drop(discarded);
        if let Some(payload) = first_panic {
            std::panic::resume_unwind(payload);
        }
    }
}

impl<W> Wakes<W> {
    /// How many waiters will be woken.
    pub fn len(&self) -> usize {
        self.wake.len()
    }

    /// Whether nobody will be woken.
    pub fn is_empty(&self) -> bool {
        self.wake.is_empty()
    }
}

/// What [`Gate::arrive`] did with a turn.
#[derive(Debug, PartialEq)]
pub enum Arrival {
    /// It holds a slot now; release it with [`TurnSlot::close`].
    Admitted(Option<Arc<str>>),
    /// It waits; register a waker, then claim the outcome when woken.
    Queued(WaiterKey),
    /// It was refused, with how long the caller should wait before trying again (`None`
    /// where waiting would not help: a policy's refusal).
    Rejected(Rejection, Option<Duration>),
}

/// What [`Gate::claim`] found.
#[derive(Debug, PartialEq)]
pub enum Claim {
    /// A slot was granted; the turn now holds it and counts as admitted.
    Admitted(Option<Arc<str>>),
    /// The turn was refused while it waited (evicted by `shed_oldest`, timed out, or the
    /// gate closed), with its retry hint.
    Refused(Rejection, Option<Duration>),
    /// Still waiting.
    Waiting,
    /// The key names no record (already claimed or withdrawn).
    Unknown,
}

/// What [`Gate::register`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Registered {
    /// The waker is stored; the turn will be woken.
    Waiting,
    /// The turn was granted a slot or shed before it registered: claim now.
    Settled,
    /// The key names no record.
    Unknown,
}

/// What [`Gate::cancel`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Cancelled {
    /// The turn left the queue.
    Withdrawn,
    /// The turn had been granted a slot; the slot went to the next waiter.
    ReturnedSlot,
    /// The turn had been refused (shed, timed out, closed) without seeing it; it now counts
    /// as cancelled instead.
    AlreadyRefused,
    /// The key names no record.
    Unknown,
}

/// A snapshot of the gate's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Turns holding a slot (including granted turns not yet running).
    pub in_flight: u64,
    /// Turns waiting for a slot.
    pub queued: u64,
    /// Admitted turns parked on a human approval, not holding a slot.
    pub awaiting_human: u64,
    /// Turns that started running.
    pub admitted: u64,
    /// Turns refused on arrival.
    pub rejected: u64,
    /// Waiters evicted by `shed_oldest`.
    pub shed: u64,
    /// Turns withdrawn while queued, or cancelled between being granted a slot and running.
    pub cancelled: u64,
    /// Turns granted a slot whose owner has not woken up to claim it (counted in flight).
    pub granted_unclaimed: u64,
    /// The most turns ever in flight at once.
    pub peak_in_flight: u64,
    /// Scopes with turns running or waiting.
    pub tracked_scopes: u64,
    /// How long the oldest waiter has waited, on the caller's clock.
    pub oldest_wait: Option<Duration>,
    /// The effective ceiling now: `max_concurrent_runs`, or below it what an adaptive
    /// limit has learned (0: no ceiling).
    pub limit: u64,
}

/// The caller's clock, read at most once, and only if asked.
struct LazyClock<F> {
    read: Option<F>,
    value: Option<Duration>,
}

impl<F: FnOnce() -> Duration> LazyClock<F> {
    fn read(&mut self) -> Duration {
        if let Some(value) = self.value {
            return value;
        }
        let value = self.read.take().map_or(Duration::ZERO, |read| read());
        self.value = Some(value);
        value
    }
}

/// The admission state machine, without a lock. See the module documentation.
#[derive(Debug)]
pub struct GateState<W> {
    limits: ConcurrencyLimit,
    /// The ceiling in force: `limits.max_concurrent_runs`, or below it what an adaptive
    /// limit allows (see `overload`).
    ceiling: u32,
    /// Overload control, when any is on (see the `overload` module); `None` costs nothing.
    overload: Option<Box<overload::Overload>>,
    pressure: Decision,
    in_flight: u64,
    awaiting_human: u64,
    admitted: u64,
    rejected: u64,
    shed: u64,
    cancelled: u64,
    granted_unclaimed: u64,
    peak_in_flight: u64,
    /// The gate is closing (drained): every newcomer is refused.
    closing: bool,
    /// Grants count as admitted only once confirmed (see the module documentation).
    deferred: bool,
    /// Turns holding a slot that are neither confirmed nor revoked yet (deferred admission:
    /// waiting for their fleet lease), granted ones not yet claimed included.
    unconfirmed: u64,
    /// Slots freed so far (turns ended, lent to a human wait, or handed back by a
    /// cancellation): what the retry hint's release rate counts.
    slots_freed: u64,
    release_rate: ReleaseRate,
    /// How long turns that queued waited before they were admitted.
    queue_wait: Histogram,
    /// The waiters, their tenants and classes, and the order they are served in.
    queue: Queue<W>,
}

impl<W> GateState<W> {
    /// A gate enforcing `limits` (a `max_concurrent_runs` of 0 means no ceiling).
    pub fn new(limits: ConcurrencyLimit) -> Self {
        Self {
            limits,
            ceiling: limits.max_concurrent_runs,
            overload: None,
            pressure: Decision::Admit,
            in_flight: 0,
            awaiting_human: 0,
            admitted: 0,
            rejected: 0,
            shed: 0,
            cancelled: 0,
            granted_unclaimed: 0,
            peak_in_flight: 0,
            closing: false,
            deferred: false,
            unconfirmed: 0,
            slots_freed: 0,
            release_rate: ReleaseRate::default(),
            queue_wait: Histogram::default(),
            queue: Queue::new(limits.max_per_scope, limits.max_concurrent_runs),
        }
    }

    /// The limits this gate enforces.
    pub fn limits(&self) -> &ConcurrencyLimit {
        &self.limits
    }

    /// Sets the queue's order: priority classes, fair queuing across tenants, weights. The
    /// classes' names and order are fixed once any turn has arrived (their counts are kept
    /// per class); shares, the default class and fairness may change at any time.
    pub fn set_order(&mut self, order: Order, wakes: &mut Wakes<W>) -> Result<(), PriorityError> {
        let used = self.in_flight > 0
            || !self.queue.is_empty()
            || self.admitted > 0
            || self.rejected > 0
            || self.cancelled > 0;
        if used && !order.priorities.same_names(&self.queue.order().priorities) {
            return Err(PriorityError::Renamed);
        }
        self.queue.set_order(order);
        self.dispatch(0, wakes);
        Ok(())
    }

    /// The queue's order in force.
    pub fn order(&self) -> &Order {
        self.queue.order()
    }

    /// Counts `outcome` for class `class` and in the totals.
    fn tally(&mut self, class: usize, outcome: Outcome) {
        increment(match outcome {
            Outcome::Admitted => &mut self.admitted,
            Outcome::Rejected => &mut self.rejected,
            Outcome::Shed => &mut self.shed,
            Outcome::Cancelled => &mut self.cancelled,
        });
        self.queue.count(class, outcome);
    }

    /// Takes back a count of `outcome` (a refusal its owner never saw: a cancellation).
    fn untally(&mut self, class: usize, outcome: Outcome) {
        let total = match outcome {
            Outcome::Admitted => &mut self.admitted,
            Outcome::Rejected => &mut self.rejected,
            Outcome::Shed => &mut self.shed,
            Outcome::Cancelled => &mut self.cancelled,
        };
        decrement(total, outcome_name(outcome));
        self.queue.uncount(class, outcome);
    }

    /// Whether the scope limit (or fair queuing) tracks `scope`.
    fn tracked<'s>(&self, scope: Option<&'s str>) -> Option<&'s str> {
        scope.filter(|s| !s.is_empty() && (self.limits.max_per_scope > 0 || self.queue.fair()))
    }

    fn global_slot_free(&self) -> bool {
        self.ceiling == 0 || self.in_flight < u64::from(self.ceiling)
    }

    /// Slots free under the ceiling (`u64::MAX` without one).
    fn free_slots(&self) -> u64 {
        match self.ceiling {
            0 => u64::MAX,
            max => u64::from(max).saturating_sub(self.in_flight),
        }
    }

    /// How long a caller refused now should wait, from the recent release rate, for
    /// `ahead` turns in front of it. Reads the caller's clock.
    fn retry_hint(&mut self, ahead: u64, now: Duration) -> Duration {
        self.release_rate.observe(now, self.slots_freed);
        self.release_rate.retry_after(ahead, now, self.slots_freed)
    }

    /// Soft pressure with no ceiling has no slot to wait on, so it admits (as documented).
    fn effective_pressure(&self, resource: Decision) -> Decision {
        if self.ceiling == 0 && resource == Decision::Queue {
            Decision::Admit
        } else {
            resource
        }
    }

    /// Counts a slot taken (the queue has counted it for the tenant and class).
    fn count_slot(&mut self) {
        increment(&mut self.in_flight);
        self.peak_in_flight = self.peak_in_flight.max(self.in_flight);
    }

    fn give_slot(&mut self, scope: Option<&str>, class: usize) {
        decrement(&mut self.in_flight, "in_flight (a slot returned twice)");
        self.queue.give_slot(scope, class);
    }

    /// Hands free slots to the waiters the queue names next (see [`crate::queue`]). Under
    /// memory pressure only `freed` slots are handed on (plus one when nothing runs), so
    /// concurrency does not grow.
    fn dispatch(&mut self, freed: u32, wakes: &mut Wakes<W>) {
        self.queue.follow_ceiling(self.ceiling);
        let mut budget = freed;
        // Overload control may refuse waiters that waited too long, and serve the newest
        // first, while a queue stands (`QueueMode::Fifo` without it).
        let newest_first = self.overload.is_some()
            && self.queue.dispatchable()
            && self.global_slot_free()
            && matches!(
                self.serve_mode(wakes),
                QueueMode::Controlled {
                    newest_first: true,
                    ..
                }
            );
        while self.global_slot_free() {
            if self.pressure != Decision::Admit {
                // Under pressure, only hand on what was freed; with nothing running at all,
                // one waiter may start so the gate always makes progress.
                if let Some(rest) = budget.checked_sub(1) {
                    budget = rest;
                } else if self.in_flight > 0 {
                    break;
                }
            }
            // A waiter the queue names but cannot grant would be a stale index (never while
            // the invariants hold): stopping keeps the loop finite.
            let Some(index) = self.queue.next(newest_first) else {
                break;
            };
            if self.waiter_misses_deadline(index)
                && self.refuse_waiter(index, Rejection::Deadline, wakes)
            {
                // Its deadline no longer fits the expected turn: the slot goes on.
                continue;
            }
            if !self.grant(index, wakes) {
                break;
            }
        }
    }

    /// Hands a slot to the waiter at `index`; `false`, changing nothing, if none waits there.
    fn grant(&mut self, index: u32, wakes: &mut Wakes<W>) -> bool {
        let Some(granted) = self.queue.grant(index) else {
            return false;
        };
        self.on_dequeue(granted.enqueued_at);
        increment(&mut self.granted_unclaimed);
        if self.deferred {
            increment(&mut self.unconfirmed);
        }
        self.count_slot();
        self.wake(index, wakes);
        true
    }

    /// Hands the waker of the record at `index`, if it registered one, to `wakes`.
    fn wake(&mut self, index: u32, wakes: &mut Wakes<W>) {
        if let Some(waker) = self.queue.get_mut(index).and_then(|r| r.waker.take()) {
            wakes.wake.push(waker);
        }
    }

    /// Evicts the waiter at `index` (counted in `shed`); `false` if it no longer waited.
    fn shed_waiter(&mut self, index: u32, wakes: &mut Wakes<W>) -> bool {
        let Some((_, class)) = self
            .queue
            .remove(index, WaiterState::Refused(Rejection::Shed))
        else {
            return false;
        };
        // Counted as shed now; moved to `cancelled` if its owner is cancelled before it
        // sees the eviction (see `cancel`), so the counters say what callers experienced.
        self.tally(class, Outcome::Shed);
        self.wake(index, wakes);
        true
    }

    /// The facts a concurrency policy decides from, for a turn of `scope`.
    pub fn facts(&self, scope: Option<&str>) -> Facts {
        // Waiters held back only by soft memory pressure would be running without it: the
        // depth, and any policy, see the queue without them.
        let (scope_in_flight, scope_queued) = self
            .tracked(scope)
            .map_or((0, 0), |name| self.queue.scope_counts(Some(name)));
        Facts {
            in_flight: self.in_flight,
            queued: difference(
                self.queue.len(),
                self.queue.outside_depth(),
                "outside-depth waiters",
            ),
            scope_in_flight,
            scope_queued,
        }
    }

    /// Admits, queues or rejects one turn.
    ///
    /// `scope` is the turn's tenant (ignored unless a per-scope limit is set). `decided` is
    /// the concurrency decision of a foreign policy, made from [`GateState::facts`]; `None`
    /// makes the gate decide with its own [`ConcurrencyLimit`] from the live facts.
    /// `resource` is the memory-pressure decision for this turn ([`Decision::Admit`] when
    /// memory-aware admission is off). `now` is the caller's clock, read only when the turn
    /// queues (reading a clock costs as much as the rest of the fast path).
    pub fn arrive(
        &mut self,
        scope: Option<&str>,
        decided: Option<Decision>,
        resource: Decision,
        now: impl FnOnce() -> Duration,
        wakes: &mut Wakes<W>,
    ) -> Arrival {
        self.arrive_by(scope, decided, resource, None, now, wakes)
    }

    /// [`GateState::arrive_as`] in the default class.
    pub fn arrive_by(
        &mut self,
        scope: Option<&str>,
        decided: Option<Decision>,
        resource: Decision,
        deadline: Option<Duration>,
        now: impl FnOnce() -> Duration,
        wakes: &mut Wakes<W>,
    ) -> Arrival {
        let turn = Entrant {
            scope,
            class: ClassId::DEFAULT,
            deadline,
        };
        self.arrive_as(turn, decided, resource, now, wakes)
    }

    /// [`GateState::arrive`] for a turn of a class whose caller waits until a deadline (on
    /// the same clock as `now`) at most. A turn that would run at once always does; one that
    /// would queue is refused with [`Rejection::Deadline`] when its deadline has passed or
    /// less of it is left than the expected service time (its caller would leave before it
    /// finished, so no slot should go to it). While it waits, the caller refuses it at
    /// [`GateState::deadline_timer`] with [`GateState::expire_for`].
    ///
    /// A class at its cap queues its turns even while slots are free. When the queue is
    /// full, the least important class below the turn's with a waiter loses its oldest one
    /// rather than the turn being refused, whatever the overflow policy; only when none
    /// waits does the overflow policy apply, within the turn's class.
    pub fn arrive_as(
        &mut self,
        turn: Entrant<'_>,
        decided: Option<Decision>,
        resource: Decision,
        now: impl FnOnce() -> Duration,
        wakes: &mut Wakes<W>,
    ) -> Arrival {
        let mut clock = LazyClock {
            read: Some(now),
            value: None,
        };
        let scope = self.tracked(turn.scope);
        let class = self.queue.class(turn.class);
        if self.closing {
            self.tally(class, Outcome::Rejected);
            return Arrival::Rejected(Rejection::Closing, None);
        }
        self.pressure = self.effective_pressure(resource);
        if self.pressure == Decision::Admit {
            // Pressure may just have eased: waiters take the free slots before the newcomer.
            self.dispatch(0, wakes);
        }
        self.queue.follow_ceiling(self.ceiling);
        let facts = self.facts(scope);
        let class_full = self.queue.class_full(class);
        let ceiling = ConcurrencyLimit {
            max_concurrent_runs: self.ceiling,
            ..self.limits
        };
        // A class at its cap meets the queue as a turn meets a gate at its ceiling.
        let seen = Facts {
            in_flight: if class_full {
                facts.in_flight.max(u64::from(self.ceiling))
            } else {
                facts.in_flight
            },
            ..facts
        };
        let mut concurrency = decided.unwrap_or_else(|| ceiling.decide(&seen, scope.is_some()));
        let scope_blocked = self.limits.scope_blocked(scope.is_some(), &facts);
        // The queue this turn joins: its tenant's own when the tenant is at its limit.
        let (joined, waiting) = if scope_blocked {
            (scope, facts.scope_queued)
        } else {
            (None, facts.queued)
        };
        // A full queue refuses nobody while a less important class waits: it sheds instead.
        let sheds_lower = decided.is_none()
            && concurrency == Decision::Reject
            && self.queue.victim(class, joined, false).is_some();
        if sheds_lower {
            concurrency = Decision::Queue;
        }
        let decision = concurrency.escalate(self.pressure);
        if decision == Decision::Reject {
            let refusal = if concurrency != Decision::Reject {
                Arrival::Rejected(Rejection::MemoryPressure, Some(MEMORY_PRESSURE_RETRY))
            } else if decided.is_some() {
                Arrival::Rejected(Rejection::Policy, None)
            } else {
                Arrival::Rejected(
                    Rejection::QueueFull,
                    Some(self.retry_hint(waiting, clock.read())),
                )
            };
            // Counted after the caller's clock is read: should that panic, nothing is.
            self.tally(class, Outcome::Rejected);
            return refusal;
        }

        // Waiters granted a slot but not yet running start first, so a newcomer queues
        // behind them (it is granted at once below if a slot is free): bodies start in
        // arrival order on a loop, which keeps one tenant's turns in order.
        let runs_now = self.global_slot_free()
            && !scope_blocked
            && !class_full
            && !self.queue.dispatchable()
            && self.granted_unclaimed == 0
            && (self.pressure == Decision::Admit || self.in_flight == 0);
        if runs_now {
            let key = scope.map(|name| self.queue.scope_key(name));
            self.queue.admit(key.as_deref(), class);
            self.count_slot();
            if self.deferred {
                increment(&mut self.unconfirmed);
            } else {
                self.tally(class, Outcome::Admitted);
            }
            return Arrival::Admitted(key);
        }
        if let Some(deadline) = turn.deadline {
            if self.misses_deadline(deadline, clock.read()) {
                self.refuse_for_deadline();
                self.queue.count(class, Outcome::Rejected);
                return Arrival::Rejected(Rejection::Deadline, None);
            }
        }

        // Soft memory pressure holds back a turn that would run at once without it: it waits
        // outside the depth, and never more of them than there are free slots, so pressure
        // alone refuses nobody. Every other turn meets the queue as it would without pressure.
        let outside_depth = self.pressure == Decision::Queue
            && concurrency == Decision::Admit
            && !scope_blocked
            && !class_full
            && self.queue.outside_depth() < self.free_slots();
        if decision == Decision::Queue
            && !outside_depth
            && waiting >= u64::from(self.limits.queue_depth)
        {
            let evicts = self.limits.overflow == Overflow::ShedOldest;
            // A policy that said QUEUE at a full queue chose to wait beyond the depth;
            // a turn queued by memory pressure meets the overflow policy instead.
            let refuses =
                concurrency == Decision::Admit && self.limits.overflow == Overflow::Reject;
            if evicts || refuses || sheds_lower {
                let victim = self.queue.victim(class, joined, evicts);
                if !victim.is_some_and(|index| self.shed_waiter(index, wakes)) {
                    let retry = self.retry_hint(waiting, clock.read());
                    self.tally(class, Outcome::Rejected);
                    return Arrival::Rejected(Rejection::QueueFull, Some(retry));
                }
            }
        }

        let now = clock.read();
        self.release_rate.observe(now, self.slots_freed);
        self.on_enqueue(now);
        let key = scope.map(|name| self.queue.scope_key(name));
        let Some(waiter) = self.queue.push(key, class, now, outside_depth) else {
            // The slab is full (2^32 - 1 records): the queue is, whatever its depth says.
            self.tally(class, Outcome::Rejected);
            let retry = self.retry_hint(self.queue.len(), now);
            return Arrival::Rejected(Rejection::QueueFull, Some(retry));
        };
        self.remember_deadline(waiter, turn.deadline);
        self.dispatch(0, wakes);
        Arrival::Queued(waiter)
    }

    /// Stores the waker of a queued turn. If the turn was settled first, returns the waker.
    pub fn register(&mut self, key: WaiterKey, waker: W) -> (Registered, Option<W>) {
        let Some((_, record)) = self.queue.lookup_mut(key) else {
            return (Registered::Unknown, Some(waker));
        };
        if record.state != WaiterState::Waiting {
            return (Registered::Settled, Some(waker));
        }
        (Registered::Waiting, record.waker.replace(waker))
    }

    /// Collects a queued turn's outcome. `now` (the caller's clock) is read once the turn
    /// is settled: how long it waited, or when a shed turn should retry.
    pub fn claim(
        &mut self,
        key: WaiterKey,
        now: impl FnOnce() -> Duration,
        wakes: &mut Wakes<W>,
    ) -> Claim {
        let Some((index, record)) = self.queue.lookup(key) else {
            return Claim::Unknown;
        };
        let class = usize::from(record.class);
        let outcome = match record.state {
            WaiterState::Waiting => return Claim::Waiting,
            WaiterState::Granted => {
                let now = now();
                self.queue_wait
                    .record(now.saturating_sub(record.enqueued_at));
                let scope = record.scope.clone();
                self.saw_time(now);
                self.release_rate.observe(now, self.slots_freed);
                if !self.deferred {
                    self.tally(class, Outcome::Admitted);
                }
                decrement(&mut self.granted_unclaimed, "granted_unclaimed");
                Claim::Admitted(scope)
            }
            WaiterState::Refused(reason) => {
                let retry = match reason {
                    // The caller's own deadline cannot be met: retrying sooner does not help
                    // (and a refusal on arrival has no hint either).
                    Rejection::Closing | Rejection::Deadline => None,
                    _ => Some(self.retry_hint(self.queue.len(), now())),
                };
                Claim::Refused(reason, retry)
            }
        };
        wakes.drop.extend(self.queue.free(index));
        outcome
    }

    /// Withdraws a queued turn (its task was cancelled or its event loop is gone). A slot it
    /// was granted in the meantime goes to the next waiter.
    pub fn cancel(&mut self, key: WaiterKey, wakes: &mut Wakes<W>) -> Cancelled {
        let Some((index, record)) = self.queue.lookup(key) else {
            return Cancelled::Unknown;
        };
        let scope = record.scope.clone();
        let class = usize::from(record.class);
        let outcome = match record.state {
            WaiterState::Waiting => {
                // Marked refused only to take it off the lists; it is freed just below. A
                // record that cannot be unlinked must not be freed (the lists would point at
                // a free slot): it is left alone, as if unknown.
                if self
                    .queue
                    .remove(index, WaiterState::Refused(Rejection::Shed))
                    .is_none()
                {
                    return Cancelled::Unknown;
                }
                Cancelled::Withdrawn
            }
            WaiterState::Granted => {
                decrement(&mut self.granted_unclaimed, "granted_unclaimed");
                if self.deferred {
                    decrement(&mut self.unconfirmed, "unconfirmed");
                }
                Cancelled::ReturnedSlot
            }
            WaiterState::Refused(reason) => {
                // Its owner was cancelled before it saw the refusal: what it experienced is a
                // cancellation.
                let counted = if reason == Rejection::Shed {
                    Outcome::Shed
                } else {
                    Outcome::Rejected
                };
                self.untally(class, counted);
                Cancelled::AlreadyRefused
            }
        };
        self.tally(class, Outcome::Cancelled);
        wakes.drop.extend(self.queue.free(index));
        if outcome == Cancelled::ReturnedSlot {
            increment(&mut self.slots_freed);
            self.give_slot(scope.as_deref(), class);
            self.dispatch(1, wakes);
        }
        outcome
    }

    /// Turns granted a slot count as admitted only when [`confirm`](Self::confirm)ed, or are
    /// [`revoke`](Self::revoke)d. Set once, before any turn arrives (a fleet-wide limit).
    pub fn defer_admission(&mut self) {
        self.deferred = true;
    }

    /// A turn granted its slot (deferred admission) got what else it needed: it counts as
    /// admitted now, in its class.
    pub fn confirm_in(&mut self, class: ClassId) {
        debug_assert!(self.deferred, "confirm without deferred admission");
        decrement(&mut self.unconfirmed, "unconfirmed");
        let class = self.queue.class(class);
        self.tally(class, Outcome::Admitted);
    }

    /// A turn of `class` granted its slot (deferred admission) will not run: its slot is
    /// handed on, and it counts as rejected for `reason`, or as cancelled when `None` (its
    /// caller gave up). Returns the retry hint for a refusal, as a waiter refused for
    /// `reason` would get it.
    pub fn revoke_in(
        &mut self,
        scope: Option<&str>,
        class: ClassId,
        reason: Option<Rejection>,
        now: impl FnOnce() -> Duration,
        wakes: &mut Wakes<W>,
    ) -> Option<Duration> {
        debug_assert!(self.deferred, "revoke without deferred admission");
        decrement(&mut self.unconfirmed, "unconfirmed");
        let class = self.queue.class(class);
        match reason {
            Some(_) => self.tally(class, Outcome::Rejected),
            None => self.tally(class, Outcome::Cancelled),
        }
        increment(&mut self.slots_freed);
        self.give_slot(scope, class);
        self.dispatch(1, wakes);
        match reason {
            None | Some(Rejection::Closing | Rejection::Deadline) => None,
            Some(_) => Some(self.retry_hint(self.queue.len(), now())),
        }
    }

    /// Refuses a waiting turn for `reason` (counted in `rejected`) and wakes it; `false` if
    /// it was no longer waiting (granted, refused or withdrawn first: exactly one wins).
    fn refuse_waiter(&mut self, index: u32, reason: Rejection, wakes: &mut Wakes<W>) -> bool {
        let Some((_, class)) = self.queue.remove(index, WaiterState::Refused(reason)) else {
            return false;
        };
        self.tally(class, Outcome::Rejected);
        self.wake(index, wakes);
        true
    }

    /// A waiting turn's queue timeout ran out: it is refused with [`Rejection::Timeout`].
    /// `false` when it had already been granted a slot, refused or withdrawn, so a turn is
    /// either granted or timed out, never both.
    pub fn expire(&mut self, key: WaiterKey, wakes: &mut Wakes<W>) -> bool {
        match self.queue.lookup(key) {
            Some((index, record)) if record.state == WaiterState::Waiting => {
                self.refuse_waiter(index, Rejection::Timeout, wakes)
            }
            _ => false,
        }
    }

    /// Stops admitting: newcomers are refused with [`Rejection::Closing`], and so is every
    /// waiting turn, at once. Running turns (and turns already granted a slot) are left to
    /// finish. Returns how many waiters were refused. A closed gate stays closed.
    pub fn close(&mut self, wakes: &mut Wakes<W>) -> u64 {
        self.closing = true;
        let waiting: Vec<u32> = self.queue.iter_all().collect();
        let mut refused = 0;
        for index in waiting {
            if self.refuse_waiter(index, Rejection::Closing, wakes) {
                increment(&mut refused);
            }
        }
        refused
    }

    /// Whether [`GateState::close`] was called.
    pub fn is_closing(&self) -> bool {
        self.closing
    }

    /// Turns still running: holding a slot (granted ones included) or parked on a human.
    pub fn running(&self) -> u64 {
        self.in_flight.saturating_add(self.awaiting_human)
    }

    /// Turns holding a slot that wait to be confirmed or revoked (deferred admission: their
    /// fleet lease), included in [`GateState::running`]. They have not started: a drain
    /// refuses them rather than waiting for them to finish.
    pub fn unconfirmed(&self) -> u64 {
        self.unconfirmed
    }

    /// Applies new limits (validated by the caller). Running turns are never cancelled: a
    /// lower ceiling is reached as they end. A higher ceiling starts waiters at once. Each
    /// tenant's queue (under a per-tenant limit), and the whole queue, keep at most the new
    /// depth of waiters that count against it; the newest of the least important class past
    /// it are refused with [`Rejection::QueueFull`], except under the `queue` overflow
    /// policy, which refuses nobody. (A gate without classes or fair queuing trims the turns
    /// without a tenant, and each tenant's, as it always did.) Returns how many waiters were
    /// refused. Classes' shares follow the new ceiling.
    ///
    /// `resource` is the memory-pressure decision under the new configuration (`None`: the
    /// remembered one). Pressure that eased, or memory-aware admission turned off, lets the
    /// waiters it held back take the free slots at once.
    pub fn reconfigure(
        &mut self,
        limits: ConcurrencyLimit,
        resource: Option<Decision>,
        wakes: &mut Wakes<W>,
    ) -> u64 {
        self.limits = limits;
        self.ceiling = self.reconfigured_ceiling(limits.max_concurrent_runs);
        // Re-derived under the new ceiling either way: soft pressure with no ceiling admits.
        self.pressure = self.effective_pressure(resource.unwrap_or(self.pressure));
        // Per-scope limits may have changed which lanes are eligible.
        self.queue.set_max_per_scope(limits.max_per_scope);
        self.queue.follow_ceiling(self.ceiling);
        let mut refused = 0;
        if limits.overflow != Overflow::Queue {
            let depth = u64::from(limits.queue_depth);
            for scope in self.queue.scopes() {
                // Stop if one cannot be refused, or this loop would never end.
                while let Some(index) = self.queue.trim_scope(scope.as_deref(), depth) {
                    if !self.refuse_waiter(index, Rejection::QueueFull, wakes) {
                        break;
                    }
                    increment(&mut refused);
                }
            }
            while let Some(index) = self.queue.trim_all(depth) {
                if !self.refuse_waiter(index, Rejection::QueueFull, wakes) {
                    break;
                }
                increment(&mut refused);
            }
        }
        self.dispatch(0, wakes);
        refused
    }

    /// How many turns would start before the waiting turn `key` (waiters that arrived
    /// before it, and turns granted a slot that have not started yet); `None` when it is not
    /// waiting. O(log n) in the queue's length (see [`crate::queue::rank`]), so `on_queued`
    /// keeps arrivals cheap however long the queue. With classes or fair queuing it counts
    /// arrival order, not the order the queue will serve.
    pub fn position(&self, key: WaiterKey) -> Option<u64> {
        let (index, _) = self.queue.lookup(key)?;
        let ahead = self.queue.ahead(index)?;
        Some(ahead.saturating_add(self.granted_unclaimed))
    }

    /// Seconds until a turn with `position` turns ahead of it may start, at the recent
    /// release rate, unclamped (the estimator behind retry hints). `None` until some turn
    /// has ended ([`ReleaseRate::expected_wait`](super::retry::ReleaseRate::expected_wait)).
    pub fn estimate_wait(&mut self, position: u64, now: Duration) -> Option<Duration> {
        self.release_rate.observe(now, self.slots_freed);
        self.release_rate
            .expected_wait(position, now, self.slots_freed)
    }

    /// Per tenant with turns running or waiting: `(tenant, in flight, queued)`. Empty when
    /// neither per-tenant limits nor fair queuing are on (turns are then not tracked per
    /// tenant).
    pub fn scope_stats(&self) -> Vec<(Arc<str>, u64, u64)> {
        self.queue.scope_stats()
    }

    /// Per priority class, most important first: its counts and its shares in slots now.
    pub fn class_stats(&self) -> Vec<ClassStats> {
        self.queue.class_stats()
    }

    /// Notes the memory pressure a newcomer just read; if it has eased, waiters take the free
    /// slots. Called before a foreign policy is asked, so it decides from the facts the
    /// arrival will see ([`GateState::arrive`] does the same for the gate's own policy).
    pub fn note_pressure(&mut self, resource: Decision, wakes: &mut Wakes<W>) {
        self.pressure = self.effective_pressure(resource);
        if self.pressure == Decision::Admit {
            self.dispatch(0, wakes);
        }
    }

    /// [`GateState::release_in`] for a turn of the default class.
    pub fn release(
        &mut self,
        scope: Option<&str>,
        resource: Option<Decision>,
        wakes: &mut Wakes<W>,
    ) {
        self.release_in(scope, ClassId::DEFAULT, resource, wakes);
    }

    /// Returns a running turn's slot and hands it on. `resource`, when known, updates the
    /// remembered memory pressure first.
    pub fn release_in(
        &mut self,
        scope: Option<&str>,
        class: ClassId,
        resource: Option<Decision>,
        wakes: &mut Wakes<W>,
    ) {
        if let Some(resource) = resource {
            self.pressure = self.effective_pressure(resource);
        }
        increment(&mut self.slots_freed);
        let class = self.queue.class(class);
        self.give_slot(scope, class);
        self.dispatch(1, wakes);
    }

    /// [`GateState::finish_in`] for a turn of the default class.
    pub fn finish(
        &mut self,
        scope: Option<&str>,
        resource: Option<Decision>,
        end: TurnEnd,
        wakes: &mut Wakes<W>,
    ) {
        self.finish_in(scope, ClassId::DEFAULT, resource, end, wakes);
    }

    /// A running turn of `class` parks on a human approval: its slot is lent to the queue.
    pub fn suspend(&mut self, scope: Option<&str>, class: ClassId, wakes: &mut Wakes<W>) {
        increment(&mut self.awaiting_human);
        increment(&mut self.slots_freed);
        let class = self.queue.class(class);
        self.give_slot(scope, class);
        self.dispatch(1, wakes);
    }

    /// A parked turn of `class` resumes: it takes a slot, borrowing one if none is free (or
    /// its class is at its cap; the borrow is repaid by not refilling the next release).
    /// Never waits.
    pub fn resume(&mut self, scope: Option<&str>, class: ClassId) {
        decrement(&mut self.awaiting_human, "awaiting_human");
        let key = scope.map(|name| self.queue.scope_key(name));
        let class = self.queue.class(class);
        self.queue.take_slot(key.as_deref(), class);
        self.count_slot();
    }

    /// Counts `turns` let through uncounted while the gate had nothing to enforce (see
    /// [`PassThroughTurns`]) as holding slots (of the default class), so a ceiling set since
    /// holds: they are not admitted by the gate, and each returns its slot with
    /// [`GateState::release`].
    pub fn adopt(&mut self, turns: u64) {
        self.in_flight = self.in_flight.saturating_add(turns);
        self.peak_in_flight = self.peak_in_flight.max(self.in_flight);
        self.queue.adopt(turns);
    }

    /// Whether memory pressure holds back a waiter that a free slot could start: then only a
    /// fresh sample (or a reconfigure) that finds the pressure eased can start it, since no
    /// release may come.
    pub fn held_back(&self) -> bool {
        self.pressure != Decision::Admit && self.queue.dispatchable() && self.global_slot_free()
    }

    /// The waker of the oldest waiter that registered one, if any: the binding re-samples
    /// memory pressure on that waiter's event loop when no other is at hand. Usually the
    /// queue's head; the walk past waiters that have not registered yet stops after 64, so
    /// the lock is held for O(1).
    pub fn oldest_waker(&self) -> Option<&W> {
        self.queue.iter_all().take(64).find_map(|index| {
            self.queue
                .get(index)
                .and_then(|record| record.waker.as_ref())
        })
    }

    /// A parked turn ends without resuming.
    pub fn end_suspended(&mut self) {
        decrement(&mut self.awaiting_human, "awaiting_human");
    }

    /// Evicts the oldest live waiter of the whole queue; `false` if nobody waits.
    pub fn shed_oldest_waiter(&mut self, wakes: &mut Wakes<W>) -> bool {
        self.queue
            .oldest()
            .is_some_and(|index| self.shed_waiter(index, wakes))
    }

    /// Forgets every turn and counter (the parent's turns after `fork()` are not the
    /// child's). The wakers are handed back to be dropped, never woken.
    pub fn reset(&mut self, wakes: &mut Wakes<W>) {
        wakes.drop.extend(self.queue.reset());
        // The queue's slab is kept, so keys handed out before the reset stay invalid; so is
        // its configuration.
        let queue = std::mem::replace(&mut self.queue, Queue::new(0, 0));
        let deferred = self.deferred;
        // Overload control's learned state is the provider's, not the parent's turns'.
        let overload = self.overload.take();
        let ceiling = self.ceiling;
        *self = Self::new(self.limits);
        self.queue = queue;
        self.deferred = deferred;
        self.overload = overload;
        self.ceiling = ceiling;
    }

    /// A snapshot of the counters. `now` (the caller's clock) is read only when someone
    /// waits, to age the oldest waiter: reading counters costs no clock read.
    pub fn stats(&self, now: impl FnOnce() -> Duration) -> Stats {
        Stats {
            in_flight: self.in_flight,
            queued: self.queue.len(),
            awaiting_human: self.awaiting_human,
            admitted: self.admitted,
            rejected: self.rejected,
            shed: self.shed,
            cancelled: self.cancelled,
            granted_unclaimed: self.granted_unclaimed,
            peak_in_flight: self.peak_in_flight,
            tracked_scopes: self.queue.tracked_scopes(),
            oldest_wait: self
                .queue
                .oldest()
                .and_then(|index| self.queue.get(index))
                .map(|record| now().saturating_sub(record.enqueued_at)),
            limit: u64::from(self.ceiling),
        }
    }

    /// How long turns that queued waited before they were admitted.
    pub fn queue_wait(&self) -> HistogramSnapshot {
        self.queue_wait.snapshot()
    }

    /// Recomputes everything that is derived and panics on the first inconsistency.
    /// Used by the unit and model tests after every step; compiled only for them, as the
    /// core outside tests never panics.
    #[cfg(test)]
    pub fn check_invariants(&self) {
        self.queue.check_invariants(self.in_flight);
        let tally = self.queue.tally_sum();
        assert_eq!(
            (tally.admitted, tally.rejected, tally.shed, tally.cancelled),
            (self.admitted, self.rejected, self.shed, self.cancelled),
            "the classes' counters add up to the totals"
        );
        assert!(self.queue.scoped_in_flight() <= self.in_flight);
        assert!(
            self.unconfirmed <= self.in_flight,
            "unconfirmed turns hold slots"
        );
        assert!(self.deferred || self.unconfirmed == 0);
        assert!(self.peak_in_flight >= self.in_flight);
        if self.pressure == Decision::Admit && self.global_slot_free() {
            assert!(
                !self.queue.dispatchable_at(self.ceiling),
                "an eligible waiter waits while a slot is free"
            );
        }
    }
}

/// The name of a total, for a failed check.
fn outcome_name(outcome: Outcome) -> &'static str {
    match outcome {
        Outcome::Admitted => "admitted",
        Outcome::Rejected => "rejected",
        Outcome::Shed => "shed",
        Outcome::Cancelled => "cancelled",
    }
}

/// Who arrives: a turn's tenant, class and deadline (see [`GateState::arrive_as`]).
#[derive(Clone, Copy, Debug)]
pub struct Entrant<'a> {
    /// Its tenant (`session_id` scope), if any.
    pub scope: Option<&'a str>,
    /// Its priority class ([`ClassId::DEFAULT`]: the gate's default).
    pub class: ClassId,
    /// When its caller gives up, on the caller's clock.
    pub deadline: Option<Duration>,
}

/// A [`GateState`] behind one lock. Every method returns the [`Wakes`] to run once the
/// lock is released (they are collected under it).
#[derive(Debug)]
pub struct Gate<W> {
    state: Mutex<GateState<W>>,
    /// The queue's length after the last operation (see [`Gate::has_waiters`]).
    queued_hint: AtomicU64,
    /// [`GateState::held_back`] after the last operation (see [`Gate::held_back`]).
    held_back_hint: AtomicBool,
    /// Turns let through while the gate had nothing to enforce, until it adopts them.
    passthrough: PassThroughTurns,
    /// Overload control is on (set once, never cleared): read on every turn without the lock.
    timed: AtomicBool,
}

impl<W> Gate<W> {
    /// A gate enforcing `limits`.
    pub fn new(limits: ConcurrencyLimit) -> Self {
        Self {
            state: Mutex::new(GateState::new(limits)),
            queued_hint: AtomicU64::new(0),
            held_back_hint: AtomicBool::new(false),
            passthrough: PassThroughTurns::default(),
            timed: AtomicBool::new(false),
        }
    }

    /// Runs `f` on the locked state; the returned wakes are run by the caller after unlock.
    pub fn with<R>(&self, f: impl FnOnce(&mut GateState<W>, &mut Wakes<W>) -> R) -> (R, Wakes<W>) {
        let mut wakes = Wakes::default();
        let mut state = self.state.lock();
        let result = f(&mut state, &mut wakes);
        self.queued_hint.store(state.queue.len(), Ordering::Relaxed);
        self.held_back_hint
            .store(state.held_back(), Ordering::Relaxed);
        (result, wakes)
    }

    /// Counts the turns let through uncounted so far as holding slots (under the lock).
    fn adopt_passthrough(&self, state: &mut GateState<W>) {
        if self.passthrough.any() {
            state.adopt(self.passthrough.adopt());
        }
    }

    /// Lets a turn through without the lock, for a gate with nothing to enforce; the turn
    /// still counts against a ceiling set while it runs (see [`PassThroughTurns`]). End it
    /// with [`Gate::end_pass_through`].
    pub fn pass_through(&self) -> PassTicket {
        self.passthrough.enter()
    }

    /// A turn let through ends; if the gate adopted it, its slot is returned (and handed
    /// on), with `resource` as for [`GateState::release`].
    pub fn end_pass_through(&self, ticket: PassTicket, resource: Option<Decision>) -> Wakes<W> {
        match self.passthrough.leave(ticket) {
            PassEnd::Uncounted => Wakes::default(),
            PassEnd::Adopted => {
                self.with(|state, wakes| state.release(None, resource, wakes))
                    .1
            }
        }
    }

    /// Whether memory pressure held back a waiter a free slot could start, after the last
    /// operation, without taking the lock. A hint: the binding then re-samples the pressure
    /// on a timer, and anything that races with it re-reads under the lock.
    pub fn held_back(&self) -> bool {
        self.held_back_hint.load(Ordering::Relaxed)
    }

    /// See [`GateState::facts`].
    pub fn facts(&self, scope: Option<&str>) -> Facts {
        self.state.lock().facts(scope)
    }

    /// See [`GateState::expire`].
    pub fn expire(&self, key: WaiterKey) -> (bool, Wakes<W>) {
        self.with(|state, wakes| state.expire(key, wakes))
    }

    /// See [`GateState::close`]. Turns let through are adopted first, so a drain waits for
    /// them as for any running turn.
    pub fn close(&self) -> (u64, Wakes<W>) {
        self.with(|state, wakes| {
            self.adopt_passthrough(state);
            state.close(wakes)
        })
    }

    /// See [`GateState::reconfigure`]. Turns let through while the gate had nothing to
    /// enforce are adopted first, so a ceiling set now counts them.
    pub fn reconfigure(
        &self,
        limits: ConcurrencyLimit,
        resource: Option<Decision>,
    ) -> (u64, Wakes<W>) {
        self.with(|state, wakes| {
            self.adopt_passthrough(state);
            state.reconfigure(limits, resource, wakes)
        })
    }

    /// See [`GateState::running`] and [`GateState::unconfirmed`], read together.
    pub fn running_and_unconfirmed(&self) -> (u64, u64) {
        let state = self.state.lock();
        (state.running(), state.unconfirmed())
    }

    /// See [`GateState::running`] and [`GateState::is_closing`].
    pub fn running(&self) -> (u64, bool) {
        let state = self.state.lock();
        (state.running(), state.is_closing())
    }

    /// See [`GateState::position`] and [`GateState::estimate_wait`].
    pub fn place_in_line(
        &self,
        key: WaiterKey,
        now: impl FnOnce() -> Duration,
    ) -> Option<(u64, Option<Duration>)> {
        let mut state = self.state.lock();
        let position = state.position(key)?;
        let estimate = state.estimate_wait(position, now());
        Some((position, estimate))
    }

    /// See [`GateState::scope_stats`].
    pub fn scope_stats(&self) -> Vec<(Arc<str>, u64, u64)> {
        self.state.lock().scope_stats()
    }

    /// The limits in force.
    pub fn limits(&self) -> ConcurrencyLimit {
        *self.state.lock().limits()
    }

    /// See [`GateState::note_pressure`].
    pub fn note_pressure(&self, resource: Decision) -> Wakes<W> {
        self.with(|state, wakes| state.note_pressure(resource, wakes))
            .1
    }

    /// See [`GateState::arrive`].
    pub fn arrive(
        &self,
        scope: Option<&str>,
        decided: Option<Decision>,
        resource: Decision,
        now: impl FnOnce() -> Duration,
    ) -> (Arrival, Wakes<W>) {
        self.with(|state, wakes| {
            // Turns let through before the gate enforced anything (a custom policy's
            // `enabled` can turn it on with no reconfigure) count before this one decides.
            self.adopt_passthrough(state);
            state.arrive(scope, decided, resource, now, wakes)
        })
    }

    /// Whether anyone waited when the gate was last changed, without taking the lock. A
    /// hint: callers use it to skip work (reading memory pressure for a release) that only
    /// matters to waiters, and anything that races with it re-reads under the lock.
    pub fn has_waiters(&self) -> bool {
        self.queued_hint.load(Ordering::Relaxed) > 0
    }

    /// See [`GateState::arrive_as`].
    pub fn arrive_as(
        &self,
        turn: Entrant<'_>,
        decided: Option<Decision>,
        resource: Decision,
        now: impl FnOnce() -> Duration,
    ) -> (Arrival, Wakes<W>) {
        self.with(|state, wakes| {
            self.adopt_passthrough(state);
            state.arrive_as(turn, decided, resource, now, wakes)
        })
    }

    /// See [`GateState::arrive_by`].
    pub fn arrive_by(
        &self,
        scope: Option<&str>,
        decided: Option<Decision>,
        resource: Decision,
        deadline: Option<Duration>,
        now: impl FnOnce() -> Duration,
    ) -> (Arrival, Wakes<W>) {
        self.with(|state, wakes| {
            self.adopt_passthrough(state);
            state.arrive_by(scope, decided, resource, deadline, now, wakes)
        })
    }

    /// See [`GateState::enable_overload`].
    pub fn enable_overload(
        &self,
        controller: Option<Box<dyn crate::overload::LimitController>>,
        discipline: crate::overload::Discipline,
    ) {
        self.state.lock().enable_overload(controller, discipline);
        self.timed.store(true, Ordering::Release);
    }

    /// See [`GateState::times_turns`]; without the lock (a turn that reads `false` while
    /// another thread turns timing on is simply not timed).
    pub fn times_turns(&self) -> bool {
        self.timed.load(Ordering::Acquire)
    }

    /// See [`GateState::turn_started`].
    pub fn turn_started(&self, now: Duration) -> (u64, Wakes<W>) {
        self.with(|state, wakes| state.turn_started(now, wakes))
    }

    /// See [`GateState::deadline_timer`].
    pub fn deadline_timer(&self, deadline: Duration) -> Duration {
        self.state.lock().deadline_timer(deadline)
    }

    /// See [`GateState::expire_for`].
    pub fn expire_for(&self, key: WaiterKey, reason: Rejection) -> (bool, Wakes<W>) {
        self.with(|state, wakes| state.expire_for(key, reason, wakes))
    }

    /// See [`GateState::next_check`].
    pub fn next_check(
        &self,
        key: WaiterKey,
        deadline: Option<Duration>,
    ) -> Option<(Duration, Rejection)> {
        self.state.lock().next_check(key, deadline)
    }

    /// See [`GateState::recheck`].
    pub fn recheck(
        &self,
        key: WaiterKey,
        deadline: Option<Duration>,
        now: Duration,
    ) -> (bool, Wakes<W>) {
        self.with(|state, wakes| state.recheck(key, deadline, now, wakes))
    }

    /// See [`GateState::register`].
    pub fn register(&self, key: WaiterKey, waker: W) -> (Registered, Option<W>) {
        self.state.lock().register(key, waker)
    }

    /// See [`GateState::claim`].
    pub fn claim(&self, key: WaiterKey, now: impl FnOnce() -> Duration) -> (Claim, Wakes<W>) {
        self.with(|state, wakes| state.claim(key, now, wakes))
    }

    /// See [`GateState::queue_wait`].
    pub fn queue_wait(&self) -> HistogramSnapshot {
        self.state.lock().queue_wait()
    }

    /// See [`GateState::cancel`].
    pub fn cancel(&self, key: WaiterKey) -> (Cancelled, Wakes<W>) {
        self.with(|state, wakes| state.cancel(key, wakes))
    }

    /// See [`GateState::defer_admission`].
    pub fn defer_admission(&self) {
        self.state.lock().defer_admission();
    }

    /// See [`GateState::confirm_in`].
    pub fn confirm_in(&self, class: ClassId) {
        self.state.lock().confirm_in(class);
    }

    /// [`Gate::confirm_in`] the default class.
    pub fn confirm(&self) {
        self.confirm_in(ClassId::DEFAULT);
    }

    /// See [`GateState::revoke_in`].
    pub fn revoke_in(
        &self,
        scope: Option<&str>,
        class: ClassId,
        reason: Option<Rejection>,
        now: impl FnOnce() -> Duration,
    ) -> (Option<Duration>, Wakes<W>) {
        self.with(|state, wakes| state.revoke_in(scope, class, reason, now, wakes))
    }

    /// [`Gate::revoke_in`] the default class.
    pub fn revoke(
        &self,
        scope: Option<&str>,
        reason: Option<Rejection>,
        now: impl FnOnce() -> Duration,
    ) -> (Option<Duration>, Wakes<W>) {
        self.revoke_in(scope, ClassId::DEFAULT, reason, now)
    }

    /// See [`GateState::set_order`].
    pub fn set_order(&self, order: Order) -> Result<Wakes<W>, PriorityError> {
        let (result, wakes) = self.with(|state, wakes| state.set_order(order, wakes));
        result.map(|()| wakes)
    }

    /// The queue's order in force (a copy).
    pub fn order(&self) -> Order {
        self.state.lock().order().clone()
    }

    /// See [`GateState::class_stats`].
    pub fn class_stats(&self) -> Vec<ClassStats> {
        self.state.lock().class_stats()
    }

    /// [`Gate::stats`] and [`Gate::class_stats`] read together, so they add up.
    pub fn stats_and_classes(&self, now: impl FnOnce() -> Duration) -> (Stats, Vec<ClassStats>) {
        let state = self.state.lock();
        (state.stats(now), state.class_stats())
    }

    /// See [`GateState::shed_oldest_waiter`].
    pub fn shed_oldest_waiter(&self) -> (bool, Wakes<W>) {
        self.with(|state, wakes| state.shed_oldest_waiter(wakes))
    }

    /// See [`GateState::reset`]; turns let through are forgotten too, and their tickets must
    /// not be ended afterwards (they belong to the parent of a fork: the binding checks its
    /// epoch first).
    pub fn reset(&self) -> Wakes<W> {
        self.with(|state, wakes| {
            self.passthrough.reset();
            state.reset(wakes)
        })
        .1
    }

    /// See [`GateState::stats`].
    pub fn stats(&self, now: impl FnOnce() -> Duration) -> Stats {
        self.state.lock().stats(now)
    }

    /// See [`GateState::check_invariants`].
    #[cfg(test)]
    pub fn check_invariants(&self) {
        self.state.lock().check_invariants()
    }
}

#[derive(Debug)]
struct SlotState {
    /// Human waits entered and not yet left (parallel approval branches nest).
    waits: u32,
    /// Whether the turn holds its run slot.
    held: bool,
    /// Whether the turn has ended.
    closed: bool,
}

/// The run slot of one admitted turn: lent back while the turn waits on a person, returned
/// exactly once when the turn ends.
///
/// Lock order: a slot's lock, then the gate's. Neither is held while waking anyone.
#[derive(Debug)]
#[must_use = "a slot is held until `close` is called"]
pub struct TurnSlot {
    scope: Option<Arc<str>>,
    class: ClassId,
    state: Mutex<SlotState>,
}

impl TurnSlot {
    /// The slot of a turn just admitted into `scope`, in the default class.
    pub fn new(scope: Option<Arc<str>>) -> Self {
        Self::in_class(scope, ClassId::DEFAULT)
    }

    /// The slot of a turn just admitted into `scope` and class `class`.
    pub fn in_class(scope: Option<Arc<str>>, class: ClassId) -> Self {
        Self {
            scope,
            class,
            state: Mutex::new(SlotState {
                waits: 0,
                held: true,
                closed: false,
            }),
        }
    }

    /// The scope the slot counts against.
    pub fn scope(&self) -> Option<&str> {
        self.scope.as_deref()
    }

    /// The class the slot counts against.
    pub fn class(&self) -> ClassId {
        self.class
    }

    /// Enters a human wait; the first of nested waits lends the slot to the queue.
    pub fn suspend<W>(&self, gate: &Gate<W>) -> Wakes<W> {
        let mut slot = self.state.lock();
        // Saturating as the counters in `count` do: 2^32 nested waits on one turn cannot be.
        slot.waits = slot.waits.saturating_add(1);
        if slot.waits == 1 && slot.held && !slot.closed {
            slot.held = false;
            return gate
                .with(|state, wakes| state.suspend(self.scope(), self.class, wakes))
                .1;
        }
        Wakes::default()
    }

    /// Leaves a human wait; takes the slot back (borrowing if none is free), never waits.
    pub fn resume<W>(&self, gate: &Gate<W>) {
        let mut slot = self.state.lock();
        slot.waits = slot.waits.saturating_sub(1);
        if slot.held || slot.closed {
            return;
        }
        slot.held = true;
        let ((), wakes) = gate.with(|state, _| state.resume(self.scope(), self.class));
        debug_assert!(wakes.is_empty(), "taking a slot wakes nobody");
        drop(wakes);
    }

    /// Ends the turn: returns the slot if held, else stops counting the human wait.
    /// Idempotent; `resource` updates the remembered memory pressure.
    pub fn close<W>(&self, gate: &Gate<W>, resource: Option<Decision>) -> Wakes<W> {
        let mut slot = self.state.lock();
        if slot.closed {
            return Wakes::default();
        }
        slot.closed = true;
        if slot.held {
            slot.held = false;
            gate.with(|state, wakes| state.release_in(self.scope(), self.class, resource, wakes))
                .1
        } else {
            gate.with(|state, _| state.end_suspended()).1
        }
    }

    /// [`TurnSlot::close`] for a turn of a gate that [times turns](GateState::times_turns):
    /// `end` says how it went, which moves the ceiling before the slot is handed on. A slot
    /// lent to a human wait at the end reports nothing (its end says nothing of the
    /// provider's capacity).
    pub fn finish<W>(&self, gate: &Gate<W>, resource: Option<Decision>, end: TurnEnd) -> Wakes<W> {
        let mut slot = self.state.lock();
        if slot.closed {
            return Wakes::default();
        }
        slot.closed = true;
        if slot.held {
            slot.held = false;
            gate.with(|state, wakes| {
                state.finish_in(self.scope(), self.class, resource, end, wakes)
            })
            .1
        } else {
            gate.with(|state, _| state.end_suspended()).1
        }
    }

    /// Whether the turn holds its slot (not lent to a human wait, not ended).
    pub fn is_held(&self) -> bool {
        self.state.lock().held
    }
}

#[cfg(all(test, not(admitgate_loom)))]
mod tests;

#[cfg(all(test, admitgate_loom))]
mod loom_tests;
