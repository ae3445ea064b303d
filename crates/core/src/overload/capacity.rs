//! admitgate's adaptive ceiling: a search for the provider's capacity.
//!
//! # Why not AIMD
//!
//! An LLM provider that is out of concurrency answers 429 at once. Such a refusal is a
//! measurement, not only a signal: the call that was refused started while `in_flight - 1`
//! other calls of this gate ran, so the provider admits at most that many. AIMD (Vector's
//! ARC: ×0.9 on back-pressure, +1 per round trip) ignores the number; it overshoots by a
//! round trip's worth of +1s and backs off by a tenth at a time, so on a small provider it
//! either spends a quarter of its calls on 429s or sits far below capacity. And fast 429s
//! fool a latency-only controller (Gradient2, Vegas): a refused call looks like a quick one.
//!
//! # The algorithm
//!
//! Time is cut into windows of one smoothed round trip (successful calls only). In each:
//!
//! * **A 429** sets the ceiling to `min(in_flight - 1, ceiling)` at once, not at the
//!   window's end: the capacity it measured. A call started at the ceiling that is refused
//!   takes one off (the capacity fell below the ceiling); a burst of refusals after an
//!   overshoot settles on the smallest measurement, never below it (refused calls still
//!   holding their slots count among the others, so they only ever measure higher), so it
//!   does not ratchet the ceiling to the floor. A `Retry-After` also holds every increase
//!   until it has passed.
//! * **Latency inflation** (the window's median round trip above [`INFLATION`] times the
//!   long-run baseline, over at least [`MIN_WINDOW_SAMPLES`] calls, for
//!   [`INFLATED_WINDOWS`] windows in a row) takes a tenth off: a
//!   provider that queues internally instead of refusing. Medians and a run of windows, not
//!   one window's mean: LLM turn durations are heavy-tailed (a log-normal of deviation 1 has
//!   a window mean above twice the long-run mean in one window out of six), and a controller
//!   that backs off on noise ratchets down to its floor.
//! * **Growth** happens only in a window where the ceiling was reached (a turn started at it,
//!   or turns waited): while nothing was ever refused, the ceiling doubles each window (slow
//!   start: a capacity it was not told is found in `log2(capacity)` round trips). After the
//!   first 429 it holds, and probes: once `probe_every` calls have started at the ceiling
//!   since the last change it tries one more; a probe that is not refused doubles its step
//!   next window (+1, +2, +4, ...: a capacity that grew is reached in `log2(growth)` round
//!   trips), and a refused one doubles the spacing before the next probe, up to
//!   [`PROBE_MAX_CALLS`]. Spacing counted in calls, not windows, bounds what probing costs
//!   as a fraction of calls whatever the capacity: a capacity that stays put costs one 429
//!   per [`PROBE_MAX_CALLS`] calls (1.6%), and one that grew is noticed within that many.
//! * With `x-ratelimit-remaining-requests` reported as 0, it does not grow.

use std::time::Duration;

use super::limit::{clamp, to_count, LimitController, Outcome, Sample};

/// A window's mean round trip above this multiple of the baseline is inflation.
pub const INFLATION: f64 = 2.0;
/// Fewer calls than this in a window say nothing about its latency.
pub const MIN_WINDOW_SAMPLES: usize = 4;
/// Consecutive inflated windows before the ceiling backs off.
pub const INFLATED_WINDOWS: u32 = 3;
/// The most round trips a window keeps for its median.
const WINDOW_SAMPLES: usize = 64;
/// What inflation keeps of the ceiling.
pub const INFLATION_BACKOFF: f64 = 0.9;
/// Calls started at the ceiling before the first probe, and after a probe succeeded.
pub const PROBE_BASE_CALLS: u64 = 16;
/// The most calls between probes (each refused probe doubles the spacing up to this).
pub const PROBE_MAX_CALLS: u64 = 64;
/// The weight of one call in the round-trip average that sizes the window.
const RTT_WEIGHT: f64 = 1.0 / 8.0;
/// The weight of one window's mean in the long-run baseline inflation is measured against:
/// per window, not per call, so a busy gate's baseline does not follow an inflation within
/// a round trip or two.
const BASELINE_WEIGHT: f64 = 1.0 / 32.0;

/// The knobs of [`CapacitySearch`]; none should need changing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CapacitySearchConfig {
    /// The lowest ceiling (at least 1, so the gate always makes progress).
    pub min_limit: u64,
    /// The highest ceiling: the gate's `max_concurrent_runs`.
    pub max_limit: u64,
    /// The ceiling before anything was learned.
    pub initial_limit: u64,
}

impl CapacitySearchConfig {
    /// The defaults under a gate of `max_limit` slots: from 1 up to `max_limit`, starting
    /// at 4 (a provider of 1 costs three 429s; one of 64 is found in 4 round trips).
    pub fn new(max_limit: u64) -> Self {
        let max_limit = max_limit.max(1);
        Self {
            min_limit: 1,
            max_limit,
            initial_limit: max_limit.min(4),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Nothing refused yet: double per window.
    SlowStart,
    /// Found a capacity: hold, and probe.
    Probing,
}

#[derive(Clone, Debug, Default)]
struct Window {
    start: Duration,
    /// A turn started at the ceiling, or turns waited.
    reached: bool,
    throttled: bool,
    /// The first [`WINDOW_SAMPLES`] round trips that ended in it, seconds.
    rtts: Vec<f64>,
}

impl Window {
    /// The median round trip, over at least [`MIN_WINDOW_SAMPLES`] calls.
    fn median(&mut self) -> Option<f64> {
        if self.rtts.len() < MIN_WINDOW_SAMPLES {
            return None;
        }
        self.rtts.sort_unstable_by(f64::total_cmp);
        self.rtts.get(self.rtts.len() / 2).copied()
    }
}

/// admitgate's adaptive ceiling (see the module documentation).
#[derive(Clone, Debug)]
pub struct CapacitySearch {
    config: CapacitySearchConfig,
    limit: u64,
    phase: Phase,
    window: Window,
    rtt_s: Option<f64>,
    baseline_s: Option<f64>,
    /// Inflated windows in a row.
    inflated: u32,
    hold_until: Duration,
    /// The provider reported no requests left.
    exhausted: bool,
    /// Calls started at the ceiling since it last changed.
    quiet_calls: u64,
    probe_every: u64,
    /// The increase of the current probe (0: not probing).
    step: u64,
    /// Windows left in which a refusal answers a probe made by another controller sharing the
    /// ceiling ([`CapacitySearch::follow`]), so it spaces the next probe as its own would.
    foreign_probe: u8,
}

impl CapacitySearch {
    /// A controller with `config` (its bounds are put in order: `min <= initial <= max`).
    pub fn new(config: CapacitySearchConfig) -> Self {
        let max_limit = config.max_limit.max(1);
        let min_limit = config.min_limit.clamp(1, max_limit);
        let config = CapacitySearchConfig {
            min_limit,
            max_limit,
            initial_limit: clamp(config.initial_limit, min_limit, max_limit),
        };
        Self {
            config,
            limit: config.initial_limit,
            phase: Phase::SlowStart,
            window: Window::default(),
            rtt_s: None,
            baseline_s: None,
            inflated: 0,
            hold_until: Duration::ZERO,
            exhausted: false,
            quiet_calls: 0,
            probe_every: PROBE_BASE_CALLS,
            step: 0,
            foreign_probe: 0,
        }
    }

    /// The bounds in force.
    pub fn config(&self) -> CapacitySearchConfig {
        self.config
    }

    /// The smoothed round trip of served calls, once one was served: the window length.
    pub fn round_trip(&self) -> Option<Duration> {
        self.rtt_s.and_then(|s| Duration::try_from_secs_f64(s).ok())
    }

    /// Takes the ceiling another controller sharing it set (a fleet's replicas share one,
    /// kept in Redis). `lowered` says it came down there: a throttle or inflation elsewhere,
    /// read as this controller reads its own (hold this window, probe from here, never slow
    /// start again). Otherwise the shared value simply replaces this one (another replica's
    /// growth, or this one's proposal that lost the race): the phase is kept, and a probe
    /// under way ends, since a change elsewhere restarts the count of quiet calls.
    /// A value that comes down within two windows of a raise followed here is a probe refused
    /// elsewhere: it spaces the next probe as a refused probe of its own does, so a fleet's
    /// probes back off together.
    pub fn follow(&mut self, limit: u64, lowered: bool) {
        if lowered {
            self.back_off_probing();
            self.phase = Phase::Probing;
            self.window.throttled = true;
        } else if limit > self.limit && self.phase == Phase::Probing {
            self.foreign_probe = 2;
        }
        if limit != self.limit {
            self.step = 0;
            self.quiet_calls = 0;
        }
        self.set_limit(limit);
    }

    fn set_limit(&mut self, limit: u64) {
        self.limit = clamp(limit, self.config.min_limit, self.config.max_limit);
    }

    /// A probe (this controller's, or one it followed) was refused: wait longer before the
    /// next.
    fn back_off_probing(&mut self) {
        if self.step > 0 || self.foreign_probe > 0 {
            self.probe_every = self.probe_every.saturating_mul(2).min(PROBE_MAX_CALLS);
        }
        self.foreign_probe = 0;
    }

    /// Closes the window if a round trip has passed since it opened.
    fn roll(&mut self, now: Duration) {
        let Some(rtt_s) = self.rtt_s else {
            return;
        };
        let length = Duration::from_secs_f64(rtt_s.max(1e-3));
        if now.saturating_sub(self.window.start) < length {
            return;
        }
        let mut window = std::mem::replace(
            &mut self.window,
            Window {
                start: now,
                rtts: Vec::with_capacity(WINDOW_SAMPLES),
                ..Window::default()
            },
        );
        self.foreign_probe = self.foreign_probe.saturating_sub(1);
        let median = window.median();
        let baseline = self.baseline_s;
        if let Some(median) = median {
            self.baseline_s = Some(baseline.map_or(median, |b| b + BASELINE_WEIGHT * (median - b)));
            let inflated = baseline.is_some_and(|b| median > INFLATION * b);
            self.inflated = if inflated {
                self.inflated.saturating_add(1)
            } else {
                0
            };
        }
        if window.throttled {
            return;
        }
        if self.inflated >= INFLATED_WINDOWS {
            self.inflated = 0;
            let lowered = to_count(self.limit as f64 * INFLATION_BACKOFF);
            self.set_limit(lowered.min(self.limit.saturating_sub(1)));
            self.phase = Phase::Probing;
            self.step = 0;
            self.quiet_calls = 0;
            return;
        }
        if !window.reached || now < self.hold_until || self.exhausted {
            // Not limited by the ceiling this window: nothing learned about a higher one.
            self.step = 0;
            return;
        }
        match self.phase {
            Phase::SlowStart => self.set_limit(self.limit.saturating_mul(2)),
            Phase::Probing if self.step > 0 => {
                // The last probe was not refused: grow faster.
                self.probe_every = PROBE_BASE_CALLS;
                self.step = self.step.saturating_mul(2);
                self.set_limit(self.limit.saturating_add(self.step));
            }
            Phase::Probing => {
                if self.quiet_calls >= self.probe_every {
                    self.quiet_calls = 0;
                    self.step = 1;
                    self.set_limit(self.limit.saturating_add(1));
                }
            }
        }
    }

    fn throttled(&mut self, sample: &Sample, retry_after: Option<Duration>) {
        let others = sample.in_flight.saturating_sub(1);
        self.set_limit(others.min(self.limit));
        self.back_off_probing();
        self.step = 0;
        self.quiet_calls = 0;
        self.phase = Phase::Probing;
        self.window.throttled = true;
        if let Some(pause) = retry_after {
            self.hold_until = self.hold_until.max(sample.ended_at.saturating_add(pause));
        }
    }

    fn served(&mut self, sample: &Sample) {
        let rtt = sample.rtt().as_secs_f64();
        self.rtt_s = Some(
            self.rtt_s
                .map_or(rtt, |mean| mean + RTT_WEIGHT * (rtt - mean)),
        );
        if self.window.rtts.len() < WINDOW_SAMPLES {
            self.window.rtts.push(rtt);
        }
    }
}

impl LimitController for CapacitySearch {
    fn name(&self) -> &'static str {
        "admitgate"
    }

    fn limit(&self) -> u64 {
        self.limit
    }

    fn on_start(&mut self, now: Duration, in_flight: u64, queued: u64) {
        self.roll(now);
        if in_flight >= self.limit || queued > 0 {
            self.window.reached = true;
            self.quiet_calls = self.quiet_calls.saturating_add(1);
        }
    }

    fn set_max_limit(&mut self, max: u64) {
        let max_limit = max.max(1);
        let min_limit = self.config.min_limit.min(max_limit);
        self.config = CapacitySearchConfig {
            min_limit,
            max_limit,
            initial_limit: clamp(self.config.initial_limit, min_limit, max_limit),
        };
        // Lowered: at most the new bound at once. Raised: from where it is, growing as it
        // learns (slow start or probes), never jumping to the new bound untested.
        self.set_limit(self.limit);
    }

    fn on_sample(&mut self, sample: Sample) {
        self.roll(sample.ended_at);
        if let Some(remaining) = sample.remaining {
            self.exhausted = remaining == 0;
        }
        match sample.outcome {
            Outcome::Throttled { retry_after } => self.throttled(&sample, retry_after),
            Outcome::Success => self.served(&sample),
            Outcome::Ignored => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::overload::test_support::{ms, sample};

    const OK: Outcome = Outcome::Success;
    const REFUSED: Outcome = Outcome::Throttled { retry_after: None };

    /// One window of 50 ms at the ceiling, every call served.
    fn busy_window(limit: &mut CapacitySearch, t: u64) {
        let now = limit.limit();
        for _ in 0..now {
            limit.on_start(ms(t), now, 5);
        }
        limit.on_sample(sample(t, t + 50, now, OK));
    }

    #[test]
    fn slow_start_doubles_per_round_trip_while_the_ceiling_is_reached() {
        let mut limit = CapacitySearch::new(CapacitySearchConfig::new(64));
        assert_eq!(limit.limit(), 4);
        let mut seen = vec![4];
        for t in (50..300).step_by(50) {
            // The call that started a round trip ago ends; the next starts at the ceiling.
            limit.on_sample(sample(t - 50, t, limit.limit(), OK));
            limit.on_start(ms(t), limit.limit(), 5);
            if seen.last() != Some(&limit.limit()) {
                seen.push(limit.limit());
            }
        }
        assert_eq!(seen, [4, 8, 16, 32, 64]);
    }

    #[test]
    fn no_growth_when_the_ceiling_is_not_reached() {
        let mut limit = CapacitySearch::new(CapacitySearchConfig::new(64));
        for t in (0..1000).step_by(50) {
            limit.on_start(ms(t), 1, 0);
            limit.on_sample(sample(t, t + 50, 1, OK));
        }
        assert_eq!(limit.limit(), 4);
    }

    #[test]
    fn a_429_measures_the_capacity_and_a_burst_does_not_ratchet_it_down() {
        let mut limit = CapacitySearch::new(CapacitySearchConfig {
            min_limit: 1,
            max_limit: 64,
            initial_limit: 16,
        });
        // Calls 9..=16 started together; the provider admits 8.
        for in_flight in 9..=16 {
            limit.on_sample(sample(0, 1, in_flight, REFUSED));
        }
        assert_eq!(limit.limit(), 8);
        // A call started at the ceiling and refused: the capacity fell, one off.
        limit.on_sample(sample(5, 6, 8, REFUSED));
        assert_eq!(limit.limit(), 7);
    }

    #[test]
    fn a_refused_probe_returns_and_waits_twice_as_long() {
        let mut limit = CapacitySearch::new(CapacitySearchConfig {
            min_limit: 1,
            max_limit: 64,
            initial_limit: 9,
        });
        limit.on_sample(sample(0, 1, 9, REFUSED));
        assert_eq!(limit.limit(), 8);
        let mut t = 10;
        let mut probes = Vec::new();
        for _ in 0..40 {
            busy_window(&mut limit, t);
            t += 50;
            if limit.limit() == 9 {
                probes.push(t);
                // The provider still admits 8.
                limit.on_start(ms(t), 9, 5);
                limit.on_sample(sample(t, t + 1, 9, REFUSED));
                assert_eq!(limit.limit(), 8);
            }
        }
        let gaps: Vec<u64> = probes.windows(2).map(|w| (w[1] - w[0]) / 50).collect();
        assert!(gaps.windows(2).all(|g| g[1] >= g[0]), "{gaps:?}");
        assert!(gaps[0] < gaps[gaps.len() - 1], "{gaps:?}");
    }

    #[test]
    fn a_probe_that_is_served_grows_by_doubling_steps() {
        let mut limit = CapacitySearch::new(CapacitySearchConfig {
            min_limit: 1,
            max_limit: 64,
            initial_limit: 5,
        });
        limit.on_sample(sample(0, 1, 5, REFUSED));
        assert_eq!(limit.limit(), 4);
        let mut seen = vec![limit.limit()];
        let mut t = 10;
        for _ in 0..12 {
            busy_window(&mut limit, t);
            t += 50;
            if seen.last() != Some(&limit.limit()) {
                seen.push(limit.limit());
            }
        }
        assert_eq!(&seen[..5], &[4, 5, 7, 11, 19], "{seen:?}");
    }

    #[test]
    fn retry_after_holds_growth_and_remaining_zero_stops_it() {
        let mut limit = CapacitySearch::new(CapacitySearchConfig::new(64));
        limit.on_sample(sample(
            0,
            1,
            4,
            Outcome::Throttled {
                retry_after: Some(Duration::from_secs(2)),
            },
        ));
        assert_eq!(limit.limit(), 3);
        let mut t = 10;
        while t < 1900 {
            busy_window(&mut limit, t);
            t += 50;
        }
        assert_eq!(limit.limit(), 3, "grew during Retry-After");
        let mut exhausted = CapacitySearch::new(CapacitySearchConfig::new(64));
        for t in (0..2000).step_by(50) {
            exhausted.on_start(ms(t), 4, 3);
            exhausted.on_sample(Sample {
                remaining: Some(0),
                ..sample(t, t + 50, 4, OK)
            });
        }
        assert_eq!(exhausted.limit(), 4);
    }

    #[test]
    fn latency_inflation_backs_off() {
        let mut limit = CapacitySearch::new(CapacitySearchConfig {
            min_limit: 1,
            max_limit: 64,
            initial_limit: 21,
        });
        limit.on_sample(sample(0, 1, 21, REFUSED));
        assert_eq!(limit.limit(), 20);
        // 20 calls of 50 ms overlap: one ends every 2.5 ms.
        let mut t = 10;
        while t < 2000 {
            limit.on_start(ms(t), 20, 0);
            limit.on_sample(sample(t.saturating_sub(50), t, 20, OK));
            t += 3;
        }
        let steady = limit.limit();
        assert!(steady >= 20, "backed off at a steady latency: {steady}");
        // Then the provider queues internally: 300 ms each.
        while t < 4000 {
            limit.on_start(ms(t), 20, 0);
            limit.on_sample(sample(t - 300, t, 20, OK));
            t += 15;
        }
        assert!(
            limit.limit() * 10 < steady * 9,
            "{} from {steady}",
            limit.limit()
        );
    }

    #[test]
    fn following_a_shared_ceiling_lowered_elsewhere_ends_slow_start() {
        let mut limit = CapacitySearch::new(CapacitySearchConfig::new(64));
        limit.follow(3, true);
        assert_eq!(limit.limit(), 3);
        // No doubling in the window the shared value came down in, nor after: it probes.
        let mut t = 10;
        for _ in 0..4 {
            busy_window(&mut limit, t);
            t += 50;
        }
        assert!(limit.limit() <= 4, "slow start resumed: {}", limit.limit());
        // Raised elsewhere (or a lost race): taken as it is, within the bounds.
        limit.follow(100, false);
        assert_eq!(limit.limit(), 64);
        assert_eq!(limit.round_trip(), Some(ms(50)));
    }

    #[test]
    fn a_probe_refused_elsewhere_spaces_the_next_probe_here_too() {
        // Two controllers sharing one ceiling (a fleet's replicas): `a` probes, the provider
        // refuses the probe on `b`'s call. Each then waits twice as long before probing.
        let calls_to_probe = |limit: &mut CapacitySearch, t: &mut u64| {
            let before = limit.limit();
            let mut calls = 0;
            while limit.limit() == before {
                limit.on_start(ms(*t), before, 5);
                limit.on_sample(sample(*t, *t + 50, before, OK));
                calls += 1;
                *t += 50;
            }
            calls
        };
        let mut a = CapacitySearch::new(CapacitySearchConfig {
            min_limit: 1,
            max_limit: 64,
            initial_limit: 16,
        });
        let mut b = a.clone();
        a.on_sample(sample(0, 1, 9, REFUSED));
        b.follow(a.limit(), true);
        let (mut ta, mut tb) = (10, 10);
        let first = calls_to_probe(&mut a, &mut ta);
        assert_eq!(a.limit(), 9);
        b.follow(9, false);
        b.on_sample(sample(tb, tb + 1, 9, REFUSED));
        tb += 1;
        assert_eq!(b.limit(), 8);
        a.follow(8, true);
        assert!(calls_to_probe(&mut a, &mut ta) > first);
        assert!(calls_to_probe(&mut b, &mut tb) > first);
    }

    #[test]
    fn the_upper_bound_follows_a_reconfiguration_both_ways() {
        let mut limit = CapacitySearch::new(CapacitySearchConfig::new(8));
        let mut t = 10;
        for _ in 0..10 {
            busy_window(&mut limit, t);
            t += 50;
        }
        assert_eq!(limit.limit(), 8);
        limit.set_max_limit(64);
        assert_eq!(limit.config().max_limit, 64);
        for _ in 0..10 {
            busy_window(&mut limit, t);
            t += 50;
        }
        assert_eq!(
            limit.limit(),
            64,
            "did not grow past the construction-time bound"
        );
        limit.set_max_limit(4);
        assert_eq!(limit.limit(), 4);
        limit.set_max_limit(0);
        assert_eq!((limit.limit(), limit.config().min_limit), (1, 1));
    }

    #[test]
    fn bounds_are_kept_and_ordered() {
        let limit = CapacitySearch::new(CapacitySearchConfig {
            min_limit: 10,
            max_limit: 5,
            initial_limit: 100,
        });
        assert_eq!(limit.config().min_limit, 5);
        assert_eq!(limit.limit(), 5);
        let mut floor = CapacitySearch::new(CapacitySearchConfig::new(8));
        for i in 0..20 {
            floor.on_sample(sample(i * 10, i * 10 + 1, 1, REFUSED));
        }
        assert_eq!(floor.limit(), 1);
    }
}
