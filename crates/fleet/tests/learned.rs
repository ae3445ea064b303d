//! The fleet's learned limit against a real redis-server: the learn script composes concurrent
//! proposals atomically (lowers as their minimum, raises as a compare-and-set on the
//! generation, at most one per spacing), bounds every value, and every lease script honours it.

mod support;

use std::sync::Arc;
use std::time::Duration;

use admitgate_core::overload::{CapacitySearchConfig, LimitController, Outcome, Sample};
use admitgate_fleet::{Change, FleetLearner, FleetLimit, Learned, Proposal};
use support::{config, limit, shared, unique_key};

fn proposal(change: Change, limit: u64, generation: u64) -> Proposal {
    Proposal {
        change,
        limit,
        generation,
        min_limit: 2,
        max_limit: 40,
        spacing: Duration::ZERO,
        hold: Duration::ZERO,
    }
}

fn replicas(key: &str, n: usize, cap: u32) -> Vec<FleetLimit> {
    (0..n).map(|_| limit(config(shared(), key, cap))).collect()
}

async fn learn(limit: &FleetLimit, p: Proposal) -> Learned {
    limit
        .learn(p)
        .await
        .unwrap()
        .expect("a learned limit after a proposal")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_lowers_compose_as_their_minimum_and_raises_as_one_compare_and_set() {
    let key = unique_key("learn-atomic");
    let fleet = replicas(&key, 8, 40);
    let seeded = learn(&fleet[0], proposal(Change::Seed, 30, 0)).await;
    assert_eq!(seeded.limit, 30);
    // A second seed leaves it: a replica that starts adopts what the fleet learned.
    let again = learn(&fleet[1], proposal(Change::Seed, 4, 0)).await;
    assert_eq!(again, seeded);

    // 64 lowers from 8 replicas at once, in no particular order: the minimum wins, and every
    // reply is the state after some prefix of them (never above a value already taken).
    let lowers = (0..64u64).map(|i| {
        let replica = fleet[(i % 8) as usize].clone();
        let value = 10 + (i * 37) % 19; // 10..=28, each several times
        async move { learn(&replica, proposal(Change::Lower, value, 0)).await }
    });
    let replies = futures_util::future::join_all(lowers).await;
    let settled = learn(&fleet[0], proposal(Change::Seed, 0, 0)).await;
    assert_eq!(settled.limit, 10);
    assert!(replies.iter().all(|r| r.limit >= 10 && r.limit <= 28));
    // Each effective lower took one generation; a reply's generation orders its value.
    let mut by_generation = replies.clone();
    by_generation.sort_by_key(|r| r.generation);
    assert!(
        by_generation.windows(2).all(|w| w[1].limit <= w[0].limit),
        "{by_generation:?}"
    );
    assert!(settled.generation > seeded.generation);
    assert!(settled.generation - seeded.generation <= 19);

    // 32 raises based on the same generation: exactly one is taken.
    let raises = (0..32u64).map(|i| {
        let replica = fleet[(i % 8) as usize].clone();
        let value = 11 + i % 7;
        async move { learn(&replica, proposal(Change::Raise, value, settled.generation)).await }
    });
    let replies = futures_util::future::join_all(raises).await;
    let after = learn(&fleet[0], proposal(Change::Seed, 0, 0)).await;
    assert_eq!(after.generation, settled.generation + 1, "{replies:?}");
    assert!((11..=17).contains(&after.limit));
    // A raise on a stale generation is refused; a lower never is.
    let stale = learn(&fleet[2], proposal(Change::Raise, 39, settled.generation)).await;
    assert_eq!(stale, after);
    let lowered = learn(&fleet[3], proposal(Change::Lower, 3, settled.generation)).await;
    assert_eq!(lowered.limit, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raise_waits_a_round_trip_by_the_server_clock_and_values_stay_in_bounds() {
    let key = unique_key("learn-bounds");
    let fleet = replicas(&key, 1, 40);
    let seeded = learn(&fleet[0], proposal(Change::Lower, 1000, 0)).await;
    assert_eq!(seeded.limit, 40, "above max_limit");
    let floor = learn(&fleet[0], proposal(Change::Lower, 0, 0)).await;
    assert_eq!(floor.limit, 2, "below min_limit");
    let mut slow = proposal(Change::Raise, 8, floor.generation);
    slow.spacing = Duration::from_secs(30);
    assert_eq!(
        learn(&fleet[0], slow).await,
        floor,
        "raised within its spacing"
    );
    slow.spacing = Duration::from_millis(20);
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert_eq!(learn(&fleet[0], slow).await.limit, 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_lease_script_honours_the_learned_limit_and_a_raise_hands_room_to_waiters() {
    let key = unique_key("learn-cap");
    let fleet = replicas(&key, 3, 20);
    learn(&fleet[0], proposal(Change::Seed, 3, 0)).await;
    let mut held = Vec::new();
    for i in 0..9 {
        if let Some(lease) = fleet[i % 3].try_acquire("").await.unwrap() {
            held.push(lease);
        }
    }
    assert_eq!(held.len(), 3, "try_acquire past the learned limit");
    assert_eq!(shared().zcard(&format!("{{{key}}}:holders")), 3);
    // Two waiters queue; a raise to 5 grants both at once (no release needed).
    let waiters: Vec<_> = (0..2)
        .map(|i| {
            let replica = fleet[i].clone();
            tokio::spawn(async move { replica.acquire("").await.unwrap() })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(waiters.iter().all(|w| !w.is_finished()));
    let now = learn(&fleet[2], proposal(Change::Seed, 0, 0)).await;
    learn(&fleet[2], proposal(Change::Raise, 5, now.generation)).await;
    for waiter in waiters {
        held.push(
            tokio::time::timeout(Duration::from_secs(5), waiter)
                .await
                .unwrap()
                .unwrap(),
        );
    }
    assert_eq!(shared().zcard(&format!("{{{key}}}:holders")), 5);
    assert_eq!(fleet[2].stats().learned_limit, 5);
    for lease in held {
        lease.release().await;
    }
    // A fleet without a learned limit is bounded by its cap alone.
    let plain = unique_key("learn-none");
    let replica = limit(config(shared(), &plain, 4));
    let mut leases = Vec::new();
    while let Some(lease) = replica.try_acquire("").await.unwrap() {
        leases.push(lease);
    }
    assert_eq!(leases.len(), 4);
    assert_eq!(replica.stats().learned_limit, 0);
}

/// A learner on `limit`'s fleet, as a replica's gate holds it.
fn learner(limit: &FleetLimit, initial: u64) -> FleetLearner {
    let source = limit.clone();
    let mut config = CapacitySearchConfig::new(u64::from(limit.config().max_in_flight));
    config.initial_limit = initial;
    FleetLearner::new(config, Arc::new(move || Some(source.clone())))
}

fn learned_in_redis(key: &str) -> String {
    shared().command(&["HGET", &format!("{{{key}}}:learned"), "limit"])
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttle_measured_while_the_seed_is_in_flight_still_lowers_the_fleet() {
    let key = unique_key("learn-seed-race");
    let (a, b) = (
        limit(config(shared(), &key, 64)),
        limit(config(shared(), &key, 64)),
    );
    let mut on_a = learner(&a, 10);
    let mut on_b = learner(&b, 10);
    let mut leases = Vec::new();
    for _ in 0..7 {
        leases.push(a.acquire("").await.unwrap());
    }
    // The first start sends the seed (10); the refusal comes before its reply: seven were
    // running, so the provider admits six. Nothing else happens on this replica afterwards.
    on_a.on_start(ms(0), 7, 0);
    on_a.on_sample(Sample {
        started_at: ms(0),
        ended_at: ms(1),
        in_flight: 7,
        outcome: Outcome::Throttled { retry_after: None },
        remaining: None,
    });
    assert_eq!(on_a.limit(), 6);
    support::eventually(ms(2000), "the fleet lowered to 6", || {
        learned_in_redis(&key) == "6"
    })
    .await;
    // Seven still hold leases, over the new limit: the other replica's turn waits for a
    // lease until the fleet is below six, then reads the value with it, and follows.
    let waiting = tokio::spawn(async move { b.acquire("").await.unwrap() });
    tokio::time::sleep(ms(100)).await;
    assert!(!waiting.is_finished(), "granted over the learned limit");
    for lease in leases.drain(..2) {
        lease.release().await;
    }
    let lease = tokio::time::timeout(ms(5000), waiting)
        .await
        .unwrap()
        .unwrap();
    on_b.on_start(ms(0), 1, 0);
    assert_eq!(on_b.limit(), 6);
    lease.release().await;
    for lease in leases {
        lease.release().await;
    }
}

// -- issue 22 ---------------------------------------------------------------------------------

fn served(start: u64, end: u64, in_flight: u64) -> Sample {
    Sample {
        started_at: ms(start),
        ended_at: ms(end),
        in_flight,
        outcome: Outcome::Success,
        remaining: None,
    }
}

/// Item 12. Fails before the fix: 4.8 s into a 30 s Retry-After on replica A, replica B raised
/// the fleet's value by compare-and-set, and A followed. The hold is kept in Redis now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_seen_by_one_replica_holds_every_replicas_raise() {
    let key = unique_key("learn-hold");
    let (a, b) = (
        limit(config(shared(), &key, 64)),
        limit(config(shared(), &key, 64)),
    );
    let seeded = learn(&a, proposal(Change::Seed, 8, 0)).await;
    // A's provider call is refused with Retry-After: 30 s, started with 8 running.
    let mut on_a = learner(&a, 8);
    on_a.on_start(ms(0), 8, 0);
    on_a.on_sample(Sample {
        started_at: ms(0),
        ended_at: ms(1),
        in_flight: 8,
        outcome: Outcome::Throttled {
            retry_after: Some(Duration::from_secs(30)),
        },
        remaining: None,
    });
    support::eventually(ms(2000), "the fleet lowered to 7", || {
        learned_in_redis(&key) == "7"
    })
    .await;
    let now = learn(&b, proposal(Change::Seed, 0, 0)).await;
    assert!(now.generation > seeded.generation);
    // B saw the current generation and no spacing is asked: before, taken at once.
    let raised = learn(&b, proposal(Change::Raise, 38, now.generation)).await;
    assert_eq!(
        raised, now,
        "a raise was taken during another replica's Retry-After"
    );
    // B's own learner, with its ceiling reached every round trip, cannot raise it either.
    let mut on_b = learner(&b, 7);
    let mut t = 0;
    for _ in 0..40 {
        on_b.on_start(ms(t), 7, 5);
        on_b.on_sample(served(t, t + 5, 7));
        t += 5;
        tokio::time::sleep(ms(5)).await;
    }
    assert_eq!(learned_in_redis(&key), "7");
    // A hold ends by the server's clock: a short one lets the next raise through.
    let key2 = unique_key("learn-hold-short");
    let c = limit(config(shared(), &key2, 64));
    let first = learn(&c, proposal(Change::Seed, 8, 0)).await;
    let mut short = proposal(Change::Lower, 8, first.generation);
    short.hold = ms(150);
    let held = learn(&c, short).await;
    assert_eq!(held, first, "a hold alone changes nothing else");
    let refused = learn(&c, proposal(Change::Raise, 9, first.generation)).await;
    assert_eq!(refused.limit, 8);
    tokio::time::sleep(ms(200)).await;
    assert_eq!(
        learn(&c, proposal(Change::Raise, 9, first.generation))
            .await
            .limit,
        9
    );
}

/// Item 19. Fails before the fix: a `{key}:learned` of "2.5" let 3 leases through at cap 4
/// (the scripts compared with 2.5) while the reply said 2; a negative one stopped every grant
/// to a waiting ticket. A value that is not a whole number >= 1 now counts as none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tampered_learned_value_counts_as_none() {
    for tampered in ["2.5", "-1", "garbage", "0", "1e400"] {
        let key = unique_key("learn-tampered");
        let replica = limit(config(shared(), &key, 4));
        shared().command(&[
            "HSET",
            &format!("{{{key}}}:learned"),
            "limit",
            tampered,
            "gen",
            "5",
        ]);
        let mut leases = Vec::new();
        while let Some(lease) = replica.try_acquire("").await.unwrap() {
            leases.push(lease);
        }
        assert_eq!(leases.len(), 4, "{tampered}: the cap alone counts");
        assert_eq!(replica.stats().learned_limit, 0, "{tampered}");
        // A waiting ticket is granted when a lease goes back.
        let waiter = {
            let replica = replica.clone();
            tokio::spawn(async move { replica.acquire("").await.unwrap() })
        };
        tokio::time::sleep(ms(50)).await;
        leases.pop().unwrap().release().await;
        let lease = tokio::time::timeout(ms(3000), waiter)
            .await
            .unwrap_or_else(|_| panic!("{tampered}: no grant to the waiting ticket"))
            .unwrap();
        leases.push(lease);
        // A replica's proposal seeds a sound value anew.
        let seeded = learn(&replica, proposal(Change::Seed, 3, 0)).await;
        assert_eq!(seeded.limit, 3, "{tampered}");
        for lease in leases {
            lease.release().await;
        }
    }
}

/// Item 19. Before the fix the learner kept each turn's fleet-wide in-flight figure by its
/// start time: two turns starting at the same instant overwrote each other. Each turn now
/// carries its own figure (`start_figure`), nothing is kept per turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_turns_starting_at_the_same_instant_keep_their_own_figures() {
    let key = unique_key("learn-same-instant");
    let a = limit(config(shared(), &key, 64));
    let mut leases = Vec::new();
    for _ in 0..3 {
        leases.push(a.acquire("").await.unwrap());
    }
    let mut on_a = learner(&a, 10);
    on_a.on_start(ms(100), 1, 0);
    let first = on_a.start_figure(1);
    leases.push(a.acquire("").await.unwrap());
    leases.push(a.acquire("").await.unwrap());
    on_a.on_start(ms(100), 2, 0);
    let second = on_a.start_figure(2);
    assert_eq!((first, second), (3, 5));
    // The first turn is refused: it started with 3 running fleet-wide, so the provider admits
    // 2 (before, the second start's 5 stood for both: 4).
    on_a.on_sample(Sample {
        started_at: ms(100),
        ended_at: ms(101),
        in_flight: first,
        outcome: Outcome::Throttled { retry_after: None },
        remaining: None,
    });
    assert_eq!(on_a.limit(), 2);
    for lease in leases {
        lease.release().await;
    }
}
