//! The built-in resident-set-size sampler behind memory-aware admission.
//!
//! Reading RSS costs a few system calls, far more than an admission decision, so the reading
//! is cached and refreshed at most once every [`RssSampler::interval`] (5 ms by default): a
//! decision never uses a reading older than that. Between refreshes a read is two atomic
//! loads. The live reading comes from sysinfo (the process's current RSS); where it is
//! unavailable the sampler falls back to the peak RSS from `getrusage` (good enough to catch
//! a climbing leak), and where neither exists it disables itself and reports so once.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

const MIB: f64 = 1024.0 * 1024.0;

/// Which reading the sampler is taking.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RssSource {
    /// The process's current RSS.
    Live,
    /// The process's peak RSS (`getrusage`).
    Peak,
    /// Nothing can be read on this platform.
    Unavailable,
}

/// One reading.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RssReading {
    /// RSS in MiB, or `None` when nothing can be read.
    pub rss_mb: Option<f64>,
    /// True exactly once: on the read that found sampling unavailable.
    pub just_disabled: bool,
}

struct Refresher {
    system: Option<sysinfo::System>,
    source: RssSource,
}

impl Refresher {
    fn live_mb(&mut self) -> Option<f64> {
        let system = self.system.as_mut()?;
        // Looked up on every refresh: after fork() the child has a new pid.
        let pid = sysinfo::get_current_pid().ok()?;
        system.refresh_processes_specifics(
            sysinfo::ProcessesToUpdate::Some(&[pid]),
            true,
            sysinfo::ProcessRefreshKind::nothing().with_memory(),
        );
        let bytes = system.process(pid)?.memory();
        (bytes > 0).then(|| bytes as f64 / MIB)
    }

    /// Reads, stepping down to the next source when one fails.
    fn read(&mut self) -> Option<f64> {
        if self.source == RssSource::Live {
            if let Some(mb) = self.live_mb() {
                return Some(mb);
            }
            self.source = RssSource::Peak;
            self.system = None;
        }
        if self.source == RssSource::Peak {
            if let Some(mb) = peak_rss_mb() {
                return Some(mb);
            }
            self.source = RssSource::Unavailable;
        }
        None
    }
}

#[cfg(unix)]
fn peak_rss_mb() -> Option<f64> {
    // Safety: getrusage writes a `rusage` into the zeroed struct we own, and reads nothing.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_SELF, &mut usage) != 0 {
            return None;
        }
        usage
    };
    let max = usage.ru_maxrss as f64;
    if max <= 0.0 {
        return None;
    }
    // ru_maxrss is in bytes on macOS and the BSD-derived Apple platforms, KiB elsewhere.
    let bytes = if cfg!(target_vendor = "apple") {
        max
    } else {
        max * 1024.0
    };
    Some(bytes / MIB)
}

#[cfg(not(unix))]
fn peak_rss_mb() -> Option<f64> {
    None
}

/// `duration` in nanoseconds, saturating past 2^64 (584 years) rather than truncating.
fn nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

/// A cached RSS reading shared by every thread that admits turns.
pub struct RssSampler {
    interval: Duration,
    /// f64 bits of the last reading in MiB; NaN when unavailable.
    value: AtomicU64,
    /// When the reading was taken, in nanoseconds on the caller's clock, plus one (0: never).
    taken_at: AtomicU64,
    refresher: Mutex<Refresher>,
}

impl std::fmt::Debug for RssSampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RssSampler")
            .field("interval", &self.interval)
            .field("source", &self.source())
            .finish()
    }
}

impl Default for RssSampler {
    fn default() -> Self {
        Self::new(Self::DEFAULT_INTERVAL)
    }
}

impl RssSampler {
    /// How stale a reading may be by default.
    pub const DEFAULT_INTERVAL: Duration = Duration::from_millis(5);

    /// A sampler that refreshes at most once per `interval`.
    pub fn new(interval: Duration) -> Self {
        Self::with_source(interval, RssSource::Live)
    }

    /// A sampler starting from `source` (tests use this to exercise the fallbacks).
    pub fn with_source(interval: Duration, source: RssSource) -> Self {
        let system = (source == RssSource::Live)
            .then(sysinfo::System::new)
            .and_then(Result::ok);
        Self {
            interval,
            value: AtomicU64::new(f64::NAN.to_bits()),
            taken_at: AtomicU64::new(0),
            refresher: Mutex::new(Refresher { system, source }),
        }
    }

    /// The refresh interval.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// The source the next refresh reads.
    pub fn source(&self) -> RssSource {
        self.refresher.lock().source
    }

    fn cached(&self, now_ns: u64) -> Option<Option<f64>> {
        // 0 (never taken) has no predecessor.
        let taken = self.taken_at.load(Ordering::Acquire).checked_sub(1)?;
        if now_ns.saturating_sub(taken) >= nanos(self.interval) {
            return None;
        }
        let value = f64::from_bits(self.value.load(Ordering::Relaxed));
        Some((!value.is_nan()).then_some(value))
    }

    /// The RSS in MiB at `now` (on the caller's monotonic clock), refreshed if the cached
    /// reading is older than the interval.
    pub fn read(&self, now: Duration) -> RssReading {
        let now_ns = nanos(now);
        if let Some(rss_mb) = self.cached(now_ns) {
            return RssReading {
                rss_mb,
                just_disabled: false,
            };
        }
        let mut refresher = self.refresher.lock();
        // Another thread may have refreshed while we waited for the lock.
        if let Some(rss_mb) = self.cached(now_ns) {
            return RssReading {
                rss_mb,
                just_disabled: false,
            };
        }
        let was_available = refresher.source != RssSource::Unavailable;
        let rss_mb = refresher.read();
        self.value
            .store(rss_mb.unwrap_or(f64::NAN).to_bits(), Ordering::Relaxed);
        self.taken_at
            .store(now_ns.saturating_add(1), Ordering::Release);
        RssReading {
            rss_mb,
            just_disabled: was_available && refresher.source == RssSource::Unavailable,
        }
    }

    /// Forgets the cached reading (after fork(), the child's RSS is its own).
    pub fn invalidate(&self) {
        self.taken_at.store(0, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_reading_is_cached_for_the_interval() {
        let sampler = RssSampler::new(Duration::from_millis(5));
        let first = sampler.read(Duration::from_millis(100));
        let mb = first.rss_mb.expect("RSS is readable on the test platform");
        assert!(mb > 0.5 && mb < 100_000.0, "implausible RSS {mb}");
        assert_eq!(sampler.source(), RssSource::Live);
        // Allocate and touch 64 MiB: a cached read does not see it, a fresh one does.
        let ballast = vec![1u8; 64 << 20];
        assert!(ballast.iter().step_by(4096).all(|&b| b == 1));
        let cached = sampler.read(Duration::from_millis(104)).rss_mb.unwrap();
        assert_eq!(cached, mb);
        let fresh = sampler.read(Duration::from_millis(105)).rss_mb.unwrap();
        assert!(
            fresh > mb + 32.0,
            "fresh reading {fresh} did not see 64 MiB over {mb}"
        );
        drop(ballast);
    }

    #[test]
    fn peak_fallback_reads_something() {
        let sampler = RssSampler::with_source(Duration::ZERO, RssSource::Peak);
        let reading = sampler.read(Duration::from_secs(1));
        assert!(reading.rss_mb.unwrap() > 0.5);
        assert!(!reading.just_disabled);
    }

    #[test]
    fn unavailable_reports_once() {
        let sampler = RssSampler::with_source(Duration::ZERO, RssSource::Unavailable);
        // Already unavailable at construction: nothing to report as a change.
        assert_eq!(sampler.read(Duration::from_secs(1)).rss_mb, None);
        let mut refresher = Refresher {
            system: None,
            source: RssSource::Live,
        };
        // No sysinfo handle: steps down to the peak reading.
        assert!(refresher.read().is_some());
        assert_eq!(refresher.source, RssSource::Peak);
    }
}
