//! Priority classes and fair shares across the fleet, against a real redis-server: the order of
//! waiting tickets against a model (generated, seeded), each class's share under a burst from
//! several replicas, fair queuing across tenants on different replicas, a crashed replica's
//! class getting its guarantee back, and a replica with other classes refused.

mod support;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use admitgate_core::queue::{Priorities, PriorityClass};
use admitgate_fleet::{FleetClasses, FleetError, FleetLimit, Lease, FAIR_QUANTUM};
use support::{config, eventually, limit, shared, unique_key};

fn classes(shares: &[(&str, f64, f64)], fair: bool) -> FleetClasses {
    let list = shares
        .iter()
        .map(|(name, min, max)| PriorityClass::shared(name, *min, *max))
        .collect();
    FleetClasses::new(Priorities::new(list, None).unwrap(), fair, HashMap::new())
}

fn class_holders(key: &str, class: usize) -> i64 {
    shared().zcard(&format!("{{{key}}}:cls:{class}"))
}

/// Holders of classes 0 and 1 and in all, read in one atomic step.
fn sample(key: &str) -> (i64, i64, i64) {
    let reply = shared().command(&[
        "EVAL",
        "return {redis.call('ZCARD', KEYS[1]), redis.call('ZCARD', KEYS[2]), \
         redis.call('ZCARD', KEYS[3])}",
        "3",
        &format!("{{{key}}}:cls:0"),
        &format!("{{{key}}}:cls:1"),
        &format!("{{{key}}}:holders"),
    ]);
    let n: Vec<i64> = reply.lines().map(|l| l.parse().unwrap()).collect();
    (n[0], n[1], n[2])
}

fn holder_ids(key: &str) -> HashSet<String> {
    let reply = shared().command(&["ZRANGE", &format!("{{{key}}}:holders"), "0", "-1"]);
    reply
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The replica instance of a limit ("<replica_id>#<nonce>"), from one lease's id.
async fn instance_of(limit: &FleetLimit) -> String {
    let lease = limit.try_acquire_in("", Some(0)).await.unwrap().unwrap();
    let id = lease.id().to_owned();
    lease.release().await;
    id.rsplit_once('#').unwrap().0.to_owned()
}

// -- the model ----------------------------------------------------------------------------

/// The fleet's queue as the design says it is served: one cap, classes with guarantees and
/// caps in slots of it, FIFO within a class or fair queuing across tenants (virtual starts,
/// ties in lane-name order, as a Redis sorted set orders equal scores), a tenant at its slice
/// skipped.
struct Model {
    cap: u64,
    /// Per-tenant slice (0: none).
    slice: u64,
    mins: Vec<f64>,
    maxs: Vec<f64>,
    fair: bool,
    /// Waiting tickets: id -> (lane, arrival order, class).
    tickets: BTreeMap<String, (String, u64, usize)>,
    /// Lane -> its tickets by arrival order.
    lanes: BTreeMap<String, Vec<(u64, String)>>,
    /// Lane -> its score in its class's heads (fair: virtual start; else its head's arrival).
    scores: HashMap<String, u64>,
    /// Holders: id -> (class, tenant).
    holders: HashMap<String, (usize, String)>,
    vt: Vec<u64>,
    finish: HashMap<(usize, String), u64>,
}

fn slots(share: f64, room: u64) -> u64 {
    ((share * room as f64 + 1e-9).floor() as u64).min(room)
}

impl Model {
    fn guarantee(&self, c: usize) -> u64 {
        match slots(self.mins[c], self.cap) {
            0 if self.mins[c] > 0.0 => 1,
            s => s,
        }
    }

    fn class_cap(&self, c: usize) -> u64 {
        slots(self.maxs[c], self.cap).max(1)
    }

    fn count(&self, c: usize) -> u64 {
        self.holders.values().filter(|h| h.0 == c).count() as u64
    }

    fn tenant_has_room(&self, tenant: &str) -> bool {
        self.slice == 0
            || (self.holders.values().filter(|h| h.1 == tenant).count() as u64) < self.slice
    }

    fn lane_parts(lane: &str) -> (usize, String) {
        let mut parts = lane.splitn(3, '|');
        let _instance = parts.next().unwrap();
        let c = parts.next().unwrap().parse().unwrap();
        (c, parts.next().unwrap().to_owned())
    }

    fn relink(&mut self, lane: &str) {
        let (c, tenant) = Self::lane_parts(lane);
        match self.lanes.get(lane).and_then(|l| l.first()) {
            None => {
                self.lanes.remove(lane);
                self.scores.remove(lane);
                let flow_left = self
                    .lanes
                    .keys()
                    .any(|other| Self::lane_parts(other) == (c, tenant.clone()));
                if !flow_left {
                    self.finish.remove(&(c, tenant));
                }
            }
            Some(&(arrival, _)) => {
                let score = if self.fair {
                    self.vt[c].max(*self.finish.get(&(c, tenant)).unwrap_or(&0))
                } else {
                    arrival
                };
                self.scores.insert(lane.to_owned(), score);
            }
        }
    }

    fn add_ticket(&mut self, id: &str, lane: String, arrival: u64, c: usize) {
        self.tickets
            .insert(id.to_owned(), (lane.clone(), arrival, c));
        self.lanes
            .entry(lane.clone())
            .or_default()
            .push((arrival, id.to_owned()));
        self.relink(&lane);
    }

    fn drop_ticket(&mut self, id: &str) {
        if let Some((lane, _, _)) = self.tickets.remove(id) {
            if let Some(l) = self.lanes.get_mut(&lane) {
                l.retain(|(_, t)| t != id);
            }
            self.relink(&lane);
        }
    }

    fn grant_waiting(&mut self) {
        while (self.holders.len() as u64) < self.cap {
            let mut best: Vec<Option<(u64, String)>> = vec![None; self.mins.len()];
            for (lane, score) in &self.scores {
                let (c, tenant) = Self::lane_parts(lane);
                if self.count(c) >= self.class_cap(c) || !self.tenant_has_room(&tenant) {
                    continue;
                }
                let candidate = (*score, lane.clone());
                if best[c].as_ref().is_none_or(|b| candidate < *b) {
                    best[c] = Some(candidate);
                }
            }
            let short =
                (0..best.len()).find(|&c| best[c].is_some() && self.count(c) < self.guarantee(c));
            let Some(c) = short.or_else(|| (0..best.len()).find(|&c| best[c].is_some())) else {
                return;
            };
            let (score, lane) = best[c].clone().unwrap();
            let id = self.lanes[&lane][0].1.clone();
            let (_, tenant) = Self::lane_parts(&lane);
            if self.fair {
                // A lane behind the class's virtual time starts at it.
                let start = self.vt[c].max(score);
                self.vt[c] = start;
                self.finish
                    .insert((c, tenant.clone()), start + FAIR_QUANTUM);
                let flow: Vec<String> = self
                    .lanes
                    .keys()
                    .filter(|l| **l != lane && Self::lane_parts(l) == (c, tenant.clone()))
                    .cloned()
                    .collect();
                for other in flow {
                    self.relink(&other);
                }
            }
            self.drop_ticket(&id);
            self.holders.insert(id, (c, tenant));
        }
    }

    /// A newcomer: a lease at once if there is room (and room in its class), else a ticket.
    fn acquire(&mut self, id: &str, lane: String, arrival: u64, c: usize) {
        self.grant_waiting();
        let (_, tenant) = Self::lane_parts(&lane);
        if (self.holders.len() as u64) < self.cap
            && self.count(c) < self.class_cap(c)
            && self.tenant_has_room(&tenant)
        {
            self.holders.insert(id.to_owned(), (c, tenant));
        } else {
            self.add_ticket(id, lane, arrival, c);
        }
    }

    fn release(&mut self, id: &str) {
        self.drop_ticket(id);
        self.holders.remove(id);
        self.grant_waiting();
    }
}

/// xorshift64*, seeded: a failing seed replays.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

/// Generated sequences of arrivals (a class and a tenant, on one of three replicas) and
/// releases: after every step, the fleet's holders are exactly the model's. So the order in
/// which waiting tickets are granted is the model's: guarantees first, then priority order,
/// FIFO or fair queuing within a class, caps never passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_order_is_the_models() {
    let server = shared();
    type Shares = &'static [(&'static str, f64, f64)];
    // (seed, fair queuing, classes, per-tenant slice)
    let cases: &[(u64, bool, Shares, u32)] = &[
        (1, false, &[("hi", 0.5, 1.0), ("lo", 0.25, 1.0)], 0),
        (2, true, &[("hi", 0.5, 1.0), ("lo", 0.25, 1.0)], 0),
        (
            3,
            true,
            &[("a", 0.0, 0.5), ("b", 0.3, 0.75), ("c", 0.1, 1.0)],
            0,
        ),
        (4, true, &[("only", 0.0, 1.0)], 0),
        (5, false, &[("hi", 0.0, 0.5), ("lo", 0.5, 1.0)], 0),
        (6, true, &[("hi", 0.6, 1.0), ("lo", 0.4, 0.5)], 0),
        (7, true, &[("hi", 0.5, 1.0), ("lo", 0.25, 1.0)], 2),
        (8, false, &[("hi", 0.5, 1.0), ("lo", 0.25, 1.0)], 1),
        (9, true, &[("only", 0.0, 1.0)], 1),
    ];
    for &(seed, fair, shares, slice) in cases {
        let key = unique_key("model");
        let cap = 4;
        let config = classes(shares, fair);
        let replicas: Vec<FleetLimit> = (0..3)
            .map(|r| {
                let mut c = config_for(&key, cap);
                c.replica_id = format!("r{r}");
                c.max_in_flight_per_scope = slice;
                // No re-check during a seed: a heartbeat re-files its replica's lanes (a lane
                // behind the class's virtual time moves up to it), at a time no model can know.
                c.recheck_interval = Duration::from_secs(60);
                let l = limit(c);
                l.set_classes(config.clone()).unwrap();
                l
            })
            .collect();
        let mut instances = Vec::new();
        let mut next = Vec::new();
        for r in &replicas {
            instances.push(instance_of(r).await);
            next.push(1u64);
        }
        let mut model = Model {
            cap: u64::from(cap),
            slice: u64::from(slice),
            mins: shares.iter().map(|s| s.1).collect(),
            maxs: shares.iter().map(|s| s.2).collect(),
            fair,
            tickets: BTreeMap::new(),
            lanes: BTreeMap::new(),
            scores: HashMap::new(),
            holders: HashMap::new(),
            vt: vec![0; shares.len()],
            finish: HashMap::new(),
        };
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let mut waits: HashMap<String, tokio::task::JoinHandle<Lease>> = HashMap::new();
        let mut arrival = 0;
        for step in 0..70 {
            let release = !model.holders.is_empty() && rng.below(100) < 45;
            if release {
                let mut held: Vec<&String> = model.holders.keys().collect();
                held.sort();
                let id = held[rng.below(held.len() as u64) as usize].clone();
                let lease = tokio::time::timeout(
                    Duration::from_secs(5),
                    waits.remove(&id).expect("a turn holds it"),
                )
                .await
                .expect("a granted turn gets its lease")
                .unwrap();
                assert_eq!(lease.id(), id);
                lease.release().await;
                model.release(&id);
            } else {
                let r = rng.below(3) as usize;
                let c = rng.below(shares.len() as u64) as usize;
                let tenant = format!("t{}", rng.below(3));
                let id = format!("{}#{}:{c}", instances[r], next[r]);
                next[r] += 1;
                arrival += 1;
                let lane = format!("{}|{c}|{tenant}", instances[r]);
                let l = replicas[r].clone();
                waits.insert(
                    id.clone(),
                    tokio::spawn(async move { l.acquire_in(&tenant, Some(c)).await.unwrap() }),
                );
                // Queued or held in Redis before the next step, so arrivals are in step order.
                let (key2, id2) = (key.clone(), id.clone());
                eventually(
                    Duration::from_secs(5),
                    "the arrival reached Redis",
                    move || {
                        let t = shared().command(&["ZSCORE", &format!("{{{key2}}}:tickets"), &id2]);
                        let h = shared().command(&["ZSCORE", &format!("{{{key2}}}:holders"), &id2]);
                        !t.is_empty() || !h.is_empty()
                    },
                )
                .await;
                model.acquire(&id, lane, arrival, c);
            }
            let expected: HashSet<String> = model.holders.keys().cloned().collect();
            assert_eq!(
                holder_ids(&key),
                expected,
                "seed {seed}, step {step}: the fleet's holders are not the model's"
            );
        }
        for (_, wait) in waits {
            wait.abort();
        }
        for r in &replicas {
            r.shutdown().await;
        }
        let _ = server;
    }
}

fn config_for(key: &str, cap: u32) -> admitgate_fleet::FleetConfig {
    let mut c = config(shared(), key, cap);
    // Long enough that nothing expires while a seed runs on a loaded machine.
    c.lease_ttl = Duration::from_secs(30);
    c.command_timeout = Duration::from_secs(2);
    c
}

/// Three replicas, two classes, a burst of 60 times the cap: the cap holds at every sample,
/// and while both classes wait each holds its target (interactive the cap less batch's
/// guarantee, batch its guarantee) within one lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_class_holds_its_share_of_a_burst_across_replicas() {
    let key = unique_key("shares");
    let cap = 10u32;
    let config = classes(&[("interactive", 0.5, 1.0), ("batch", 0.3, 1.0)], true);
    let replicas: Vec<FleetLimit> = (0..3)
        .map(|_| {
            let l = limit(config_for(&key, cap));
            l.set_classes(config.clone()).unwrap();
            l
        })
        .collect();
    let per_class = 100; // per replica: 600 turns, 60 times the cap
    let waiting = Arc::new([AtomicUsize::new(0), AtomicUsize::new(0)]);
    let done = Arc::new(AtomicBool::new(false));
    let released = Arc::new(AtomicUsize::new(0));
    let mut turns = Vec::new();
    for (r, replica) in replicas.iter().enumerate() {
        for c in 0..2 {
            for t in 0..per_class {
                let (replica, waiting, released) =
                    (replica.clone(), waiting.clone(), released.clone());
                waiting[c].fetch_add(1, Ordering::SeqCst);
                turns.push(tokio::spawn(async move {
                    let lease = replica
                        .acquire_in(&format!("tenant{}", t % 5), Some(c))
                        .await
                        .unwrap();
                    waiting[c].fetch_sub(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(10 + ((r + t) % 4) as u64 * 5)).await;
                    lease.release().await;
                    released.fetch_add(1, Ordering::SeqCst);
                }));
            }
        }
    }
    let sampler = {
        let (key, waiting, done, released) =
            (key.clone(), waiting.clone(), done.clone(), released.clone());
        tokio::task::spawn_blocking(move || {
            let (mut samples, mut backlogged, mut worst) = (0, 0, (0i64, 0i64));
            // The leases taken before the other class queued (free room is lent) run to their
            // end: running turns are never cancelled. So the shares are checked from the
            // moment every lease held when the backlog began has been given back.
            let mut settled_at = None;
            while !done.load(Ordering::SeqCst) {
                let before = [
                    waiting[0].load(Ordering::SeqCst),
                    waiting[1].load(Ordering::SeqCst),
                ];
                let (hi, lo, all) = sample(&key);
                let after = [
                    waiting[0].load(Ordering::SeqCst),
                    waiting[1].load(Ordering::SeqCst),
                ];
                assert!(all <= i64::from(cap), "over the cap: {all}");
                assert_eq!(hi + lo, all, "every lease counted in its class");
                samples += 1;
                // Both classes still had tickets queued (more than could be in flight to a
                // claim) around the reading.
                let both = all == i64::from(cap) && before.iter().chain(&after).all(|&w| w > 12);
                let settled = *settled_at
                    .get_or_insert_with(|| released.load(Ordering::SeqCst) + cap as usize);
                if both && released.load(Ordering::SeqCst) >= settled {
                    backlogged += 1;
                    worst.0 = worst.0.max((hi - 7).abs());
                    worst.1 = worst.1.max((lo - 3).abs());
                }
                std::thread::sleep(Duration::from_millis(3));
            }
            (samples, backlogged, worst)
        })
    };
    for turn in turns {
        tokio::time::timeout(Duration::from_secs(60), turn)
            .await
            .unwrap()
            .unwrap();
    }
    done.store(true, Ordering::SeqCst);
    let (samples, backlogged, worst) = sampler.await.unwrap();
    assert!(
        backlogged > 20,
        "{backlogged} of {samples} samples while both waited"
    );
    assert!(
        worst.0 <= 1 && worst.1 <= 1,
        "a class strayed from its target by {worst:?} leases"
    );
    for r in &replicas {
        r.shutdown().await;
    }
}

/// One tenant's burst queued on one replica does not put another tenant's first ticket, on
/// another replica, behind it: the second tenant's ticket is the next granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_burst_does_not_delay_another_tenant_on_another_replica() {
    let key = unique_key("fair");
    let config = classes(&[("only", 0.0, 1.0)], true);
    let (a, b) = (limit(config_for(&key, 1)), limit(config_for(&key, 1)));
    a.set_classes(config.clone()).unwrap();
    b.set_classes(config).unwrap();
    let first = a.acquire_in("noisy", Some(0)).await.unwrap();
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut turns = Vec::new();
    for n in 0..20 {
        let (a, order) = (a.clone(), order.clone());
        turns.push(tokio::spawn(async move {
            let lease = a.acquire_in("noisy", Some(0)).await.unwrap();
            order.lock().unwrap().push(format!("noisy{n}"));
            tokio::time::sleep(Duration::from_millis(5)).await;
            lease.release().await;
        }));
    }
    let tickets = format!("{{{key}}}:tickets");
    eventually(Duration::from_secs(5), "the burst is queued", || {
        shared().zcard(&tickets) == 20
    })
    .await;
    {
        let (b, order) = (b.clone(), order.clone());
        turns.push(tokio::spawn(async move {
            let lease = b.acquire_in("quiet", Some(0)).await.unwrap();
            order.lock().unwrap().push("quiet".to_owned());
            lease.release().await;
        }));
    }
    eventually(Duration::from_secs(5), "the quiet ticket is queued", || {
        shared().zcard(&tickets) == 21
    })
    .await;
    first.release().await;
    for turn in turns {
        tokio::time::timeout(Duration::from_secs(20), turn)
            .await
            .unwrap()
            .unwrap();
    }
    let order = order.lock().unwrap();
    let quiet = order.iter().position(|t| t == "quiet").unwrap();
    assert!(quiet <= 1, "the quiet tenant came {quiet}th: {order:?}");
}

/// A replica killed while both classes wait: batch's leases on it stay taken until they
/// expire, then batch's tickets on the live replicas get its guarantee back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_replicas_class_gets_its_guarantee_back() {
    let key = unique_key("crash");
    let cap = 6u32;
    let config = classes(&[("interactive", 0.5, 1.0), ("batch", 0.5, 1.0)], false);
    let mut short = config_for(&key, cap);
    short.lease_ttl = Duration::from_secs(2);
    short.command_timeout = Duration::from_millis(500);
    let live = limit(short.clone());
    live.set_classes(config.clone()).unwrap();
    // The replica to be killed runs on a runtime of its own, dropped without a release.
    let doomed_runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let doomed = FleetLimit::new(short, doomed_runtime.handle().clone()).unwrap();
    doomed.set_classes(config).unwrap();
    let mut held = Vec::new();
    for _ in 0..3 {
        let d = doomed.clone();
        held.push(
            doomed_runtime
                .spawn(async move { d.acquire_in("", Some(1)).await.unwrap() })
                .await
                .unwrap(),
        );
    }
    // Interactive fills the rest and queues; batch queues on the live replica.
    let stop = Arc::new(AtomicBool::new(false));
    let mut turns = Vec::new();
    for c in [0usize, 1, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0] {
        for _ in 0..4 {
            let (live, stop) = (live.clone(), stop.clone());
            turns.push(tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    let lease = live.acquire_in("", Some(c)).await.unwrap();
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    lease.release().await;
                }
            }));
        }
    }
    let ttl = Duration::from_secs(2);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(class_holders(&key, 1), 3, "batch holds its guarantee");
    let doomed_instance = held[0].id().rsplit_once('#').unwrap().0.to_owned();
    // Killed: its leases are never released nor renewed.
    std::mem::forget(held);
    doomed_runtime.shutdown_background();
    let killed = Instant::now();
    let batch_live = move |key: &str| {
        let ids = shared().command(&["ZRANGE", &format!("{{{key}}}:cls:1"), "0", "-1"]);
        ids.lines()
            .filter(|id| !id.is_empty() && !id.starts_with(&doomed_instance))
            .count()
    };
    let k = key.clone();
    eventually(
        ttl * 3,
        "batch's guarantee is back on the live replica",
        move || batch_live(&k) >= 3,
    )
    .await;
    let recovered = killed.elapsed();
    assert!(
        recovered < ttl + Duration::from_secs(2),
        "recovered after {recovered:?}"
    );
    stop.store(true, Ordering::SeqCst);
    for turn in turns {
        let _ = tokio::time::timeout(Duration::from_secs(10), turn).await;
    }
    live.shutdown().await;
}

/// A replica configured with other classes than the fleet's is refused, nothing queued; it is
/// logged once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_with_other_classes_is_refused() {
    let key = unique_key("conflict");
    let a = limit(config_for(&key, 2));
    a.set_classes(classes(&[("hi", 0.5, 1.0), ("lo", 0.2, 1.0)], true))
        .unwrap();
    let held = a.acquire_in("t", Some(0)).await.unwrap();
    let b = limit(config_for(&key, 2));
    b.set_classes(classes(&[("hi", 0.5, 1.0), ("lo", 0.3, 1.0)], true))
        .unwrap();
    let events = Arc::new(AtomicUsize::new(0));
    let seen = events.clone();
    b.set_event_handler(Arc::new(move |e| {
        if matches!(e, admitgate_fleet::FleetEvent::ClassConflict { .. }) {
            seen.fetch_add(1, Ordering::SeqCst);
        }
    }));
    for _ in 0..2 {
        let refused = b.acquire_in("t", Some(0)).await.unwrap_err();
        assert!(matches!(refused, FleetError::Conflict(_)), "{refused:?}");
        assert_eq!(refused.reason(), "fleet_unavailable");
        assert!(refused.to_string().contains("2:lo 0.3"), "{refused}");
    }
    assert_eq!(events.load(Ordering::SeqCst), 1, "logged once");
    let plain = limit(config_for(&key, 2));
    assert!(matches!(
        plain.acquire("t").await,
        Err(FleetError::Conflict(_))
    ));
    assert_eq!(shared().zcard(&format!("{{{key}}}:tickets")), 0);
    // The same classes as the fleet's are served; a limit with leases keeps its classes.
    let c = limit(config_for(&key, 2));
    c.set_classes(classes(&[("hi", 0.5, 1.0), ("lo", 0.2, 1.0)], true))
        .unwrap();
    let second = c.acquire_in("u", Some(1)).await.unwrap();
    assert!(c.set_classes(FleetClasses::default()).is_err());
    assert_eq!(second.class(), Some(1));
    second.release().await;
    // A replica whose classes are not the fleet's never grants room by its own shares: with
    // the fleet's configuration swapped under it, a release leaves the room for a replica
    // that agrees (here the same one once the configuration is back, at its re-check).
    let d = a.acquire_in("t", Some(0)).await.unwrap(); // the fleet is full (2)
    let waiting = {
        let a = a.clone();
        tokio::spawn(async move { a.acquire_in("t", Some(1)).await.unwrap() })
    };
    let tickets = format!("{{{key}}}:tickets");
    eventually(Duration::from_secs(5), "one ticket waits", || {
        shared().zcard(&tickets) >= 1
    })
    .await;
    let conf = format!("{{{key}}}:conf");
    let ours = shared().command(&["GET", &conf]);
    shared().command(&["SET", &conf, "someone else's", "PX", "60000"]);
    held.release().await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(
        !waiting.is_finished(),
        "granted by shares that are not the fleet's"
    );
    shared().command(&["SET", &conf, &ours, "PX", "60000"]);
    let granted = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("granted once the configuration agrees again")
        .unwrap();
    granted.release().await;
    d.release().await;
    for l in [a, b, c, plain] {
        l.shutdown().await;
    }
}

/// Guarantees are slots of the fleet's learned limit when there is one: lowered, batch's
/// guarantee shrinks with it; raised, the new room goes to batch first, up to its guarantee of
/// the new limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarantees_follow_the_learned_limit() {
    use admitgate_fleet::{Change, Proposal};
    let key = unique_key("learned");
    let l = limit(config_for(&key, 10));
    l.set_classes(classes(&[("hi", 0.5, 1.0), ("lo", 0.3, 1.0)], false))
        .unwrap();
    let propose = |change, limit, generation| Proposal {
        change,
        limit,
        generation,
        min_limit: 1,
        max_limit: 10,
        spacing: Duration::ZERO,
        hold: Duration::ZERO,
    };
    let learned = l.learn(propose(Change::Seed, 5, 0)).await.unwrap().unwrap();
    assert_eq!(learned.limit, 5);
    let mut hi = Vec::new();
    for _ in 0..5 {
        hi.push(l.acquire_in("", Some(0)).await.unwrap());
    }
    let mut waits = Vec::new();
    for c in [1, 1, 1, 1, 1, 0, 0, 0, 0, 0] {
        let l = l.clone();
        waits.push(tokio::spawn(async move {
            let lease = l.acquire_in("", Some(c)).await.unwrap();
            tokio::time::sleep(Duration::from_secs(60)).await;
            drop(lease);
        }));
    }
    let tickets = format!("{{{key}}}:tickets");
    eventually(Duration::from_secs(5), "ten tickets wait", || {
        shared().zcard(&tickets) == 10
    })
    .await;
    // Two releases under a limit of 5: lo's guarantee is floor(0.3 x 5) = 1, then hi's turn.
    hi.pop().unwrap().release().await;
    hi.pop().unwrap().release().await;
    assert_eq!((class_holders(&key, 0), class_holders(&key, 1)), (4, 1));
    // Raised to 10: lo first up to floor(0.3 x 10) = 3, then hi.
    let raised = l
        .learn(propose(Change::Raise, 10, learned.generation))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(raised.limit, 10);
    assert_eq!((class_holders(&key, 0), class_holders(&key, 1)), (7, 3));
    for wait in waits {
        wait.abort();
    }
    drop(hi);
    l.shutdown().await;
}
