//! The lease protocol against a real redis-server: the cap, hand-off, FIFO, per-scope slices,
//! expiry of dead holders, lost leases, cancellation and lending. Each test uses its own limit
//! key on the binary's shared server; each `FleetLimit` stands for one replica.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use admitgate_fleet::{FleetEvent, FleetLimit, Reclaim};
use support::{config, eventually, limit, percentiles, shared, unique_key};

fn holders(key: &str) -> String {
    format!("{{{key}}}:holders")
}

fn tickets(key: &str) -> String {
    format!("{{{key}}}:tickets")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cap_holds_under_many_concurrent_acquirers() {
    let server = shared();
    let key = unique_key("cap");
    let replicas: Vec<FleetLimit> = (0..3).map(|_| limit(config(server, &key, 6))).collect();
    let running = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut turns = Vec::new();
    for (r, replica) in replicas.iter().enumerate() {
        for t in 0..20 {
            let (replica, running, peak, done) =
                (replica.clone(), running.clone(), peak.clone(), done.clone());
            turns.push(tokio::spawn(async move {
                let lease = replica.acquire("").await.unwrap();
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(5 + ((r * 7 + t * 3) % 15) as u64)).await;
                running.fetch_sub(1, Ordering::SeqCst);
                lease.release().await;
                done.fetch_add(1, Ordering::SeqCst);
            }));
        }
    }
    // Meanwhile, Redis itself never shows more holders than the cap.
    let watcher = {
        let (key, done) = (key.clone(), done.clone());
        tokio::task::spawn_blocking(move || {
            let mut most = 0;
            while done.load(Ordering::SeqCst) < 60 {
                most = most.max(shared().zcard(&holders(&key)));
                std::thread::sleep(Duration::from_millis(2));
            }
            most
        })
    };
    for turn in turns {
        tokio::time::timeout(Duration::from_secs(30), turn)
            .await
            .expect("every turn completes")
            .unwrap();
    }
    let most_in_redis = watcher.await.unwrap();
    let elapsed = started.elapsed();
    assert_eq!(done.load(Ordering::SeqCst), 60);
    let peak = peak.load(Ordering::SeqCst);
    assert!(peak <= 6, "peak {peak} over the cap");
    assert!(peak >= 5, "the cap was used (peak {peak})");
    assert!(most_in_redis <= 6, "Redis held {most_in_redis}");
    // 60 turns of ~12 ms at 6 at a time is ~120 ms of work; hand-off is pushed, not polled
    // (re-check every 200 ms), so the whole run stays far below 60 / 6 × 200 ms.
    assert!(elapsed < Duration::from_secs(2), "took {elapsed:?}");
    eventually(Duration::from_secs(2), "no lease left behind", || {
        server.zcard(&holders(&key)) == 0
    })
    .await;
    let stats = replicas[0].stats();
    assert_eq!((stats.held, stats.waiting, stats.lease_lost), (0, 0, 0));
    eprintln!("cap test: 60 turns on 3 replicas, cap 6, peak {peak}, in {elapsed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_hands_off_to_a_waiter_on_another_replica_promptly() {
    let server = shared();
    let key = unique_key("handoff");
    let mut c = config(server, &key, 1);
    // Re-checks and heartbeats far apart: only the pushed notification can explain a fast
    // hand-off.
    c.lease_ttl = Duration::from_secs(30);
    c.command_timeout = Duration::from_secs(1);
    c.connect_timeout = Duration::from_secs(1);
    c.recheck_interval = Duration::from_secs(10);
    let a = limit(c.clone());
    let b = limit(c);
    a.connect().await.unwrap();
    b.connect().await.unwrap();
    let mut samples = Vec::new();
    for _ in 0..100 {
        let held = a.acquire("").await.unwrap();
        let waiter = {
            let b = b.clone();
            tokio::spawn(async move {
                let lease = b.acquire("").await.unwrap();
                let started = Instant::now();
                (lease, started)
            })
        };
        eventually(Duration::from_secs(2), "ticket queued", || {
            b.stats().waiting == 1 && server.zcard(&tickets(&key)) == 1
        })
        .await;
        let released = Instant::now();
        held.release().await;
        let (lease, started) = tokio::time::timeout(Duration::from_secs(2), waiter)
            .await
            .expect("handed off without waiting for a re-check")
            .unwrap();
        samples.push(started - released);
        lease.release().await;
    }
    let (p50, p99) = percentiles(samples);
    eprintln!(
        "hand-off latency (release on A -> waiter starts on B), 100 runs: p50 {p50:?}, p99 {p99:?}"
    );
    assert!(p50 < Duration::from_millis(50), "p50 {p50:?}");
    assert!(p99 < Duration::from_millis(500), "p99 {p99:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_start_in_fleet_wide_arrival_order_across_unequal_backlogs() {
    let server = shared();
    let key = unique_key("fifo");
    let c = config(server, &key, 1);
    let (holder, x, y) = (limit(c.clone()), limit(c.clone()), limit(c));
    let first = holder.acquire("").await.unwrap();
    // X has a backlog of 6, Y of 3, arriving interleaved.
    let arrivals = ["x1", "x2", "y1", "x3", "x4", "y2", "x5", "y3", "x6"];
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for (n, name) in arrivals.iter().enumerate() {
        let replica = if name.starts_with('x') {
            x.clone()
        } else {
            y.clone()
        };
        let (order, name) = (order.clone(), name.to_string());
        waiters.push(tokio::spawn(async move {
            let lease = replica.acquire("").await.unwrap();
            order.lock().unwrap().push(name);
            tokio::time::sleep(Duration::from_millis(3)).await;
            lease.release().await;
        }));
        // The next one arrives after this one's ticket is in Redis.
        eventually(Duration::from_secs(2), "ticket queued", || {
            server.zcard(&tickets(&key)) == n as i64 + 1
        })
        .await;
    }
    first.release().await;
    for waiter in waiters {
        tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .unwrap()
            .unwrap();
    }
    assert_eq!(*order.lock().unwrap(), arrivals);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_slice_holds_fleet_wide_and_other_tenants_pass() {
    let server = shared();
    let key = unique_key("slice");
    let mut c = config(server, &key, 10);
    c.max_in_flight_per_scope = 2;
    let (a, b) = (limit(c.clone()), limit(c));
    let n1 = a.acquire("noisy").await.unwrap();
    let n2 = a.acquire("noisy").await.unwrap();
    // The slice is fleet-wide: replica B may not add a third noisy turn.
    assert!(b.try_acquire("noisy").await.unwrap().is_none());
    let noisy_waiter = {
        let b = b.clone();
        tokio::spawn(async move { b.acquire("noisy").await.unwrap() })
    };
    eventually(Duration::from_secs(2), "noisy ticket", || {
        server.zcard(&tickets(&key)) == 1
    })
    .await;
    // A quiet tenant is admitted at once although the noisy ticket is older: that ticket
    // cannot run.
    let started = Instant::now();
    let quiet = tokio::time::timeout(Duration::from_millis(500), b.acquire("quiet"))
        .await
        .expect("quiet tenant admitted at once")
        .unwrap();
    assert!(started.elapsed() < Duration::from_millis(200));
    assert_eq!(server.zcard(&format!("{{{key}}}:scope:noisy")), 2);
    // A noisy release hands the slot to the noisy waiter on the other replica.
    n1.release().await;
    let n3 = tokio::time::timeout(Duration::from_secs(1), noisy_waiter)
        .await
        .expect("noisy waiter granted")
        .unwrap();
    assert_eq!(n3.scope(), "noisy");
    assert_eq!(server.zcard(&format!("{{{key}}}:scope:noisy")), 2);
    for lease in [n2, n3, quiet] {
        lease.release().await;
    }
    assert_eq!(server.zcard(&holders(&key)), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_holders_leases_expire_and_go_to_a_waiter() {
    let server = shared();
    let key = unique_key("dead");
    let mut c = config(server, &key, 2);
    c.lease_ttl = Duration::from_millis(600);
    c.command_timeout = Duration::from_millis(250);
    // A "replica" on its own runtime, which dies without releasing anything (kill -9: nothing
    // of it runs any more, no release is sent).
    let dead = {
        let c = c.clone();
        std::thread::spawn(move || {
            let doomed = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            let dead = FleetLimit::new(c, doomed.handle().clone()).unwrap();
            let leases = doomed.block_on(async {
                vec![
                    dead.acquire("").await.unwrap(),
                    dead.acquire("").await.unwrap(),
                ]
            });
            std::mem::forget(leases);
            doomed.shutdown_background();
            dead
        })
        .join()
        .unwrap()
    };
    let crashed = Instant::now();
    assert_eq!(server.zcard(&holders(&key)), 2);
    let survivor = limit(c);
    let lease = tokio::time::timeout(Duration::from_secs(3), survivor.acquire(""))
        .await
        .expect("the dead holder's lease came back")
        .unwrap();
    let took = crashed.elapsed();
    // Within the TTL plus one re-check (200 ms) and a margin.
    assert!(
        took < Duration::from_millis(600 + 200 + 500),
        "took {took:?}"
    );
    assert!(
        took >= Duration::from_millis(300),
        "came back before expiry: {took:?}"
    );
    lease.release().await;
    drop(dead);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_holder_is_counted_lost_and_never_frees_the_new_holders_room() {
    let server = shared();
    let key = unique_key("paused");
    let mut c = config(server, &key, 1);
    c.lease_ttl = Duration::from_millis(500);
    c.command_timeout = Duration::from_millis(200);
    c.connect_timeout = Duration::from_millis(200);
    let events = Arc::new(Mutex::new(Vec::new()));
    let (acquired_tx, acquired_rx) = std::sync::mpsc::channel();
    let (check_tx, check_rx) = std::sync::mpsc::channel();
    let paused = {
        let (c, events) = (c.clone(), events.clone());
        std::thread::spawn(move || {
            // One thread runs everything of this replica, so blocking it pauses its heartbeat
            // the way SIGSTOP or a long GC pause would.
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let replica = FleetLimit::new(c, tokio::runtime::Handle::current()).unwrap();
                replica.set_event_handler(Arc::new(move |e: &FleetEvent| {
                    events.lock().unwrap().push(e.clone())
                }));
                let lease = replica.acquire("").await.unwrap();
                acquired_tx.send(()).unwrap();
                std::thread::sleep(Duration::from_millis(1500)); // paused past the TTL
                tokio::time::sleep(Duration::from_millis(600)).await; // heartbeats run again
                let lost = (lease.is_lost(), replica.stats().lease_lost);
                lease.release().await;
                check_tx.send(lost).unwrap();
                replica.shutdown().await;
            });
        })
    };
    acquired_rx.recv().unwrap();
    let other = limit(c);
    let lease = tokio::time::timeout(Duration::from_secs(2), other.acquire(""))
        .await
        .expect("the paused holder's lease expired")
        .unwrap();
    let (is_lost, lease_lost) = check_rx.recv_timeout(Duration::from_secs(5)).unwrap();
    paused.join().unwrap();
    assert!(is_lost);
    assert_eq!(lease_lost, 1);
    assert!(events
        .lock()
        .unwrap()
        .iter()
        .any(|e| matches!(e, FleetEvent::LeaseLost { .. })));
    // The lost lease's release did not free the new holder's room.
    assert_eq!(
        server.command(&["ZRANGE", &holders(&key), "0", "-1"]),
        lease.id()
    );
    lease.release().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_wait_leaves_no_ticket_and_never_leaks_a_lease() {
    let server = shared();
    let key = unique_key("cancel");
    let c = config(server, &key, 1);
    let (a, b) = (limit(c.clone()), limit(c));
    let held = a.acquire("").await.unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(100), b.acquire(""))
            .await
            .is_err()
    );
    eventually(Duration::from_secs(1), "ticket withdrawn", || {
        server.zcard(&tickets(&key)) == 0
    })
    .await;
    assert_eq!(b.stats().waiting, 0);
    held.release().await;
    // Cancellations racing the grant: whatever the interleaving, nothing leaks.
    for round in 0..40u64 {
        let held = a.acquire("").await.unwrap();
        let waiter = {
            let b = b.clone();
            tokio::spawn(async move { b.acquire("").await.map(drop) })
        };
        eventually(Duration::from_secs(1), "queued", || {
            server.zcard(&tickets(&key)) == 1
        })
        .await;
        let release = tokio::spawn(held.release());
        tokio::time::sleep(Duration::from_micros(round * 50)).await;
        waiter.abort();
        let _ = waiter.await;
        release.await.unwrap();
        eventually(Duration::from_secs(1), "nothing held or queued", || {
            server.zcard(&holders(&key)) == 0 && server.zcard(&tickets(&key)) == 0
        })
        .await;
    }
    // The slot is still usable.
    let lease = tokio::time::timeout(Duration::from_millis(500), b.acquire(""))
        .await
        .unwrap()
        .unwrap();
    lease.release().await;
    assert_eq!((b.stats().held, b.stats().waiting), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lent_lease_serves_a_waiter_and_a_borrow_is_repaid_by_the_next_release() {
    let server = shared();
    let key = unique_key("lend");
    let c = config(server, &key, 2);
    let (a, b) = (limit(c.clone()), limit(c));
    let l1 = a.acquire("").await.unwrap();
    let l2 = a.acquire("").await.unwrap();
    let waiter = {
        let b = b.clone();
        tokio::spawn(async move { b.acquire("").await.unwrap() })
    };
    eventually(Duration::from_secs(1), "queued", || {
        server.zcard(&tickets(&key)) == 1
    })
    .await;
    // l1's turn waits for a person: its lease serves the waiter.
    a.lend(l1).await;
    let w = tokio::time::timeout(Duration::from_secs(1), waiter)
        .await
        .unwrap()
        .unwrap();
    // The person answered: no room, so the turn borrows, without waiting.
    let started = Instant::now();
    let (resumed, how) = a.reclaim("").await.unwrap();
    assert!(started.elapsed() < Duration::from_millis(300));
    assert_eq!(how, Reclaim::Borrowed);
    assert_eq!(server.zcard(&holders(&key)), 3);
    assert_eq!(a.stats().borrowed, 1);
    // A newcomer waits: the fleet is over its cap.
    let late = {
        let b = b.clone();
        tokio::spawn(async move { b.acquire("").await.unwrap() })
    };
    eventually(Duration::from_secs(1), "queued", || {
        server.zcard(&tickets(&key)) == 1
    })
    .await;
    // The next release anywhere repays the borrow instead of freeing room.
    w.release().await;
    assert_eq!(server.command(&["GET", &format!("{{{key}}}:borrowed")]), "");
    assert_eq!(b.stats().borrowed, 0);
    assert_eq!(server.zcard(&holders(&key)), 2);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!late.is_finished(), "the repaying release freed no room");
    // The release after that does free room.
    l2.release().await;
    let l3 = tokio::time::timeout(Duration::from_secs(1), late)
        .await
        .unwrap()
        .unwrap();
    // With room, a reclaim just takes a lease.
    resumed.release().await;
    let (again, how) = a.reclaim("").await.unwrap();
    assert_eq!(how, Reclaim::Taken);
    again.release().await;
    l3.release().await;
    assert_eq!(server.zcard(&holders(&key)), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_acquire_never_queues_and_dropped_leases_are_given_back() {
    let server = shared();
    let key = unique_key("try");
    let a = limit(config(server, &key, 1));
    let lease = a.try_acquire("").await.unwrap().expect("room");
    assert!(a.try_acquire("").await.unwrap().is_none());
    assert_eq!(server.zcard(&tickets(&key)), 0);
    drop(lease); // no release() call: the destructor gives it back
    eventually(Duration::from_secs(1), "dropped lease given back", || {
        server.zcard(&holders(&key)) == 0
    })
    .await;
    assert!(a.try_acquire("").await.unwrap().is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_racing_releases_report_no_false_loss_and_leak_nothing() {
    let server = shared();
    let key = unique_key("race");
    let mut c = config(server, &key, 2);
    // Beats as often as allowed, so they keep overlapping releases; waiters on both replicas
    // take freed room at once, so a beat that raced a release finds the room gone.
    c.heartbeat_interval = Some(Duration::from_millis(10));
    c.recheck_interval = Duration::from_millis(10);
    let (a, b) = (limit(c.clone()), limit(c));
    let mut workers = Vec::new();
    for replica in [&a, &a, &b, &b, &b] {
        let replica = replica.clone();
        workers.push(tokio::spawn(async move {
            for _ in 0..150 {
                let lease = replica.acquire("").await.unwrap();
                tokio::time::sleep(Duration::from_millis(1)).await;
                lease.release().await;
            }
        }));
    }
    for worker in workers {
        tokio::time::timeout(Duration::from_secs(30), worker)
            .await
            .unwrap()
            .unwrap();
    }
    assert_eq!((a.stats().lease_lost, b.stats().lease_lost), (0, 0));
    eventually(Duration::from_secs(1), "nothing left", || {
        server.zcard(&holders(&key)) == 0 && server.zcard(&tickets(&key)) == 0
    })
    .await;
    // Without contention a beat that raced a release finds room and puts the lease back; the
    // replica then gives it back again instead of leaving it to expire (TTL 3 s).
    let mut c = config(server, &key, 10);
    c.heartbeat_interval = Some(Duration::from_millis(10));
    let alone = limit(c);
    let mut workers = Vec::new();
    for _ in 0..3 {
        let alone = alone.clone();
        workers.push(tokio::spawn(async move {
            for _ in 0..150 {
                let lease = alone.acquire("").await.unwrap();
                tokio::time::sleep(Duration::from_millis(1)).await;
                lease.release().await;
            }
        }));
    }
    for worker in workers {
        worker.await.unwrap();
    }
    eventually(Duration::from_secs(1), "no lease put back and left", || {
        server.zcard(&holders(&key)) == 0
    })
    .await;
    assert_eq!(alone.stats().lease_lost, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn during_a_rolling_deploy_each_replica_enforces_its_own_cap() {
    let server = shared();
    let key = unique_key("rolling");
    let old = limit(config(server, &key, 4)); // not yet redeployed
    let new = limit(config(server, &key, 2)); // redeployed with a lower cap
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(old.acquire("").await.unwrap());
    }
    // 3 held: over the new replica's cap, under the old one's.
    assert!(new.try_acquire("").await.unwrap().is_none());
    let waiting_new = {
        let new = new.clone();
        tokio::spawn(async move { new.acquire("").await.unwrap() })
    };
    eventually(Duration::from_secs(1), "queued", || {
        server.zcard(&tickets(&key)) == 1
    })
    .await;
    // The old replica's cap still has room, and the new replica's ticket cannot run: no FIFO
    // block.
    let fourth = tokio::time::timeout(Duration::from_millis(500), old.acquire(""))
        .await
        .unwrap()
        .unwrap();
    assert!(
        old.try_acquire("").await.unwrap().is_none(),
        "never over the larger cap"
    );
    // The new replica's turn runs once fewer than 2 are held fleet-wide.
    fourth.release().await;
    held.pop().unwrap().release().await;
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert!(
        !waiting_new.is_finished(),
        "2 still held: not under the new cap"
    );
    held.pop().unwrap().release().await;
    let lease = tokio::time::timeout(Duration::from_secs(1), waiting_new)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(server.zcard(&holders(&key)), 2);
    lease.release().await;
    held.pop().unwrap().release().await;
    assert_eq!(server.zcard(&holders(&key)), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_to_a_paused_waiter_goes_unclaimed_and_no_turn_starts_on_it() {
    let server = shared();
    let key = unique_key("unclaimed");
    let mut c = config(server, &key, 1);
    c.lease_ttl = Duration::from_secs(3);
    c.command_timeout = Duration::from_millis(250); // the claim window
    let holder = limit(c.clone());
    let held = holder.acquire("").await.unwrap();
    let (queued_tx, queued_rx) = std::sync::mpsc::channel();
    let (paused_tx, paused_rx) = std::sync::mpsc::channel::<()>();
    let started = Arc::new(Mutex::new(Vec::new()));
    let paused = {
        let (c, started) = (c.clone(), started.clone());
        std::thread::spawn(move || {
            // One thread runs everything of this replica, so blocking it pauses it the way
            // SIGSTOP would: its listener cannot claim, its heartbeat cannot renew.
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let replica = FleetLimit::new(c, tokio::runtime::Handle::current()).unwrap();
                let turns: Vec<_> = (0..2)
                    .map(|_| {
                        let (replica, started) = (replica.clone(), started.clone());
                        tokio::spawn(async move {
                            let lease = replica.acquire("").await.unwrap();
                            started.lock().unwrap().push(Instant::now());
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            lease.release().await;
                        })
                    })
                    .collect();
                while replica.stats().fleet_waiting < 2 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                queued_tx.send(()).unwrap();
                paused_rx.recv().unwrap(); // paused until told
                for turn in turns {
                    turn.await.unwrap();
                }
                replica.stats().lease_lost
            })
        })
    };
    queued_rx.recv().unwrap();
    let other = limit(c);
    let waiting = tokio::spawn({
        let other = other.clone();
        async move { other.acquire("").await.unwrap() }
    });
    eventually(Duration::from_secs(2), "the other replica queued", || {
        server.zcard(&tickets(&key)) == 3
    })
    .await;
    let released = Instant::now();
    held.release().await; // granted to the paused replica's oldest ticket
    let lease = tokio::time::timeout(Duration::from_secs(2), waiting)
        .await
        .expect("the room went on to the live replica")
        .unwrap();
    let took = released.elapsed();
    // The claim window (250 ms), then the live waiter's next re-check (200 ms); before, the
    // grant held the room for the whole lease TTL (3 s).
    assert!(
        took < Duration::from_millis(250 + 200 + 500),
        "took {took:?}"
    );
    paused_tx.send(()).unwrap(); // wakes: its stale grant message arrives now
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        started.lock().unwrap().is_empty(),
        "a turn started on an expired grant while the room was taken"
    );
    let freed = Instant::now();
    lease.release().await;
    let lost = tokio::task::spawn_blocking(move || paused.join().unwrap())
        .await
        .unwrap();
    let starts = started.lock().unwrap().clone();
    assert_eq!(starts.len(), 2, "both waiting turns ran in the end");
    assert!(starts.iter().all(|s| *s >= freed));
    assert!(lost <= 1, "{lost} lost grants counted");
    eventually(Duration::from_secs(2), "nothing left", || {
        server.zcard(&holders(&key)) == 0 && server.zcard(&tickets(&key)) == 0
    })
    .await;
}
