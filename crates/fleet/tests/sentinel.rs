//! The fleet on Redis Sentinel, against real processes (Debian's redis-server and
//! redis-sentinel on loopback): a primary, a replica and three sentinels with
//! `down-after-milliseconds 1000`. One scenario, in order, on one deployment (started once):
//! a failover by `kill -9`, a manual failover (the old primary demoted while alive), and
//! `durability = replicated` with and without a replica to confirm.

mod support;

use std::time::{Duration, Instant};

use admitgate_fleet::{Durability, FleetConfig, FleetError, FleetLimit, OnBackendError};
use support::{unique_key, SentinelSet};

fn sentinel_config(set: &SentinelSet, key: &str, cap: u32) -> FleetConfig {
    let mut config = FleetConfig::new(set.url(), key, cap);
    config.lease_ttl = Duration::from_secs(10);
    config.connect_timeout = Duration::from_millis(500);
    config.command_timeout = Duration::from_millis(500);
    config.recheck_interval = Duration::from_millis(200);
    config.probe_interval = Duration::from_millis(100);
    config.on_backend_error = OnBackendError::Reject;
    config
}

fn limit(config: FleetConfig) -> FleetLimit {
    FleetLimit::new(config, tokio::runtime::Handle::current()).expect("valid config")
}

/// Acquires until a lease comes (refusals `fleet_unavailable` are retried every 50 ms):
/// how long it took and how many refusals.
async fn acquire_retrying(
    limit: &FleetLimit,
    within: Duration,
) -> (admitgate_fleet::Lease, Duration, u32) {
    let started = Instant::now();
    let mut refused = 0;
    loop {
        match limit.try_acquire("").await {
            Ok(Some(lease)) => return (lease, started.elapsed(), refused),
            Ok(None) => panic!("no room: the cap should not be reached here"),
            Err(FleetError::Unavailable) => refused += 1,
            Err(other) => panic!("not a documented refusal: {other:?}"),
        }
        assert!(started.elapsed() < within, "no lease within {within:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_follows_sentinel_failovers() {
    let set = SentinelSet::start();
    let first_primary = set.primary_port();

    // --- Healthy: both durabilities grant; replicated confirms each grant with WAIT.
    let key = unique_key("sentinel");
    let fast = limit(sentinel_config(&set, &key, 5));
    let mut replicated_config = sentinel_config(&set, &key, 5);
    replicated_config.durability = Durability::Replicated;
    let safe = limit(replicated_config);
    fast.connect().await.unwrap();
    safe.connect().await.unwrap();
    let running_fast = fast.acquire("").await.unwrap();
    let running_safe = safe.acquire("").await.unwrap();
    assert_eq!(safe.stats().unconfirmed, 0);
    assert_eq!(fast.stats().topology, "sentinel");
    // Let the replica hold both leases (the replicated one is confirmed already).
    tokio::time::sleep(Duration::from_millis(200)).await;

    // --- kill -9 the primary: the sentinels promote the replica; the limit follows.
    let killed_at = Instant::now();
    set.node(first_primary).kill();
    let named = tokio::task::spawn_blocking({
        let ports: Vec<u16> = set.sentinels.iter().map(|s| s.port).collect();
        move || support::first_naming(&ports, first_primary, Duration::from_secs(15))
    });
    let (lease, waited, refused) = acquire_retrying(&fast, Duration::from_secs(15)).await;
    let named = named.await.unwrap().duration_since(killed_at);
    eprintln!("a sentinel named the new primary {named:?} after the kill; first lease {waited:?}");
    assert!(
        waited <= named + Duration::from_millis(600),
        "served {waited:?} after the kill, the new primary named after {named:?}"
    );
    let failover = killed_at.elapsed();
    let new_primary = set.primary_port();
    assert_ne!(
        new_primary, first_primary,
        "the sentinels named a new primary"
    );
    eprintln!(
        "failover followed: first lease after {waited:?} ({refused} fleet_unavailable refusals); \
         failovers seen {}",
        fast.stats().failovers
    );
    // The refusal window is bounded by the sentinels' failover (down-after 1 s + election)
    // plus one probe and a call: about 2-4 s on loopback.
    assert!(failover < Duration::from_secs(10), "{failover:?}");
    assert_eq!(fast.stats().failovers, 1);
    lease.release().await;

    // Turns running across the failover keep their leases: both are on the new primary.
    let holders_key = format!("{{{key}}}:holders");
    let new = set.node(new_primary);
    support::eventually_blocking(
        Duration::from_secs(5),
        "both running leases re-registered",
        || new.zcard(&holders_key) == 2,
    );
    assert_eq!(fast.stats().lease_lost, 0);
    assert_eq!(safe.stats().lease_lost, 0);

    // --- replicated with no replica left: grants are refused (reject), none counts.
    let (_, unconfirmed_before) = (0, safe.stats().unconfirmed);
    let mut refusals = 0;
    for _ in 0..3 {
        match safe.try_acquire("").await {
            Err(FleetError::Unavailable) | Err(FleetError::Backend(_)) => refusals += 1,
            Ok(lease) => panic!("granted without a replica to confirm it: {lease:?}"),
            Err(other) => panic!("{other:?}"),
        }
    }
    assert_eq!(refusals, 3);
    assert!(safe.stats().unconfirmed > unconfirmed_before);
    // The refused grant was undone: only the two running leases are held.
    support::eventually_blocking(Duration::from_secs(5), "no unconfirmed lease left", || {
        new.zcard(&holders_key) == 2
    });

    // --- The old primary returns empty; the sentinels make it a replica of the new one, and
    // replicated grants are confirmed again.
    set.node(first_primary).restart();
    set.wait_settled(Duration::from_secs(20));
    let (lease, waited, _) = acquire_retrying(&safe, Duration::from_secs(15)).await;
    eprintln!("replicated grants resumed {waited:?} after the replica settled");
    lease.release().await;

    // --- A manual failover demotes the primary while it lives: the connection to it answers
    // READONLY, which is taken as "the primary moved", not as an outage.
    let outages = fast.stats().outages;
    let failovers = fast.stats().failovers;
    let sentinel = set.sentinels.iter().find(|s| s.is_running()).unwrap();
    // Asked until done: refused (NOGOODSLAVE) until the sentinel's INFO of the replica is
    // fresh, and a failover the sentinel accepted can abort (it failed once in a full run:
    // accepted, never done within 15 s); a sentinel takes a new request for the same primary
    // after twice its failover-timeout (4 s here), answering INPROG until then.
    support::eventually_blocking(Duration::from_secs(45), "a manual failover done", || {
        if set.primary_port() == first_primary {
            return true;
        }
        sentinel.command(&["SENTINEL", "FAILOVER", "mymaster"]);
        false
    });
    set.wait_settled(Duration::from_secs(20));
    let lease = fast.try_acquire("").await.unwrap().expect("room");
    assert_eq!(
        fast.stats().outages,
        outages,
        "a demoted primary is not an outage"
    );
    assert_eq!(fast.stats().failovers, failovers + 1);
    lease.release().await;

    running_fast.release().await;
    running_safe.release().await;
    fast.shutdown().await;
    safe.shutdown().await;
}
