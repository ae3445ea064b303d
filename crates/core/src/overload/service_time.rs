//! The expected service time: a smoothed recent turn duration.
//!
//! An exponentially weighted moving average of successful turn durations with weight
//! [`WEIGHT`] per sample: it follows a change within a few dozen turns and one outlier
//! moves it by an eighth of the difference. Deadlines are checked against it (a turn whose
//! caller will have left before a typical turn ends is refused), and the queue discipline's
//! interval and target are multiples of it, so nothing is sized in fixed milliseconds.

use std::time::Duration;

/// The weight of each new sample.
pub const WEIGHT: f64 = 1.0 / 8.0;

/// A smoothed turn duration; empty until the first sample.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ServiceTime {
    mean_s: Option<f64>,
    samples: u64,
}

impl ServiceTime {
    /// Adds one turn's duration.
    pub fn record(&mut self, duration: Duration) {
        let x = duration.as_secs_f64();
        self.mean_s = Some(match self.mean_s {
            None => x,
            Some(mean) => mean + WEIGHT * (x - mean),
        });
        self.samples = self.samples.saturating_add(1);
    }

    /// The estimate, `None` before any turn has ended.
    pub fn estimate(&self) -> Option<Duration> {
        self.mean_s
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
    }

    /// How many durations were recorded.
    pub fn samples(&self) -> u64 {
        self.samples
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_until_the_first_sample_then_follows_a_change() {
        let mut estimate = ServiceTime::default();
        assert_eq!(estimate.estimate(), None);
        estimate.record(Duration::from_millis(50));
        assert_eq!(estimate.estimate(), Some(Duration::from_millis(50)));
        for _ in 0..40 {
            estimate.record(Duration::from_millis(200));
        }
        let now = estimate.estimate().unwrap().as_secs_f64();
        assert!((now - 0.2).abs() < 0.002, "{now}");
        assert_eq!(estimate.samples(), 41);
    }

    #[test]
    fn one_outlier_moves_it_by_an_eighth() {
        let mut estimate = ServiceTime::default();
        estimate.record(Duration::from_millis(100));
        estimate.record(Duration::from_millis(900));
        let now = estimate.estimate().unwrap().as_secs_f64();
        assert!((now - 0.2).abs() < 1e-9, "{now}");
    }
}
