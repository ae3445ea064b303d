//! Whether the agent behind the broker answers: what `/readyz` and `broker_upstream_up` say.
//!
//! The upstream is *up* while it has answered within the last [`DOWN_AFTER`]: a proxied
//! request that got a response, or a probe. The probe ([`probe`]) asks `GET
//! --readiness-path` (by default the A2A agent card, which an agent serves without side
//! effects; any status counts: an answer is an answer) every [`PROBE_INTERVAL`], but only
//! when nothing answered in the last interval, so a busy agent sees no probes at all and an
//! idle one one a second. It runs only when /readyz is served (`--metrics-listen`): nothing
//! else reads its result, and the agent should see no request that no client sent.
//! A probe that gets no answer within [`PROBE_TIMEOUT`] counts as none.
//!
//! So an agent that dies (or hangs) is reported down at most [`DOWN_AFTER`] after its last
//! answer, and up again at the first answer after it comes back, at most
//! [`PROBE_INTERVAL`] plus the time it takes to answer. Before the first answer it is down
//! ("not answering yet"), as before this module, when readiness never went back once ready.
//!
//! Failures of proxied requests are not counted: one reset stream says little about the
//! agent, and the probe decides within the bound anyway. The times are kept as milliseconds
//! since the tracker's creation in one atomic, so marking an answer on the request path is
//! one relaxed store.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::proxy::Broker;

/// How often the upstream is probed while nothing else answered.
pub const PROBE_INTERVAL: Duration = Duration::from_secs(1);
/// How long a probe waits for its answer.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// How long after the last answer the upstream counts as down: three probes missed, so one
/// lost or slow probe never flips readiness.
pub const DOWN_AFTER: Duration = Duration::from_secs(3);

/// When the upstream last answered.
pub struct UpstreamHealth {
    epoch: Instant,
    /// Milliseconds since `epoch` of the last answer, plus one; 0: never answered.
    last_answer: AtomicU64,
}

impl Default for UpstreamHealth {
    fn default() -> Self {
        Self {
            epoch: Instant::now(),
            last_answer: AtomicU64::new(0),
        }
    }
}

impl UpstreamHealth {
    fn millis(&self, at: Instant) -> u64 {
        let since = at.saturating_duration_since(self.epoch).as_millis();
        u64::try_from(since).unwrap_or(u64::MAX).saturating_add(1)
    }

    /// The upstream answered (at `at`).
    pub fn answered_at(&self, at: Instant) {
        // fetch_max: a slow answer recorded late never moves the time back.
        self.last_answer
            .fetch_max(self.millis(at), Ordering::Relaxed);
    }

    /// The upstream answered just now.
    pub fn answered(&self) {
        self.answered_at(Instant::now());
    }

    /// How long before `at` the upstream last answered; `None` if it never has.
    pub fn silent_for(&self, at: Instant) -> Option<Duration> {
        match self.last_answer.load(Ordering::Relaxed) {
            0 => None,
            last => Some(Duration::from_millis(self.millis(at).saturating_sub(last))),
        }
    }

    /// Whether the upstream counts as up at `at` (see the module documentation).
    pub fn is_up_at(&self, at: Instant) -> bool {
        self.silent_for(at)
            .is_some_and(|silent| silent < DOWN_AFTER)
    }

    /// Whether the upstream counts as up now.
    pub fn is_up(&self) -> bool {
        self.is_up_at(Instant::now())
    }
}

/// Probes the upstream for as long as the broker runs (a task on the broker's runtime, ended
/// with it).
pub async fn probe(broker: Arc<Broker>) {
    loop {
        let quiet = broker
            .upstream_health
            .silent_for(Instant::now())
            .is_none_or(|silent| silent >= PROBE_INTERVAL);
        if quiet {
            // An answer is recorded by the probe itself (as by any proxied request).
            broker.probe_upstream(PROBE_TIMEOUT).await;
        }
        tokio::time::sleep(PROBE_INTERVAL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn down_until_the_first_answer_then_up_until_silent_for_down_after() {
        let health = UpstreamHealth::default();
        let start = health.epoch;
        let at = |ms: u64| start + Duration::from_millis(ms);
        assert!(!health.is_up_at(at(0)));
        assert_eq!(health.silent_for(at(5)), None);
        health.answered_at(at(100));
        assert!(health.is_up_at(at(100)));
        assert!(health.is_up_at(at(100 + 2_999)));
        assert!(!health.is_up_at(at(100 + 3_000)));
        // Back up at the next answer.
        health.answered_at(at(10_000));
        assert!(health.is_up_at(at(10_001)));
        // An answer recorded late, for an earlier time, does not move the last answer back.
        health.answered_at(at(9_000));
        assert_eq!(
            health.silent_for(at(10_500)),
            Some(Duration::from_millis(500))
        );
    }
}
