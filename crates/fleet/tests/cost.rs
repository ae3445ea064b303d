//! What the protocol costs in Redis calls, each test on its own redis-server (they read its
//! command statistics): two round trips per uncontended turn, one heartbeat call per interval
//! whatever the number of leases.

mod support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use admitgate_core::queue::{Priorities, PriorityClass};
use admitgate_fleet::FleetClasses;
use support::{config, eventually, limit, RedisServer};

const KEY: &str = "agent:cost";

fn holders() -> String {
    format!("{{{KEY}}}:holders")
}

/// Script calls the server executed (EVAL and EVALSHA).
fn script_calls(server: &RedisServer) -> u64 {
    let info = server.command(&["INFO", "commandstats"]);
    info.lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .map(|l| {
            l.split(['=', ','])
                .nth(1)
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or(0)
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncontended_turn_costs_two_round_trips() {
    let server = RedisServer::start();
    let mut c = config(&server, KEY, 10);
    c.lease_ttl = Duration::from_secs(60); // no heartbeat during the measurement
    c.command_timeout = Duration::from_secs(1);
    // Nor a re-check: the heartbeat plans its first period while the first take is in flight,
    // which counts as a waiting turn, so it would beat once after recheck_interval (1 s by
    // default), inside the measurement on a loaded machine (101 calls).
    c.recheck_interval = Duration::from_secs(60);
    let a = limit(c);
    // Warm up: scripts loaded, connections made, the first heartbeat sent.
    a.acquire("").await.unwrap().release().await;
    a.acquire("t").await.unwrap().release().await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let before = script_calls(&server);
    for n in 0..50 {
        let lease = a.acquire(if n % 2 == 0 { "" } else { "t" }).await.unwrap();
        lease.release().await;
    }
    let scripts = script_calls(&server) - before;
    assert_eq!(scripts, 100, "one script call to take, one to release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_heartbeat_renews_every_lease_in_one_call_per_interval() {
    let server = RedisServer::start();
    let mut c = config(&server, KEY, 100);
    c.lease_ttl = Duration::from_millis(900); // heartbeat every 300 ms
    let a = limit(c);
    let mut leases = Vec::new();
    for _ in 0..50 {
        leases.push(a.acquire("").await.unwrap());
    }
    let calls = || script_calls(&server);
    let before = calls();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let beats = calls() - before;
    // 1.5 s / 300 ms = 5 beats, each one call for all 50 leases (not 50 calls).
    assert!((3..=7).contains(&beats), "{beats} script calls in 1.5 s");
    assert_eq!(
        server.zcard(&holders()),
        50,
        "all renewed past their 900 ms TTL"
    );
    for lease in leases {
        lease.release().await;
    }
    // An idle limit leaves no keys behind once its TTL has passed.
    eventually(Duration::from_secs(4), "keys expired", || {
        server.command(&["KEYS", &format!("{{{KEY}}}*")]).is_empty()
    })
    .await;
}

/// Mean Lua time (µs) of the script calls Redis ran since `CONFIG RESETSTAT`.
fn mean_script_usec(server: &RedisServer) -> f64 {
    let info = server.command(&["INFO", "commandstats"]);
    let (mut calls, mut usec) = (0u64, 0u64);
    for line in info.lines().filter(|l| l.starts_with("cmdstat_evalsha:")) {
        for field in line.split([':', ',']) {
            if let Some(n) = field.strip_prefix("calls=") {
                calls += n.parse::<u64>().unwrap();
            } else if let Some(n) = field.strip_prefix("usec=") {
                usec += n.parse::<u64>().unwrap();
            }
        }
    }
    assert!(calls > 0, "no script call measured");
    usec as f64 / calls as f64
}

/// What one call costs with `waiting` tickets queued behind a full cap: the mean Lua time of
/// 40 release-and-grant hand-offs (each granted turn gives its lease straight back and queues
/// again at the back, so the queue keeps its length) and 40 acquisitions that find no room.
///
/// `classed`: two classes with guarantees and fair queuing, the tickets spread over both
/// classes and 50 tenants.
async fn cost_with(server: &RedisServer, waiting: usize, classed: bool) -> f64 {
    let key = format!("agent:cost-flat-{waiting}-{classed}");
    let tickets = format!("{{{key}}}:tickets");
    let quiet = |id: &str| {
        let mut c = config(server, &key, 1);
        // No heartbeat or re-check during the measurement: only the calls measured run.
        c.lease_ttl = Duration::from_secs(600);
        c.command_timeout = Duration::from_secs(5);
        c.recheck_interval = Duration::from_secs(60);
        c.replica_id = id.to_owned();
        let l = limit(c);
        if classed {
            let classes = Priorities::new(
                vec![
                    PriorityClass::shared("interactive", 0.5, 1.0),
                    PriorityClass::shared("batch", 0.3, 1.0),
                ],
                None,
            )
            .unwrap();
            l.set_classes(FleetClasses::new(classes, true, HashMap::new()))
                .unwrap();
        }
        l
    };
    let (holder, queue, prober) = (quiet("holder"), quiet("queue"), quiet("prober"));
    let held = holder.acquire("").await.unwrap();
    let hand_offs = Arc::new(AtomicI64::new(40));
    let mut waits = Vec::new();
    for n in 0..waiting {
        let (queue, hand_offs) = (queue.clone(), hand_offs.clone());
        let (tenant, class) = (format!("t{}", n % 50), Some(n % 2));
        waits.push(tokio::spawn(async move {
            loop {
                let lease = queue.acquire_in(&tenant, class).await?;
                if hand_offs.fetch_sub(1, Ordering::SeqCst) <= 0 {
                    return Ok::<_, admitgate_fleet::FleetError>(lease);
                }
                lease.release().await;
            }
        }));
    }
    eventually(Duration::from_secs(60), "all tickets queued", || {
        server.zcard(&tickets) == waiting as i64
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await; // the subscriber's first re-check
    server.command(&["CONFIG", "RESETSTAT"]);
    held.release().await;
    eventually(Duration::from_secs(30), "40 hand-offs", || {
        hand_offs.load(Ordering::SeqCst) < 0
    })
    .await;
    for _ in 0..40 {
        assert!(prober.try_acquire("").await.unwrap().is_none());
    }
    let mean = mean_script_usec(server);
    queue.shutdown().await;
    for wait in waits {
        if let Ok(Ok(lease)) = wait.await {
            lease.release().await;
        }
    }
    mean
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scripts_cost_stays_flat_as_tickets_grow() {
    let server = RedisServer::start();
    let small = cost_with(&server, 100, false).await;
    let large = cost_with(&server, 2000, false).await;
    eprintln!("mean Lua time per call: {small:.1} µs with 100 tickets, {large:.1} µs with 2,000");
    // O(log n) per call: twenty times the tickets cost about the same (a walk over the queue
    // would cost twenty times as much).
    assert!(
        large < 3.0 * small + 30.0,
        "{small:.0} µs per call with 100 tickets, {large:.0} µs with 2,000"
    );
}

/// The same with priority classes and fair queuing: a grant also picks the class and moves the
/// tenant's virtual time, still O(log n) per call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scripts_cost_stays_flat_as_tickets_grow_with_classes() {
    let server = RedisServer::start();
    let small = cost_with(&server, 100, true).await;
    let large = cost_with(&server, 2000, true).await;
    eprintln!("with classes, mean Lua time per call: {small:.1} µs with 100 tickets, {large:.1} µs with 2,000");
    assert!(
        large < 3.0 * small + 30.0,
        "{small:.0} µs per call with 100 tickets, {large:.0} µs with 2,000"
    );
}
