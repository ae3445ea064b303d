//! The fleet on a real Redis Cluster (three primaries, three replicas: `redis-server
//! --cluster-enabled yes`, `redis-cli --cluster create`), started once for the file: ten
//! fleets spread over the slots each hold their cap under a burst, and a fleet's slot migrated
//! mid-burst (ASK, TRYAGAIN) keeps its cap with no outage.

mod support;

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use admitgate_fleet::{FleetConfig, FleetLimit, OnBackendError};
use support::{unique_key, ClusterSet};

fn cluster_config(set: &ClusterSet, key: &str, cap: u32) -> FleetConfig {
    let mut config = FleetConfig::new(set.url(), key, cap);
    config.lease_ttl = Duration::from_secs(5);
    config.connect_timeout = Duration::from_millis(1000);
    config.command_timeout = Duration::from_millis(1000);
    config.recheck_interval = Duration::from_millis(200);
    config.on_backend_error = OnBackendError::Reject;
    config
}

/// `turns` turns on `replicas` limits of one key, `hold` each; the most that ran at once.
async fn burst(limits: &[FleetLimit], turns: usize, hold: Duration) -> usize {
    let running = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for n in 0..turns {
        let limit = limits[n % limits.len()].clone();
        let (running, peak) = (running.clone(), peak.clone());
        tasks.push(tokio::spawn(async move {
            let lease = limit.acquire("").await.expect("a lease, never an outage");
            let now = running.fetch_add(1, Ordering::SeqCst) + 1;
            peak.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(hold).await;
            running.fetch_sub(1, Ordering::SeqCst);
            lease.release().await;
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    peak.load(Ordering::SeqCst)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleets_on_a_cluster_hold_their_caps_through_a_slot_migration() {
    // Leaked: the processes live until the test binary exits (killed with it).
    let set: &'static ClusterSet = Box::leak(Box::new(ClusterSet::start()));

    // --- Ten fleets spread over the slots, two replicas each, every cap held exactly.
    let keys: Vec<String> = (0..10)
        .map(|n| unique_key(&format!("cluster{n}")))
        .collect();
    let owners: HashSet<u16> = keys
        .iter()
        .map(|k| set.owner(set.slot(&format!("{{{k}}}"))).1)
        .collect();
    assert!(
        owners.len() >= 2,
        "ten fleets should land on several primaries"
    );
    let fleets: Vec<Vec<FleetLimit>> = keys
        .iter()
        .map(|k| {
            (0..2)
                .map(|_| {
                    FleetLimit::new(cluster_config(set, k, 3), tokio::runtime::Handle::current())
                        .unwrap()
                })
                .collect()
        })
        .collect();
    for limit in fleets.iter().flatten() {
        limit.set_event_handler(std::sync::Arc::new(|event| eprintln!("event: {event:?}")));
    }
    let peaks = futures_util::future::join_all(
        fleets
            .iter()
            .map(|limits| burst(limits, 30, Duration::from_millis(15))),
    )
    .await;
    assert!(
        peaks.iter().all(|&p| p == 3),
        "peaks {peaks:?} with caps of 3"
    );
    for limit in fleets.iter().flatten() {
        let stats = limit.stats();
        assert_eq!(stats.outages, 0, "{stats:?}");
        assert_eq!(stats.topology, "cluster");
    }

    // --- The first fleet's slot migrated to another primary mid-burst.
    let slot = set.slot(&format!("{{{}}}", keys[0]));
    let (from_id, _) = set.owner(slot);
    let to = set
        .primaries()
        .into_iter()
        .find(|(id, _, _)| *id != from_id)
        .map(|(id, port, _)| (id, port))
        .unwrap();
    let limits = &fleets[0];
    let migration = tokio::task::spawn_blocking(move || {
        std::thread::sleep(Duration::from_millis(150));
        set.migrate_slot(slot, &to, Duration::from_millis(100));
        (to, std::time::Instant::now())
    });
    let peak = burst(limits, 200, Duration::from_millis(10)).await;
    let burst_ended = std::time::Instant::now();
    let (to, migrated) = migration.await.unwrap();
    assert!(migrated < burst_ended, "the slot moved while the burst ran");
    assert_eq!(set.owner(slot).0, to.0, "the slot moved");
    assert!(
        peak <= 3,
        "{peak} at once with a cap of 3 across the migration"
    );
    for limit in limits {
        assert_eq!(limit.stats().outages, 0, "a migration is not an outage");
    }
    // And the fleet still works on its new node.
    assert_eq!(burst(limits, 12, Duration::from_millis(10)).await, 3);
    for limit in fleets.iter().flatten() {
        limit.shutdown().await;
    }
}
