//! How long a refused turn should wait before trying again: the recent release rate.
//!
//! The estimate is `(turns ahead + 1) / releases per second`, where the rate is measured over
//! the last [`WINDOW`]. The gate never reads a clock on the admitted path, so the estimator
//! only sees time when the caller reads it anyway (a turn queues or is refused): each such
//! moment may leave a sample `(time, releases so far)`, at most one per [`SPACING`]. The rate
//! is the releases since the anchor divided by the time since it, where the anchor is the
//! newest sample at least [`WINDOW`] old (or the oldest sample, while the history is shorter
//! than the window). With no release since the anchor the rate is at most one per span,
//! which gives a long estimate for a gate stuck on long turns and a short one for a gate that
//! has only just filled up. At most one sample older than the window is kept, so the history
//! is bounded (`WINDOW / SPACING + 1` samples).
//!
//! Before any turn has ended, nothing says how long turns take: the span since the first
//! sample is only how long the gate has been full, microseconds at its first refusal. The hint
//! is then at least [`RETRY_BEFORE_ANY_RELEASE`], a default that errs long: agent turns take
//! seconds, and a client that honours a short hint is refused again by the same full gate.

use std::collections::VecDeque;
use std::time::Duration;

/// How far back the release rate looks.
pub const WINDOW: Duration = Duration::from_secs(10);
/// The closest two samples may be.
pub const SPACING: Duration = Duration::from_millis(250);
/// The bounds a client-facing retry hint is clamped to.
pub const RETRY_MIN: Duration = Duration::from_secs(1);
/// See [`RETRY_MIN`].
pub const RETRY_MAX: Duration = Duration::from_secs(30);
/// The least retry hint a client gets before any turn has ended (see the module's docs).
pub const RETRY_BEFORE_ANY_RELEASE: Duration = Duration::from_secs(5);
/// The retry hint for a turn refused under hard memory pressure: memory frees as turns end,
/// which the release rate does not predict, so a fixed pause.
pub const MEMORY_PRESSURE_RETRY: Duration = Duration::from_secs(5);

/// Samples of the release counter at the moments a clock was read.
#[derive(Debug, Default)]
pub struct ReleaseRate {
    samples: VecDeque<(Duration, u64)>,
}

impl ReleaseRate {
    /// Notes that `releases` turns had ended by `now`.
    pub fn observe(&mut self, now: Duration, releases: u64) {
        if let Some(&(last, _)) = self.samples.back() {
            if now.saturating_sub(last) < SPACING {
                return;
            }
        }
        self.samples.push_back((now, releases));
        // Keep one sample at least a window old: the anchor.
        while self
            .samples
            .get(1)
            .is_some_and(|&(at, _)| now.saturating_sub(at) >= WINDOW)
        {
            self.samples.pop_front();
        }
    }

    /// Seconds until `ahead + 1` more turns have ended at the recent rate, unclamped; `None`
    /// before the first observation.
    pub fn estimate(&self, ahead: u64, now: Duration, releases: u64) -> Option<Duration> {
        let anchor = self
            .samples
            .iter()
            .rev()
            .find(|(at, _)| now.saturating_sub(*at) >= WINDOW)
            .or(self.samples.front())?;
        let span = now.saturating_sub(anchor.0).as_secs_f64();
        let released = releases.saturating_sub(anchor.1);
        let needed = (ahead as f64) + 1.0;
        let seconds = if released == 0 {
            // No release seen: the rate is below one per span.
            needed * span
        } else {
            needed * span / released as f64
        };
        Some(Duration::try_from_secs_f64(seconds).unwrap_or(Duration::MAX))
    }

    /// [`ReleaseRate::estimate`] for a waiter's expected wait: `None` until some turn has
    /// ended. Before that the rate's span says nothing of how long turns take: a gate that has
    /// just filled up would estimate the microseconds since its first sample. (The retry hint
    /// keeps the bound instead, clamped to [`RETRY_MIN`] at least.)
    pub fn expected_wait(&self, ahead: u64, now: Duration, releases: u64) -> Option<Duration> {
        if releases == 0 {
            return None;
        }
        self.estimate(ahead, now, releases)
    }

    /// [`ReleaseRate::estimate`] clamped to `[RETRY_MIN, RETRY_MAX]`: the hint a client gets;
    /// before any turn has ended, at least [`RETRY_BEFORE_ANY_RELEASE`] (turns have lasted
    /// at least the span seen so far, and nothing says how much longer).
    pub fn retry_after(&self, ahead: u64, now: Duration, releases: u64) -> Duration {
        let estimate = self.estimate(ahead, now, releases).unwrap_or(RETRY_MIN);
        let least = if releases == 0 {
            RETRY_BEFORE_ANY_RELEASE
        } else {
            RETRY_MIN
        };
        estimate.max(least).clamp(RETRY_MIN, RETRY_MAX)
    }

    /// Forgets every sample.
    pub fn reset(&mut self) {
        self.samples.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    #[test]
    fn rate_over_the_window() {
        let mut r = ReleaseRate::default();
        r.observe(secs(0.0), 0);
        r.observe(secs(2.0), 20); // 10 releases per second
                                  // 9 ahead + this one = 10 turns at 10/s: one second.
        let est = r.estimate(9, secs(2.0), 20).unwrap();
        assert!((est.as_secs_f64() - 1.0).abs() < 1e-9, "{est:?}");
        assert_eq!(r.retry_after(0, secs(2.0), 20), RETRY_MIN);
        assert_eq!(r.retry_after(10_000, secs(2.0), 20), RETRY_MAX);
    }

    #[test]
    fn old_samples_fall_out_but_one_anchor_stays() {
        let mut r = ReleaseRate::default();
        r.observe(secs(0.0), 0);
        r.observe(secs(1.0), 100); // a fast burst long ago
        r.observe(secs(30.0), 100);
        // Nothing released in the 29 s since the last sample before the window.
        let est = r.estimate(0, secs(30.0), 100).unwrap();
        assert!((est.as_secs_f64() - 29.0).abs() < 1e-9, "{est:?}");
        assert_eq!(r.samples.len(), 2);
    }

    #[test]
    fn unknown_before_any_sample_and_spacing_is_kept() {
        let mut r = ReleaseRate::default();
        assert_eq!(r.estimate(3, secs(1.0), 0), None);
        assert_eq!(r.retry_after(3, secs(1.0), 0), RETRY_BEFORE_ANY_RELEASE);
        r.observe(secs(1.0), 0);
        r.observe(secs(1.1), 5); // too close: ignored
        assert_eq!(r.samples.len(), 1);
        // Just filled up: 5 releases in 0.5 s -> 10/s.
        let est = r.estimate(4, secs(1.5), 5).unwrap();
        assert!((est.as_secs_f64() - 0.5).abs() < 1e-9, "{est:?}");
    }

    #[test]
    fn no_expected_wait_until_a_turn_has_ended() {
        let mut r = ReleaseRate::default();
        r.observe(secs(1.0), 0);
        // Just filled up: the estimate is the microseconds since the sample, not a wait.
        assert!(r.estimate(0, secs(1.00001), 0).is_some());
        assert_eq!(r.expected_wait(0, secs(1.00001), 0), None);
        assert_eq!(r.retry_after(0, secs(1.00001), 0), RETRY_BEFORE_ANY_RELEASE);
        let est = r.expected_wait(4, secs(1.5), 5).unwrap();
        assert!((est.as_secs_f64() - 0.5).abs() < 1e-9, "{est:?}");
    }

    /// Issue 27: a gate whose turns take 3 s answered its first refusal "retry after 1 s", so
    /// a client that honoured it was refused again.
    #[test]
    fn the_first_refusals_hint_errs_long_until_a_turn_has_ended() {
        let mut r = ReleaseRate::default();
        r.observe(secs(0.0), 0);
        // Full for 1 ms, no turn ended: the default, not the microseconds seen.
        assert_eq!(r.retry_after(0, secs(0.001), 0), RETRY_BEFORE_ANY_RELEASE);
        // Full for 8 s with no turn ended: the turns take longer than the default says.
        r.observe(secs(8.0), 0);
        assert_eq!(r.retry_after(0, secs(8.0), 0), secs(8.0));
        // One turn ended after 3 s (a second gate): the measured rate from then on.
        let mut r = ReleaseRate::default();
        r.observe(secs(0.0), 0);
        r.observe(secs(3.0), 1);
        assert_eq!(r.retry_after(0, secs(3.0), 1), secs(3.0));
        assert_eq!(r.retry_after(1, secs(3.0), 1), secs(6.0));
    }
}
