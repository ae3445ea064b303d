//! What a turn costs on each topology: one server, Sentinel, Cluster, and Sentinel with
//! `durability = replicated` (all on loopback, real processes). Ignored by default (it
//! measures); run `cargo test --release -p admitgate-fleet --test topology_cost -- --ignored
//! --nocapture` for the BENCHMARKS.md rows.

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use admitgate_fleet::{Durability, FleetConfig, FleetLimit};
use support::{percentiles, unique_key, ClusterSet, RedisServer, SentinelSet};

/// Turns one at a time: (turns/s, p50, p99 of one acquire + release).
async fn one_at_a_time(limit: &FleetLimit, turns: usize) -> (f64, Duration, Duration) {
    let mut samples = Vec::with_capacity(turns);
    let started = Instant::now();
    for _ in 0..turns {
        let t = Instant::now();
        let lease = limit.acquire("").await.unwrap();
        lease.release().await;
        samples.push(t.elapsed());
    }
    let rate = turns as f64 / started.elapsed().as_secs_f64();
    let (p50, p99) = percentiles(samples);
    (rate, p50, p99)
}

/// Turns from 32 tasks for `for_how_long`: turns/s.
async fn concurrent(limit: &FleetLimit, for_how_long: Duration) -> f64 {
    let done = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + for_how_long;
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let (limit, done) = (limit.clone(), done.clone());
            tokio::spawn(async move {
                while Instant::now() < until {
                    let lease = limit.acquire("").await.unwrap();
                    lease.release().await;
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    done.load(Ordering::Relaxed) as f64 / for_how_long.as_secs_f64()
}

async fn measure(name: &str, url: String, durability: Durability) {
    let mut config = FleetConfig::new(url, unique_key("cost"), 64);
    config.durability = durability;
    let limit = FleetLimit::new(config, tokio::runtime::Handle::current()).unwrap();
    limit.connect().await.unwrap();
    let _ = one_at_a_time(&limit, 200).await; // warm-up
    let (rate, p50, p99) = one_at_a_time(&limit, 2000).await;
    let parallel = concurrent(&limit, Duration::from_secs(2)).await;
    println!(
        "| {name} | {rate:.0} /s | {:.0} µs | {:.0} µs | {parallel:.0} /s |",
        p50.as_secs_f64() * 1e6,
        p99.as_secs_f64() * 1e6
    );
    limit.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run it for BENCHMARKS.md"]
async fn what_a_turn_costs_on_each_topology() {
    println!("| topology | one at a time | p50 per turn | p99 per turn | from 32 tasks |");
    println!("|---|---|---|---|---|");
    let single = RedisServer::start();
    measure("one server", single.url(), Durability::Primary).await;
    let sentinels = SentinelSet::start();
    measure("Sentinel", sentinels.url(), Durability::Primary).await;
    measure(
        "Sentinel, durability=replicated",
        sentinels.url(),
        Durability::Replicated,
    )
    .await;
    let cluster: &'static ClusterSet = Box::leak(Box::new(ClusterSet::start()));
    measure("Cluster", cluster.url(), Durability::Primary).await;
    measure(
        "Cluster, durability=replicated",
        cluster.url(),
        Durability::Replicated,
    )
    .await;
}
