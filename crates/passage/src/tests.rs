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
