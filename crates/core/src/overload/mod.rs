//! Overload control: an adaptive concurrency ceiling, a queue discipline for standing
//! queues, and the service-time estimate deadlines are checked against.
//!
//! Everything here is pure: time and outcomes are inputs, nothing reads a clock, nothing
//! imports pyo3. The gate consults these policies; the simulator ([`sim`]) drives the real
//! gate with any of them side by side, which is how the defaults were chosen.
//!
//! * [`limit`]: the [`LimitController`] trait every ceiling algorithm implements, and the
//!   [`Sample`] of one finished provider call it learns from.
//! * [`capacity`]: admitgate's own controller ([`CapacitySearch`]): it reads a 429 as a
//!   measurement of the provider's capacity, not only as a "slow down".
//! * [`aimd`]: a Vector-ARC-style additive-increase / multiplicative-decrease baseline.
//! * [`gradient`]: a Netflix-Gradient2-style latency-gradient baseline.
//! * [`discipline`]: controlled delay with adaptive LIFO ("Fail at Scale"), and CoDel alone.
//! * [`service_time`]: the recent turn duration, smoothed.

pub mod aimd;
pub mod capacity;
pub mod discipline;
pub mod gradient;
pub mod limit;
pub mod service_time;
pub mod sim;

pub use aimd::Aimd;
pub use capacity::{CapacitySearch, CapacitySearchConfig};
pub use discipline::{Discipline, QueueDiscipline, QueueMode};
pub use gradient::Gradient2;
pub use limit::{LimitController, Outcome, Sample};
pub use service_time::ServiceTime;

/// What the controllers' unit tests build their samples from.
#[cfg(test)]
pub(crate) mod test_support {
    use std::time::Duration;

    use super::limit::{Outcome, Sample};

    /// `n` milliseconds.
    pub(crate) fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A call that ran from `start` to `end` ms with `in_flight` calls running when it began.
    pub(crate) fn sample(start: u64, end: u64, in_flight: u64, outcome: Outcome) -> Sample {
        Sample {
            started_at: ms(start),
            ended_at: ms(end),
            in_flight,
            outcome,
            remaining: None,
        }
    }
}
