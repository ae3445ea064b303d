use super::*;

fn passage(
    max: i64,
    depth: i64,
    overflow: &str,
    per_scope: i64,
    timeout: Option<Duration>,
) -> Arc<Passage> {
    Passage::new(PassageConfig {
        limits: ConcurrencyLimit::new(max, depth, overflow, per_scope).unwrap(),
        queue_timeout: timeout,
        fleet: None,
        resource: None,
        rate_limits: budget::RateLimits::default(),
    })
}

#[tokio::test]
async fn cap_queue_and_hand_off() {
    let p = passage(2, 1, "reject", 0, None);
    let t = p.transport("jsonrpc").unwrap();
    let a = p.admit("", t).await.unwrap();
    let _b = p.admit("", t).await.unwrap();
    let waiting = tokio::spawn({
        let p = p.clone();
        async move { p.admit("", t).await.map(|_| ()) }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    let refused = p.admit("", t).await.err().unwrap();
    assert_eq!(refused.reason, Rejection::QueueFull);
    assert!(refused.retry_after.is_some());
    drop(a);
    waiting.await.unwrap().unwrap();
    let stats = &p.transports().stats()[1];
    assert_eq!(stats.admitted, 3);
    assert_eq!(stats.rejected[Rejection::QueueFull.index()], 1);
    assert_eq!(stats.in_flight, 1);
}

#[tokio::test]
async fn dropped_waiters_leak_nothing() {
    let p = passage(1, 1000, "reject", 0, None);
    let t = p.transport("rest").unwrap();
    let held = p.admit("", t).await.unwrap();
    for _ in 0..1000 {
        let fut = p.admit("", t);
        let _ = tokio::time::timeout(Duration::from_micros(1), fut).await;
    }
    drop(held);
    let s = p.stats();
    assert_eq!((s.in_flight, s.queued), (0, 0));
    assert_eq!(p.transports().stats()[1].queued, 0);
    let _again = p.admit("", t).await.unwrap();
}

#[tokio::test]
async fn timeout_and_close() {
    let p = passage(1, 4, "reject", 0, Some(Duration::from_millis(30)));
    let t = p.transport("grpc").unwrap();
    let held = p.admit("", t).await.unwrap();
    let refused = p.admit("", t).await.err().unwrap();
    assert_eq!(refused.reason, Rejection::Timeout);
    let queued = tokio::spawn({
        let p = p.clone();
        async move { p.admit("", t).await.err().map(|r| r.reason) }
    });
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(p.close(), 1);
    assert_eq!(queued.await.unwrap(), Some(Rejection::Closing));
    assert_eq!(
        p.admit("", t).await.err().unwrap().reason,
        Rejection::Closing
    );
    assert!(
        !p.drained(tokio::time::Instant::now() + Duration::from_millis(30))
            .await
    );
    drop(held);
    assert!(
        p.drained(tokio::time::Instant::now() + Duration::from_millis(30))
            .await
    );
}

#[tokio::test]
async fn per_tenant_limit() {
    let p = passage(10, 0, "reject", 1, None);
    let t = p.transport("rest").unwrap();
    let _a = p.admit("acme", t).await.unwrap();
    assert_eq!(
        p.admit("acme", t).await.err().unwrap().reason,
        Rejection::QueueFull
    );
    let _b = p.admit("other", t).await.unwrap();
}

/// `admission`'s outcome, or a failed test (not a hung one) if it takes more than 2 s.
async fn within(
    admission: impl std::future::Future<Output = Result<Permit, Refused>>,
) -> Result<Permit, Refused> {
    tokio::time::timeout(Duration::from_secs(2), admission)
        .await
        .expect("the admission did not end within 2 s")
}

fn after(ms: u64) -> Option<Instant> {
    Instant::now().checked_add(Duration::from_millis(ms))
}

#[tokio::test]
async fn a_queued_turn_whose_deadline_passes_is_refused_with_deadline() {
    let p = passage(1, 4, "reject", 0, Some(Duration::from_secs(5)));
    let t = p.transport("rest").unwrap();
    let held = p.admit("", t).await.unwrap();
    let started = Instant::now();
    let refused = within(p.admit_by("", t, after(60))).await.err().unwrap();
    assert_eq!(refused.reason, Rejection::Deadline);
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(55), "{waited:?}");
    assert!(waited < Duration::from_secs(2), "{waited:?}");
    // The queue timeout still ends a wait that comes before the deadline.
    let p2 = passage(1, 4, "reject", 0, Some(Duration::from_millis(30)));
    let t2 = p2.transport("rest").unwrap();
    let _held2 = p2.admit("", t2).await.unwrap();
    let refused = within(p2.admit_by("", t2, after(5_000)))
        .await
        .err()
        .unwrap();
    assert_eq!(refused.reason, Rejection::Timeout);
    drop(held);
    let stats = &p.transports().stats()[1];
    assert_eq!(stats.rejected[Rejection::Deadline.index()], 1);
    assert_eq!((stats.queued, stats.in_flight), (0, 0));
    assert_eq!(p.stats().rejected, 1);
}

#[tokio::test]
async fn a_turn_that_runs_at_once_ignores_its_deadline() {
    let p = passage(1, 4, "reject", 0, None);
    let t = p.transport("rest").unwrap();
    let past = Instant::now().checked_sub(Duration::from_millis(1));
    let permit = within(p.admit_by("", t, past)).await.unwrap();
    // The same deadline on a turn that would queue: refused at once.
    let started = Instant::now();
    let refused = within(p.admit_by("", t, past)).await.err().unwrap();
    assert_eq!(refused.reason, Rejection::Deadline);
    assert_eq!(refused.retry_after, None);
    assert!(started.elapsed() < Duration::from_millis(500));
    drop(permit);
    // A deadline with ample time left runs after waiting for its slot.
    let held = p.admit("", t).await.unwrap();
    let waiting = tokio::spawn({
        let p = p.clone();
        async move { within(p.admit_by("", t, after(10_000))).await.map(|_| ()) }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    drop(held);
    waiting.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_turn_that_cannot_finish_in_time_is_refused_at_once() {
    let p = passage(1, 4, "reject", 0, None);
    let t = p.transport("grpc").unwrap();
    // A timed turn of about 100 ms teaches the gate the service time.
    let timed = within(p.admit_by("", t, after(10_000))).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(timed);
    let held = p.admit("", t).await.unwrap();
    let started = Instant::now();
    let refused = within(p.admit_by("", t, after(50))).await.err().unwrap();
    assert_eq!(refused.reason, Rejection::Deadline);
    assert!(
        started.elapsed() < Duration::from_millis(40),
        "{:?}",
        started.elapsed()
    );
    // Time for one turn left: it queues, and is refused once less than a turn is left.
    let started = Instant::now();
    let refused = within(p.admit_by("", t, after(250))).await.err().unwrap();
    assert_eq!(refused.reason, Rejection::Deadline);
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(100), "{waited:?}");
    assert!(waited < Duration::from_millis(240), "{waited:?}");
    drop(held);
    let stats = &p.transports().stats()[1];
    assert_eq!(stats.rejected[Rejection::Deadline.index()], 2);
    assert_eq!(stats.admitted, 2);
    assert_eq!(stats.in_flight, 0);
}
