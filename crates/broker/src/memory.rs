//! Memory-aware admission for a sidecar: the agent container's memory, not the broker's.
//!
//! The broker reads its cgroup v2 `memory.current` against `memory.max` (a sidecar that shares
//! the agent's pod-level cgroup, or is pointed at the agent's with `--memory-cgroup`). The
//! ratios are those of the in-process gate's ladder: below the soft ratio admit, from it queue,
//! at the hard ratio refuse (`memory_pressure`). Where the files are missing or unreadable, or
//! `memory.max` is `max`, it is off, with one warning. A reading is cached for 5 ms, as the
//! core's RSS sampler caches: a decision costs two atomic loads between refreshes.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use admitgate_passage::core_api::{Decision, MemoryPressure};
use admitgate_passage::ResourceCheck;

use crate::logging;

const REFRESH_NANOS: u64 = 5_000_000;

fn read_number(path: &std::path::Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

struct Sampler {
    dir: PathBuf,
    ladder: MemoryPressure,
    epoch: Instant,
    /// When the cached reading was taken (nanoseconds since `epoch`), and the reading (bytes).
    at: AtomicU64,
    current: AtomicU64,
}

impl Sampler {
    fn decide(&self) -> Decision {
        let now = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let at = self.at.load(Ordering::Relaxed);
        let mut current = self.current.load(Ordering::Relaxed);
        if now.saturating_sub(at) >= REFRESH_NANOS || at == 0 {
            if let Some(value) = read_number(&self.dir.join("memory.current")) {
                current = value;
                self.current.store(value, Ordering::Relaxed);
            }
            self.at.store(now.max(1), Ordering::Relaxed);
        }
        // The ladder in MiB of the container's usage, thresholds as fractions of memory.max.
        self.ladder.evaluate(Some(current as f64 / 1_048_576.0))
    }
}

/// The check for the passage, or `None` (off) when not asked for or not readable.
pub fn cgroup_check(dir: PathBuf, soft_ratio: f64, hard_ratio: f64) -> Option<ResourceCheck> {
    if soft_ratio <= 0.0 && hard_ratio <= 0.0 {
        return None;
    }
    let off = |why: &str| {
        logging::line(
            "warning",
            "memory_aware_admission_off",
            &[
                ("cgroup", logging::text(&dir.display().to_string())),
                ("why", logging::text(why)),
            ],
        );
        None
    };
    let max = std::fs::read_to_string(dir.join("memory.max")).ok();
    let max = match max.as_deref().map(str::trim) {
        Some("max") | None => return off("no readable cgroup v2 memory.max limit"),
        Some(text) => match text.parse::<u64>() {
            Ok(max) if max > 0 => max,
            _ => return off("memory.max is not a number of bytes"),
        },
    };
    if read_number(&dir.join("memory.current")).is_none() {
        return off("no readable cgroup v2 memory.current");
    }
    let mib = max as f64 / 1_048_576.0;
    let Ok(ladder) = MemoryPressure::new(soft_ratio * mib, hard_ratio * mib) else {
        return off("memory.max too small for the ratios");
    };
    let sampler = Arc::new(Sampler {
        dir,
        ladder,
        epoch: Instant::now(),
        at: AtomicU64::new(0),
        current: AtomicU64::new(0),
    });
    Some(Box::new(move || sampler.decide()))
}
