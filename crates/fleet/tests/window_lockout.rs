//! The BotOS drop-ins' rule on a real redis-server: every fleet decision is the local rule's
//! (crates/budget's window_lockout) fed with the server's time the reply carries, retry hints
//! bit for bit; replicas share one key's count; keys expire with their window or lockout and
//! never show the identity.

mod support;

use std::collections::HashMap;
use std::time::Duration;

use admitgate_budget::{KeyState, WindowLockoutRule, WindowVerdict};
use admitgate_fleet::FleetWindowLockout;
use support::{config, limit, shared, unique_key, RedisServer};

fn on(server: &RedisServer, name: &str, rule: WindowLockoutRule) -> FleetWindowLockout {
    let fleet = limit(config(server, &unique_key("wl-conn"), 10));
    FleetWindowLockout::new(&fleet, name, rule).unwrap()
}

fn name(what: &str) -> String {
    unique_key(what).replace(':', "-")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_decides_as_the_rule_at_the_servers_times() {
    let server = shared();
    let (mut allowed, mut refused) = (0, 0);
    for seed in 0..8u64 {
        let mut rng = fastrand::Rng::with_seed(seed);
        let rule = WindowLockoutRule::new(
            rng.u64(1..=4),
            rng.u64(20..=80) as f64 / 1000.0,
            if seed % 2 == 0 {
                0.0
            } else {
                rng.u64(10..=60) as f64 / 1000.0
            },
        )
        .unwrap();
        let fleet = on(server, &name("wl-model"), rule);
        let mut model: HashMap<String, Option<KeyState>> = HashMap::new();
        for _ in 0..120 {
            let key = fleet.key(
                ["login", "ws"][rng.usize(0..2)],
                ["a", "b", "c"][rng.usize(0..3)],
            );
            let got = fleet.check(&key).await.unwrap();
            let state = model.entry(key).or_insert(None);
            let (want, next) = rule.decide(*state, got.decided_at);
            *state = next;
            assert_eq!(got.verdict, want, "seed {seed} at {}", got.decided_at);
            match want {
                WindowVerdict::Allowed => allowed += 1,
                WindowVerdict::Limited { .. } => refused += 1,
            }
            if rng.u8(..) < 40 {
                tokio::time::sleep(Duration::from_millis(rng.u64(1..=40))).await;
            }
        }
    }
    assert!(
        allowed > 100 && refused > 100,
        "{allowed} allowed, {refused} refused"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_one_count_and_keys_expire_hiding_the_identity() {
    let server = shared();
    let rule = WindowLockoutRule::new(5, 0.3, 0.2).unwrap();
    let ns = name("wl-shared");
    let replicas: Vec<_> = (0..3).map(|_| on(server, &ns, rule)).collect();
    let key = replicas[0].key("magic_link", "203.0.113.7");
    assert_eq!(key, replicas[2].key("magic_link", "203.0.113.7"));
    let mut allowed = 0;
    for i in 0..9 {
        if replicas[i % 3].check(&key).await.unwrap().verdict == WindowVerdict::Allowed {
            allowed += 1;
        }
    }
    assert_eq!(allowed, 5);
    let (wait, _) = replicas[1].wait(&key).await.unwrap();
    assert!(wait > 0.0 && wait <= 0.2, "{wait}");
    let keys = server.command(&["KEYS", &format!("{{{ns}:*")]);
    assert!(!keys.contains("203.0.113.7"), "{keys}");
    let ttl: i64 = server.command(&["PTTL", &key]).trim().parse().unwrap();
    assert!(ttl > 0 && ttl <= 1200, "{ttl}");
    replicas[2].reset(&key).await.unwrap();
    assert_eq!(
        replicas[0].check(&key).await.unwrap().verdict,
        WindowVerdict::Allowed
    );
}
