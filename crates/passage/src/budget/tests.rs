use std::time::Duration;

use admitgate_budget::{Budget, Limit, Meter, Rate};

use super::*;
use crate::core_api::{ClassId, ConcurrencyLimit};
use crate::{Passage, PassageConfig};

fn limiter(name: &str, limits: &[(Meter, &str)], on_limit: OnLimit) -> Arc<RateLimiter> {
    let limits = limits
        .iter()
        .map(|(meter, rate)| Limit::sliding(*meter, Rate::parse(meter.name(), rate).unwrap()))
        .collect();
    let budget = Budget::new(limits, 1000).unwrap();
    Arc::new(RateLimiter::new(
        name,
        BudgetBackend::Local(Box::new(budget)),
        on_limit,
    ))
}

fn passage(max: i64, depth: i64, timeout: Option<Duration>, limits: RateLimits) -> Arc<Passage> {
    Passage::new(PassageConfig {
        limits: ConcurrencyLimit::new(max, depth, "reject", 0).unwrap(),
        queue_timeout: timeout,
        fleet: None,
        resource: None,
        rate_limits: limits,
    })
}

#[tokio::test]
async fn a_refused_turn_takes_no_slot_and_knows_when_to_retry() {
    let rl = limiter("chat", &[(Meter::Requests, "2/s")], OnLimit::Reject);
    let p = passage(10, 0, None, RateLimits::new(vec![rl.clone()]));
    let t = p.transport("jsonrpc").unwrap();
    let started = Instant::now();
    let a = p
        .admit_as("", ClassId::DEFAULT, t, None, Some(b"alice"), 0)
        .await
        .unwrap();
    let _b = p
        .admit_as("", ClassId::DEFAULT, t, None, Some(b"alice"), 0)
        .await
        .unwrap();
    let refused = p
        .admit_as("", ClassId::DEFAULT, t, None, Some(b"alice"), 0)
        .await
        .err()
        .unwrap();
    assert_eq!(refused.reason, Rejection::RateLimited);
    let retry = refused.retry_after.unwrap();
    // Exact: the first admission leaves the window one second after it was made.
    assert!(retry <= Duration::from_secs(1), "{retry:?}");
    assert!(
        retry + started.elapsed() >= Duration::from_millis(999),
        "{retry:?}"
    );
    // Another identity is not limited; the refused turn took no slot.
    let _c = p
        .admit_as("", ClassId::DEFAULT, t, None, Some(b"bob"), 0)
        .await
        .unwrap();
    let s = p.stats();
    assert_eq!((s.in_flight, s.admitted, s.rejected), (3, 3, 0));
    let jsonrpc = p.transports().stats();
    let jsonrpc = jsonrpc.iter().find(|s| &*s.name == "jsonrpc").unwrap();
    assert_eq!(jsonrpc.rejected[Rejection::RateLimited.index()], 1);
    let stats = rl.stats();
    assert_eq!((stats.allowed, stats.limited), (3, 1));
    drop(a);
}

#[tokio::test]
async fn wait_waits_for_the_budget_within_the_queue_timeout() {
    let rate = Rate::new("requests", 1, Duration::from_millis(200)).unwrap();
    let budget = Budget::new(vec![Limit::sliding(Meter::Requests, rate)], 1000).unwrap();
    let rl = Arc::new(RateLimiter::new(
        "chat",
        BudgetBackend::Local(Box::new(budget)),
        OnLimit::Wait,
    ));
    let p = passage(
        10,
        10,
        Some(Duration::from_secs(2)),
        RateLimits::new(vec![rl.clone()]),
    );
    let t = p.transport("rest").unwrap();
    let first = Instant::now();
    let _a = p
        .admit_as("", ClassId::DEFAULT, t, None, Some(b"k"), 0)
        .await
        .unwrap();
    let _b = p
        .admit_as("", ClassId::DEFAULT, t, None, Some(b"k"), 0)
        .await
        .unwrap();
    assert!(
        first.elapsed() >= Duration::from_millis(199),
        "{:?}",
        first.elapsed()
    );
    assert_eq!(rl.stats().waited, 1);
    // A retry time past the turn's deadline is refused at once, with the exact time.
    let deadline = Instant::now() + Duration::from_millis(50);
    let asked = Instant::now();
    let refused = p
        .admit_as("", ClassId::DEFAULT, t, Some(deadline), Some(b"k"), 0)
        .await
        .err()
        .unwrap();
    assert_eq!(refused.reason, Rejection::RateLimited);
    assert!(asked.elapsed() < Duration::from_millis(50));
    assert!(refused.retry_after.unwrap() > Duration::from_millis(100));
}

#[tokio::test]
async fn a_turn_the_gate_refuses_gives_its_reservation_back() {
    let rl = limiter("chat", &[(Meter::Requests, "1/min")], OnLimit::Reject);
    let p = passage(1, 0, None, RateLimits::new(vec![rl.clone()]));
    let t = p.transport("rest").unwrap();
    let running = p
        .admit_as("", ClassId::DEFAULT, t, None, Some(b"a"), 0)
        .await
        .unwrap();
    // The gate is full: b is refused by it, and its budget hold is given back ...
    let refused = p
        .admit_as("", ClassId::DEFAULT, t, None, Some(b"b"), 0)
        .await
        .err()
        .unwrap();
    assert_eq!(refused.reason, Rejection::QueueFull);
    assert_eq!(rl.stats().returned, 1);
    drop(running);
    // ... so b's one request a minute is still there.
    let _b = p
        .admit_as("", ClassId::DEFAULT, t, None, Some(b"b"), 0)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_turn_cancelled_while_queued_gives_its_reservation_back() {
    let rl = limiter("chat", &[(Meter::Requests, "1/min")], OnLimit::Reject);
    let p = passage(1, 5, None, RateLimits::new(vec![rl.clone()]));
    let t = p.transport("rest").unwrap();
    let running = p
        .admit_as("", ClassId::DEFAULT, t, None, Some(b"a"), 0)
        .await
        .unwrap();
    let queued = tokio::spawn({
        let p = p.clone();
        async move {
            p.admit_as("", ClassId::DEFAULT, t, None, Some(b"b"), 0)
                .await
                .map(drop)
        }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(p.stats().queued, 1);
    queued.abort();
    let _ = queued.await;
    assert_eq!(rl.stats().returned, 1);
    drop(running);
    let _b = p
        .admit_as("", ClassId::DEFAULT, t, None, Some(b"b"), 0)
        .await
        .unwrap();
}

#[tokio::test]
async fn usage_settles_and_later_limiters_refusing_give_earlier_holds_back() {
    let tokens = limiter("tokens", &[(Meter::Tokens, "1000/min")], OnLimit::Reject);
    let requests = limiter("requests", &[(Meter::Requests, "1/min")], OnLimit::Reject);
    let p = passage(
        10,
        0,
        None,
        RateLimits::new(vec![tokens.clone(), requests.clone()]),
    );
    let t = p.transport("rest").unwrap();
    let mut a = p
        .admit_as("", ClassId::DEFAULT, t, None, Some(b"a"), 900)
        .await
        .unwrap();
    // The estimate holds 900 of 1000: a turn of 200 does not fit ...
    let refused = p
        .admit_as("", ClassId::DEFAULT, t, None, Some(b"x"), 200)
        .await;
    assert!(refused.is_ok()); // another identity
    assert!(a.report_usage(100));
    assert!(!a.report_usage(100), "settled once");
    let s = tokens.stats();
    assert_eq!((s.settled, s.tokens_settled), (1, 100));
    // ... but after a refund of 800 it does, for the tokens; the request limit then refuses
    // and the token hold is given back whole.
    let refused = p
        .admit_as("", ClassId::DEFAULT, t, None, Some(b"a"), 200)
        .await
        .err()
        .unwrap();
    assert_eq!(refused.reason, Rejection::RateLimited);
    let s = tokens.stats();
    assert_eq!((s.returned, s.tokens_returned), (1, 200));
    // A cost above the whole window never fits: refused with no retry time.
    let never = p
        .admit_as("", ClassId::DEFAULT, t, None, Some(b"z"), 5000)
        .await
        .err()
        .unwrap();
    assert_eq!(never.reason, Rejection::RateLimited);
    assert_eq!(never.retry_after, None);
}

#[test]
fn on_limit_names_the_bad_value() {
    assert_eq!("wait".parse::<OnLimit>(), Ok(OnLimit::Wait));
    let err = "later".parse::<OnLimit>().unwrap_err();
    assert!(err.contains("on_limit=\"later\""), "{err}");
}
