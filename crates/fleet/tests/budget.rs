//! Fleet budgets against a real redis-server: decisions checked one by one against the local
//! budget driven at the server's times (the same exact model), three replicas bursting at one
//! limit (never more than N per identity in any window, by the server's clock), keys that
//! expire with their window, and the three `on_backend_error` modes through a killed and
//! restarted Redis.

mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use admitgate_budget::{Budget, Decision, Limit, Meter, Rate, Reservation};
use admitgate_fleet::{
    BudgetFallback, Decider, FleetBudget, FleetDecision, FleetError, FleetReservation,
};
use support::{config, eventually, limit, shared, unique_key, RedisServer};

fn rate(amount: u64, window_ms: u64) -> Rate {
    Rate::new("test", amount, Duration::from_millis(window_ms)).unwrap()
}

fn budget_on(
    server: &RedisServer,
    name: &str,
    limits: &[Limit],
    fallback: BudgetFallback,
) -> FleetBudget {
    let fleet = limit(config(server, &unique_key("budget-conn"), 10));
    let local = Budget::new(limits.to_vec(), 1 << 16).unwrap();
    FleetBudget::new(&fleet, name, local, fallback).unwrap()
}

fn name(what: &str) -> String {
    unique_key(what).replace(':', "-")
}

/// A generated sequence of reserves, settles and cancels (sleeps between them cross the short
/// windows many times); every Redis decision must be the local model's at the server's time,
/// retry time included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_decides_exactly_as_the_model_at_the_servers_times() {
    let server = shared();
    let (mut allowed, mut refused) = (0, 0);
    for seed in 0..6u64 {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut limits = vec![Limit::sliding(
            Meter::Requests,
            rate(rng.u64(2..=5), rng.u64(50..=200)),
        )];
        if seed % 2 == 0 {
            limits.push(Limit::sliding(
                Meter::Tokens,
                rate(rng.u64(100..=300), rng.u64(50..=200)),
            ));
        }
        if seed % 3 == 0 {
            limits.push(Limit::sliding(
                Meter::Requests,
                rate(rng.u64(5..=9), rng.u64(200..=400)),
            ));
        }
        let fleet = budget_on(server, &name("model"), &limits, BudgetFallback::Reject);
        let model = Budget::new(limits.clone(), 1024).unwrap();
        let identities = ["alice", "bob", "carol"];
        let mut held: Vec<(usize, FleetReservation, Reservation)> = Vec::new();
        for step in 0..250 {
            if rng.u8(0..4) == 0 {
                tokio::time::sleep(Duration::from_millis(rng.u64(0..60))).await;
            }
            let ctx = format!("seed {seed} step {step} {limits:?}");
            match rng.u8(0..10) {
                0..=5 => {
                    let who = rng.usize(0..identities.len());
                    let tokens = rng.u64(0..=120);
                    let key = model.key(identities[who].as_bytes());
                    match fleet
                        .reserve(identities[who].as_bytes(), tokens)
                        .await
                        .unwrap()
                    {
                        FleetDecision::Allowed(r) => {
                            let at = r.server_time().unwrap();
                            match model.reserve(key, tokens, at) {
                                Decision::Allowed(m) => held.push((who, r, m)),
                                other => panic!("{ctx}: Redis allowed, model {other:?}"),
                            }
                            allowed += 1;
                        }
                        FleetDecision::Limited(l) if l.decider == Decider::KnownRefusal => {}
                        FleetDecision::Limited(l) => {
                            let at = l.server_time.unwrap();
                            match model.reserve(key, tokens, at) {
                                Decision::Limited(m) => {
                                    assert_eq!(l.retry_after, m.retry_after(at), "{ctx}");
                                    assert_eq!(l.limit, m.limit, "{ctx}");
                                }
                                Decision::Allowed(_) => {
                                    panic!("{ctx}: Redis refused {l:?}, model allowed")
                                }
                            }
                            refused += 1;
                        }
                    }
                }
                6..=7 if !held.is_empty() => {
                    let (_, r, m) = held.swap_remove(rng.usize(0..held.len()));
                    let used = rng.u64(0..=200);
                    let changes =
                        r.tokens() != used && limits.iter().any(|l| l.meter == Meter::Tokens);
                    let at = fleet.settle(r, used).await;
                    assert_eq!(at.is_some(), changes, "{ctx}");
                    if let Some(at) = at {
                        model.settle(m, used, at);
                    }
                }
                8 if !held.is_empty() => {
                    let (_, r, m) = held.swap_remove(rng.usize(0..held.len()));
                    fleet.cancel(r).await.unwrap();
                    model.cancel(m);
                }
                _ => {}
            }
        }
    }
    // The sequences reached both answers often (slow calls on a loaded host pass windows
    // sooner, so this is counted over all of them).
    assert!(
        allowed > 100 && refused > 30,
        "{allowed} allowed, {refused} refused"
    );
}

/// Three replicas (their own connections) burst at 20 identities far above the limit: by the
/// server's clock, no identity gets more than N in any half-open window of length T.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_bursting_never_pass_more_than_n_per_identity_per_window() {
    let server = shared();
    let (n, window_ms) = (5u64, 300u64);
    let limits = [Limit::sliding(Meter::Requests, rate(n, window_ms))];
    let budget_name = name("burst");
    let replicas: Vec<_> = (0..3)
        .map(|_| budget_on(server, &budget_name, &limits, BudgetFallback::Reject))
        .collect();
    let admitted: Arc<Mutex<HashMap<usize, Vec<Duration>>>> = Arc::default();
    let until = Instant::now() + Duration::from_millis(1500);
    let mut tasks = Vec::new();
    for (r, replica) in replicas.iter().enumerate() {
        for worker in 0..8 {
            let replica = replica.clone();
            let admitted = admitted.clone();
            tasks.push(tokio::spawn(async move {
                let mut i = worker + r;
                let mut calls = 0u64;
                while Instant::now() < until {
                    let who = i % 20;
                    i += 7;
                    calls += 1;
                    let id = format!("identity-{who}");
                    if let FleetDecision::Allowed(res) =
                        replica.reserve(id.as_bytes(), 0).await.unwrap()
                    {
                        admitted
                            .lock()
                            .unwrap()
                            .entry(who)
                            .or_default()
                            .push(res.server_time().unwrap());
                    }
                    if calls.is_multiple_of(16) {
                        tokio::task::yield_now().await;
                    }
                }
                calls
            }));
        }
    }
    let mut calls = 0;
    for t in tasks {
        calls += t.await.unwrap();
    }
    let window = Duration::from_millis(window_ms);
    let admitted = admitted.lock().unwrap();
    let mut total = 0;
    for (who, times) in admitted.iter() {
        let mut times = times.clone();
        times.sort();
        total += times.len();
        let mut start = 0;
        for end in 0..times.len() {
            while times[start] + window <= times[end] {
                start += 1;
            }
            assert!(
                (end - start + 1) as u64 <= n,
                "identity {who}: {} in one window",
                end - start + 1
            );
        }
        // The limit is used, not just never exceeded: ~1.5 s / 300 ms windows of 5.
        assert!(
            times.len() as u64 >= 2 * n,
            "identity {who}: only {} admitted",
            times.len()
        );
    }
    assert_eq!(admitted.len(), 20);
    assert!(
        calls as usize > 3 * total,
        "a burst: {calls} calls for {total} admissions"
    );
    let stats: Vec<_> = replicas.iter().map(|r| r.stats()).collect();
    assert!(stats.iter().any(|s| s.known_refusals > 0), "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_expire_with_their_window_and_hold_no_raw_identity() {
    let server = shared();
    let budget_name = name("expiry");
    let limits = [
        Limit::sliding(Meter::Requests, rate(3, 400)),
        Limit::sliding(Meter::Tokens, rate(1000, 400)),
    ];
    let fleet = budget_on(server, &budget_name, &limits, BudgetFallback::Reject);
    let FleetDecision::Allowed(r) = fleet.reserve(b"sk-live-SECRET", 10).await.unwrap() else {
        panic!("allowed")
    };
    let keys = server.command(&["KEYS", &format!("{{{budget_name}:*")]);
    assert!(keys.contains(&format!("{{{budget_name}:")), "{keys}");
    assert!(!keys.contains("SECRET"), "{keys}");
    let first = keys
        .lines()
        .find(|k| k.starts_with('{'))
        .unwrap()
        .to_owned();
    let ttl: i64 = server.command(&["PTTL", &first]).parse().unwrap();
    // A window and a second, up to the end of the half-second cell the entry is in.
    assert!(ttl > 0 && ttl <= 1900, "PTTL {ttl}");
    fleet.settle(r, 4).await.unwrap();
    eventually(
        Duration::from_secs(3),
        "the identity's keys expired",
        || {
            !server
                .command(&["KEYS", &format!("{{{budget_name}:*")])
                .contains('{')
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cost_above_a_whole_window_is_refused_at_once_with_no_retry_time() {
    let fleet = budget_on(
        shared(),
        &name("never"),
        &[Limit::sliding(Meter::Tokens, rate(100, 1000))],
        BudgetFallback::Reject,
    );
    match fleet.reserve(b"k", 101).await.unwrap() {
        FleetDecision::Limited(l) => assert_eq!((l.retry_after, l.decider), (None, Decider::Fleet)),
        other => panic!("{other:?}"),
    }
}

/// Redis killed mid-use, then restarted: `local` decides with the replica's budget (which
/// remembers what it admitted through the fleet), `reject` refuses, `allow` admits; no call
/// waits past the bound; decisions go back to Redis after the restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outages_follow_on_backend_error_and_recover() {
    let server = RedisServer::start();
    let limits = [Limit::sliding(Meter::Requests, rate(5, 60_000))];
    let local = budget_on(&server, &name("out-local"), &limits, BudgetFallback::Local);
    let reject = budget_on(
        &server,
        &name("out-reject"),
        &limits,
        BudgetFallback::Reject,
    );
    let allow = budget_on(&server, &name("out-allow"), &limits, BudgetFallback::Allow);
    for _ in 0..3 {
        assert!(matches!(
            local.reserve(b"k", 0).await.unwrap(),
            FleetDecision::Allowed(_)
        ));
    }
    server.kill();
    let started = Instant::now();
    // The first call finds Redis gone; after it none makes a round trip.
    let mut deciders = Vec::new();
    for _ in 0..4 {
        match local.reserve(b"k", 0).await.unwrap() {
            FleetDecision::Allowed(r) => deciders.push(r.decider()),
            FleetDecision::Limited(l) => deciders.push(l.decider),
        }
    }
    assert!(
        started.elapsed() < Duration::from_millis(1600),
        "{:?}",
        started.elapsed()
    );
    // 3 through the fleet + 2 local = the limit; the rest refused locally.
    assert_eq!(local.local().stats().allowed, 2, "{deciders:?}");
    assert!(
        deciders.iter().all(|d| *d == Decider::Local),
        "{deciders:?}"
    );
    assert_eq!(
        reject.reserve(b"k", 0).await.unwrap_err(),
        FleetError::Unavailable
    );
    match allow.reserve(b"k", 0).await.unwrap() {
        FleetDecision::Allowed(r) => assert_eq!(r.decider(), Decider::Unchecked),
        other => panic!("{other:?}"),
    }
    server.restart();
    eventually(Duration::from_secs(5), "decisions back on Redis", || {
        local.fleet().backend_up() && reject.fleet().backend_up()
    })
    .await;
    match reject.reserve(b"other", 0).await.unwrap() {
        FleetDecision::Allowed(r) => assert_eq!(r.decider(), Decider::Fleet),
        other => panic!("{other:?}"),
    }
}

/// Redis paused (SIGSTOP) mid-use: with `local`, a decision waits at most the call bound
/// before it falls back, and none after it; thawed, decisions go back to Redis and nothing is
/// stuck (the fleet's count is what Redis recorded plus what is admitted after).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_redis_costs_one_bounded_call_then_local_decisions_then_recovery() {
    let server = RedisServer::start();
    let limits = [Limit::sliding(Meter::Requests, rate(1000, 60_000))];
    let budget = budget_on(&server, &name("pause"), &limits, BudgetFallback::Local);
    assert!(matches!(
        budget.reserve(b"k", 0).await.unwrap(),
        FleetDecision::Allowed(_)
    ));
    server.freeze();
    let started = Instant::now();
    let first = budget.reserve(b"k", 0).await.unwrap();
    let first_took = started.elapsed();
    let then = Instant::now();
    for _ in 0..50 {
        match budget.reserve(b"k", 0).await.unwrap() {
            FleetDecision::Allowed(r) => assert_eq!(r.decider(), Decider::Local),
            other => panic!("{other:?}"),
        }
    }
    let rest_took = then.elapsed();
    server.thaw();
    assert!(matches!(first, FleetDecision::Allowed(ref r) if r.decider() == Decider::Local));
    // connect_timeout + command_timeout, then as much for the PING (2 x 600 ms), plus slack.
    assert!(first_took < Duration::from_millis(1600), "{first_took:?}");
    assert!(
        rest_took < Duration::from_millis(50),
        "no round trip while down: {rest_took:?}"
    );
    eventually(Duration::from_secs(5), "back on Redis", || {
        budget.fleet().backend_up()
    })
    .await;
    match budget.reserve(b"k", 0).await.unwrap() {
        FleetDecision::Allowed(r) => assert_eq!(r.decider(), Decider::Fleet),
        other => panic!("{other:?}"),
    }
}

/// Throughput and latency of fleet decisions on one replica (loopback, its own redis-server):
/// `cargo test --release -p admitgate-fleet --test budget -- --ignored --nocapture
/// fleet_decision_cost`. Every decision goes to Redis (a limit no identity reaches).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: run it alone with --release"]
async fn fleet_decision_cost() {
    let server = RedisServer::start();
    let limits = [
        Limit::sliding(Meter::Requests, rate(1_000_000, 60_000)),
        Limit::sliding(Meter::Tokens, rate(1 << 40, 60_000)),
    ];
    let budget = budget_on(&server, &name("cost"), &limits, BudgetFallback::Reject);
    // Where the time goes, independent of wall-clock noise: CPU seconds of the redis-server
    // (INFO cpu) and of this process (getrusage) per decision, and the script's own time
    // inside the server (evalsha usec_per_call).
    let server_cpu = || {
        let info = server.command(&["INFO", "cpu"]);
        ["used_cpu_sys:", "used_cpu_user:"]
            .iter()
            .map(|field| {
                info.lines()
                    .find_map(|l| l.strip_prefix(field))
                    .and_then(|v| v.trim().parse::<f64>().ok())
                    .unwrap_or(0.0)
            })
            .sum::<f64>()
    };
    let own_cpu = || {
        // Safety: getrusage writes only the struct it is given.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
        let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
        secs(usage.ru_utime) + secs(usage.ru_stime)
    };
    for concurrency in [1usize, 8, 32] {
        server.command(&["CONFIG", "RESETSTAT"]);
        let (server_before, own_before) = (server_cpu(), own_cpu());
        let until = Instant::now() + Duration::from_secs(3);
        let mut tasks = Vec::new();
        for t in 0..concurrency {
            let budget = budget.clone();
            tasks.push(tokio::spawn(async move {
                let mut samples = Vec::new();
                let mut i = t;
                while Instant::now() < until {
                    let id = format!("identity-{}", i % 2000);
                    i += concurrency;
                    let started = Instant::now();
                    let d = budget.reserve(id.as_bytes(), 100).await.unwrap();
                    samples.push(started.elapsed());
                    assert!(matches!(d, FleetDecision::Allowed(_)));
                }
                samples
            }));
        }
        let mut samples = Vec::new();
        for t in tasks {
            samples.extend(t.await.unwrap());
        }
        let n = samples.len();
        let (p50, p99) = support::percentiles(samples);
        let server_us = (server_cpu() - server_before) * 1e6 / n as f64;
        let own_us = (own_cpu() - own_before) * 1e6 / n as f64;
        let stats = server.command(&["INFO", "commandstats"]);
        let script_us = stats
            .lines()
            .find(|l| l.starts_with("cmdstat_evalsha:"))
            .and_then(|l| l.split("usec_per_call=").nth(1))
            .and_then(|v| v.split(',').next())
            .unwrap_or("?")
            .to_owned();
        println!(
            "concurrency {concurrency}: {:.0} decisions/s, p50 {p50:?}, p99 {p99:?}; CPU per \
             decision: redis-server {server_us:.1} us (evalsha {script_us} us), this process \
             {own_us:.1} us",
            n as f64 / 3.0
        );
    }
    // The bar as stated (issue 24: >= 20,000 decisions/s with p99 <= 1 ms): decisions offered
    // at 20,000/s whoever is waiting (20 every millisecond, each its own task), each timed from
    // when it was due, so a late issuer counts against the latency. (With C callers each
    // waiting for its answer, the mean latency is C / throughput: 32 callers at 20,000/s wait
    // 1.6 ms on average, so a closed loop of 32 cannot show it.)
    let (per_tick, seconds) = (20usize, 3u64);
    server.command(&["CONFIG", "RESETSTAT"]);
    let (server_before, own_before) = (server_cpu(), own_cpu());
    let started = Instant::now();
    let mut ticks = tokio::time::interval(Duration::from_millis(1));
    let mut tasks = Vec::new();
    for tick in 0..seconds * 1000 {
        ticks.tick().await;
        let due = started + Duration::from_millis(tick);
        for k in 0..per_tick {
            let budget = budget.clone();
            let id = format!("identity-{}", (tick as usize * per_tick + k) % 2000);
            tasks.push(tokio::spawn(async move {
                // Err: a call that took longer than its bound (the backlog of an overload).
                let decided = budget.reserve(id.as_bytes(), 100).await;
                if let Ok(d) = &decided {
                    assert!(matches!(d, FleetDecision::Allowed(_)));
                }
                (
                    decided.is_ok(),
                    Instant::now(),
                    Instant::now().saturating_duration_since(due),
                )
            }));
        }
    }
    let mut samples = Vec::new();
    let (mut last, mut failed) = (started, 0);
    for t in tasks {
        let (ok, done, latency) = t.await.unwrap();
        last = last.max(done);
        samples.push(latency);
        failed += usize::from(!ok);
    }
    let n = samples.len();
    let (p50, p99) = support::percentiles(samples);
    println!(
        "offered {}/s: {:.0} decisions/s, p50 {p50:?}, p99 {p99:?}, {failed} past the call's \
         bound; CPU per decision: redis-server {:.1} us, this process {:.1} us",
        per_tick * 1000,
        n as f64 / (last - started).as_secs_f64(),
        (server_cpu() - server_before) * 1e6 / n as f64,
        (own_cpu() - own_before) * 1e6 / n as f64,
    );
    // Redis memory of one identity holding 60 requests and 60 token entries.
    let FleetDecision::Allowed(_) = budget.reserve(b"memory", 1).await.unwrap() else {
        panic!()
    };
    for _ in 0..59 {
        let _ = budget.reserve(b"memory", 1).await.unwrap();
    }
    let keys = server.command(&["KEYS", "*"]);
    let hash = keys
        .lines()
        .filter(|k| k.starts_with('{'))
        .map(|k| {
            let bytes: i64 = server.command(&["MEMORY", "USAGE", k]).parse().unwrap_or(0);
            (k.to_owned(), bytes)
        })
        .collect::<Vec<_>>();
    let (requests, tokens): (i64, i64) = hash
        .iter()
        .filter(|(k, _)| server.command(&["ZCARD", k]) == "60")
        .fold((0, 0), |(r, t), (k, b)| {
            if k.ends_with(":0") {
                (r + b, t)
            } else {
                (r, t + b)
            }
        });
    println!("Redis memory, 60 entries: request log {requests} B, token log {tokens} B (+ its amounts hash)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gcra_limit_is_refused_for_a_fleet_budget_naming_burst() {
    let fleet = limit(config(shared(), &unique_key("gcra"), 10));
    let gcra = Limit::gcra(Meter::Requests, rate(60, 60_000), 5).unwrap();
    let local = Budget::new(vec![gcra], 1024).unwrap();
    let e = FleetBudget::new(&fleet, "gcra", local, BudgetFallback::Local).unwrap_err();
    assert_eq!(e.field, "burst");
    assert!(e.to_string().contains("sliding windows"), "{e}");
}

/// More expired token entries than Lua's `unpack` takes at once (~8,000) leave in one call:
/// pruned in chunks, the decision still made by Redis. (Written straight into Redis, long
/// expired: making 10,000 calls within one window is too slow on a loaded host.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_token_entries_expiring_at_once_are_pruned_in_chunks() {
    let server = shared();
    let budget_name = name("prune");
    let limits = [Limit::sliding(Meter::Tokens, rate(1000, 3_000))];
    let budget = budget_on(server, &budget_name, &limits, BudgetFallback::Reject);
    let digest = sha1_smol::Sha1::from(b"many").digest().to_string();
    let tag = format!("{{{budget_name}:{}}}", &digest[..32]);
    let (log, amounts) = (format!("{tag}:0"), format!("{tag}:0:t"));
    let ids: Vec<String> = (0..10_000).map(|i| format!("old-{i}")).collect();
    let mut zadd = vec!["ZADD", log.as_str()];
    let mut hset = vec!["HSET", amounts.as_str(), "sum", "10000"];
    for id in &ids {
        zadd.extend(["1", id.as_str()]);
        hset.extend([id.as_str(), "1"]);
    }
    assert_eq!(server.command(&zadd), "10000");
    server.command(&hset);
    match budget.reserve(b"many", 1000).await.unwrap() {
        FleetDecision::Allowed(r) => assert_eq!(r.decider(), Decider::Fleet),
        other => panic!("{other:?}"),
    }
    assert!(budget.fleet().backend_up());
    assert_eq!(server.zcard(&log), 1);
    assert_eq!(server.command(&["HGET", &amounts, "sum"]), "1000");
}

/// The script as `FleetBudget` calls it, straight from a test: `op` for reservation `id` on
/// the identity `tag` with limits `(kind, amount, window_us)`; the reply's integers.
fn call_script(
    server: &RedisServer,
    tag: &str,
    op: &str,
    id: &str,
    tokens: u64,
    limits: &[(&str, u64, u64)],
) -> Vec<i64> {
    let keys: Vec<String> = (0..limits.len())
        .flat_map(|i| [format!("{tag}:{i}"), format!("{tag}:{i}:t")])
        .collect();
    let mut args: Vec<String> = vec![
        "EVAL".into(),
        include_str!("../src/lua/budget.lua").into(),
        keys.len().to_string(),
    ];
    args.extend(keys);
    args.extend([op.into(), id.into(), tokens.to_string(), "0".into()]);
    args.push(limits.len().to_string());
    for (kind, amount, window) in limits {
        args.extend([kind.to_string(), amount.to_string(), window.to_string()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    server
        .command(&args)
        .lines()
        .map(|v| v.parse().unwrap())
        .collect()
}

/// A reserve sent again (its reply lost with a dropped connection) answers "allowed" and is
/// counted once: when it still fits, when its own entry now fills the limit, and when only a
/// later limit still holds it (the earlier one lost it): nothing is recorded twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reserve_sent_again_is_allowed_and_counted_once() {
    let server = shared();
    let tag = format!("{{{}:resend}}", name("resend"));
    let limits = [("r", 2, 60_000_000), ("t", 100, 60_000_000)];
    let reserve = |id: &str| call_script(server, &tag, "reserve", id, 30, &limits);
    let allowed = |id: &str| reserve(id).first() == Some(&1);
    let (log, sum) = (format!("{tag}:0"), || {
        server.command(&["HGET", &format!("{tag}:1:t"), "sum"])
    });
    assert!(allowed("a"));
    // Sent again while it fits: allowed, nothing added.
    assert!(allowed("a"));
    assert_eq!((server.zcard(&log), sum()), (1, "30".to_owned()));
    // The limit of 2 requests reached: a new id is refused (by the request limit, index 0), a
    // resend of one held is allowed.
    assert!(allowed("b"));
    let refused = reserve("c");
    assert_eq!((refused[0], refused[2]), (0, 0), "{refused:?}");
    assert!(allowed("b"));
    // Only the token limit still holds "b" (its request entry gone): allowed, and the
    // request log is not given an entry back.
    server.command(&["ZREM", &log, "b"]);
    assert!(allowed("b"));
    assert_eq!((server.zcard(&log), sum()), (1, "60".to_owned()));
}

/// A failover to a server whose clock is behind: the identity's time stays at its newest
/// entry (nothing is recorded earlier), and the keys' expiry follows that time, so no entry
/// expires before its window ends by the clock it was recorded with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_gone_back_records_at_the_newest_time_and_expires_nothing_early() {
    let server = shared();
    let budget_name = name("clock");
    let limits = [Limit::sliding(Meter::Requests, rate(3, 1_000))];
    let budget = budget_on(server, &budget_name, &limits, BudgetFallback::Reject);
    let digest = sha1_smol::Sha1::from(b"k").digest().to_string();
    let log = format!("{{{budget_name}:{}}}:0", &digest[..32]);
    // An entry recorded 5 s ahead of this server's clock by the primary before a failover,
    // which kept the key a window and a second past it.
    let time = server.command(&["TIME"]);
    let mut parts = time.lines().map(|v| v.parse::<u64>().unwrap());
    let now_us = parts.next().unwrap() * 1_000_000 + parts.next().unwrap();
    let ahead_us = now_us + 5_000_000;
    server.command(&["ZADD", &log, &ahead_us.to_string(), "before-failover"]);
    let expiry_ms = ahead_us / 1000 + 2_000;
    server.command(&["PEXPIREAT", &log, &expiry_ms.to_string()]);
    match budget.reserve(b"k", 0).await.unwrap() {
        FleetDecision::Allowed(r) => {
            assert_eq!(r.server_time(), Some(Duration::from_micros(ahead_us)));
        }
        other => panic!("{other:?}"),
    }
    // Still kept until 5 s + the window + the margin from now (not cut to the window + the
    // margin by this server's clock, which would drop both entries 5 s early).
    let ttl: i64 = server.command(&["PTTL", &log]).parse().unwrap();
    assert!(ttl > 6_500, "PTTL {ttl}");
    // The limit still counts the entry from the future, and the next admission too.
    for _ in 0..2 {
        let _ = budget.reserve(b"k", 0).await.unwrap();
    }
    assert_eq!(server.zcard(&log), 3);
}

/// `fleet="redis://..."`: a budget with a connection of its own decides on Redis; its stats
/// count what it did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_with_its_own_url_decides_on_redis_and_counts_what_it_did() {
    let server = shared();
    let limits = vec![
        Limit::sliding(Meter::Requests, rate(2, 60_000)),
        Limit::sliding(Meter::Tokens, rate(100, 60_000)),
    ];
    let budget = FleetBudget::with_url(
        &server.url(),
        &name("own-url"),
        Budget::new(limits, 1024).unwrap(),
        BudgetFallback::Local,
        tokio::runtime::Handle::current(),
    )
    .unwrap();
    let FleetDecision::Allowed(first) = budget.reserve(b"k", 60).await.unwrap() else {
        panic!("allowed")
    };
    assert_eq!(first.decider(), Decider::Fleet);
    // 60 + 60 > 100: refused by the token limit (index 1), then answered locally.
    match budget.reserve(b"k", 60).await.unwrap() {
        FleetDecision::Limited(l) => assert_eq!((l.limit, l.decider), (1, Decider::Fleet)),
        other => panic!("{other:?}"),
    }
    match budget.reserve(b"k", 60).await.unwrap() {
        FleetDecision::Limited(l) => assert_eq!((l.limit, l.decider), (1, Decider::KnownRefusal)),
        other => panic!("{other:?}"),
    }
    // A refund here clears the known refusal: 60 -> 30 used, 30 + 60 fits.
    assert!(budget.settle(first, 30).await.is_some());
    match budget.reserve(b"k", 60).await.unwrap() {
        FleetDecision::Allowed(r) => assert_eq!(r.decider(), Decider::Fleet),
        other => panic!("{other:?}"),
    }
    let stats = budget.stats();
    assert_eq!(
        (
            stats.fleet_decisions,
            stats.known_refusals,
            stats.offline_decisions
        ),
        (3, 1, 0)
    );
    let e = FleetBudget::with_url(
        "redis://127.0.0.1:1/0",
        "bad name",
        Budget::new(vec![Limit::sliding(Meter::Requests, rate(1, 1000))], 8).unwrap(),
        BudgetFallback::Local,
        tokio::runtime::Handle::current(),
    )
    .unwrap_err();
    assert_eq!(e.field, "name");
}

/// A settle while Redis is down applies to the local budget only, and is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_during_an_outage_is_local_and_counted() {
    let server = RedisServer::start();
    let limits = [Limit::sliding(Meter::Tokens, rate(100, 60_000))];
    let budget = budget_on(&server, &name("settle-out"), &limits, BudgetFallback::Local);
    let FleetDecision::Allowed(r) = budget.reserve(b"k", 80).await.unwrap() else {
        panic!("allowed")
    };
    server.kill();
    // The next decision finds Redis gone: local, where the 80 are recorded.
    match budget.reserve(b"k", 30).await.unwrap() {
        FleetDecision::Limited(l) => assert_eq!(l.decider, Decider::Local),
        other => panic!("{other:?}"),
    }
    assert_eq!(budget.settle(r, 10).await, None);
    assert_eq!(budget.stats().settles_lost, 1);
    // Refunded locally: 10 + 30 fits.
    match budget.reserve(b"k", 30).await.unwrap() {
        FleetDecision::Allowed(r) => assert_eq!(r.decider(), Decider::Local),
        other => panic!("{other:?}"),
    }
    assert_eq!(budget.stats().offline_decisions, 2);
}

/// A server that has forgotten the script (`SCRIPT FLUSH`, as after a restart or on a new
/// cluster node) gets it loaded again by the decision that finds it missing (`NOSCRIPT`), and
/// the decision is counted once: the limit still admits exactly N.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flushed_script_is_loaded_again_and_the_decision_counted_once() {
    let server = shared();
    let budget = budget_on(
        server,
        &name("flushed"),
        &[Limit::sliding(Meter::Requests, rate(3, 60_000))],
        BudgetFallback::Reject,
    );
    let decide = || async {
        match budget.reserve(b"k", 0).await.unwrap() {
            // Kept (the turn ran): dropping a reservation gives nothing back.
            FleetDecision::Allowed(r) => Some(r.decider()),
            FleetDecision::Limited(_) => None,
        }
    };
    assert_eq!(decide().await, Some(Decider::Fleet));
    assert_eq!(server.command(&["SCRIPT", "FLUSH"]), "OK");
    assert_eq!(decide().await, Some(Decider::Fleet));
    assert_eq!(server.command(&["SCRIPT", "FLUSH"]), "OK");
    assert_eq!(decide().await, Some(Decider::Fleet));
    assert_eq!(decide().await, None, "a fourth within the minute");
    assert_eq!(budget.stats().fleet_decisions, 4);
}
