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

use std::time::Duration;

use super::{GateState, Rejection, Wakes};
use crate::count::increment;
use crate::overload::{
    Discipline, LimitController, Outcome, QueueDiscipline, QueueMode, Sample, ServiceTime,
};
use crate::waiters::WaiterState;

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
}

impl Overload {
    fn new(controller: Option<Box<dyn LimitController>>, discipline: Discipline) -> Self {
        Self {
            controller,
            discipline: QueueDiscipline::new(discipline),
            service: ServiceTime::default(),
            now: Duration::ZERO,
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

    /// Notes the time: it ages waiters for the discipline between clock readings.
    pub(super) fn saw_time(&mut self, now: Duration) {
        if let Some(overload) = &mut self.overload {
            overload.saw(now);
        }
    }

    /// A turn admitted at `now` starts running; returns the turns running then, itself
    /// included (slots granted to turns that have not started yet are not counted: they
    /// have not reached the provider). The caller keeps it for [`GateState::finish`].
    pub fn turn_started(&mut self, now: Duration, wakes: &mut Wakes<W>) -> u64 {
        let running = self.in_flight.saturating_sub(self.granted_unclaimed);
        let queued = self.queue.len();
        if let Some(overload) = &mut self.overload {
            overload.saw(now);
            if let Some(controller) = &mut overload.controller {
                controller.on_start(now, running, queued);
            }
        }
        // Slow start may have raised the ceiling: waiters start at once.
        self.follow_controller(wakes);
        running
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
        if let Some(overload) = &mut self.overload {
            overload.saw(end.ended_at);
            if end.outcome == Outcome::Success {
                overload
                    .service
                    .record(end.ended_at.saturating_sub(end.started_at));
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
            while let Some(oldest) = self.queue.oldest() {
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

    /// Counts a turn refused on arrival for its deadline.
    pub(super) fn refuse_for_deadline(&mut self) {
        increment(&mut self.rejected);
    }
}

#[cfg(test)]
mod tests;
