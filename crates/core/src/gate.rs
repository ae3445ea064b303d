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
//! below the per-scope limit. Freed slots go to the oldest *eligible* waiter: the `ready`
//! index holds, for each lane (one per scope, one for unscoped turns) that is below its
//! limit and not empty, the arrival number of its head, so the next waiter to run is the
//! first entry of that index. A tenant at its sub-limit is skipped, not dropped, and a
//! newcomer never overtakes an eligible waiter. Under a discipline that serves newest first
//! (the adaptive queue), `ready_newest` files each eligible lane by its *newest* waiter
//! instead, so the newest eligible waiter is its last entry: found in O(log lanes), where
//! walking back from the newest waiter passed every waiter of every tenant at its limit.
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

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::count::{decrement, difference, increment};
use super::histogram::{Histogram, HistogramSnapshot};
use super::passthrough::{PassEnd, PassThroughTurns, PassTicket};
use super::policy::{ConcurrencyLimit, Decision, Facts, Overflow};
use super::retry::{ReleaseRate, MEMORY_PRESSURE_RETRY};
use super::sync::Mutex;
use super::waiters::{Lane, WaitQueue, WaiterKey, WaiterState};
use crate::overload::QueueMode;

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

/// Why a turn was refused. One table maps each reason to its HTTP and gRPC status
/// (`admitgate.REJECTION_REASONS` in Python, and the README).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rejection {
    /// The queue it would join was full and the overflow policy rejects (or `shed_oldest`
    /// found nobody to evict).
    QueueFull,
    /// Evicted from the queue by a newer turn under `shed_oldest` (counted in `shed`).
    Shed,
    /// A user-supplied policy said reject.
    Policy,
    /// Resident memory is at or above the hard threshold.
    MemoryPressure,
    /// The gate is closing (drained).
    Closing,
    /// It waited longer than the queue timeout.
    Timeout,
    /// The fleet-wide limit's backend is unreachable and the gate refuses rather than admit
    /// against its local ceiling alone.
    FleetUnavailable,
    /// Its caller's deadline passed while it waited, or less of it was left than a turn
    /// typically takes: its caller would have left before it finished.
    Deadline,
}

impl Rejection {
    /// Every reason, in the order per-reason counters are kept.
    pub const ALL: [Rejection; 8] = [
        Rejection::QueueFull,
        Rejection::Shed,
        Rejection::Policy,
        Rejection::MemoryPressure,
        Rejection::Closing,
        Rejection::Timeout,
        Rejection::FleetUnavailable,
        Rejection::Deadline,
    ];

    /// A stable name for logs, metrics and `AdmissionRejected.reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            Rejection::QueueFull => "queue_full",
            Rejection::Shed => "shed",
            Rejection::Policy => "policy",
            Rejection::MemoryPressure => "memory_pressure",
            Rejection::Closing => "closing",
            Rejection::Timeout => "timeout",
            Rejection::FleetUnavailable => "fleet_unavailable",
            Rejection::Deadline => "deadline",
        }
    }

    /// This reason's position in [`Rejection::ALL`].
    pub fn index(self) -> usize {
        self as usize
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

#[derive(Debug, Default)]
struct ScopeState {
    in_flight: u64,
    lane: Lane,
    /// Waiters of this lane queued by soft memory pressure alone (outside `queue_depth`).
    outside_depth: u64,
    /// This lane's key in `ready`, if it is there.
    ready: Option<u64>,
    /// This lane's key in `ready_newest`, if it is there.
    newest: Option<u64>,
}

impl ScopeState {
    /// Whether the lane may take another slot under `limits` (`scoped`: a tenant's lane).
    fn below_limit(&self, limits: &ConcurrencyLimit, scoped: bool) -> bool {
        !scoped || limits.max_per_scope == 0 || self.in_flight < u64::from(limits.max_per_scope)
    }
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

/// [`GateState::unlink_waiter`] found no waiting record to unlink, and changed nothing.
struct NotWaiting;

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
    /// Waiters queued by soft memory pressure alone, outside `queue_depth` (see `arrive`).
    outside_depth: u64,
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
    /// Keyed with foldhash: several lookups per scoped turn make SipHash a third of its
    /// cost; foldhash is seeded per process, so tenants cannot choose colliding ids.
    scopes: HashMap<Arc<str>, ScopeState, foldhash::fast::RandomState>,
    unscoped: ScopeState,
    queue: WaitQueue<W>,
    /// Arrival number of each eligible lane's head -> that waiter's record.
    ready: BTreeMap<u64, u32>,
    /// Arrival number of each eligible lane's newest waiter -> its record, kept only under
    /// a discipline that serves newest first (`tracks_newest`): its last entry is the
    /// newest waiter that may take a slot, found in O(log lanes) instead of by walking
    /// back past every waiter of a tenant at its limit.
    ready_newest: BTreeMap<u64, u32>,
    /// Whether `ready_newest` is kept.
    tracks_newest: bool,
}

/// Files a lane under `wanted` (arrival number, record) in `index`, where `filed` says it
/// is now, if that changed.
fn refile(index: &mut BTreeMap<u64, u32>, filed: &mut Option<u64>, wanted: Option<(u64, u32)>) {
    if *filed != wanted.map(|(seq, _)| seq) {
        if let Some(seq) = *filed {
            index.remove(&seq);
        }
        if let Some((seq, record)) = wanted {
            index.insert(seq, record);
        }
        *filed = wanted.map(|(seq, _)| seq);
    }
}

/// The state of `scope`'s lane; `None` for a scope that is not tracked (a scope's state
/// exists while any turn of it runs or waits, so callers that name one always find it).
fn lane_state<'a>(
    scopes: &'a mut HashMap<Arc<str>, ScopeState, foldhash::fast::RandomState>,
    unscoped: &'a mut ScopeState,
    scope: Option<&str>,
) -> Option<&'a mut ScopeState> {
    let state = match scope {
        None => Some(unscoped),
        Some(name) => scopes.get_mut(name),
    };
    debug_assert!(state.is_some(), "no state for scope {scope:?}");
    state
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
            outside_depth: 0,
            closing: false,
            deferred: false,
            unconfirmed: 0,
            slots_freed: 0,
            release_rate: ReleaseRate::default(),
            queue_wait: Histogram::default(),
            scopes: HashMap::default(),
            unscoped: ScopeState::default(),
            queue: WaitQueue::default(),
            ready: BTreeMap::new(),
            ready_newest: BTreeMap::new(),
            tracks_newest: false,
        }
    }

    /// The limits this gate enforces.
    pub fn limits(&self) -> &ConcurrencyLimit {
        &self.limits
    }

    /// Whether the scope limit applies to `scope`.
    fn tracked<'s>(&self, scope: Option<&'s str>) -> Option<&'s str> {
        scope.filter(|s| !s.is_empty() && self.limits.max_per_scope > 0)
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

    /// Takes a waiting record off its lists, settling it as `state`, and returns its scope.
    /// The caller refreshes the lane (after counting any slot, so the scope is not forgotten
    /// in between). Changes nothing when `index` holds no waiting record or its lane's state
    /// is missing (neither happens while the invariants hold).
    fn unlink_waiter(
        &mut self,
        index: u32,
        state: WaiterState,
    ) -> Result<Option<Arc<str>>, NotWaiting> {
        let scope = self.queue.get(index).ok_or(NotWaiting)?.scope.clone();
        let lane =
            lane_state(&mut self.scopes, &mut self.unscoped, scope.as_deref()).ok_or(NotWaiting)?;
        let record = self
            .queue
            .unlink(index, &mut lane.lane, state)
            .ok_or(NotWaiting)?;
        if std::mem::take(&mut record.outside_depth) {
            decrement(&mut lane.outside_depth, "a lane's outside-depth waiters");
            decrement(&mut self.outside_depth, "outside-depth waiters");
        }
        Ok(scope)
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

    /// The scope's key, creating its state if needed.
    fn scope_entry(&mut self, name: &str) -> Arc<str> {
        if let Some((key, _)) = self.scopes.get_key_value(name) {
            return key.clone();
        }
        let key: Arc<str> = Arc::from(name);
        self.scopes.insert(key.clone(), ScopeState::default());
        key
    }

    /// Puts a lane's head in `ready` if the lane is eligible, takes it out otherwise, and
    /// forgets the scope once nothing of it runs or waits.
    fn refresh_lane(&mut self, scope: Option<&str>) {
        let scoped = scope.is_some();
        let state = match scope {
            None => &mut self.unscoped,
            Some(name) => match self.scopes.get_mut(name) {
                Some(state) => state,
                None => return,
            },
        };
        let eligible = state.below_limit(&self.limits, scoped);
        let filed = |index: Option<u32>| {
            index
                .filter(|_| eligible)
                .and_then(|index| Some((self.queue.get(index)?.seq, index)))
        };
        let wanted = filed(self.queue.lane_head(&state.lane));
        refile(&mut self.ready, &mut state.ready, wanted);
        if self.tracks_newest {
            let newest = filed(self.queue.lane_tail(&state.lane));
            refile(&mut self.ready_newest, &mut state.newest, newest);
        }
        if let Some(name) = scope {
            if state.in_flight == 0 && state.lane.is_empty() {
                debug_assert!(state.ready.is_none() && state.newest.is_none());
                self.scopes.remove(name);
            }
        }
    }

    /// Refiles every lane (what makes a lane eligible, or which indexes are kept, changed).
    fn refresh_all_lanes(&mut self) {
        let scopes: Vec<Arc<str>> = self.scopes.keys().cloned().collect();
        for scope in scopes {
            self.refresh_lane(Some(&scope));
        }
        self.refresh_lane(None);
    }

    /// Counts a slot taken by a turn of `scope` (whose state must exist).
    fn take_slot(&mut self, scope: Option<&str>) {
        increment(&mut self.in_flight);
        self.peak_in_flight = self.peak_in_flight.max(self.in_flight);
        if scope.is_some() {
            if let Some(state) = lane_state(&mut self.scopes, &mut self.unscoped, scope) {
                increment(&mut state.in_flight);
            }
            self.refresh_lane(scope);
        }
    }

    fn give_slot(&mut self, scope: Option<&str>) {
        decrement(&mut self.in_flight, "in_flight (a slot returned twice)");
        if let Some(name) = scope {
            if let Some(state) = self.scopes.get_mut(name) {
                decrement(&mut state.in_flight, "a scope's in_flight (returned twice)");
            }
            self.refresh_lane(scope);
        }
    }

    /// Hands free slots to the oldest eligible waiters. Under memory pressure only `freed`
    /// slots are handed on (plus one when nothing runs), so concurrency does not grow.
    fn dispatch(&mut self, freed: u32, wakes: &mut Wakes<W>) {
        let mut budget = freed;
        // Overload control may refuse waiters that waited too long, and serve the newest
        // first, while a queue stands (`QueueMode::Fifo` without it).
        let newest_first = self.overload.is_some()
            && !self.ready.is_empty()
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
            let Some((&seq, &oldest)) = self.ready.first_key_value() else {
                break;
            };
            let index = if newest_first {
                self.newest_eligible().unwrap_or(oldest)
            } else {
                oldest
            };
            if self.waiter_misses_deadline(index)
                && self.refuse_waiter(index, Rejection::Deadline, wakes)
            {
                // Its deadline no longer fits the expected turn: the slot goes on.
                continue;
            }
            if !self.grant(index, wakes) {
                // A stale entry (never while the invariants hold): dropping it keeps the loop
                // finite, and the lane's next refresh files its head again.
                self.ready.remove(&seq);
            }
        }
    }

    /// Hands a slot to the waiter at `index`; `false`, changing nothing, if none waits there.
    fn grant(&mut self, index: u32, wakes: &mut Wakes<W>) -> bool {
        let enqueued_at = self.queue.get(index).map(|record| record.enqueued_at);
        let Ok(scope) = self.unlink_waiter(index, WaiterState::Granted) else {
            return false;
        };
        if let Some(enqueued_at) = enqueued_at {
            self.on_dequeue(enqueued_at);
        }
        increment(&mut self.granted_unclaimed);
        if self.deferred {
            increment(&mut self.unconfirmed);
        }
        // Count the slot before refreshing, so the scope is not forgotten in between.
        self.take_slot(scope.as_deref());
        self.refresh_lane(scope.as_deref());
        self.wake(index, wakes);
        true
    }

    /// Hands the waker of the record at `index`, if it registered one, to `wakes`.
    fn wake(&mut self, index: u32, wakes: &mut Wakes<W>) {
        if let Some(waker) = self.queue.get_mut(index).and_then(|r| r.waker.take()) {
            wakes.wake.push(waker);
        }
    }

    /// Evicts the oldest waiter of `scope`'s lane (or of the whole queue when `None`). For
    /// an overflowing newcomer (`in_depth_only`), only a waiter that counts against the depth:
    /// a turn held back only by soft memory pressure is not part of the queue it overflows
    /// (there are at most as many of those to skip as free slots).
    fn evict_oldest(
        &mut self,
        scope: Option<&str>,
        in_depth_only: bool,
        wakes: &mut Wakes<W>,
    ) -> bool {
        let in_depth = |&index: &u32| {
            !in_depth_only || self.queue.get(index).is_some_and(|r| !r.outside_depth)
        };
        let victim = match scope {
            None => self.queue.iter_all().find(in_depth),
            Some(name) => self
                .scopes
                .get(name)
                .and_then(|state| self.queue.iter_lane(&state.lane).find(in_depth)),
        };
        let Some(index) = victim else {
            return false;
        };
        let Ok(victim_scope) = self.unlink_waiter(index, WaiterState::Refused(Rejection::Shed))
        else {
            return false;
        };
        self.refresh_lane(victim_scope.as_deref());
        // Counted as shed now; moved to `cancelled` if its owner is cancelled before it
        // sees the eviction (see `cancel`), so the counters say what callers experienced.
        increment(&mut self.shed);
        self.wake(index, wakes);
        true
    }

    /// The facts a concurrency policy decides from, for a turn of `scope`.
    pub fn facts(&self, scope: Option<&str>) -> Facts {
        let scope_state = self.tracked(scope).and_then(|name| self.scopes.get(name));
        // Waiters held back only by soft memory pressure would be running without it: the
        // depth, and any policy, see the queue without them.
        Facts {
            in_flight: self.in_flight,
            queued: difference(
                self.queue.len(),
                self.outside_depth,
                "outside-depth waiters",
            ),
            scope_in_flight: scope_state.map_or(0, |s| s.in_flight),
            scope_queued: scope_state.map_or(0, |s| {
                difference(
                    s.lane.len(),
                    s.outside_depth,
                    "a lane's outside-depth waiters",
                )
            }),
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

    /// [`GateState::arrive`] for a turn whose caller waits until `deadline` (on the same
    /// clock as `now`) at most. A turn that would run at once always does; one that would
    /// queue is refused with [`Rejection::Deadline`] when its deadline has passed or less
    /// of it is left than the expected service time (its caller would leave before it
    /// finished, so no slot should go to it). While it waits, the caller refuses it at
    /// [`GateState::deadline_timer`] with [`GateState::expire_for`].
    pub fn arrive_by(
        &mut self,
        scope: Option<&str>,
        decided: Option<Decision>,
        resource: Decision,
        deadline: Option<Duration>,
        now: impl FnOnce() -> Duration,
        wakes: &mut Wakes<W>,
    ) -> Arrival {
        let mut clock = LazyClock {
            read: Some(now),
            value: None,
        };
        let scope = self.tracked(scope);
        if self.closing {
            increment(&mut self.rejected);
            return Arrival::Rejected(Rejection::Closing, None);
        }
        self.pressure = self.effective_pressure(resource);
        if self.pressure == Decision::Admit {
            // Pressure may just have eased: waiters take the free slots before the newcomer.
            self.dispatch(0, wakes);
        }
        let facts = self.facts(scope);
        let ceiling = ConcurrencyLimit {
            max_concurrent_runs: self.ceiling,
            ..self.limits
        };
        let concurrency = decided.unwrap_or_else(|| ceiling.decide(&facts, scope.is_some()));
        let decision = concurrency.escalate(self.pressure);
        if decision == Decision::Reject {
            let refusal = if concurrency != Decision::Reject {
                Arrival::Rejected(Rejection::MemoryPressure, Some(MEMORY_PRESSURE_RETRY))
            } else if decided.is_some() {
                Arrival::Rejected(Rejection::Policy, None)
            } else {
                let ahead = if self.limits.scope_blocked(scope.is_some(), &facts) {
                    facts.scope_queued
                } else {
                    facts.queued
                };
                Arrival::Rejected(
                    Rejection::QueueFull,
                    Some(self.retry_hint(ahead, clock.read())),
                )
            };
            // Counted after the caller's clock is read: should that panic, nothing is.
            increment(&mut self.rejected);
            return refusal;
        }

        let scope_blocked = self.limits.scope_blocked(scope.is_some(), &facts);
        // Waiters granted a slot but not yet running start first, so a newcomer queues
        // behind them (it is granted at once below if a slot is free): bodies start in
        // arrival order on a loop, which keeps one tenant's turns in order.
        let runs_now = self.global_slot_free()
            && !scope_blocked
            && self.ready.is_empty()
            && self.granted_unclaimed == 0
            && (self.pressure == Decision::Admit || self.in_flight == 0);
        if runs_now {
            let key = scope.map(|name| self.scope_entry(name));
            self.take_slot(key.as_deref());
            if self.deferred {
                increment(&mut self.unconfirmed);
            } else {
                increment(&mut self.admitted);
            }
            return Arrival::Admitted(key);
        }
        if let Some(deadline) = deadline {
            if self.misses_deadline(deadline, clock.read()) {
                self.refuse_for_deadline();
                return Arrival::Rejected(Rejection::Deadline, None);
            }
        }

        // Soft memory pressure holds back a turn that would run at once without it: it waits
        // outside the depth, and never more of them than there are free slots, so pressure
        // alone refuses nobody. Every other turn meets the queue as it would without pressure.
        let outside_depth = self.pressure == Decision::Queue
            && concurrency == Decision::Admit
            && !scope_blocked
            && self.outside_depth < self.free_slots();
        if decision == Decision::Queue && !outside_depth {
            // The queue this turn joins: its tenant's own when the tenant is at its limit.
            let (joined, waiting) = if scope_blocked {
                (scope, facts.scope_queued)
            } else {
                (None, facts.queued)
            };
            if waiting >= u64::from(self.limits.queue_depth) {
                let evicts = self.limits.overflow == Overflow::ShedOldest;
                // A policy that said QUEUE at a full queue chose to wait beyond the depth;
                // a turn queued by memory pressure meets the overflow policy instead.
                let refuses =
                    concurrency == Decision::Admit && self.limits.overflow == Overflow::Reject;
                if (evicts && !self.evict_oldest(joined, true, wakes)) || refuses {
                    let retry = self.retry_hint(waiting, clock.read());
                    increment(&mut self.rejected);
                    return Arrival::Rejected(Rejection::QueueFull, Some(retry));
                }
            }
        }

        let now = clock.read();
        self.release_rate.observe(now, self.slots_freed);
        self.on_enqueue(now);
        let key = scope.map(|name| self.scope_entry(name));
        let lane = lane_state(&mut self.scopes, &mut self.unscoped, key.as_deref());
        let waiter = lane.and_then(|lane| {
            let waiter = self
                .queue
                .push(&mut lane.lane, key.clone(), now, outside_depth)?;
            if outside_depth {
                increment(&mut lane.outside_depth);
                increment(&mut self.outside_depth);
            }
            Some(waiter)
        });
        // Files the new waiter, or forgets a scope entered for a turn that could not queue.
        self.refresh_lane(key.as_deref());
        let Some(waiter) = waiter else {
            // The slab is full (2^32 - 1 records): the queue is, whatever its depth says.
            increment(&mut self.rejected);
            let retry = self.retry_hint(self.queue.len(), now);
            return Arrival::Rejected(Rejection::QueueFull, Some(retry));
        };
        self.remember_deadline(waiter, deadline);
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
                    increment(&mut self.admitted);
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
        let outcome = match record.state {
            WaiterState::Waiting => {
                // Marked refused only to take it off the lists; it is freed just below. A
                // record that cannot be unlinked must not be freed (the lists would point at
                // a free slot): it is left alone, as if unknown.
                if self
                    .unlink_waiter(index, WaiterState::Refused(Rejection::Shed))
                    .is_err()
                {
                    return Cancelled::Unknown;
                }
                self.refresh_lane(scope.as_deref());
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
                if reason == Rejection::Shed {
                    decrement(&mut self.shed, "shed");
                } else {
                    decrement(&mut self.rejected, "rejected");
                }
                Cancelled::AlreadyRefused
            }
        };
        increment(&mut self.cancelled);
        wakes.drop.extend(self.queue.free(index));
        if outcome == Cancelled::ReturnedSlot {
            increment(&mut self.slots_freed);
            self.give_slot(scope.as_deref());
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
    /// admitted now.
    pub fn confirm(&mut self) {
        debug_assert!(self.deferred, "confirm without deferred admission");
        decrement(&mut self.unconfirmed, "unconfirmed");
        increment(&mut self.admitted);
    }

    /// A turn granted its slot (deferred admission) will not run: its slot is handed on, and
    /// it counts as rejected for `reason`, or as cancelled when `None` (its caller gave up).
    /// Returns the retry hint for a refusal, as a waiter refused for `reason` would get it.
    pub fn revoke(
        &mut self,
        scope: Option<&str>,
        reason: Option<Rejection>,
        now: impl FnOnce() -> Duration,
        wakes: &mut Wakes<W>,
    ) -> Option<Duration> {
        debug_assert!(self.deferred, "revoke without deferred admission");
        decrement(&mut self.unconfirmed, "unconfirmed");
        match reason {
            Some(_) => increment(&mut self.rejected),
            None => increment(&mut self.cancelled),
        }
        increment(&mut self.slots_freed);
        self.give_slot(scope);
        self.dispatch(1, wakes);
        match reason {
            None | Some(Rejection::Closing | Rejection::Deadline) => None,
            Some(_) => Some(self.retry_hint(self.queue.len(), now())),
        }
    }

    /// Refuses a waiting turn for `reason` (counted in `rejected`) and wakes it; `false` if
    /// it was no longer waiting (granted, refused or withdrawn first: exactly one wins).
    fn refuse_waiter(&mut self, index: u32, reason: Rejection, wakes: &mut Wakes<W>) -> bool {
        let Ok(scope) = self.unlink_waiter(index, WaiterState::Refused(reason)) else {
            return false;
        };
        self.refresh_lane(scope.as_deref());
        increment(&mut self.rejected);
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
    /// lane (each tenant's, and the untenanted one) keeps at most the new depth of waiters
    /// that count against it; the newest past it are refused with [`Rejection::QueueFull`],
    /// except under the `queue` overflow policy, which refuses nobody. Returns how many
    /// waiters were refused.
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
        let mut refused = 0;
        if limits.overflow != Overflow::Queue {
            let depth = u64::from(limits.queue_depth);
            let lanes: Vec<Option<Arc<str>>> = std::iter::once(None)
                .chain(self.scopes.keys().cloned().map(Some))
                .collect();
            for scope in lanes {
                while let Some(state) = match &scope {
                    None => Some(&self.unscoped),
                    Some(name) => self.scopes.get(name),
                } {
                    let in_depth = difference(
                        state.lane.len(),
                        state.outside_depth,
                        "a lane's outside-depth waiters",
                    );
                    if in_depth <= depth {
                        break;
                    }
                    // The newest waiter that counts against the depth.
                    let mut victim = self.queue.lane_tail(&state.lane);
                    while let Some(index) = victim
                        .filter(|&i| self.queue.get(i).is_some_and(|record| record.outside_depth))
                    {
                        victim = self.queue.lane_prev(index);
                    }
                    // Stop if it cannot be refused, or this loop would never end.
                    let Some(index) = victim else { break };
                    if !self.refuse_waiter(index, Rejection::QueueFull, wakes) {
                        break;
                    }
                    increment(&mut refused);
                }
            }
        }
        // Per-scope limits may have changed which lanes are eligible.
        self.refresh_all_lanes();
        self.dispatch(0, wakes);
        refused
    }

    /// How many turns would start before the waiting turn `key` (waiters that arrived
    /// before it, and turns granted a slot that have not started yet); `None` when it is not
    /// waiting. O(log n) in the queue's length (see [`super::rank`]), so `on_queued` keeps
    /// arrivals cheap however long the queue.
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
    /// per-tenant limits are off (turns are then not tracked per tenant).
    pub fn scope_stats(&self) -> Vec<(Arc<str>, u64, u64)> {
        self.scopes
            .iter()
            .map(|(name, state)| (name.clone(), state.in_flight, state.lane.len()))
            .collect()
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

    /// Returns a running turn's slot and hands it on. `resource`, when known, updates the
    /// remembered memory pressure first.
    pub fn release(
        &mut self,
        scope: Option<&str>,
        resource: Option<Decision>,
        wakes: &mut Wakes<W>,
    ) {
        if let Some(resource) = resource {
            self.pressure = self.effective_pressure(resource);
        }
        increment(&mut self.slots_freed);
        self.give_slot(scope);
        self.dispatch(1, wakes);
    }

    /// A running turn parks on a human approval: its slot is lent to the queue.
    pub fn suspend(&mut self, scope: Option<&str>, wakes: &mut Wakes<W>) {
        increment(&mut self.awaiting_human);
        increment(&mut self.slots_freed);
        self.give_slot(scope);
        self.dispatch(1, wakes);
    }

    /// A parked turn resumes: it takes a slot, borrowing one if none is free (the borrow is
    /// repaid by not refilling the next release). Never waits.
    pub fn resume(&mut self, scope: Option<&str>) {
        decrement(&mut self.awaiting_human, "awaiting_human");
        let key = scope.map(|name| self.scope_entry(name));
        self.take_slot(key.as_deref());
    }

    /// Counts `turns` let through uncounted while the gate had nothing to enforce (see
    /// [`PassThroughTurns`]) as holding slots, so a ceiling set since holds: they are not
    /// admitted by the gate, and each returns its slot with [`GateState::release`].
    pub fn adopt(&mut self, turns: u64) {
        self.in_flight = self.in_flight.saturating_add(turns);
        self.peak_in_flight = self.peak_in_flight.max(self.in_flight);
    }

    /// Whether memory pressure holds back a waiter that a free slot could start: then only a
    /// fresh sample (or a reconfigure) that finds the pressure eased can start it, since no
    /// release may come.
    pub fn held_back(&self) -> bool {
        self.pressure != Decision::Admit && !self.ready.is_empty() && self.global_slot_free()
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
        self.evict_oldest(None, false, wakes)
    }

    /// Forgets every turn and counter (the parent's turns after `fork()` are not the
    /// child's). The wakers are handed back to be dropped, never woken.
    pub fn reset(&mut self, wakes: &mut Wakes<W>) {
        wakes.drop.extend(self.queue.clear());
        // The slab is kept, so keys handed out before the reset stay invalid.
        let queue = std::mem::take(&mut self.queue);
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
            tracked_scopes: self.scopes.len() as u64,
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
        let record = |index: u32| {
            self.queue
                .get(index)
                .unwrap_or_else(|| panic!("a list names free record {index}"))
        };
        let mut lanes_len = self.unscoped.lane.len();
        let mut scoped_in_flight = 0;
        let mut outside_total = 0;
        let mut expected_ready = BTreeMap::new();
        let mut expected_newest = BTreeMap::new();
        let lanes = std::iter::once((None, &self.unscoped))
            .chain(self.scopes.iter().map(|(k, v)| (Some(k), v)));
        for (name, state) in lanes {
            if let Some(name) = name {
                lanes_len += state.lane.len();
                scoped_in_flight += state.in_flight;
                assert!(
                    state.in_flight > 0 || !state.lane.is_empty(),
                    "scope {name:?} kept with nothing running or waiting"
                );
            }
            let members: Vec<u32> = self.queue.iter_lane(&state.lane).collect();
            assert_eq!(members.len() as u64, state.lane.len());
            for window in members.windows(2) {
                assert!(record(window[0]).seq < record(window[1]).seq);
            }
            for &index in &members {
                assert_eq!(record(index).scope.as_deref(), name.map(|n| &**n));
                assert_eq!(record(index).state, WaiterState::Waiting);
            }
            let outside = members.iter().filter(|&&i| record(i).outside_depth).count() as u64;
            assert_eq!(
                outside, state.outside_depth,
                "lane {name:?} outside-depth count"
            );
            outside_total += outside;
            let lane_ready = members
                .first()
                .filter(|_| state.below_limit(&self.limits, name.is_some()))
                .map(|&head| (record(head).seq, head));
            assert_eq!(
                state.ready,
                lane_ready.map(|(seq, _)| seq),
                "lane {name:?} misfiled"
            );
            expected_ready.extend(lane_ready);
            let lane_newest = members
                .last()
                .filter(|_| self.tracks_newest && state.below_limit(&self.limits, name.is_some()))
                .map(|&tail| (record(tail).seq, tail));
            assert_eq!(
                state.newest,
                lane_newest.map(|(seq, _)| seq),
                "lane {name:?} misfiled as newest"
            );
            expected_newest.extend(lane_newest);
        }
        assert_eq!(lanes_len, self.queue.len(), "lanes and queue disagree");
        assert_eq!(outside_total, self.outside_depth, "outside-depth count");
        assert_eq!(self.queue.iter_all().count() as u64, self.queue.len());
        for (ahead, index) in self.queue.iter_all().enumerate() {
            assert_eq!(
                self.queue.ahead(index),
                Some(ahead as u64),
                "rank of waiter {index}"
            );
        }
        assert_eq!(self.ready, expected_ready, "ready index is stale");
        assert_eq!(
            self.ready_newest, expected_newest,
            "newest-first index is stale"
        );
        if self.tracks_newest {
            // The index gives what walking back from the newest waiter would find.
            let eligible = |index: &u32| {
                let scope = record(*index).scope.as_deref();
                let state = match scope {
                    None => Some(&self.unscoped),
                    Some(name) => self.scopes.get(name),
                };
                state.is_some_and(|s| s.below_limit(&self.limits, scope.is_some()))
            };
            let walked = self.queue.iter_all().filter(eligible).last();
            let indexed = self.ready_newest.last_key_value().map(|(_, &index)| index);
            assert_eq!(indexed, walked, "newest eligible waiter");
        }
        assert!(scoped_in_flight <= self.in_flight);
        assert!(
            self.unconfirmed <= self.in_flight,
            "unconfirmed turns hold slots"
        );
        assert!(self.deferred || self.unconfirmed == 0);
        assert!(self.peak_in_flight >= self.in_flight);
        if self.pressure == Decision::Admit && self.global_slot_free() {
            assert!(
                self.ready.is_empty(),
                "an eligible waiter waits while a slot is free"
            );
        }
    }
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

    /// See [`GateState::confirm`].
    pub fn confirm(&self) {
        self.state.lock().confirm();
    }

    /// See [`GateState::revoke`].
    pub fn revoke(
        &self,
        scope: Option<&str>,
        reason: Option<Rejection>,
        now: impl FnOnce() -> Duration,
    ) -> (Option<Duration>, Wakes<W>) {
        self.with(|state, wakes| state.revoke(scope, reason, now, wakes))
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
    state: Mutex<SlotState>,
}

impl TurnSlot {
    /// The slot of a turn just admitted into `scope`.
    pub fn new(scope: Option<Arc<str>>) -> Self {
        Self {
            scope,
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

    /// Enters a human wait; the first of nested waits lends the slot to the queue.
    pub fn suspend<W>(&self, gate: &Gate<W>) -> Wakes<W> {
        let mut slot = self.state.lock();
        // Saturating as the counters in `count` do: 2^32 nested waits on one turn cannot be.
        slot.waits = slot.waits.saturating_add(1);
        if slot.waits == 1 && slot.held && !slot.closed {
            slot.held = false;
            return gate
                .with(|state, wakes| state.suspend(self.scope(), wakes))
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
        let ((), wakes) = gate.with(|state, _| state.resume(self.scope()));
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
            gate.with(|state, wakes| state.release(self.scope(), resource, wakes))
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
            gate.with(|state, wakes| state.finish(self.scope(), resource, end, wakes))
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
