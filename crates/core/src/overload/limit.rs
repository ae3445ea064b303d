//! The interface every adaptive-ceiling algorithm implements, so the gate and the simulator
//! can swap them (as Netflix concurrency-limits puts one class per algorithm behind `Limit`).

use std::fmt;
use std::time::Duration;

/// How one provider call ended, as far as its ceiling is concerned.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Outcome {
    /// The call was served (whatever the caller then did with the answer).
    Success,
    /// The provider refused it for load (HTTP 429, gRPC RESOURCE_EXHAUSTED), with the pause
    /// it asked for, if any (`Retry-After`).
    Throttled {
        /// The provider's `Retry-After`, when it sent one.
        retry_after: Option<Duration>,
    },
    /// The call ended otherwise (the caller left, an unrelated error): says nothing about the
    /// provider's capacity, and is ignored.
    Ignored,
}

/// One finished turn, reported to the controller.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    /// When the turn started running, on the gate's clock.
    pub started_at: Duration,
    /// When it ended.
    pub ended_at: Duration,
    /// Turns running when it started, itself included (turns that had started and not
    /// ended, not slots granted to turns yet to start): a call refused at once by a provider
    /// that admits `c` concurrent calls had `in_flight - 1 >= c` others running.
    pub in_flight: u64,
    /// How it ended.
    pub outcome: Outcome,
    /// The provider's `x-ratelimit-remaining-requests`, when reported: at 0 the controller
    /// does not probe upwards.
    pub remaining: Option<u64>,
}

impl Sample {
    /// How long the call took.
    pub fn rtt(&self) -> Duration {
        self.ended_at.saturating_sub(self.started_at)
    }
}

/// An algorithm that sets the gate's effective ceiling from what finished turns report.
///
/// The ceiling stays within `[min_limit, max_limit]`. Methods take the time as an argument;
/// no implementation reads a clock.
pub trait LimitController: Send + fmt::Debug {
    /// A short name for tables and metrics.
    fn name(&self) -> &'static str;
    /// The ceiling now.
    fn limit(&self) -> u64;
    /// A turn started at `now` with `in_flight` turns (itself included) holding slots and
    /// `queued` waiting: whether the limit is being reached is what growth depends on.
    fn on_start(&mut self, now: Duration, in_flight: u64, queued: u64);
    /// A turn ended.
    fn on_sample(&mut self, sample: Sample);
    /// The in-flight figure the turn that just started (after [`LimitController::on_start`])
    /// should carry back in its [`Sample`]: `in_flight` (the gate's count), unless the
    /// controller counts otherwise (a fleet's learner: the turns in flight across the fleet).
    /// Handed to the turn, not kept here, so nothing is remembered per turn.
    fn start_figure(&self, in_flight: u64) -> u64 {
        in_flight
    }
    /// The configured most (`max_concurrent_runs`) changed to `max` (a reconfiguration): the
    /// ceiling's upper bound follows it, both ways. A controller bounded by something else (a
    /// fleet's learned limit, by the fleet's cap) keeps its bounds: the gate clamps its value
    /// to `max` anyway.
    fn set_max_limit(&mut self, max: u64) {
        let _ = max;
    }
}

/// `value` within `[min, max]` (`min` wins should they cross).
pub(crate) fn clamp(value: u64, min: u64, max: u64) -> u64 {
    value.min(max).max(min)
}

/// Rounds a non-negative float to a count, saturating.
pub(crate) fn to_count(value: f64) -> u64 {
    if value.is_nan() || value <= 0.0 {
        0
    } else if value >= u64::MAX as f64 {
        u64::MAX
    } else {
        value as u64
    }
}
