//! The pub/sub listener: learns at once that a ticket of this replica was granted, so hand-off
//! is pushed rather than polled, and claims the grant (one round trip) before the turn starts.
//! A message can be lost (a reconnect, a slow consumer dropped by Redis), which the heartbeat's
//! re-check covers; a message can also arrive late (this replica was paused), which the claim
//! covers: a grant that expired meanwhile is not started on.

use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::StreamExt;

use crate::limit::Inner;

/// Pause between two attempts to subscribe while Redis is up but the subscription fails.
const RETRY: Duration = Duration::from_millis(200);

/// The listener task. Holds the limit weakly except while handling a message.
pub(crate) async fn run(limit: Weak<Inner>) {
    loop {
        let (inner_ref, channel, command_timeout) = {
            let Some(inner) = limit.upgrade() else { return };
            // While Redis is down the probe restarts this task when it returns.
            if !inner.backend.is_up() {
                drop(inner);
                return;
            }
            (
                Arc::downgrade(&inner),
                inner.scripts.keys().channel.clone(),
                inner.backend.command_timeout(),
            )
        };
        let subscribed = async {
            // Bounded by connect_timeout inside; the limit is held only while dialling.
            let mut pubsub = {
                let inner = inner_ref.upgrade()?;
                inner.backend.pubsub().await?
            };
            tokio::time::timeout(command_timeout, pubsub.subscribe(&channel))
                .await
                .ok()?
                .ok()?;
            Some(pubsub)
        }
        .await;
        if let Some(pubsub) = subscribed {
            {
                let Some(inner) = limit.upgrade() else { return };
                // Grants published before the subscription took effect were missed: re-check.
                if inner.registry().waiting() > 0 {
                    inner.beat_now.notify_one();
                }
            }
            let mut messages = pubsub.into_on_message();
            while let Some(message) = messages.next().await {
                let Some(inner) = limit.upgrade() else { return };
                let Ok(payload) = std::str::from_utf8(message.get_payload_bytes()) else {
                    continue;
                };
                // Ids of other replicas are unknown here and ignored. A grant is claimed before
                // its turn starts: it may have expired while this replica was paused.
                let claims: Vec<_> = {
                    let mut registry = inner.registry();
                    payload
                        .split(' ')
                        .filter_map(|id| registry.announce(id))
                        .collect()
                };
                if !claims.is_empty() {
                    let claimer = inner.clone();
                    inner
                        .handle
                        .spawn(async move { claimer.claim_grants(claims).await });
                }
            }
            // The connection closed (Redis restarted, or the network failed): subscribe again;
            // a wait that missed its message meanwhile is found by the heartbeat.
            if let Some(inner) = limit.upgrade() {
                if inner.registry().waiting() > 0 {
                    inner.beat_now.notify_one();
                }
            }
        }
        tokio::time::sleep(RETRY).await;
    }
}
