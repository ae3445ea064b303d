//! Unit tests of the state machine, driven step by step with the invariants checked after
//! every step.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::retry::{MEMORY_PRESSURE_RETRY, RETRY_BEFORE_ANY_RELEASE};

use super::*;
use crate::policy::ConcurrencyLimit;

/// Counts how often it was woken.
#[derive(Clone, Default)]
struct Counter(Arc<AtomicUsize>);

impl Waker for Counter {
    fn wake(self) -> Wakes<Self> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Wakes::default()
    }
}

impl Counter {
    fn woken(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

const T0: Duration = Duration::ZERO;

fn gate(max: i64, depth: i64, overflow: &str, per_scope: i64) -> Gate<Counter> {
    Gate::new(ConcurrencyLimit::new(max, depth, overflow, per_scope).unwrap())
}

/// Arrives and checks invariants; the wakes are run.
fn arrive(g: &Gate<Counter>, scope: &str, resource: Decision) -> Arrival {
    let (arrival, wakes) = g.arrive(Some(scope), None, resource, || T0);
    wakes.run();
    g.check_invariants();
    arrival
}

fn admit(g: &Gate<Counter>, scope: &str) -> TurnSlot {
    match arrive(g, scope, Decision::Admit) {
        Arrival::Admitted(key) => TurnSlot::new(key),
        other => panic!("expected admission, got {other:?}"),
    }
}

fn queue(g: &Gate<Counter>, scope: &str) -> (WaiterKey, Counter) {
    match arrive(g, scope, Decision::Admit) {
        Arrival::Queued(key) => {
            let waker = Counter::default();
            assert_eq!(g.register(key, waker.clone()).0, Registered::Waiting);
            (key, waker)
        }
        other => panic!("expected to queue, got {other:?}"),
    }
}

fn claim<W: Waker>(g: &Gate<W>, key: WaiterKey) -> Claim {
    let (claim, wakes) = g.claim(key, || T0);
    wakes.run();
    g.check_invariants();
    claim
}

fn close(g: &Gate<Counter>, slot: &TurnSlot) {
    slot.close(g, None).run();
    g.check_invariants();
}

fn stats(g: &Gate<Counter>) -> Stats {
    g.stats(|| T0)
}

#[test]
fn ceiling_queue_and_fifo_handoff() {
    let g = gate(2, 2, "reject", 0);
    let a = admit(&g, "");
    let b = admit(&g, "");
    let (k1, w1) = queue(&g, "");
    let (k2, w2) = queue(&g, "");
    assert_eq!(
        arrive(&g, "", Decision::Admit),
        Arrival::Rejected(Rejection::QueueFull, Some(RETRY_BEFORE_ANY_RELEASE))
    );
    let s = stats(&g);
    assert_eq!(
        (s.in_flight, s.queued, s.admitted, s.rejected),
        (2, 2, 2, 1)
    );

    close(&g, &a);
    assert_eq!(
        (w1.woken(), w2.woken()),
        (1, 0),
        "the oldest waiter gets the slot"
    );
    assert_eq!(claim(&g, k2), Claim::Waiting);
    assert_eq!(claim(&g, k1), Claim::Admitted(None));
    assert_eq!(claim(&g, k1), Claim::Unknown, "a claimed key is spent");
    close(&g, &b);
    assert_eq!(w2.woken(), 1);
    assert_eq!(claim(&g, k2), Claim::Admitted(None));
    let s = stats(&g);
    assert_eq!((s.in_flight, s.queued, s.admitted), (2, 0, 4));
}

#[test]
fn closing_twice_returns_one_slot() {
    let g = gate(1, 0, "reject", 0);
    let a = admit(&g, "");
    close(&g, &a);
    close(&g, &a);
    assert_eq!(stats(&g).in_flight, 0);
}

#[test]
fn queue_overflow_waits_beyond_depth() {
    let g = gate(1, 1, "queue", 0);
    let _a = admit(&g, "");
    for _ in 0..5 {
        queue(&g, "");
    }
    assert_eq!(stats(&g).queued, 5);
}

#[test]
fn shed_oldest_evicts_the_oldest_live_waiter() {
    let g = gate(1, 2, "shed_oldest", 0);
    let a = admit(&g, "");
    let (k1, w1) = queue(&g, "");
    let (k2, _) = queue(&g, "");
    let (k3, _) = queue(&g, "");
    assert_eq!(w1.woken(), 1, "the evicted waiter is woken");
    assert!(matches!(claim(&g, k1), Claim::Refused(Rejection::Shed, _)));
    let s = stats(&g);
    assert_eq!((s.queued, s.shed, s.rejected), (2, 1, 0));
    close(&g, &a);
    assert_eq!(claim(&g, k2), Claim::Admitted(None));
    assert_eq!(claim(&g, k3), Claim::Waiting);
}

#[test]
fn shed_oldest_with_nobody_to_evict_rejects() {
    let g = gate(1, 0, "shed_oldest", 0);
    let _a = admit(&g, "");
    assert_eq!(
        arrive(&g, "", Decision::Admit),
        Arrival::Rejected(Rejection::QueueFull, Some(RETRY_BEFORE_ANY_RELEASE))
    );
    assert_eq!(stats(&g).shed, 0);
}

#[test]
fn noisy_tenant_waits_in_its_own_lane() {
    let g = gate(32, 128, "reject", 4);
    let running: Vec<TurnSlot> = (0..4).map(|_| admit(&g, "noisy")).collect();
    let waiting: Vec<(WaiterKey, Counter)> = (0..6).map(|_| queue(&g, "noisy")).collect();
    let quiet = admit(&g, "quiet");
    let s = stats(&g);
    assert_eq!(
        (s.in_flight, s.queued),
        (5, 6),
        "global slots stay free for others"
    );

    close(&g, &running[0]);
    let woken: Vec<usize> = waiting.iter().map(|(_, w)| w.woken()).collect();
    assert_eq!(
        woken,
        vec![1, 0, 0, 0, 0, 0],
        "the tenant's own turns start in order"
    );
    assert_eq!(
        claim(&g, waiting[0].0),
        Claim::Admitted(Some(Arc::from("noisy")))
    );
    close(&g, &quiet);
    assert_eq!(
        waiting[1].1.woken(),
        0,
        "another tenant's release frees no noisy slot"
    );
    assert_eq!(g.facts(Some("noisy")).scope_in_flight, 4);
}

#[test]
fn a_skipped_tenant_keeps_its_place() {
    let g = gate(2, 8, "queue", 1);
    let a = admit(&g, "a");
    let b = admit(&g, "b");
    let (a2, wa2) = queue(&g, "a"); // blocked by its scope
    let (c1, wc1) = queue(&g, "c"); // blocked by the ceiling
    close(&g, &b);
    assert_eq!(
        (wa2.woken(), wc1.woken()),
        (0, 1),
        "a's turn is skipped, not dropped"
    );
    assert_eq!(claim(&g, c1), Claim::Admitted(Some(Arc::from("c"))));
    close(&g, &a);
    assert_eq!(wa2.woken(), 1);
    assert_eq!(claim(&g, a2), Claim::Admitted(Some(Arc::from("a"))));
}

#[test]
fn shed_oldest_evicts_within_the_full_tenant_lane() {
    let g = gate(8, 1, "shed_oldest", 1);
    let _other = admit(&g, "other");
    let (o1, _) = queue(&g, "other"); // other's lane is now full
    let _a = admit(&g, "a");
    let (a1, _) = queue(&g, "a");
    let (a2, _) = queue(&g, "a"); // evicts a1, not the globally oldest o1
    assert!(matches!(claim(&g, a1), Claim::Refused(Rejection::Shed, _)));
    assert_eq!(claim(&g, o1), Claim::Waiting);
    assert_eq!(claim(&g, a2), Claim::Waiting);
}

#[test]
fn cancelled_waiter_leaves_no_trace() {
    let g = gate(1, 4, "reject", 0);
    let a = admit(&g, "");
    let (k, _) = queue(&g, "");
    let (cancelled, wakes) = g.cancel(k);
    wakes.run();
    assert_eq!(cancelled, Cancelled::Withdrawn);
    g.check_invariants();
    close(&g, &a);
    let s = stats(&g);
    assert_eq!((s.in_flight, s.queued, s.cancelled), (0, 0, 1));
    let again = admit(&g, "");
    close(&g, &again);
}

#[test]
fn cancel_after_grant_hands_the_slot_on() {
    let g = gate(1, 4, "reject", 0);
    let a = admit(&g, "");
    let (k1, w1) = queue(&g, "");
    let (k2, w2) = queue(&g, "");
    close(&g, &a);
    assert_eq!(w1.woken(), 1);
    // The owner was cancelled in the same instant: the slot goes to the next waiter.
    let (cancelled, wakes) = g.cancel(k1);
    assert_eq!(cancelled, Cancelled::ReturnedSlot);
    wakes.run();
    g.check_invariants();
    assert_eq!(w2.woken(), 1);
    assert_eq!(claim(&g, k2), Claim::Admitted(None));
    let s = stats(&g);
    assert_eq!((s.in_flight, s.admitted, s.cancelled), (1, 2, 1));
}

#[test]
fn a_grant_before_registration_is_found_at_registration() {
    let g = gate(1, 4, "reject", 0);
    let a = admit(&g, "");
    let key = match arrive(&g, "", Decision::Admit) {
        Arrival::Queued(key) => key,
        other => panic!("{other:?}"),
    };
    close(&g, &a);
    let (registered, back) = g.register(key, Counter::default());
    assert_eq!(registered, Registered::Settled);
    assert!(back.is_some());
    assert_eq!(claim(&g, key), Claim::Admitted(None));
}

#[test]
fn soft_pressure_queues_while_anything_runs() {
    let g = gate(4, 8, "reject", 0);
    let first = match arrive(&g, "", Decision::Queue) {
        Arrival::Admitted(key) => TurnSlot::new(key),
        other => panic!("nothing runs: the gate must make progress, got {other:?}"),
    };
    let waiting = match arrive(&g, "", Decision::Queue) {
        Arrival::Queued(key) => key,
        other => panic!("soft pressure with a turn running must queue, got {other:?}"),
    };
    let second = match arrive(&g, "", Decision::Queue) {
        Arrival::Queued(key) => key,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        stats(&g).in_flight,
        1,
        "concurrency stops growing under soft pressure"
    );
    // A release under pressure hands its slot on: level, not growing.
    first.close(&g, Some(Decision::Queue)).run();
    g.check_invariants();
    assert_eq!(claim(&g, waiting), Claim::Admitted(None));
    assert_eq!(claim(&g, second), Claim::Waiting);
    // Pressure eases: the waiter takes a free slot before the newcomer, and the newcomer
    // (granted a slot at once) queues behind it so their bodies start in arrival order.
    let newcomer = arrive(&g, "", Decision::Admit);
    let Arrival::Queued(newcomer) = newcomer else {
        panic!("a newcomer must not start before a granted waiter, got {newcomer:?}");
    };
    assert_eq!(stats(&g).granted_unclaimed, 2);
    assert_eq!(claim(&g, second), Claim::Admitted(None));
    assert_eq!(claim(&g, newcomer), Claim::Admitted(None));
    assert_eq!(stats(&g).in_flight, 3);
}

#[test]
fn soft_pressure_holds_back_turns_outside_the_depth() {
    // Ceiling 4, one running, soft pressure: the three turns that would run at once without
    // pressure wait outside the depth (even with depth 0), the fourth meets the queue as it
    // would without pressure.
    let g = gate(4, 0, "reject", 0);
    let _a = admit(&g, "");
    for _ in 0..3 {
        queue_with(&g, Decision::Queue);
    }
    assert_eq!(stats(&g).queued, 3);
    assert!(matches!(
        arrive(&g, "", Decision::Queue),
        Arrival::Rejected(Rejection::QueueFull, Some(_))
    ));
    // Depth 2: four arrivals, none refused while three slots are free.
    let d = gate(4, 2, "reject", 0);
    let _b = admit(&d, "");
    for _ in 0..4 {
        queue_with(&d, Decision::Queue);
    }
    assert_eq!(
        d.facts(None).queued,
        1,
        "only the fourth counts against the depth"
    );
    queue_with(&d, Decision::Queue);
    assert!(matches!(
        arrive(&d, "", Decision::Queue),
        Arrival::Rejected(Rejection::QueueFull, Some(_))
    ));
    // Pressure eases: the held-back turns take the free slots in order, and the newcomer
    // meets a full queue of the two that were queued normally.
    assert!(matches!(
        arrive(&d, "", Decision::Admit),
        Arrival::Rejected(Rejection::QueueFull, Some(_))
    ));
    let st = stats(&d);
    assert_eq!((st.in_flight, st.queued, st.granted_unclaimed), (4, 2, 3));
}

#[test]
fn soft_pressure_shed_oldest_evicts_only_turns_in_the_depth() {
    let s = gate(2, 1, "shed_oldest", 0);
    let _b = admit(&s, "");
    let held_back = queue_with(&s, Decision::Queue);
    let victim = queue_with(&s, Decision::Queue);
    assert!(matches!(
        arrive(&s, "", Decision::Queue),
        Arrival::Queued(_)
    ));
    assert!(matches!(
        claim(&s, victim),
        Claim::Refused(Rejection::Shed, _)
    ));
    assert_eq!(claim(&s, held_back), Claim::Waiting);
}

fn queue_with(g: &Gate<Counter>, resource: Decision) -> WaiterKey {
    match arrive(g, "", resource) {
        Arrival::Queued(key) => key,
        other => panic!("{other:?}"),
    }
}

#[test]
fn hard_pressure_rejects_and_no_ceiling_soft_admits() {
    let g = gate(4, 8, "queue", 0);
    assert_eq!(
        arrive(&g, "", Decision::Reject),
        Arrival::Rejected(Rejection::MemoryPressure, Some(MEMORY_PRESSURE_RETRY))
    );
    let resource_only = gate(0, 0, "reject", 0);
    assert!(matches!(
        arrive(&resource_only, "", Decision::Queue),
        Arrival::Admitted(_)
    ));
    assert!(matches!(
        arrive(&resource_only, "", Decision::Queue),
        Arrival::Admitted(_)
    ));
    assert_eq!(
        arrive(&resource_only, "", Decision::Reject),
        Arrival::Rejected(Rejection::MemoryPressure, Some(MEMORY_PRESSURE_RETRY))
    );
}

#[test]
fn foreign_decisions_are_made_real() {
    let g = gate(1, 0, "reject", 0);
    // A policy that says admit when no slot is free makes the turn wait.
    let _a = admit(&g, "");
    let (said_admit, wakes) = g.arrive(None, Some(Decision::Admit), Decision::Admit, || T0);
    drop(wakes);
    assert!(matches!(said_admit, Arrival::Queued(_)));
    // A policy that says reject is obeyed, with its own reason.
    let (said_reject, _) = g.arrive(None, Some(Decision::Reject), Decision::Admit, || T0);
    assert_eq!(said_reject, Arrival::Rejected(Rejection::Policy, None));
    // A policy that says queue while a slot is free runs at once.
    let free = gate(2, 0, "reject", 0);
    let (said_queue, _) = free.arrive(None, Some(Decision::Queue), Decision::Admit, || T0);
    assert!(matches!(said_queue, Arrival::Admitted(None)));
}

#[test]
fn human_wait_lends_and_borrows() {
    let g = gate(1, 4, "reject", 0);
    let parked = admit(&g, "");
    let (k, w) = queue(&g, "");
    parked.suspend(&g).run();
    g.check_invariants();
    assert_eq!(w.woken(), 1, "the lent slot goes to the waiter");
    assert_eq!(claim(&g, k), Claim::Admitted(None));
    let s = stats(&g);
    assert_eq!((s.in_flight, s.awaiting_human), (1, 1));
    // Resume with no free slot: borrow, never wait.
    parked.resume(&g);
    g.check_invariants();
    assert_eq!(stats(&g).in_flight, 2);
    let (k2, w2) = queue(&g, "");
    close(&g, &parked);
    assert_eq!(w2.woken(), 0, "the first release repays the borrow");
    assert_eq!(stats(&g).in_flight, 1);
    assert_eq!(claim(&g, k2), Claim::Waiting);
}

#[test]
fn nested_human_waits_lend_once_and_ending_while_parked_counts_once() {
    let g = gate(2, 0, "reject", 0);
    let slot = admit(&g, "");
    slot.suspend(&g).run();
    slot.suspend(&g).run();
    assert_eq!((stats(&g).in_flight, stats(&g).awaiting_human), (0, 1));
    close(&g, &slot);
    assert_eq!((stats(&g).in_flight, stats(&g).awaiting_human), (0, 0));
    slot.resume(&g);
    slot.resume(&g);
    assert_eq!(stats(&g).in_flight, 0, "a closed turn takes nothing back");
    g.check_invariants();
}

#[test]
fn scoped_resume_borrows_per_tenant() {
    let g = gate(8, 4, "reject", 1);
    let parked = admit(&g, "t");
    parked.suspend(&g).run();
    let other = admit(&g, "t");
    parked.resume(&g);
    g.check_invariants();
    assert_eq!(
        g.facts(Some("t")).scope_in_flight,
        2,
        "the tenant borrows its own slot"
    );
    let (k, w) = queue(&g, "t");
    close(&g, &other);
    assert_eq!(w.woken(), 0, "the tenant's release repays its borrow");
    close(&g, &parked);
    assert_eq!(claim(&g, k), Claim::Admitted(Some(Arc::from("t"))));
}

#[test]
fn scopes_are_forgotten_when_idle() {
    let g = gate(200, 4, "reject", 60);
    let slots: Vec<TurnSlot> = (0..100)
        .map(|i| admit(&g, &format!("s{}", i % 2)))
        .collect();
    drop(slots);
    let mut turns = Vec::new();
    for i in 0..3 {
        turns.push(admit(&g, &format!("tenant-{i}")));
    }
    assert_eq!(stats(&g).tracked_scopes, 5);
    for t in &turns {
        close(&g, t);
    }
    assert_eq!(stats(&g).tracked_scopes, 2);
}

#[test]
fn reset_forgets_everything() {
    let g = gate(1, 4, "reject", 0);
    let _a = admit(&g, "");
    let (_k, w) = queue(&g, "");
    g.reset().run();
    assert_eq!(w.woken(), 0, "reset drops wakers without waking them");
    // The ceiling is configuration, not a counter: it stays.
    assert_eq!(
        stats(&g),
        Stats {
            limit: 1,
            ..Stats::default()
        }
    );
    g.check_invariants();
}

#[test]
fn oldest_wait_uses_the_callers_clock() {
    let g = gate(1, 4, "reject", 0);
    let _a = admit(&g, "");
    let (arrival, _) = g.arrive(None, None, Decision::Admit, || Duration::from_secs(10));
    assert!(matches!(arrival, Arrival::Queued(_)));
    assert_eq!(
        g.stats(|| Duration::from_secs(13)).oldest_wait,
        Some(Duration::from_secs(3))
    );
}

/// A small deterministic random walk over every operation, checking the invariants and
/// the conservation of turns after every step.
#[test]
fn random_walk_keeps_every_invariant() {
    let mut seed: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    for config in 0..12 {
        let overflow = ["reject", "queue", "shed_oldest"][config % 3];
        let g = gate(
            1 + (config as i64 % 4),
            (config as i64) % 3,
            overflow,
            (config as i64) % 3,
        );
        let mut running: Vec<TurnSlot> = Vec::new();
        let mut waiting: Vec<WaiterKey> = Vec::new();
        let mut arrivals = 0u64;
        for _ in 0..4000 {
            let scope = format!("t{}", next(4));
            match next(7) {
                0 | 1 => {
                    arrivals += 1;
                    let resource = [
                        Decision::Admit,
                        Decision::Admit,
                        Decision::Queue,
                        Decision::Reject,
                    ][next(4) as usize];
                    let (arrival, wakes) = g.arrive(Some(&scope), None, resource, || T0);
                    wakes.run();
                    match arrival {
                        Arrival::Admitted(key) => running.push(TurnSlot::new(key)),
                        Arrival::Queued(key) => waiting.push(key),
                        Arrival::Rejected(..) => {}
                    }
                }
                2 if !running.is_empty() => {
                    let slot = running.swap_remove(next(running.len() as u64) as usize);
                    slot.close(&g, None).run();
                }
                3 if !waiting.is_empty() => {
                    let key = waiting.swap_remove(next(waiting.len() as u64) as usize);
                    g.cancel(key).1.run();
                }
                4 if !waiting.is_empty() => {
                    let i = next(waiting.len() as u64) as usize;
                    match g.claim(waiting[i], || T0) {
                        (Claim::Admitted(key), wakes) => {
                            wakes.run();
                            waiting.swap_remove(i);
                            running.push(TurnSlot::new(key));
                        }
                        (Claim::Refused(Rejection::Shed, _), _) => {
                            waiting.swap_remove(i);
                        }
                        _ => {}
                    }
                }
                5 if !running.is_empty() => {
                    let slot = &running[next(running.len() as u64) as usize];
                    if next(2) == 0 {
                        slot.suspend(&g).run();
                    } else {
                        slot.resume(&g);
                    }
                }
                _ => {
                    g.shed_oldest_waiter().1.run();
                }
            }
            g.check_invariants();
            let s = stats(&g);
            assert_eq!(
                s.admitted + s.rejected + s.shed + s.cancelled + s.queued + s.granted_unclaimed,
                arrivals,
                "every turn that reached the gate is accounted for exactly once"
            );
            let held = running.iter().filter(|slot| slot.is_held()).count() as u64;
            assert_eq!(
                s.in_flight,
                held + s.granted_unclaimed,
                "every slot has one holder"
            );
        }
    }
}

#[test]
fn close_refuses_waiters_and_newcomers_and_leaves_running_turns() {
    let g = gate(1, 4, "reject", 0);
    let a = admit(&g, "");
    let (k1, w1) = queue(&g, "");
    let (k2, _) = queue(&g, "");
    let (refused, wakes) = g.close();
    wakes.run();
    g.check_invariants();
    assert_eq!(refused, 2);
    assert_eq!(w1.woken(), 1, "a refused waiter is woken");
    assert_eq!(claim(&g, k1), Claim::Refused(Rejection::Closing, None));
    // Cancelled before it saw the refusal: counted as cancelled instead.
    assert_eq!(g.cancel(k2).0, Cancelled::AlreadyRefused);
    assert_eq!(
        arrive(&g, "", Decision::Admit),
        Arrival::Rejected(Rejection::Closing, None)
    );
    assert_eq!(g.running(), (1, true));
    close(&g, &a);
    assert_eq!(g.running(), (0, true));
    let s = stats(&g);
    assert_eq!((s.admitted, s.rejected, s.cancelled), (1, 2, 1));
}

#[test]
fn expire_and_grant_race_exactly_one_wins() {
    let g = gate(1, 4, "reject", 0);
    let a = admit(&g, "");
    let (k1, _) = queue(&g, "");
    let (k2, _) = queue(&g, "");
    // k1 is granted first: its timeout finds nothing to do.
    close(&g, &a);
    assert!(!g.expire(k1).0);
    assert_eq!(claim(&g, k1), Claim::Admitted(None));
    // k2 times out first: a later release has nobody to grant.
    let (expired, wakes) = g.expire(k2);
    wakes.run();
    g.check_invariants();
    assert!(expired);
    assert!(matches!(
        claim(&g, k2),
        Claim::Refused(Rejection::Timeout, Some(_))
    ));
    assert!(!g.expire(k2).0, "a settled key cannot time out twice");
    let s = stats(&g);
    assert_eq!(
        (s.admitted, s.rejected, s.queued, s.in_flight),
        (2, 1, 0, 1)
    );
}

#[test]
fn reconfigure_trims_each_lane_keeps_running_turns_and_fills_raised_ceilings() {
    let g = gate(1, 4, "reject", 1);
    let a = admit(&g, "t");
    let _b = queue(&g, "t");
    let (t2, _) = queue(&g, "t");
    let (u1, _) = queue(&g, "u"); // blocked by the global ceiling, in its own lane
    let (refused, wakes) = g.reconfigure(ConcurrencyLimit::new(1, 1, "reject", 1).unwrap(), None);
    wakes.run();
    g.check_invariants();
    assert_eq!(refused, 1);
    assert!(matches!(
        claim(&g, t2),
        Claim::Refused(Rejection::QueueFull, Some(_))
    ));
    assert_eq!(stats(&g).in_flight, 1, "the running turn is untouched");
    let (_, wakes) = g.reconfigure(ConcurrencyLimit::new(3, 1, "reject", 1).unwrap(), None);
    wakes.run();
    g.check_invariants();
    // u is granted at once; t stays at its per-tenant limit.
    assert_eq!(claim(&g, u1), Claim::Admitted(Some(Arc::from("u"))));
    assert_eq!(stats(&g).queued, 1);
    close(&g, &a);
    assert_eq!(stats(&g).in_flight, 2);
}

#[test]
fn position_counts_older_waiters_and_granted_turns_and_scopes_are_reported() {
    let g = gate(1, 8, "reject", 2);
    let a = admit(&g, "x");
    let (k1, _) = queue(&g, "x");
    let (k2, _) = queue(&g, "y");
    let (k3, _) = queue(&g, "x");
    assert_eq!(g.place_in_line(k1, || T0).map(|p| p.0), Some(0));
    assert_eq!(g.place_in_line(k3, || T0).map(|p| p.0), Some(2));
    let mut scopes = g.scope_stats();
    scopes.sort();
    assert_eq!(scopes, vec![(Arc::from("x"), 1, 2), (Arc::from("y"), 0, 1)]);
    close(&g, &a); // k1 granted, not yet claimed: it starts before the others
    assert_eq!(g.place_in_line(k1, || T0), None);
    assert_eq!(g.place_in_line(k2, || T0).map(|p| p.0), Some(1));
}

#[test]
fn deferred_admission_counts_what_the_caller_experienced() {
    // A fleet-wide limit: a turn granted its slot runs only once its lease comes.
    let g = gate(1, 2, "reject", 0);
    g.defer_admission();
    let Arrival::Admitted(scope) = arrive(&g, "", Decision::Admit) else {
        panic!("a free slot is granted");
    };
    let (k1, w1) = queue(&g, "");
    let (k2, _w2) = queue(&g, "");
    assert_eq!(stats(&g).admitted, 0, "granted, not yet admitted");
    // The lease was refused: rejected, and the slot goes to the oldest waiter.
    let (retry, wakes) = g.revoke(scope.as_deref(), Some(Rejection::FleetUnavailable), || T0);
    wakes.run();
    g.check_invariants();
    assert!(retry.is_some());
    assert_eq!(w1.woken(), 1);
    assert_eq!(claim(&g, k1), Claim::Admitted(None));
    let s = stats(&g);
    assert_eq!(
        (s.in_flight, s.queued, s.admitted, s.rejected),
        (1, 1, 0, 1)
    );
    // Its caller gave up while waiting for the lease: cancelled, and the slot is handed on.
    let (retry, wakes) = g.revoke(None, None, || T0);
    wakes.run();
    g.check_invariants();
    assert_eq!(retry, None);
    assert_eq!(claim(&g, k2), Claim::Admitted(None));
    g.confirm();
    let slot = TurnSlot::new(None);
    close(&g, &slot);
    let s = stats(&g);
    assert_eq!(
        (s.in_flight, s.queued, s.admitted, s.rejected, s.cancelled),
        (0, 0, 1, 1, 1),
        "every arrival counted once, as its caller saw it"
    );
    drop(g.reset());
    let Arrival::Admitted(_) = arrive(&g, "", Decision::Admit) else {
        panic!("a free slot is granted");
    };
    assert_eq!(stats(&g).admitted, 0, "a forked child's gate still defers");
}

/// A waker that panics instead of waking when told to (standing in for a binding's waker
/// whose foreign code panicked), counting the wakes it did deliver.
struct MaybePanics {
    woken: Arc<AtomicUsize>,
    panics: bool,
}

impl Waker for MaybePanics {
    fn wake(self) -> Wakes<Self> {
        assert!(!self.panics, "deliberate panic in a waker");
        self.woken.fetch_add(1, Ordering::SeqCst);
        Wakes::default()
    }
}

#[test]
fn a_waker_panicking_mid_handoff_strands_nobody_else_and_counters_add_up() {
    // Ceiling 1 with three waiters; raising the ceiling grants all three in one change, whose
    // wakes run after the lock is released. The first waker panics in the middle of that run.
    let g: Gate<MaybePanics> = Gate::new(ConcurrencyLimit::new(1, 3, "queue", 0).unwrap());
    let (running, wakes) = g.arrive(None, None, Decision::Admit, || T0);
    wakes.run();
    let Arrival::Admitted(scope) = running else {
        panic!("expected admission, got {running:?}")
    };
    let running = TurnSlot::new(scope);
    let woken = Arc::new(AtomicUsize::new(0));
    let keys: Vec<WaiterKey> = (0..3)
        .map(|i| {
            let (arrival, wakes) = g.arrive(None, None, Decision::Admit, || T0);
            wakes.run();
            let Arrival::Queued(key) = arrival else {
                panic!("expected to queue, got {arrival:?}")
            };
            let waker = MaybePanics {
                woken: woken.clone(),
                panics: i == 0,
            };
            assert_eq!(g.register(key, waker).0, Registered::Waiting);
            key
        })
        .collect();

    let (_, wakes) = g.reconfigure(ConcurrencyLimit::new(4, 3, "queue", 0).unwrap(), None);
    assert_eq!(wakes.len(), 3);
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| wakes.run()));
    assert!(outcome.is_err(), "the waker's panic reaches the caller");
    assert_eq!(
        woken.load(Ordering::SeqCst),
        2,
        "the waiters behind it were still woken"
    );
    g.check_invariants();

    // The woken waiters run; the one whose waker panicked never heard, and its owner gives
    // up (a wait timeout, a cancellation): its slot is handed back, it counts as cancelled.
    assert_eq!(claim(&g, keys[1]), Claim::Admitted(None));
    assert_eq!(claim(&g, keys[2]), Claim::Admitted(None));
    let (cancelled, wakes) = g.cancel(keys[0]);
    wakes.run();
    assert_eq!(cancelled, Cancelled::ReturnedSlot);
    g.check_invariants();
    let s = g.stats(|| T0);
    assert_eq!((s.in_flight, s.queued, s.granted_unclaimed), (3, 0, 0));
    assert_eq!((s.admitted, s.cancelled, s.rejected, s.shed), (3, 1, 0, 0));

    // The gate keeps serving: a newcomer takes the fourth slot at once.
    let (arrival, wakes) = g.arrive(None, None, Decision::Admit, || T0);
    wakes.run();
    assert!(matches!(arrival, Arrival::Admitted(_)));
    running.close(&g, None).run();
    g.check_invariants();
    assert_eq!(g.stats(|| T0).in_flight, 3);
}

#[test]
fn pressure_easing_at_a_reconfigure_starts_held_back_waiters() {
    // Ceiling 4, one running, three held back by soft pressure: the gate says so.
    let g = gate(4, 8, "reject", 0);
    let _a = admit(&g, "");
    let wakers: Vec<Counter> = (0..3)
        .map(|_| {
            let key = queue_with(&g, Decision::Queue);
            let waker = Counter::default();
            assert_eq!(g.register(key, waker.clone()).0, Registered::Waiting);
            waker
        })
        .collect();
    assert!(
        g.held_back(),
        "three waiters, three free slots, soft pressure"
    );
    // A reconfigure that keeps the pressure changes nothing; one under eased pressure (or
    // memory-aware admission turned off) starts all three at once.
    let limits = *g.state.lock().limits();
    let (_, wakes) = g.reconfigure(limits, Some(Decision::Queue));
    assert!(wakes.is_empty());
    assert!(g.held_back());
    let (_, wakes) = g.reconfigure(limits, Some(Decision::Admit));
    assert_eq!(wakes.len(), 3);
    wakes.run();
    g.check_invariants();
    assert!(wakers.iter().all(|w| w.woken() == 1));
    assert!(!g.held_back());
    assert_eq!(stats(&g).granted_unclaimed, 3);
    // The same through a sample taken with nobody arriving (`note_pressure`).
    let h = gate(2, 8, "reject", 0);
    let _b = admit(&h, "");
    let key = queue_with(&h, Decision::Queue);
    assert!(h.held_back());
    assert!(h.note_pressure(Decision::Queue).is_empty());
    h.note_pressure(Decision::Admit).run();
    h.check_invariants();
    assert!(!h.held_back());
    assert_eq!(claim(&h, key), Claim::Admitted(None));
}

#[test]
fn turns_let_through_are_adopted_by_a_ceiling_set_later() {
    let g = gate(0, 4, "queue", 0);
    let tickets: Vec<_> = (0..3).map(|_| g.pass_through()).collect();
    assert_eq!(
        stats(&g).in_flight,
        0,
        "uncounted while the gate enforces nothing"
    );
    let (_, wakes) = g.reconfigure(ConcurrencyLimit::new(2, 4, "queue", 0).unwrap(), None);
    wakes.run();
    g.check_invariants();
    let s = stats(&g);
    assert_eq!((s.in_flight, s.admitted, s.peak_in_flight), (3, 0, 3));
    let (key, waker) = queue(&g, "");
    // Two of the three end: only then is a slot free under the ceiling of 2.
    let mut tickets = tickets.into_iter();
    for _ in 0..2 {
        g.end_pass_through(tickets.next().unwrap(), None).run();
        g.check_invariants();
    }
    assert_eq!(waker.woken(), 1);
    assert_eq!(claim(&g, key), Claim::Admitted(None));
    g.end_pass_through(tickets.next().unwrap(), None).run();
    close(&g, &TurnSlot::new(None));
    let s = stats(&g);
    assert_eq!((s.in_flight, s.queued, s.admitted), (0, 0, 1));
    // A turn let through after the ceiling went back to 0 is adopted by the next enforced
    // arrival (a custom policy can start enforcing with no reconfigure).
    let (_, wakes) = g.reconfigure(ConcurrencyLimit::new(0, 4, "queue", 0).unwrap(), None);
    wakes.run();
    let late = g.pass_through();
    let _enforced = admit(&g, "");
    assert_eq!(stats(&g).in_flight, 2);
    g.end_pass_through(late, None).run();
    assert_eq!(stats(&g).in_flight, 1);
    // A forked child forgets them (the binding never ends a parent's ticket in the child):
    // the next enforced arrival adopts nothing.
    let _parents = g.pass_through();
    drop(g.reset());
    let _child = admit(&g, "");
    assert_eq!(stats(&g).in_flight, 1);
}

#[test]
fn turns_waiting_for_confirmation_are_counted_apart_from_running_ones() {
    let g = gate(2, 2, "reject", 0);
    g.defer_admission();
    let Arrival::Admitted(_) = arrive(&g, "", Decision::Admit) else {
        panic!("a free slot is granted");
    };
    let Arrival::Admitted(_) = arrive(&g, "", Decision::Admit) else {
        panic!("a free slot is granted");
    };
    let (key, _w) = queue(&g, "");
    assert_eq!(g.running_and_unconfirmed(), (2, 2));
    g.confirm();
    assert_eq!(g.running_and_unconfirmed(), (2, 1));
    // The unconfirmed one is revoked: its slot goes to the waiter, granted and unconfirmed.
    let (_, wakes) = g.revoke(None, Some(Rejection::Closing), || T0);
    wakes.run();
    g.check_invariants();
    assert_eq!(g.running_and_unconfirmed(), (2, 1));
    // Cancelled between its grant and its claim: the slot it never confirmed is returned.
    assert_eq!(g.cancel(key).0, Cancelled::ReturnedSlot);
    g.check_invariants();
    assert_eq!(g.running_and_unconfirmed(), (1, 0));
}
