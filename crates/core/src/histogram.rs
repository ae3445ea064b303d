//! A fixed-bucket duration histogram that many threads record into without a lock.
//!
//! Buckets are Prometheus-style upper bounds ([`DURATION_BUCKETS`] plus `+Inf`); a snapshot
//! reports them cumulatively, as a `HistogramMetricFamily` wants them. Each record is two
//! relaxed atomic adds (its bucket, the sum): a scrape may see a record's count before its sum, which only skews
//! one scrape's mean by one sample.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the duration buckets, in seconds: agent turns run from milliseconds (a
/// cached answer) to minutes (a long tool chain), so the ladder spans 5 ms to 5 min.
pub const DURATION_BUCKETS: [f64; 15] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// A histogram of durations over [`DURATION_BUCKETS`].
#[derive(Debug, Default)]
pub struct Histogram {
    /// Per bucket (not cumulative); the last one is `+Inf`.
    buckets: [AtomicU64; DURATION_BUCKETS.len() + 1],
    sum_nanos: AtomicU64,
}

/// A consistent-enough copy of a [`Histogram`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HistogramSnapshot {
    /// Observations recorded.
    pub count: u64,
    /// Their sum, in seconds.
    pub sum: f64,
    /// `(upper bound, observations at or below it)`, cumulative, ending with `+Inf`.
    pub buckets: Vec<(f64, u64)>,
}

impl Histogram {
    /// Records one duration.
    pub fn record(&self, value: Duration) {
        let seconds = value.as_secs_f64();
        // The `+Inf` bound takes every duration the finite ones do not.
        let bounds = DURATION_BUCKETS.iter().copied().chain([f64::INFINITY]);
        if let Some((_, bucket)) = bounds
            .zip(&self.buckets)
            .find(|&(bound, _)| seconds <= bound)
        {
            bucket.fetch_add(1, Ordering::Relaxed);
        }
        let nanos = u64::try_from(value.as_nanos()).unwrap_or(u64::MAX);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// The cumulative buckets, count and sum.
    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut running: u64 = 0;
        let bounds = DURATION_BUCKETS.iter().copied().chain([f64::INFINITY]);
        let buckets = bounds
            .zip(&self.buckets)
            .map(|(bound, bucket)| {
                running = running.saturating_add(bucket.load(Ordering::Relaxed));
                (bound, running)
            })
            .collect();
        HistogramSnapshot {
            // The buckets' total: `+Inf` always equals the count a scrape reports.
            count: running,
            sum: Duration::from_nanos(self.sum_nanos.load(Ordering::Relaxed)).as_secs_f64(),
            buckets,
        }
    }

    /// Forgets every observation (a forked child starts empty).
    pub fn reset(&self) {
        for bucket in &self.buckets {
            bucket.store(0, Ordering::Relaxed);
        }
        self.sum_nanos.store(0, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative_and_end_with_the_count() {
        let h = Histogram::default();
        h.record(Duration::from_millis(3));
        h.record(Duration::from_millis(5)); // on a bound: counted in it
        h.record(Duration::from_secs(2));
        h.record(Duration::from_secs(3600));
        let s = h.snapshot();
        assert_eq!(s.count, 4);
        assert_eq!(s.buckets[0], (0.005, 2));
        assert_eq!(s.buckets.iter().find(|(b, _)| *b == 2.5).unwrap().1, 3);
        assert_eq!(*s.buckets.last().unwrap(), (f64::INFINITY, 4));
        assert!((s.sum - 3602.008).abs() < 1e-6);
        h.reset();
        assert_eq!(h.snapshot().count, 0);
    }
}
