//! The replica's heartbeat: one pipelined call per interval renews all of its leases and
//! tickets (not one call per turn), re-takes leases Redis forgot, reports lost ones, and learns
//! grants whose pub/sub message was lost. While Redis is down it becomes the recovery probe.

use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::backend::Failure;
use crate::events::FleetEvent;
use crate::limit::Inner;
use crate::registry::Grant;
use crate::scripts::{Beat, BeatResult, HEARTBEAT_CHUNK};
use crate::topology::Kind;

/// The heartbeat task. Holds the limit weakly, so dropping the last handle stops it.
pub(crate) async fn run(limit: Weak<Inner>, beat_now: Arc<Notify>, replan: Arc<Notify>) {
    let mut last = Instant::now();
    loop {
        let period = match limit.upgrade() {
            Some(inner) => inner.period(),
            None => return,
        };
        // The period is validated (at most an hour), so the deadline is always representable.
        // One past the clock's range would never be reached anyway: then only a notification
        // wakes the heartbeat (no deadline, as `tokio::time::timeout` does for such a bound).
        let next = last.checked_add(period);
        let due = async {
            match next {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = due => {}
            _ = beat_now.notified() => {}
            _ = replan.notified() => continue,
        }
        last = Instant::now();
        let Some(inner) = limit.upgrade() else { return };
        if inner.backend.is_up() {
            if let Err(failure) = inner.beat().await {
                inner.backend_failed(failure);
            }
        } else {
            inner.probe().await;
        }
    }
}

/// The probe's period while a Sentinel or Cluster deployment is down (at most `probe_interval`).
const FAILOVER_PROBE: Duration = Duration::from_millis(250);

impl Inner {
    /// How long until the next beat: the probe interval while Redis is down, the re-check
    /// interval while a turn waits, the heartbeat interval otherwise.
    fn period(&self) -> Duration {
        let heartbeat = self.config.effective_heartbeat_interval();
        if !self.backend.is_up() {
            match self.backend.kind() {
                Kind::Single => self.config.probe_interval,
                // Asking the sentinels (or the cluster) is cheap, and a failover ends when they
                // name the new primary: ask often so the outage ends soon after.
                Kind::Sentinel | Kind::Cluster => self.config.probe_interval.min(FAILOVER_PROBE),
            }
        } else if self.registry().waiting() > 0 {
            heartbeat.min(self.config.recheck_interval)
        } else {
            heartbeat
        }
    }

    /// Renews everything this replica holds or waits for, in one pipelined round trip, and acts
    /// on what Redis found.
    pub(crate) async fn beat(&self) -> Result<(), Failure> {
        let beats = self.registry().snapshot();
        // Also with nothing to renew: the call prunes dead holders, hands their room to waiters
        // and refreshes the fleet-wide counters.
        let chunks: Vec<&[Beat]> = if beats.is_empty() {
            vec![&[]]
        } else {
            beats.chunks(HEARTBEAT_CHUNK).collect()
        };
        let replies = self
            .backend
            .call(|con| {
                let calls = chunks.iter().map(|chunk| {
                    let mut con = con.clone();
                    async move { self.scripts.heartbeat(&mut con, chunk).await }
                });
                // Sent together on the multiplexed connection: one pipelined round trip.
                futures_util::future::try_join_all(calls)
            })
            .await?;
        let mut owed = Vec::new();
        let mut lost = Vec::new();
        {
            let mut registry = self.registry();
            if let Some((status, _)) = replies.last() {
                self.observe(*status);
            }
            let results = replies.iter().flat_map(|(_, results)| results.iter());
            for (beat, result) in beats.iter().zip(results) {
                match (beat, result) {
                    (Beat::Lease { id, .. }, BeatResult::Retaken) => {
                        if registry.is_live_lease(id) {
                            self.counters
                                .lease_retaken
                                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        } else {
                            // Released while the beat was in flight: the release reached Redis
                            // first and this beat put the lease back. Give it back again.
                            owed.push(beat.clone());
                        }
                    }
                    // Only a lease still held is lost; one released meanwhile is not (a
                    // refresh racing a release must not report a false loss).
                    (Beat::Lease { id, scope }, BeatResult::Lost) if registry.mark_lost(id) => {
                        self.counters
                            .lease_lost
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        lost.push(FleetEvent::LeaseLost {
                            lease: id.to_string(),
                            scope: scope.to_string(),
                        });
                    }
                    // Granted (or queued again) for a wait that was withdrawn meanwhile: the
                    // withdrawal reached Redis first. Give it back again.
                    (Beat::Ticket { id, .. }, BeatResult::Granted)
                        if !registry.grant(id, Grant::Fleet) =>
                    {
                        owed.push(beat.clone());
                    }
                    (Beat::Ticket { id, .. }, BeatResult::Requeued) if !registry.contains(id) => {
                        owed.push(beat.clone());
                    }
                    // Queued again after a grant this replica heard of had expired unclaimed
                    // (it was paused): a lost grant, whose turn never started.
                    (Beat::Ticket { id, .. }, BeatResult::Requeued) if registry.unannounce(id) => {
                        self.counters
                            .lease_lost
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    _ => {}
                }
            }
        }
        for event in lost {
            self.emit(event);
        }
        for beat in owed {
            let (id, scope) = match beat {
                Beat::Lease { id, scope } | Beat::Ticket { id, scope, .. } => (id, scope),
            };
            self.send_release(id, scope).await;
        }
        Ok(())
    }

    /// While Redis is down: is it back? If so, send the releases owed, register the leases
    /// taken during the outage (re-take, or count lost), and only then say it is up.
    pub(crate) async fn probe(self: &Arc<Self>) {
        // Reachable? (Unconfirmed: with `durability = replicated` the owed releases, which only
        // give room back, go out even while no replica confirms; the heartbeat below, which may
        // grant, needs the confirmation before the backend is said to be up.)
        let ping = self
            .backend
            .call_unconfirmed(|mut con| async move {
                redis::cmd("PING").query_async::<String>(&mut con).await
            })
            .await;
        if ping.is_err() {
            self.backend.reset();
            return;
        }
        let owed = self.registry().take_owed();
        if !owed.is_empty() {
            let sent = self
                .backend
                .call_unconfirmed(|con| {
                    let calls = owed.iter().map(|(id, scope)| {
                        let mut con = con.clone();
                        async move { self.scripts.release(&mut con, id, scope).await }
                    });
                    futures_util::future::try_join_all(calls)
                })
                .await;
            match sent {
                Ok(replies) => {
                    if let Some((status, _)) = replies.last() {
                        self.observe(*status);
                    }
                }
                Err(_) => {
                    // Releases are idempotent: all of them are sent again next time.
                    let mut registry = self.registry();
                    for (id, scope) in owed {
                        registry.owe(id, scope);
                    }
                    drop(registry);
                    self.backend.reset();
                    return;
                }
            }
        }
        if self.beat().await.is_err() {
            self.backend.reset();
            return;
        }
        if let Some(down_for) = self.backend.mark_up() {
            self.restart_subscriber();
            self.emit(FleetEvent::BackendUp {
                url: self.config.redacted_url(),
                down_for,
            });
        }
    }
}
