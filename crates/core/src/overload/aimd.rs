//! A baseline: additive increase, multiplicative decrease, as Vector's adaptive request
//! concurrency (`src/sinks/util/adaptive_concurrency/controller.rs`) decides.
//!
//! One decision per window of one mean round trip: back-pressure (a 429) seen in the window
//! takes [`DECREASE`] of the limit; else a round trip above the past mean plus
//! [`DEVIATION_SCALE`] deviations does too; else, if the limit was reached, +1.

use std::time::Duration;

use super::limit::{clamp, to_count, LimitController, Outcome, Sample};

/// What a decrease keeps (Vector's `decrease_ratio`).
pub const DECREASE: f64 = 0.9;
/// Vector's `ewma_alpha` for the past round-trip mean.
pub const EWMA_ALPHA: f64 = 0.4;
/// Vector's `rtt_deviation_scale`.
pub const DEVIATION_SCALE: f64 = 2.5;

/// A Vector-ARC-style AIMD limit.
#[derive(Clone, Debug)]
pub struct Aimd {
    min: u64,
    max: u64,
    limit: u64,
    window_start: Duration,
    reached: bool,
    throttled: bool,
    rtt_sum_s: f64,
    samples: u64,
    past_mean_s: Option<f64>,
    past_deviation_s: f64,
}

impl Aimd {
    /// Between `min` and `max`, starting at `initial` (Vector starts at 1).
    pub fn new(min: u64, max: u64, initial: u64) -> Self {
        let max = max.max(1);
        let min = min.clamp(1, max);
        Self {
            min,
            max,
            limit: clamp(initial, min, max),
            window_start: Duration::ZERO,
            reached: false,
            throttled: false,
            rtt_sum_s: 0.0,
            samples: 0,
            past_mean_s: None,
            past_deviation_s: 0.0,
        }
    }

    fn roll(&mut self, now: Duration) {
        let Some(past) = self.past_mean_s else {
            if self.samples > 0 {
                self.past_mean_s = Some(self.rtt_sum_s / self.samples as f64);
            }
            return;
        };
        if now.saturating_sub(self.window_start) < Duration::from_secs_f64(past.max(1e-3)) {
            return;
        }
        let current = (self.samples > 0).then(|| self.rtt_sum_s / self.samples as f64);
        if self.throttled
            || current.is_some_and(|rtt| rtt > past + DEVIATION_SCALE * self.past_deviation_s)
        {
            self.limit = clamp(to_count(self.limit as f64 * DECREASE), self.min, self.max);
        } else if self.reached {
            self.limit = clamp(self.limit.saturating_add(1), self.min, self.max);
        }
        if let Some(rtt) = current {
            let mean = past + EWMA_ALPHA * (rtt - past);
            self.past_deviation_s += EWMA_ALPHA * ((rtt - mean).abs() - self.past_deviation_s);
            self.past_mean_s = Some(mean);
        }
        self.window_start = now;
        self.reached = false;
        self.throttled = false;
        self.rtt_sum_s = 0.0;
        self.samples = 0;
    }
}

impl LimitController for Aimd {
    fn name(&self) -> &'static str {
        "aimd (vector arc)"
    }

    fn limit(&self) -> u64 {
        self.limit
    }

    fn on_start(&mut self, now: Duration, in_flight: u64, _queued: u64) {
        self.roll(now);
        if in_flight >= self.limit {
            self.reached = true;
        }
    }

    fn on_sample(&mut self, sample: Sample) {
        self.roll(sample.ended_at);
        match sample.outcome {
            Outcome::Throttled { .. } => self.throttled = true,
            Outcome::Success => {
                self.rtt_sum_s += sample.rtt().as_secs_f64();
                self.samples = self.samples.saturating_add(1);
            }
            Outcome::Ignored => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::overload::test_support::{ms, sample};

    #[test]
    fn plus_one_per_window_at_the_limit_and_a_tenth_off_on_back_pressure() {
        let mut limit = Aimd::new(1, 64, 1);
        let mut t = 0;
        for _ in 0..11 {
            let now = limit.limit();
            limit.on_start(ms(t), now, 1);
            limit.on_sample(sample(t, t + 50, now, Outcome::Success));
            t += 50;
        }
        let grown = limit.limit();
        assert!((9..=12).contains(&grown), "{grown}");
        limit.on_sample(sample(
            t,
            t + 1,
            grown,
            Outcome::Throttled { retry_after: None },
        ));
        limit.on_start(ms(t + 60), grown, 1);
        assert_eq!(limit.limit(), to_count(grown as f64 * DECREASE));
    }
}
