//! What the protocol costs in Redis calls, each test on its own redis-server (they read its
//! command statistics): two round trips per uncontended turn, one heartbeat call per interval
//! whatever the number of leases.

mod support;

use std::time::Duration;

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
