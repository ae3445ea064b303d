//! The wait queue and the order it is served in: FIFO, priority classes with shares, and fair
//! queuing across tenants within a class.
//!
//! # Implementation details
//!
//! The gate ([`crate::gate`]) decides *whether* a turn runs, waits or is refused; this module
//! decides *which* waiter a free slot goes to, and which waiter a full queue sheds. The gate
//! consults it under its one lock; nothing here blocks, reads a clock or calls out.
//!
//! **Records and lists.** Waiters live in a slab ([`waiters::WaitQueue`]) threaded on three
//! intrusive lists: all waiters in arrival order (the oldest waiter, a waiter's place in line
//! through [`rank`]), each class's waiters in arrival order (the `shed_oldest` victim), and
//! each *lane*, the waiters of one tenant in one class (FIFO within a tenant). Unlinking is
//! O(1) from each.
//!
//! **Eligibility.** A lane is *eligible* while it has a waiter and its tenant is below the
//! per-tenant limit (a tenant at its limit is skipped, not dropped, and keeps its place).
//! Each class keeps an ordered index of its eligible lanes, `ready`, keyed by
//! `(virtual start tag, arrival number of the lane's head)`, so the next lane of a class is
//! its first entry: O(log tenants).
//!
//! **Within a class.** Without fair queuing every tag is 0 and `ready` orders lanes by their
//! heads' arrival: the oldest eligible waiter first, FIFO exactly as a gate without classes
//! always served. With fair queuing (`fairness="tenant"`, on by default with classes) the
//! tags are virtual times, as in start-time fair queuing (Goyal et al.; Kubernetes API
//! Priority and Fairness's `queueset` keeps the same "virtual time" per queue): a lane's tag
//! is the virtual start of its head, and each turn it starts moves the tag on by one quantum
//! divided by the tenant's weight, while the class's virtual time becomes the tag of the turn
//! just served. A lane that joins `ready` (a tenant with nothing waiting that queues, or one
//! that drops below its limit) starts no earlier than the class's virtual time, so idle time
//! banks no credit and one tenant's burst cannot push another tenant's first turn behind
//! it: backlogged tenants start turns in proportion to their weights. This is deficit round
//! robin with a quantum of one turn, ordered by an index instead of a round-robin list, so
//! tenants skipped for their limit cost nothing. The fairness is in turns *started*: a tenant
//! whose turns run ten times longer holds ten times the slots (see `docs/priorities.md`).
//! Under the adaptive discipline's newest-first rule the lane is chosen as above and its
//! *newest* waiter runs (the rule applies within a tenant); without fair queuing the newest
//! eligible waiter of the class runs, from a second index keyed by each lane's newest
//! waiter.
//!
//! **Across classes.** Classes are numbered most important first, at most 64, and the queue
//! keeps four bit masks over them, each bit maintained in O(1) whenever that class's count
//! changes: *backlogged* (an eligible lane), *below its cap* (`max_share`), *below its
//! guarantee* (`min_share`), and *has waiters that count against the depth*. The class to
//! serve is the lowest set bit of `backlogged & below_cap & below_guarantee`, or, when no
//! class is short of its guarantee, of `backlogged & below_cap`: a class below its guarantee
//! first, then priority order, found in O(1). So a grant costs O(1) across classes plus
//! O(log tenants) within one. Shares are slots of the *effective* ceiling (the learned one
//! under an adaptive limit), recomputed only when the ceiling moves ([`Queue::follow_ceiling`]).
//! A class using less than its guarantee lends the rest (free slots go to whoever waits, the
//! work-conserving half, as Netflix's partitioned limiter borrows idle partitions); the
//! guarantee is taken back by serving the short class first at each release, never by
//! cancelling a running turn.
//!
//! **Shedding.** When a newcomer finds the queue full, the least important class below the
//! newcomer's with a waiter to spare loses its oldest waiter first (bit scan of a mask);
//! only when no lower class has one does the overflow policy apply within the newcomer's own
//! class. A class at or below its guarantee keeps as many waiters as its guaranteed slots
//! from being shed: otherwise a more important class in overload would shed every waiter
//! of a less important one as it arrived, and the guarantee would never be served.
//! A newcomer never evicts a waiter of a more important class.
//!
//! **Counting.** Each class counts its turns in flight and its outcomes (admitted, refused,
//! shed, cancelled); the gate keeps the totals, and the invariant checks assert that the
//! classes add up to them after every step.

pub mod classes;
pub mod rank;
pub mod waiters;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use crate::count::{decrement, difference, increment};
pub use classes::{ClassId, Priorities, PriorityClass, PriorityError, Slots, MAX_CLASSES};
use waiters::{Lane, WaitQueue, Waiter, WaiterKey, WaiterState};

/// A tenant's virtual time moves on by this, divided by its weight, per turn it starts.
const FAIR_QUANTUM: u64 = 1 << 20;

/// The queue's order and shares as configured (see the module documentation).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Order {
    /// The classes (a gate without classes: one plain class).
    pub priorities: Priorities,
    /// Fair queuing across tenants within each class.
    pub fair: bool,
    /// Tenants' weights under fair queuing (1 for a tenant not named).
    pub weights: HashMap<Arc<str>, u32>,
}

/// One tenant's waiters in one class, and its place in that class's index.
#[derive(Debug, Default)]
struct LaneState {
    lane: Lane,
    /// Its waiters held back only by soft memory pressure (outside `queue_depth`).
    outside_depth: u64,
    /// Its key in its class's `ready`, if filed.
    ready: Option<(u64, u64)>,
    /// Its key in its class's `newest`, if filed.
    newest: Option<u64>,
    /// Fair queuing: the virtual start of its head.
    tag: u64,
}

/// One tenant (or the turns without one): its running turns and its lanes.
#[derive(Debug)]
struct ScopeState {
    in_flight: u64,
    /// Its waiters in every class, and those of them outside the depth.
    queued: u64,
    outside_depth: u64,
    /// How far its virtual time moves per turn (the quantum over its weight).
    step: u64,
    /// Its lane in the first class, and in the others (grown as used: a gate without classes
    /// allocates nothing more per tenant).
    first: LaneState,
    rest: Vec<LaneState>,
}

impl ScopeState {
    fn new(weight: u32) -> Self {
        Self {
            in_flight: 0,
            queued: 0,
            outside_depth: 0,
            step: FAIR_QUANTUM
                .checked_div(u64::from(weight))
                .unwrap_or(FAIR_QUANTUM),
            first: LaneState::default(),
            rest: Vec::new(),
        }
    }

    fn lane(&self, class: usize) -> Option<&LaneState> {
        match class.checked_sub(1) {
            None => Some(&self.first),
            Some(i) => self.rest.get(i),
        }
    }

    fn lane_mut(&mut self, class: usize) -> Option<&mut LaneState> {
        match class.checked_sub(1) {
            None => Some(&mut self.first),
            Some(i) => {
                if self.rest.len() <= i {
                    self.rest.resize_with(class, LaneState::default);
                }
                self.rest.get_mut(i)
            }
        }
    }

    /// Its lanes with their class positions.
    fn lanes(&self) -> impl Iterator<Item = (usize, &LaneState)> {
        std::iter::once(&self.first).chain(&self.rest).enumerate()
    }

    fn idle(&self) -> bool {
        self.in_flight == 0 && self.queued == 0
    }
}

impl Default for ScopeState {
    fn default() -> Self {
        Self::new(1)
    }
}

/// What a class has counted (see [`ClassStats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Turns that started running.
    pub admitted: u64,
    /// Turns refused, on arrival or while they waited.
    pub rejected: u64,
    /// Waiters evicted to make room.
    pub shed: u64,
    /// Turns withdrawn while queued, or cancelled before running.
    pub cancelled: u64,
}

/// One outcome a class counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A turn started running.
    Admitted,
    /// A turn was refused.
    Rejected,
    /// A waiter was evicted.
    Shed,
    /// A turn was withdrawn or cancelled.
    Cancelled,
}

impl Tally {
    fn field(&mut self, outcome: Outcome) -> &mut u64 {
        match outcome {
            Outcome::Admitted => &mut self.admitted,
            Outcome::Rejected => &mut self.rejected,
            Outcome::Shed => &mut self.shed,
            Outcome::Cancelled => &mut self.cancelled,
        }
    }
}

/// One class's counters and shares, for `stats()["classes"]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClassStats {
    /// The class's name.
    pub name: Arc<str>,
    /// Its turns holding a slot.
    pub in_flight: u64,
    /// Its turns waiting.
    pub queued: u64,
    /// What it has counted.
    pub tally: Tally,
    /// Its guarantee and cap in slots under the ceiling now.
    pub slots: Slots,
}

/// One class's indices and counts.
#[derive(Debug, Default)]
struct ClassState {
    /// Eligible lanes by `(virtual start tag, head's arrival number)` -> the head's record.
    ready: BTreeMap<(u64, u64), u32>,
    /// Eligible lanes by their newest waiter's arrival number -> its record (kept only for
    /// the newest-first rule without fair queuing).
    newest: BTreeMap<u64, u32>,
    /// The virtual time: the tag of the turn it started last.
    vtime: u64,
    in_flight: u64,
    /// Its waiters held back only by soft memory pressure.
    outside_depth: u64,
    slots: Slots,
    tally: Tally,
}

impl ClassState {
    /// How many of its waiters a class holding `in_flight` slots keeps from more important
    /// newcomers: at or below its guarantee, as many as its guarantee, so each of its turns
    /// that ends is replaced at once and it never runs below its share while it has work;
    /// above it (borrowing), none.
    fn kept(&self, in_flight: u64) -> u64 {
        if in_flight <= self.slots.guarantee {
            self.slots.guarantee
        } else {
            0
        }
    }
}

/// Files a lane under `wanted` in `index`, where `filed` says it is now, if that changed.
fn refile<K: Ord + Copy>(
    index: &mut BTreeMap<K, u32>,
    filed: &mut Option<K>,
    wanted: Option<(K, u32)>,
) {
    if *filed != wanted.map(|(key, _)| key) {
        if let Some(key) = *filed {
            index.remove(&key);
        }
        if let Some((key, record)) = wanted {
            index.insert(key, record);
        }
        *filed = wanted.map(|(key, _)| key);
    }
}

/// Sets or clears bit `class` of `mask`.
fn set_bit(mask: &mut u64, class: usize, on: bool) {
    let bit = 1u64
        .checked_shl(u32::try_from(class).unwrap_or(u32::MAX))
        .unwrap_or(0);
    if on {
        *mask |= bit;
    } else {
        *mask &= !bit;
    }
}

/// The bits of classes less important than `class`.
fn below(class: usize) -> u64 {
    u64::MAX
        .checked_shl(u32::try_from(class.saturating_add(1)).unwrap_or(u32::MAX))
        .unwrap_or(0)
}

/// What [`Queue::grant`] took off the queue.
#[derive(Debug)]
pub struct Granted {
    /// Its tenant.
    pub scope: Option<Arc<str>>,
    /// Its class's position.
    pub class: usize,
    /// When it joined the queue.
    pub enqueued_at: Duration,
}

/// The waiters, their tenants and classes, and the order they are served in. See the module
/// documentation.
#[derive(Debug)]
pub struct Queue<W> {
    waiters: WaitQueue<W>,
    /// Keyed with foldhash: several lookups per scoped turn make SipHash a third of its
    /// cost; foldhash is seeded per process, so tenants cannot choose colliding ids.
    scopes: HashMap<Arc<str>, ScopeState, foldhash::fast::RandomState>,
    unscoped: ScopeState,
    classes: Vec<ClassState>,
    order: Order,
    /// Whether the newest-first index is kept (the adaptive discipline is on).
    newest_first: bool,
    max_per_scope: u32,
    /// The ceiling the classes' slots are computed for.
    ceiling: u32,
    /// Per class (bit = position): an eligible lane; below its cap; below its guarantee;
    /// waiters that count against the depth.
    backlogged: u64,
    below_cap: u64,
    below_guarantee: u64,
    in_depth: u64,
    /// Per class: more waiters that count against the depth than it keeps for its guarantee
    /// (see [`ClassState::kept`]): a waiter a more important newcomer may shed.
    sheddable: u64,
    /// Waiters held back only by soft memory pressure, in all.
    outside: u64,
}

impl<W> Queue<W> {
    /// An empty queue for a gate without classes.
    pub fn new(max_per_scope: u32, ceiling: u32) -> Self {
        let mut queue = Self {
            waiters: WaitQueue::default(),
            scopes: HashMap::default(),
            unscoped: ScopeState::default(),
            classes: Vec::new(),
            order: Order::default(),
            newest_first: false,
            max_per_scope,
            ceiling,
            backlogged: 0,
            below_cap: 0,
            below_guarantee: 0,
            in_depth: 0,
            sheddable: 0,
            outside: 0,
        };
        queue.classes = queue.fresh_classes();
        queue.reslot();
        queue
    }

    fn fresh_classes(&self) -> Vec<ClassState> {
        self.order
            .priorities
            .classes()
            .iter()
            .map(|_| ClassState::default())
            .collect()
    }

    /// Sets the order: classes, fair queuing, weights. Changing the classes themselves (not
    /// only their shares) is for a queue nobody uses yet (the gate checks that).
    pub fn set_order(&mut self, order: Order) {
        let renamed = !order.priorities.same_names(&self.order.priorities);
        let refair = order.fair != self.order.fair;
        self.order = order;
        if renamed {
            self.classes = self.fresh_classes();
        }
        self.reslot();
        if refair {
            self.refile_all();
        }
    }

    /// The order in force.
    pub fn order(&self) -> &Order {
        &self.order
    }

    /// Whether tenants' turns are tracked for the order (fair queuing), whatever the
    /// per-tenant limit.
    pub fn fair(&self) -> bool {
        self.order.fair
    }

    /// Keeps (or drops) the index the newest-first rule serves from.
    pub fn set_newest_first(&mut self, on: bool) {
        if on != self.newest_first {
            self.newest_first = on;
            self.refile_all();
        }
    }

    /// Applies a new per-tenant limit (lanes' eligibility may change).
    pub fn set_max_per_scope(&mut self, max_per_scope: u32) {
        if max_per_scope != self.max_per_scope {
            self.max_per_scope = max_per_scope;
            self.refile_all();
        }
    }

    /// Recomputes the classes' slots if the ceiling moved (O(classes), only then).
    pub fn follow_ceiling(&mut self, ceiling: u32) {
        if ceiling != self.ceiling {
            self.ceiling = ceiling;
            self.reslot();
        }
    }

    fn reslot(&mut self) {
        let ceiling = self.ceiling;
        let slots: Vec<Slots> = self
            .order
            .priorities
            .classes()
            .iter()
            .map(|spec| spec.slots(ceiling))
            .collect();
        for (class, slots) in slots.into_iter().enumerate() {
            if let Some(state) = self.classes.get_mut(class) {
                state.slots = slots;
            }
            self.settle(class);
        }
    }

    /// Recomputes class `class`'s bits in the masks.
    fn settle(&mut self, class: usize) {
        let Some(state) = self.classes.get(class) else {
            return;
        };
        let backlogged = !state.ready.is_empty();
        let below_cap = state.in_flight < state.slots.cap;
        let below_guarantee = state.in_flight < state.slots.guarantee;
        let held = self
            .waiters
            .class_len(class)
            .saturating_sub(state.outside_depth);
        let needed = state.kept(state.in_flight);
        set_bit(&mut self.backlogged, class, backlogged);
        set_bit(&mut self.below_cap, class, below_cap);
        set_bit(&mut self.below_guarantee, class, below_guarantee);
        set_bit(&mut self.in_depth, class, held > 0);
        set_bit(&mut self.sheddable, class, held > needed);
    }

    /// `class` as a position in this queue's classes.
    pub fn class(&self, class: ClassId) -> usize {
        self.order.priorities.resolve(class)
    }

    /// Waiters on the lists.
    pub fn len(&self) -> u64 {
        self.waiters.len()
    }

    /// Whether nobody waits.
    pub fn is_empty(&self) -> bool {
        self.waiters.is_empty()
    }

    /// The waiters held back only by soft memory pressure.
    pub fn outside_depth(&self) -> u64 {
        self.outside
    }

    /// The record at `index` (see [`WaitQueue::get`]).
    pub fn get(&self, index: u32) -> Option<&Waiter<W>> {
        self.waiters.get(index)
    }

    /// The record at `index`, mutably.
    pub fn get_mut(&mut self, index: u32) -> Option<&mut Waiter<W>> {
        self.waiters.get_mut(index)
    }

    /// The key of the record at `index` (see [`WaitQueue::key`]).
    pub fn key(&self, index: u32) -> Option<WaiterKey> {
        self.waiters.key(index)
    }

    /// How many records the slab holds (see [`WaitQueue::records`]).
    pub fn records(&self) -> usize {
        self.waiters.records()
    }

    /// See [`WaitQueue::lookup`].
    pub fn lookup(&self, key: WaiterKey) -> Option<(u32, &Waiter<W>)> {
        self.waiters.lookup(key)
    }

    /// See [`WaitQueue::lookup_mut`].
    pub fn lookup_mut(&mut self, key: WaiterKey) -> Option<(u32, &mut Waiter<W>)> {
        self.waiters.lookup_mut(key)
    }

    /// The oldest waiter of all.
    pub fn oldest(&self) -> Option<u32> {
        self.waiters.oldest()
    }

    /// Walks every waiter in arrival order.
    pub fn iter_all(&self) -> impl Iterator<Item = u32> + '_ {
        self.waiters.iter_all()
    }

    /// How many waiters arrived before the one at `index` (O(log n)).
    pub fn ahead(&self, index: u32) -> Option<u64> {
        self.waiters.ahead(index)
    }

    /// Frees a settled record, returning its waker (dropped outside the lock).
    pub fn free(&mut self, index: u32) -> Option<W> {
        self.waiters.free(index)
    }

    /// Forgets every waiter, tenant and count, keeping the configuration and the slab (so
    /// keys handed out before stay invalid). Returns the wakers, to be dropped.
    pub fn reset(&mut self) -> Vec<W> {
        let wakers = self.waiters.clear();
        self.scopes.clear();
        self.unscoped = ScopeState::default();
        self.classes = self.fresh_classes();
        self.outside = 0;
        self.reslot();
        wakers
    }

    /// The tenant's key, creating its state if needed.
    pub fn scope_key(&mut self, name: &str) -> Arc<str> {
        if let Some((key, _)) = self.scopes.get_key_value(name) {
            return key.clone();
        }
        let key: Arc<str> = Arc::from(name);
        let weight = self.order.weights.get(name).copied().unwrap_or(1);
        self.scopes.insert(key.clone(), ScopeState::new(weight));
        key
    }

    fn scope(&self, scope: Option<&str>) -> Option<&ScopeState> {
        match scope {
            None => Some(&self.unscoped),
            Some(name) => self.scopes.get(name),
        }
    }

    /// A tenant's turns holding a slot, and its waiters that count against the depth.
    pub fn scope_counts(&self, scope: Option<&str>) -> (u64, u64) {
        self.scope(scope).map_or((0, 0), |s| {
            let queued = difference(s.queued, s.outside_depth, "a tenant's outside-depth");
            (s.in_flight, queued)
        })
    }

    /// Per tenant with turns running or waiting: `(tenant, in flight, queued)`.
    pub fn scope_stats(&self) -> Vec<(Arc<str>, u64, u64)> {
        self.scopes
            .iter()
            .map(|(name, state)| (name.clone(), state.in_flight, state.queued))
            .collect()
    }

    /// Tenants tracked (running or waiting).
    pub fn tracked_scopes(&self) -> u64 {
        self.scopes.len() as u64
    }

    /// Per class, most important first.
    pub fn class_stats(&self) -> Vec<ClassStats> {
        self.order
            .priorities
            .classes()
            .iter()
            .zip(&self.classes)
            .enumerate()
            .map(|(class, (spec, state))| ClassStats {
                name: spec.name.clone(),
                in_flight: state.in_flight,
                queued: self.waiters.class_len(class),
                tally: state.tally,
                slots: state.slots,
            })
            .collect()
    }

    /// Counts `outcome` for class `class`.
    pub fn count(&mut self, class: usize, outcome: Outcome) {
        if let Some(state) = self.classes.get_mut(class) {
            increment(state.tally.field(outcome));
        }
    }

    /// Takes back a count of `outcome` (a refusal that became a cancellation).
    pub fn uncount(&mut self, class: usize, outcome: Outcome) {
        if let Some(state) = self.classes.get_mut(class) {
            decrement(state.tally.field(outcome), "a class's outcome count");
        }
    }

    /// Whether tenant lanes of `scope` may take a slot under the per-tenant limit.
    fn eligible(max_per_scope: u32, scope: Option<&str>, state: &ScopeState) -> bool {
        scope.is_none() || max_per_scope == 0 || state.in_flight < u64::from(max_per_scope)
    }

    /// Files `scope`'s lane of class `class` in that class's indices as it stands now.
    fn refile_lane(&mut self, scope: Option<&str>, class: usize) {
        let Self {
            waiters,
            scopes,
            unscoped,
            classes,
            order,
            newest_first,
            max_per_scope,
            ..
        } = self;
        let state = match scope {
            None => unscoped,
            Some(name) => match scopes.get_mut(name) {
                Some(state) => state,
                None => return,
            },
        };
        let eligible = Self::eligible(*max_per_scope, scope, state);
        let (Some(lane), Some(class_state)) = (state.lane_mut(class), classes.get_mut(class))
        else {
            return;
        };
        let seq_of = |index: Option<u32>| {
            index
                .filter(|_| eligible)
                .and_then(|index| Some((waiters.get(index)?.seq, index)))
        };
        let head = seq_of(waiters.lane_head(&lane.lane));
        if order.fair && head.is_some() && lane.ready.is_none() {
            // Joining the index: no earlier than the class's virtual time (no banked credit).
            lane.tag = lane.tag.max(class_state.vtime);
        }
        let tag = if order.fair { lane.tag } else { 0 };
        let wanted = head.map(|(seq, index)| ((tag, seq), index));
        refile(&mut class_state.ready, &mut lane.ready, wanted);
        let newest = seq_of(waiters.lane_tail(&lane.lane)).filter(|_| *newest_first && !order.fair);
        refile(&mut class_state.newest, &mut lane.newest, newest);
        self.settle(class);
    }

    /// Refiles every lane of `scope` (its eligibility changed).
    fn refile_scope(&mut self, scope: Option<&str>) {
        let Some(state) = self.scope(scope) else {
            return;
        };
        let classes: Vec<usize> = state
            .lanes()
            .filter(|(_, lane)| !lane.lane.is_empty() || lane.ready.is_some())
            .map(|(class, _)| class)
            .collect();
        for class in classes {
            self.refile_lane(scope, class);
        }
    }

    /// Refiles every lane (what makes a lane eligible, or which indexes are kept, changed).
    fn refile_all(&mut self) {
        let scopes: Vec<Arc<str>> = self.scopes.keys().cloned().collect();
        for scope in scopes {
            self.refile_scope(Some(&scope));
        }
        self.refile_scope(None);
    }

    /// Forgets a tenant once nothing of it runs or waits.
    fn forget_if_idle(&mut self, scope: Option<&str>) {
        if let Some(name) = scope {
            if self.scopes.get(name).is_some_and(ScopeState::idle) {
                debug_assert!(self.scopes.get(name).is_some_and(|s| s
                    .lanes()
                    .all(|(_, lane)| lane.ready.is_none() && lane.newest.is_none())));
                self.scopes.remove(name);
            }
        }
    }

    /// Counts a slot taken by a turn of `scope` (whose state exists: see
    /// [`Queue::scope_key`]) in class `class`.
    pub fn take_slot(&mut self, scope: Option<&str>, class: usize) {
        if let Some(state) = self.classes.get_mut(class) {
            increment(&mut state.in_flight);
        }
        self.settle(class);
        if let Some(name) = scope {
            if let Some(state) = self.scopes.get_mut(name) {
                increment(&mut state.in_flight);
            }
            if self.max_per_scope > 0 {
                self.refile_scope(scope);
            }
        }
    }

    /// Returns a slot of a turn of `scope` in class `class`.
    pub fn give_slot(&mut self, scope: Option<&str>, class: usize) {
        if let Some(state) = self.classes.get_mut(class) {
            decrement(&mut state.in_flight, "a class's in_flight (returned twice)");
        }
        self.settle(class);
        if let Some(name) = scope {
            if let Some(state) = self.scopes.get_mut(name) {
                decrement(&mut state.in_flight, "a scope's in_flight (returned twice)");
            }
            if self.max_per_scope > 0 {
                self.refile_scope(scope);
            }
            self.forget_if_idle(scope);
        }
    }

    /// Counts `turns` let through uncounted as holding slots of the default class.
    pub fn adopt(&mut self, turns: u64) {
        let class = self.class(ClassId::DEFAULT);
        if let Some(state) = self.classes.get_mut(class) {
            state.in_flight = state.in_flight.saturating_add(turns);
        }
        self.settle(class);
    }

    /// Adds a waiter of `scope` (whose state exists, see [`Queue::scope_key`]) in class
    /// `class`. `None` when the slab is full (the tenant is forgotten if that left it idle).
    pub fn push(
        &mut self,
        scope: Option<Arc<str>>,
        class: usize,
        now: Duration,
        outside_depth: bool,
    ) -> Option<WaiterKey> {
        let key = scope.as_deref().map(str::to_owned);
        let key = key.as_deref();
        let pushed = (|| {
            let state = match key {
                None => &mut self.unscoped,
                Some(name) => self.scopes.get_mut(name)?,
            };
            // At most 64 classes: the position fits.
            let position = u8::try_from(class).ok()?;
            let lane = state.lane_mut(class)?;
            let waiter = self
                .waiters
                .push(&mut lane.lane, scope, position, now, outside_depth)?;
            increment(&mut state.queued);
            if outside_depth {
                if let Some(lane) = state.lane_mut(class) {
                    increment(&mut lane.outside_depth);
                }
                increment(&mut state.outside_depth);
                increment(&mut self.outside);
                if let Some(class_state) = self.classes.get_mut(class) {
                    increment(&mut class_state.outside_depth);
                }
            }
            Some(waiter)
        })();
        self.refile_lane(key, class);
        if pushed.is_none() {
            self.forget_if_idle(key);
        }
        pushed
    }

    /// Takes the waiting record at `index` off its lists, settling it as `state`, and
    /// returns its tenant and class; the lane is refiled but the tenant not forgotten (the
    /// caller may count a slot for it first). `None`, changing nothing, if none waits there.
    fn unlink(&mut self, index: u32, settled: WaiterState) -> Option<(Option<Arc<str>>, usize)> {
        let record = self
            .waiters
            .get(index)
            .filter(|record| record.state == WaiterState::Waiting)?;
        let scope = record.scope.clone();
        let class = usize::from(record.class);
        let state = match scope.as_deref() {
            None => &mut self.unscoped,
            Some(name) => self.scopes.get_mut(name)?,
        };
        let lane = state.lane_mut(class)?;
        let record = self.waiters.unlink(index, &mut lane.lane, settled)?;
        let outside = std::mem::take(&mut record.outside_depth);
        decrement(&mut state.queued, "a tenant's waiters");
        if outside {
            if let Some(lane) = state.lane_mut(class) {
                decrement(&mut lane.outside_depth, "a lane's outside-depth waiters");
            }
            decrement(&mut state.outside_depth, "a tenant's outside-depth waiters");
            decrement(&mut self.outside, "outside-depth waiters");
            if let Some(class_state) = self.classes.get_mut(class) {
                decrement(&mut class_state.outside_depth, "a class's outside-depth");
            }
        }
        self.refile_lane(scope.as_deref(), class);
        Some((scope, class))
    }

    /// Takes the waiter at `index` off the queue as granted a slot, counting the slot for
    /// its tenant and class (fair queuing: its tenant's virtual time moves on). `None`,
    /// changing nothing, if none waits there.
    pub fn grant(&mut self, index: u32) -> Option<Granted> {
        let enqueued_at = self.waiters.get(index)?.enqueued_at;
        let (scope, class) = self.unlink(index, WaiterState::Granted)?;
        self.started(scope.as_deref(), class);
        self.take_slot(scope.as_deref(), class);
        Some(Granted {
            scope,
            class,
            enqueued_at,
        })
    }

    /// A turn of `scope` (whose state exists) in class `class` runs at once on arrival: its
    /// slot is counted, and its tenant's virtual time moves on as for a waiter granted one.
    pub fn admit(&mut self, scope: Option<&str>, class: usize) {
        self.started(scope, class);
        self.take_slot(scope, class);
    }

    /// Fair queuing: a turn of `scope` in class `class` starts, so its tenant's virtual time
    /// moves on by its step (from no earlier than the class's), and the class's virtual time
    /// becomes the turn's start.
    fn started(&mut self, scope: Option<&str>, class: usize) {
        if !self.order.fair {
            return;
        }
        let state = match scope {
            None => Some(&mut self.unscoped),
            Some(name) => self.scopes.get_mut(name),
        };
        if let Some(state) = state {
            let step = state.step;
            if let (Some(lane), Some(class_state)) =
                (state.lane_mut(class), self.classes.get_mut(class))
            {
                if lane.ready.is_none() {
                    lane.tag = lane.tag.max(class_state.vtime);
                }
                class_state.vtime = class_state.vtime.max(lane.tag);
                lane.tag = lane.tag.saturating_add(step);
            }
        }
        self.refile_lane(scope, class);
    }

    /// Takes the waiter at `index` off the queue as refused (or withdrawn), forgetting its
    /// tenant if that left it idle; returns its tenant and class. `None`, changing nothing,
    /// if none waits there.
    pub fn remove(
        &mut self,
        index: u32,
        settled: WaiterState,
    ) -> Option<(Option<Arc<str>>, usize)> {
        let (scope, class) = self.unlink(index, settled)?;
        self.forget_if_idle(scope.as_deref());
        Some((scope, class))
    }

    /// The class a free slot goes to: the most important one below its guarantee with an
    /// eligible waiter, else the most important one with an eligible waiter, among classes
    /// below their caps. O(1).
    fn next_class(&self) -> Option<usize> {
        let open = self.backlogged & self.below_cap;
        if open == 0 {
            return None;
        }
        let short = open & self.below_guarantee;
        let pick = if short != 0 { short } else { open };
        Some(pick.trailing_zeros() as usize)
    }

    /// Whether some waiter may take a free slot now.
    pub fn dispatchable(&self) -> bool {
        self.backlogged & self.below_cap != 0
    }

    /// [`Queue::dispatchable`] under `ceiling`, recomputed from the counts (for checks that
    /// must not trust the masks).
    #[cfg(test)]
    pub fn dispatchable_at(&self, ceiling: u32) -> bool {
        self.classes
            .iter()
            .zip(self.order.priorities.classes())
            .any(|(state, spec)| {
                !state.ready.is_empty() && state.in_flight < spec.slots(ceiling).cap
            })
    }

    /// Whether class `class` holds as many slots as its cap allows.
    pub fn class_full(&self, class: usize) -> bool {
        self.below_cap & (1u64.checked_shl(class as u32).unwrap_or(0)) == 0
    }

    /// The waiter a free slot goes to (see the module documentation), or `None`.
    /// `newest_first`: the adaptive discipline's rule, within the chosen tenant.
    pub fn next(&self, newest_first: bool) -> Option<u32> {
        let class = self.classes.get(self.next_class()?)?;
        let (_, &head) = class.ready.first_key_value()?;
        if !newest_first {
            return Some(head);
        }
        if !self.order.fair {
            debug_assert!(self.newest_first, "newest first without its index");
            return Some(class.newest.last_key_value().map_or(head, |(_, &i)| i));
        }
        let record = self.waiters.get(head)?;
        let lane = self
            .scope(record.scope.as_deref())?
            .lane(usize::from(record.class))?;
        Some(self.waiters.lane_tail(&lane.lane).unwrap_or(head))
    }

    /// The first waiter of `lane` that counts against the depth.
    fn first_in_depth(&self, lane: &Lane) -> Option<u32> {
        self.waiters
            .iter_lane(lane)
            .find(|&i| self.waiters.get(i).is_some_and(|r| !r.outside_depth))
    }

    /// Whom a newcomer of class `class` that finds its queue full sheds: the oldest waiter
    /// (that counts against the depth) of the least important class below `class` that has
    /// one to spare, else, when `same_class` (`shed_oldest`), the oldest of `class` itself.
    /// A class at or below its guarantee spares none of the waiters it keeps for it (as many
    /// as its guaranteed slots): shedding those would starve the share it is guaranteed. `tenant`: the queue is that tenant's own (it is at its limit), not the
    /// whole queue.
    pub fn victim(&self, class: usize, tenant: Option<&str>, same_class: bool) -> Option<u32> {
        match tenant {
            None => {
                let lower = self.sheddable & below(class);
                let from = if lower != 0 {
                    63usize.saturating_sub(lower.leading_zeros() as usize)
                } else if same_class {
                    class
                } else {
                    return None;
                };
                self.waiters
                    .iter_class(from)
                    .find(|&i| self.waiters.get(i).is_some_and(|r| !r.outside_depth))
            }
            Some(name) => {
                let state = self.scopes.get(name)?;
                let lower = state
                    .lanes()
                    .filter(|&(c, _)| c > class && self.sheddable >> c & 1 == 1)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .find_map(|(_, lane)| self.first_in_depth(&lane.lane));
                lower.or_else(|| {
                    same_class
                        .then(|| state.lane(class))
                        .flatten()
                        .and_then(|lane| self.first_in_depth(&lane.lane))
                })
            }
        }
    }

    /// Tenants (and the turns without one), for a reconfiguration's trim.
    pub fn scopes(&self) -> Vec<Option<Arc<str>>> {
        std::iter::once(None)
            .chain(self.scopes.keys().cloned().map(Some))
            .collect()
    }

    /// Whether this queue orders as a gate without classes and fair queuing always did.
    fn plain(&self) -> bool {
        !self.order.fair && self.order.priorities.is_plain()
    }

    /// The next waiter a reconfiguration to `depth` refuses among `scope`'s waiters: the
    /// newest one that counts against the depth, of the tenant's least important class,
    /// while the tenant holds more than `depth` of them. Tenants' own queues exist under a
    /// per-tenant limit; a gate without classes and fairness trims the turns without a
    /// tenant as one more lane, as it always did.
    pub fn trim_scope(&self, scope: Option<&str>, depth: u64) -> Option<u32> {
        let tenants_queue = scope.is_some() && self.max_per_scope > 0;
        if !(tenants_queue || self.plain() && scope.is_none()) {
            return None;
        }
        let state = self.scope(scope)?;
        let held = difference(
            state.queued,
            state.outside_depth,
            "a tenant's outside-depth",
        );
        if held <= depth {
            return None;
        }
        let lanes: Vec<&LaneState> = state.lanes().map(|(_, lane)| lane).collect();
        lanes.into_iter().rev().find_map(|lane| {
            let mut victim = self.waiters.lane_tail(&lane.lane);
            while let Some(index) =
                victim.filter(|&i| self.waiters.get(i).is_some_and(|r| r.outside_depth))
            {
                victim = self.waiters.lane_prev(index);
            }
            victim
        })
    }

    /// The next waiter a reconfiguration to `depth` refuses from the whole queue (a gate
    /// with classes or fair queuing): the newest that counts against the depth of the least
    /// important class with one, while more than `depth` of them wait.
    pub fn trim_all(&self, depth: u64) -> Option<u32> {
        if self.plain() {
            return None;
        }
        let held = difference(self.len(), self.outside_depth(), "outside-depth waiters");
        if held <= depth || self.in_depth == 0 {
            return None;
        }
        let class = 63usize.saturating_sub(self.in_depth.leading_zeros() as usize);
        self.waiters.class_newest_in_depth(class)
    }

    /// Recomputes everything derived here and panics on the first inconsistency; `in_flight`
    /// is the gate's total. Compiled only for the tests.
    #[cfg(test)]
    pub fn check_invariants(&self, in_flight: u64) {
        let record = |index: u32| {
            self.waiters
                .get(index)
                .unwrap_or_else(|| panic!("a list names free record {index}"))
        };
        assert_eq!(self.classes.len(), self.order.priorities.classes().len());
        type Indices = (BTreeMap<(u64, u64), u32>, BTreeMap<u64, u32>);
        let mut expected: Vec<Indices> = self.classes.iter().map(|_| Default::default()).collect();
        let mut lanes_len = 0;
        let mut outside_total = 0;
        let mut class_outside = vec![0u64; self.classes.len()];
        let scopes = std::iter::once((None, &self.unscoped))
            .chain(self.scopes.iter().map(|(k, v)| (Some(&**k), v)));
        for (name, state) in scopes {
            if name.is_some() {
                assert!(
                    !state.idle(),
                    "scope {name:?} kept with nothing running or waiting"
                );
            }
            let eligible = Self::eligible(self.max_per_scope, name, state);
            let mut queued = 0;
            let mut outside = 0;
            for (class, lane) in state.lanes() {
                let members: Vec<u32> = self.waiters.iter_lane(&lane.lane).collect();
                assert_eq!(members.len() as u64, lane.lane.len());
                for window in members.windows(2) {
                    assert!(record(window[0]).seq < record(window[1]).seq);
                }
                for &index in &members {
                    assert_eq!(record(index).scope.as_deref(), name);
                    assert_eq!(usize::from(record(index).class), class);
                    assert_eq!(record(index).state, WaiterState::Waiting);
                }
                let lane_outside =
                    members.iter().filter(|&&i| record(i).outside_depth).count() as u64;
                assert_eq!(lane_outside, lane.outside_depth, "lane {name:?}/{class}");
                queued += lane.lane.len();
                outside += lane_outside;
                class_outside[class] += lane_outside;
                let tag = if self.order.fair { lane.tag } else { 0 };
                let head = members
                    .first()
                    .filter(|_| eligible)
                    .map(|&head| ((tag, record(head).seq), head));
                assert_eq!(
                    lane.ready,
                    head.map(|(k, _)| k),
                    "lane {name:?}/{class} misfiled"
                );
                expected[class].0.extend(head);
                let newest = members
                    .last()
                    .filter(|_| eligible && self.newest_first && !self.order.fair)
                    .map(|&tail| (record(tail).seq, tail));
                assert_eq!(
                    lane.newest,
                    newest.map(|(k, _)| k),
                    "lane {name:?}/{class} newest"
                );
                expected[class].1.extend(newest);
            }
            assert_eq!(queued, state.queued, "scope {name:?} waiters");
            assert_eq!(outside, state.outside_depth, "scope {name:?} outside-depth");
            lanes_len += queued;
            outside_total += outside;
        }
        assert_eq!(lanes_len, self.waiters.len(), "lanes and queue disagree");
        assert_eq!(outside_total, self.outside, "outside-depth count");
        assert_eq!(self.waiters.iter_all().count() as u64, self.waiters.len());
        for (ahead, index) in self.waiters.iter_all().enumerate() {
            assert_eq!(
                self.waiters.ahead(index),
                Some(ahead as u64),
                "rank of {index}"
            );
        }
        let mut class_in_flight = 0;
        let mut class_waiting = 0;
        for (class, (state, spec)) in self
            .classes
            .iter()
            .zip(self.order.priorities.classes())
            .enumerate()
        {
            let members: Vec<u32> = self.waiters.iter_class(class).collect();
            assert_eq!(members.len() as u64, self.waiters.class_len(class));
            for window in members.windows(2) {
                assert!(record(window[0]).seq < record(window[1]).seq, "class order");
            }
            assert!(members
                .iter()
                .all(|&i| usize::from(record(i).class) == class));
            class_waiting += members.len() as u64;
            assert_eq!(
                state.outside_depth, class_outside[class],
                "class {class} outside"
            );
            assert_eq!(
                state.ready, expected[class].0,
                "class {class}: ready index stale"
            );
            assert_eq!(
                state.newest, expected[class].1,
                "class {class}: newest index stale"
            );
            assert_eq!(state.slots, spec.slots(self.ceiling), "class {class} slots");
            let bit = |mask: u64| mask >> class & 1 == 1;
            assert_eq!(bit(self.backlogged), !state.ready.is_empty());
            assert_eq!(bit(self.below_cap), state.in_flight < state.slots.cap);
            assert_eq!(
                bit(self.below_guarantee),
                state.in_flight < state.slots.guarantee
            );
            let held = members.len() as u64 - state.outside_depth;
            assert_eq!(bit(self.in_depth), held > 0, "class {class} in-depth bit");
            let needed = state.kept(state.in_flight);
            assert_eq!(
                bit(self.sheddable),
                held > needed,
                "class {class} sheddable bit"
            );
            class_in_flight += state.in_flight;
        }
        assert_eq!(
            class_waiting,
            self.waiters.len(),
            "classes and queue disagree"
        );
        assert_eq!(class_in_flight, in_flight, "classes' in_flight add up");
        assert!(self.classes.len() == 64 || self.backlogged >> self.classes.len() == 0);
    }

    /// Sums the classes' tallies (the gate checks them against its totals).
    #[cfg(test)]
    pub fn tally_sum(&self) -> Tally {
        self.classes.iter().fold(Tally::default(), |sum, c| Tally {
            admitted: sum.admitted + c.tally.admitted,
            rejected: sum.rejected + c.tally.rejected,
            shed: sum.shed + c.tally.shed,
            cancelled: sum.cancelled + c.tally.cancelled,
        })
    }

    /// The slots a turn of `scope` holds (0 for the turns without a tenant, which are not
    /// counted per tenant), for the gate's invariant checks.
    #[cfg(test)]
    pub fn scoped_in_flight(&self) -> u64 {
        self.scopes.values().map(|s| s.in_flight).sum()
    }
}

#[cfg(all(test, not(admitgate_loom)))]
mod tests;
