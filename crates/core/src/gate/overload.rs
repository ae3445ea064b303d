//! The gate's overload control: an adaptive ceiling, a queue discipline and deadlines.
//!
//! Off by default: a gate without any of them has no [`Overload`] (`GateState::overload`
//! is `None`) and runs exactly the code it ran before, reading no clock it did not read.
//! Turned on, the gate keeps:
//!
//! * a [`LimitController`] that moves the effective ceiling (`GateState::ceiling`) between
//!   its bounds and the configured `max_concurrent_runs`, from what finished turns report
//!   ([`GateState::turn_started`], [`GateState::finish`]);
//! * a [`QueueDiscipline`] consulted each time slots are handed out: while a queue stands,
//!   waiters older than its cap are refused with `timeout` and the newest eligible waiter
//!   runs first;
//! * a [`ServiceTime`] estimate, against which an arrival's deadline is checked, and the
//!   latest clock reading (the discipline needs the time where the gate is not handed one,
//!   as when a cancellation frees a slot; under a standing queue arrivals refresh it
//!   constantly).
//!
//! A waiter is looked at again while it waits, not only when it arrived: the gate remembers
//! each waiter's deadline, never grants a slot to one whose deadline can no longer be met
//! (the estimate may have grown since it arrived), and gives the caller the time of the next
//! look ([`GateState::next_check`]): when its deadline becomes infeasible at the current
//! estimate, or when it will have waited the adaptive queue's cap. At that time the caller
//! calls [`GateState::recheck`], which refuses it if that is now true and otherwise says
//! when to look again (the estimate moved). So a deadline is refused as soon as it cannot be
//! met and granted whenever it still can, and under a standing queue each waiter leaves at
//! about one service time even when no slot is freed meanwhile.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use super::{GateState, Rejection, Wakes};
use crate::count::increment;
use crate::overload::{
    Discipline, LimitController, Outcome, QueueDiscipline, QueueMode, Sample, ServiceTime,
};
use crate::waiters::{WaiterKey, WaiterState};

/// A timer due exactly at a bound is past it by this much: the rules compare strictly.
const PAST: Duration = Duration::from_micros(1);

/// How one turn ended, for the controller and the service-time estimate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TurnEnd {
    /// When it started running ([`GateState::turn_started`]'s `now`).
    pub started_at: Duration,
    /// When it ended.
    pub ended_at: Duration,
    /// What [`GateState::turn_started`] returned for it.
    pub in_flight: u64,
    /// How it ended.
    pub outcome: Outcome,
    /// The provider's `x-ratelimit-remaining-requests`, if reported.
    pub remaining: Option<u64>,
}

/// The overload-control state of a gate that has any.
#[derive(Debug)]
pub(super) struct Overload {
    controller: Option<Box<dyn LimitController>>,
    discipline: QueueDiscipline,
    service: ServiceTime,
    /// The latest time the gate was given.
    now: Duration,
    /// The deadline of each waiter that has one, with its place in `by_deadline` (entries of
    /// waiters gone are dropped when met, and purged as they pile up).
    deadlines: HashMap<WaiterKey, (Duration, u64)>,
    /// The same waiters by deadline (then arrival): those a grown estimate no longer fits are
    /// a prefix, found without a scan of the queue.
    by_deadline: BTreeMap<(Duration, u64), WaiterKey>,
    /// Numbers the entries, to order equal deadlines.
    deadline_seq: u64,
}

impl Overload {
    fn new(controller: Option<Box<dyn LimitController>>, discipline: Discipline) -> Self {
        Self {
            controller,
            discipline: QueueDiscipline::new(discipline),
            service: ServiceTime::default(),
            now: Duration::ZERO,
            deadlines: HashMap::new(),
            by_deadline: BTreeMap::new(),
            deadline_seq: 0,
        }
    }

    fn saw(&mut self, now: Duration) {
        self.now = self.now.max(now);
    }
}

/// The ceiling `controller` allows under the configured `max` (0: no ceiling, which an
/// adaptive gate does not accept; kept as is).
fn bounded(controller: Option<&dyn LimitController>, max: u32) -> u32 {
    match controller {
        Some(controller) if max > 0 => {
            u32::try_from(controller.limit().clamp(1, u64::from(max))).unwrap_or(max)
        }
        _ => max,
    }
}

impl<W> GateState<W> {
    /// Turns on overload control: `controller` (if any) moves the ceiling below the
    /// configured one, `discipline` serves the queue. Set before any turn arrives (or, for
    /// timing alone, `controller` `None` and [`Discipline::Fifo`], at any time: what is on
    /// already is kept).
    pub fn enable_overload(
        &mut self,
        controller: Option<Box<dyn LimitController>>,
        discipline: Discipline,
    ) {
        if controller.is_none() && discipline == Discipline::Fifo && self.overload.is_some() {
            return;
        }
        let overload = Overload::new(controller, discipline);
        self.ceiling = bounded(
            overload.controller.as_deref(),
            self.limits.max_concurrent_runs,
        );
        self.overload = Some(Box::new(overload));
        let tracks = discipline == Discipline::AdaptiveLifo;
        // Files the lanes already waiting (none, when set before any turn arrives).
        self.queue.set_newest_first(tracks);
    }

    /// Whether turns should report their start and end ([`GateState::turn_started`],
    /// [`GateState::finish`]): overload control is on.
    pub fn times_turns(&self) -> bool {
        self.overload.is_some()
    }

    /// The effective ceiling now (0: none).
    pub fn ceiling(&self) -> u32 {
        self.ceiling
    }

    /// The expected service time, once a turn has been timed.
    pub fn service_time(&self) -> Option<Duration> {
        self.overload.as_ref().and_then(|o| o.service.estimate())
    }

    /// The ceiling under `max` now, for a reconfiguration.
    pub(super) fn ceiling_under(&self, max: u32) -> u32 {
        bounded(
            self.overload.as_ref().and_then(|o| o.controller.as_deref()),
            max,
        )
    }

    /// The ceiling after a reconfiguration to `max`: the controller's own upper bound follows
    /// it first (both ways), so an adaptive gate can grow to a raised `max_concurrent_runs`.
    pub(super) fn reconfigured_ceiling(&mut self, max: u32) -> u32 {
        if let Some(controller) = self.overload.as_mut().and_then(|o| o.controller.as_mut()) {
            controller.set_max_limit(u64::from(max));
        }
        self.ceiling_under(max)
    }

    /// Notes the time: it ages waiters for the discipline between clock readings.
    pub(super) fn saw_time(&mut self, now: Duration) {
        if let Some(overload) = &mut self.overload {
            overload.saw(now);
        }
    }

    /// A turn admitted at `now` starts running; returns the turns running then, itself
    /// included (slots granted to turns that have not started yet are not counted: they
    /// have not reached the provider; a fleet's learner counts the fleet's, see
    /// [`LimitController::start_figure`]). The caller keeps it for [`GateState::finish`].
    pub fn turn_started(&mut self, now: Duration, wakes: &mut Wakes<W>) -> u64 {
        let running = self.in_flight.saturating_sub(self.granted_unclaimed);
        let queued = self.queue.len();
        let mut figure = running;
        if let Some(overload) = &mut self.overload {
            overload.saw(now);
            if let Some(controller) = &mut overload.controller {
                controller.on_start(now, running, queued);
                figure = controller.start_figure(running);
            }
        }
        // Slow start may have raised the ceiling: waiters start at once.
        self.follow_controller(wakes);
        figure
    }

    /// Ends a running turn that reported its start, as [`GateState::release`] does, after
    /// telling the controller how it went: the ceiling moves before the slot is handed on,
    /// so a refusal never starts the next turn under the ceiling it just proved too high.
    pub fn finish_in(
        &mut self,
        scope: Option<&str>,
        class: crate::ClassId,
        resource: Option<super::Decision>,
        end: TurnEnd,
        wakes: &mut Wakes<W>,
    ) {
        let mut estimate_grew = false;
        if let Some(overload) = &mut self.overload {
            overload.saw(end.ended_at);
            if end.outcome == Outcome::Success {
                let before = overload.service.estimate();
                overload
                    .service
                    .record(end.ended_at.saturating_sub(end.started_at));
                estimate_grew = overload.service.estimate() > before;
            }
            if let Some(controller) = &mut overload.controller {
                controller.on_sample(Sample {
                    started_at: end.started_at,
                    ended_at: end.ended_at,
                    in_flight: end.in_flight,
                    outcome: end.outcome,
                    remaining: end.remaining,
                });
            }
        }
        if estimate_grew {
            // Deadlines that a longer expected turn no longer fits are refused now.
            self.refuse_infeasible(wakes);
        }
        self.follow_controller(wakes);
        self.release_in(scope, class, resource, wakes);
    }

    /// Sets the ceiling the controller wants; a higher one starts waiters at once, a lower
    /// one is reached as turns end (running turns are never cancelled).
    fn follow_controller(&mut self, wakes: &mut Wakes<W>) {
        let wanted = self.ceiling_under(self.limits.max_concurrent_runs);
        if wanted != self.ceiling {
            let raised = wanted > self.ceiling;
            self.ceiling = wanted;
            if raised {
                self.dispatch(0, wakes);
            }
        }
    }

    /// Whether a turn arriving at `now` with `deadline` (on the same clock) should be
    /// refused rather than queued: its deadline has passed, or less of it is left than a
    /// typical turn takes, so its caller would leave before it finished.
    pub(super) fn misses_deadline(&self, deadline: Duration, now: Duration) -> bool {
        let left = deadline.saturating_sub(now);
        left.is_zero() || self.service_time().is_some_and(|service| left < service)
    }

    /// When a waiter with `deadline` should be refused with [`Rejection::Deadline`] if it
    /// still waits: once less than a typical turn is left. The caller arms a timer for it
    /// and calls [`GateState::expire_for`].
    pub fn deadline_timer(&self, deadline: Duration) -> Duration {
        deadline.saturating_sub(self.service_time().unwrap_or_default())
    }

    /// Notes a turn joining the queue (the discipline learns when the queue was empty).
    pub(super) fn on_enqueue(&mut self, now: Duration) {
        let queued = self.queue.len();
        if let Some(overload) = &mut self.overload {
            overload.saw(now);
            overload.discipline.on_enqueue(now, queued);
        }
    }

    /// Notes a waiter handed a slot after waiting since `enqueued_at` (CoDel's input).
    pub(super) fn on_dequeue(&mut self, enqueued_at: Duration) {
        if let Some(overload) = &mut self.overload {
            let now = overload.now;
            overload
                .discipline
                .on_dequeue(now, now.saturating_sub(enqueued_at));
        }
    }

    /// How to serve the queue now. Under a controlled mode, first refuses every waiter
    /// older than its cap (with `timeout`, counted in `rejected`).
    pub(super) fn serve_mode(&mut self, wakes: &mut Wakes<W>) -> QueueMode {
        let queued = self.queue.len();
        let Some(overload) = &mut self.overload else {
            return QueueMode::Fifo;
        };
        let now = overload.now;
        let service = overload.service.estimate();
        let mode = overload.discipline.mode(now, queued, service);
        if let QueueMode::Controlled { max_wait, .. } = mode {
            // Waiters past the cap leave, but never so many that a free slot stays idle:
            // the newest of them, as many as slots are free, are served instead.
            let free = self.free_slots();
            while let Some(oldest) = self.queue.oldest() {
                if self.queue.len() <= free {
                    break;
                }
                let too_old = self
                    .queue
                    .get(oldest)
                    .is_some_and(|record| now.saturating_sub(record.enqueued_at) > max_wait);
                if !too_old || !self.refuse_waiter(oldest, Rejection::Timeout, wakes) {
                    break;
                }
            }
        }
        mode
    }

    /// A waiting turn's deadline timer ([`GateState::deadline_timer`]) or queue timeout
    /// ran out: it is refused for `reason`. `false` when it no longer waited.
    pub fn expire_for(
        &mut self,
        key: crate::WaiterKey,
        reason: Rejection,
        wakes: &mut Wakes<W>,
    ) -> bool {
        match self.queue.lookup(key) {
            Some((index, record)) if record.state == WaiterState::Waiting => {
                self.refuse_waiter(index, reason, wakes)
            }
            _ => false,
        }
    }

    /// Remembers the deadline of the waiter just queued under `key`.
    pub(super) fn remember_deadline(&mut self, key: WaiterKey, deadline: Option<Duration>) {
        let (Some(deadline), Some(overload)) = (deadline, self.overload.as_mut()) else {
            return;
        };
        if overload.deadlines.len() > 64 && overload.deadlines.len() / 2 > self.queue.records() {
            // Entries of waiters gone (granted, refused, withdrawn) are dropped in bulk.
            let queue = &self.queue;
            overload.deadlines.retain(|key, _| {
                queue
                    .lookup(*key)
                    .is_some_and(|(_, record)| record.state == WaiterState::Waiting)
            });
            overload.by_deadline = overload
                .deadlines
                .iter()
                .map(|(&key, &place)| (place, key))
                .collect();
        }
        overload.deadline_seq = overload.deadline_seq.wrapping_add(1);
        let place = (deadline, overload.deadline_seq);
        if let Some(old) = overload.deadlines.insert(key, place) {
            overload.by_deadline.remove(&old);
        }
        overload.by_deadline.insert(place, key);
    }

    /// The deadline of the waiter at `index`, if it has one.
    fn deadline_of(&self, index: u32) -> Option<Duration> {
        let overload = self.overload.as_ref()?;
        if overload.deadlines.is_empty() {
            return None;
        }
        let key = self.queue.key(index)?;
        overload.deadlines.get(&key).map(|&(deadline, _)| deadline)
    }

    /// Whether the waiter at `index` may no longer be granted a slot: its deadline can no
    /// longer be met at the current estimate (checked just before each grant).
    pub(super) fn waiter_misses_deadline(&self, index: u32) -> bool {
        match (self.deadline_of(index), self.overload.as_ref()) {
            (Some(deadline), Some(overload)) => self.misses_deadline(deadline, overload.now),
            _ => false,
        }
    }

    /// Refuses every waiter whose deadline the current estimate no longer fits: a prefix of
    /// the waiters by deadline (less is left of an earlier deadline).
    fn refuse_infeasible(&mut self, wakes: &mut Wakes<W>) {
        let mut due = Vec::new();
        if let Some(overload) = self.overload.as_ref() {
            let now = overload.now;
            for (&place, &key) in &overload.by_deadline {
                if !self.misses_deadline(place.0, now) {
                    break;
                }
                due.push((place, key));
            }
        }
        for (place, key) in due {
            if let Some(overload) = self.overload.as_mut() {
                overload.by_deadline.remove(&place);
                overload.deadlines.remove(&key);
            }
            // A waiter gone already (granted, refused, withdrawn) is left alone.
            self.expire_for(key, Rejection::Deadline, wakes);
        }
    }

    /// When the waiter under `key` should next be looked at by [`GateState::recheck`], and
    /// for which refusal: once less of its `deadline` is left than the expected service time
    /// ([`Rejection::Deadline`]), or, under the adaptive queue, once it will have waited its
    /// cap while the queue stands ([`Rejection::Timeout`]), whichever comes first. `None`: no
    /// such look is needed (no deadline, no cap to apply, or it no longer waits).
    pub fn next_check(
        &self,
        key: WaiterKey,
        deadline: Option<Duration>,
    ) -> Option<(Duration, Rejection)> {
        let overload = self.overload.as_ref()?;
        let (_, record) = self
            .queue
            .lookup(key)
            .filter(|(_, record)| record.state == WaiterState::Waiting)?;
        // Past the timer, not at it: `misses_deadline` compares strictly (exactly a turn left
        // still fits), so a look at the timer itself would find nothing to do and ask again.
        let infeasible = deadline.map(|d| {
            (
                self.deadline_timer(d).saturating_add(PAST),
                Rejection::Deadline,
            )
        });
        let capped = overload
            .discipline
            .cap_due(record.enqueued_at, overload.service.estimate())
            .map(|at| (at.saturating_add(PAST), Rejection::Timeout));
        let next = match (infeasible, capped) {
            (Some(d), Some(c)) if c.0 < d.0 => Some(c),
            (Some(d), _) => Some(d),
            (None, c) => c,
        };
        // Never at or before the last look: a look that found nothing due asks again later,
        // so no driver loops at one instant (the simulator's clock would never move).
        next.map(|(at, reason)| (at.max(overload.now.saturating_add(PAST)), reason))
    }

    /// The waiter under `key` (with `deadline`) is looked at at `now`, as
    /// [`GateState::next_check`] asked: refused with `deadline` if its deadline can no longer
    /// be met, or with `timeout` if it waited longer than the adaptive queue's cap while the
    /// queue stands (never while a slot it could take is free: it is granted instead).
    /// Returns whether it was refused; if not and it still waits, the caller asks
    /// [`GateState::next_check`] again (the estimate moved since).
    pub fn recheck(
        &mut self,
        key: WaiterKey,
        deadline: Option<Duration>,
        now: Duration,
        wakes: &mut Wakes<W>,
    ) -> bool {
        self.saw_time(now);
        let Some((index, record)) = self.queue.lookup(key) else {
            return false;
        };
        if record.state != WaiterState::Waiting {
            return false;
        }
        let enqueued_at = record.enqueued_at;
        if deadline.is_some_and(|d| self.misses_deadline(d, now)) {
            return self.refuse_waiter(index, Rejection::Deadline, wakes);
        }
        let queued = self.queue.len();
        let Some(overload) = self.overload.as_mut() else {
            return false;
        };
        let service = overload.service.estimate();
        let mode = overload.discipline.mode(now, queued, service);
        let QueueMode::Controlled { max_wait, .. } = mode else {
            return false;
        };
        if now.saturating_sub(enqueued_at) <= max_wait {
            return false;
        }
        // A free slot goes to waiters before anyone is refused for waiting too long.
        self.dispatch(0, wakes);
        match self.queue.lookup(key) {
            Some((index, record)) if record.state == WaiterState::Waiting => {
                self.refuse_waiter(index, Rejection::Timeout, wakes)
            }
            _ => false,
        }
    }

    /// Counts a turn refused on arrival for its deadline.
    pub(super) fn refuse_for_deadline(&mut self) {
        increment(&mut self.rejected);
    }
}

#[cfg(test)]
mod tests;
