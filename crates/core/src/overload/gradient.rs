//! A baseline: Netflix concurrency-limits' `Gradient2Limit`, a latency-only controller.
//!
//! Each window: `gradient = clamp(TOLERANCE * long / short, 0.5, 1)` where `short` is the
//! window's mean round trip and `long` a slow average of them; the new limit is
//! `limit * gradient + sqrt(limit)` (the queue allowance), smoothed by [`SMOOTHING`]. A
//! refused call is a sample like any other (Gradient2 ignores `didDrop`), so fast 429s read
//! as a fast provider: the weakness the issue names.

use std::time::Duration;

use super::limit::{clamp, to_count, LimitController, Sample};

/// Gradient2's `rttTolerance`.
pub const TOLERANCE: f64 = 1.5;
/// Gradient2's `smoothing`.
pub const SMOOTHING: f64 = 0.2;
/// Gradient2's `longWindow`, in windows.
pub const LONG_WINDOW: f64 = 600.0;

/// A Gradient2-style limit.
#[derive(Clone, Debug)]
pub struct Gradient2 {
    min: u64,
    max: u64,
    estimate: f64,
    window_start: Duration,
    rtt_sum_s: f64,
    samples: u64,
    max_in_flight: u64,
    long_s: Option<f64>,
}

impl Gradient2 {
    /// Between `min` and `max`, starting at `initial` (Netflix: 20).
    pub fn new(min: u64, max: u64, initial: u64) -> Self {
        let max = max.max(1);
        let min = min.clamp(1, max);
        Self {
            min,
            max,
            estimate: clamp(initial, min, max) as f64,
            window_start: Duration::ZERO,
            rtt_sum_s: 0.0,
            samples: 0,
            max_in_flight: 0,
            long_s: None,
        }
    }

    fn roll(&mut self, now: Duration) {
        let Some(short) = (self.samples > 0).then(|| self.rtt_sum_s / self.samples as f64) else {
            return;
        };
        let long = *self.long_s.get_or_insert(short);
        if now.saturating_sub(self.window_start) < Duration::from_secs_f64(long.max(1e-3)) {
            return;
        }
        let mut long = long + (short - long) / LONG_WINDOW.min(self.samples as f64 + 10.0);
        // Gradient2: a long average far above the short one decays, to recover faster.
        if long / short > 2.0 {
            long *= 0.95;
        }
        self.long_s = Some(long);
        // Gradient2 does not grow while the application uses under half the limit.
        if (self.max_in_flight as f64) >= self.estimate / 2.0 {
            let gradient = (TOLERANCE * long / short).clamp(0.5, 1.0);
            let target = self.estimate * gradient + self.estimate.sqrt();
            let next = self.estimate * (1.0 - SMOOTHING) + target * SMOOTHING;
            self.estimate = next.clamp(self.min as f64, self.max as f64);
        }
        self.window_start = now;
        self.rtt_sum_s = 0.0;
        self.samples = 0;
        self.max_in_flight = 0;
    }
}

impl LimitController for Gradient2 {
    fn name(&self) -> &'static str {
        "gradient2 (netflix)"
    }

    fn limit(&self) -> u64 {
        clamp(to_count(self.estimate), self.min, self.max)
    }

    fn on_start(&mut self, now: Duration, in_flight: u64, _queued: u64) {
        self.roll(now);
        self.max_in_flight = self.max_in_flight.max(in_flight);
    }

    fn on_sample(&mut self, sample: Sample) {
        self.roll(sample.ended_at);
        self.rtt_sum_s += sample.rtt().as_secs_f64();
        self.samples = self.samples.saturating_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::overload::limit::Outcome;

    #[test]
    fn fast_refusals_read_as_a_fast_provider_and_it_grows() {
        let mut limit = Gradient2::new(1, 64, 8);
        let mut t = 0u64;
        for i in 0..400u64 {
            let outcome = if i % 2 == 0 {
                Outcome::Success
            } else {
                Outcome::Throttled { retry_after: None }
            };
            let rtt = if i % 2 == 0 { 50 } else { 1 };
            let now = limit.limit();
            limit.on_start(Duration::from_millis(t), now, 0);
            limit.on_sample(Sample {
                started_at: Duration::from_millis(t),
                ended_at: Duration::from_millis(t + rtt),
                in_flight: now,
                outcome,
                remaining: None,
            });
            t += 20;
        }
        assert!(limit.limit() > 8, "{}", limit.limit());
    }
}
