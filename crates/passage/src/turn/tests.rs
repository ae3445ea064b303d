//! The turn state machine driven by hand, without a runtime: every phase's counters, and the
//! one close path from each.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};

use admitgate_core::ConcurrencyLimit;

use super::*;

/// A waker that records that it ran.
struct Flag(Arc<AtomicBool>);

impl Waker for Flag {
    fn wake(self) -> Wakes<Self> {
        self.0.store(true, Ordering::SeqCst);
        Wakes::default()
    }
}

struct TestLane {
    gate: Gate<Flag>,
    transports: Transports,
    epoch: Cell<u64>,
}

impl Lane for TestLane {
    type Waker = Flag;

    fn gate(&self) -> &Gate<Flag> {
        &self.gate
    }

    fn transports(&self) -> &Transports {
        &self.transports
    }

    fn epoch(&self) -> u64 {
        self.epoch.get()
    }
}

fn lane(max: i64, depth: i64, fleet: bool) -> TestLane {
    let gate = Gate::new(ConcurrencyLimit::new(max, depth, "reject", 0).unwrap());
    if fleet {
        gate.defer_admission();
    }
    TestLane {
        gate,
        transports: Transports::default(),
        epoch: Cell::new(0),
    }
}

fn now() -> Duration {
    Duration::from_millis(1)
}

/// (queued, admitted, in_flight, rejected total) of transport `direct`.
fn counted(lane: &TestLane) -> (u64, u64, u64, u64) {
    let t = &lane.transports.stats()[0];
    (t.queued, t.admitted, t.in_flight, t.rejected.iter().sum())
}

fn arrive(lane: &TestLane, turn: &mut Turn) -> Arrived {
    turn.begin(lane).unwrap();
    let (arrived, wakes) = turn.arrive(lane, None, None, Decision::Admit, None, now);
    wakes.run();
    arrived
}

#[test]
fn a_turn_enters_once_and_ends_once() {
    let lane = lane(1, 0, false);
    let mut turn = Turn::new(TransportId::DIRECT, false);
    assert_eq!(arrive(&lane, &mut turn), Arrived::Granted);
    assert_eq!(turn.begin(&lane), Err(AlreadyEntered));
    let (shared, wakes) = turn.start(&lane, false, now);
    wakes.run();
    assert!(shared.is_none() && turn.is_running());
    assert_eq!(counted(&lane), (0, 1, 1, 0));
    assert!(turn.end(&lane, || None, || None).is_some());
    assert!(turn.end(&lane, || None, || None).is_none());
    assert!(turn.abandon(&lane, now).is_none());
    assert_eq!(counted(&lane), (0, 1, 0, 0));
    assert_eq!(lane.gate.stats(now).in_flight, 0);
}

#[test]
fn a_refused_turn_is_counted_with_its_reason_and_holds_nothing() {
    let lane = lane(1, 0, false);
    let mut first = Turn::new(TransportId::DIRECT, false);
    arrive(&lane, &mut first);
    let mut second = Turn::new(TransportId::DIRECT, false);
    let Arrived::Refused(refused) = arrive(&lane, &mut second) else {
        panic!("a full gate without a queue refuses");
    };
    assert_eq!(refused.reason, Rejection::QueueFull);
    assert!(second.abandon(&lane, now).is_none());
    assert_eq!(counted(&lane), (0, 1, 1, 1));
}

#[test]
fn a_queued_turn_is_woken_granted_and_counted_once_as_admitted() {
    let lane = lane(1, 1, false);
    let mut first = Turn::new(TransportId::DIRECT, false);
    arrive(&lane, &mut first);
    let mut second = Turn::new(TransportId::DIRECT, false);
    assert!(matches!(arrive(&lane, &mut second), Arrived::Queued(_)));
    let woken = Arc::new(AtomicBool::new(false));
    assert_eq!(
        second.register(&lane, Flag(woken.clone())),
        Registered::Waiting
    );
    assert_eq!(second.claim(&lane, now).0, Claimed::Waiting);
    assert_eq!(counted(&lane), (1, 1, 1, 0));
    first.end(&lane, || None, || None).unwrap().run();
    assert!(woken.load(Ordering::SeqCst));
    let (claimed, wakes) = second.claim(&lane, now);
    wakes.run();
    assert_eq!(claimed, Claimed::Granted);
    assert!(second.waited());
    assert_eq!(counted(&lane), (0, 2, 1, 0));
    second.abandon(&lane, now).unwrap().run();
    assert_eq!(counted(&lane), (0, 2, 0, 0));
}

#[test]
fn an_expired_turn_is_refused_unless_granted_first() {
    let lane = lane(1, 2, false);
    let mut first = Turn::new(TransportId::DIRECT, false);
    arrive(&lane, &mut first);
    let mut late = Turn::new(TransportId::DIRECT, false);
    arrive(&lane, &mut late);
    late.register(&lane, Flag(Arc::default()));
    let timeout = Duration::from_secs(1);
    let end = late.wait_deadline(&lane, Some(timeout), None).unwrap();
    late.expire(&lane, &end, timeout).run();
    let (claimed, _) = late.claim(&lane, now);
    assert!(matches!(
        claimed,
        Claimed::Refused(Refused {
            reason: Rejection::Timeout,
            ..
        })
    ));
    // Granted first: the expiry changes nothing.
    let mut lucky = Turn::new(TransportId::DIRECT, false);
    arrive(&lane, &mut lucky);
    lucky.register(&lane, Flag(Arc::default()));
    let end = lucky.wait_deadline(&lane, Some(timeout), None).unwrap();
    first.end(&lane, || None, || None).unwrap().run();
    lucky.expire(&lane, &end, timeout).run();
    assert_eq!(lucky.claim(&lane, now).0, Claimed::Granted);
    assert_eq!(counted(&lane), (0, 2, 1, 1));
}

#[test]
fn a_dropped_queued_turn_withdraws_and_hands_on_a_slot_granted_meanwhile() {
    let lane = lane(1, 2, false);
    let mut first = Turn::new(TransportId::DIRECT, false);
    arrive(&lane, &mut first);
    let mut gone = Turn::new(TransportId::DIRECT, false);
    arrive(&lane, &mut gone);
    gone.register(&lane, Flag(Arc::default()));
    let mut next = Turn::new(TransportId::DIRECT, false);
    arrive(&lane, &mut next);
    let woken = Arc::new(AtomicBool::new(false));
    next.register(&lane, Flag(woken.clone()));
    first.end(&lane, || None, || None).unwrap().run();
    // Granted to `gone`, which is dropped before it claims: the slot goes to `next`.
    gone.abandon(&lane, now).unwrap().run();
    assert!(woken.load(Ordering::SeqCst));
    assert_eq!(next.claim(&lane, now).0, Claimed::Granted);
    assert_eq!(counted(&lane), (0, 2, 1, 0));
    assert_eq!(lane.gate.stats(now).cancelled, 1);
}

#[test]
fn a_turn_waiting_for_its_lease_is_queued_until_refused_or_dropped() {
    let lane = lane(2, 0, true);
    let mut refused = Turn::new(TransportId::DIRECT, true);
    assert_eq!(arrive(&lane, &mut refused), Arrived::Granted);
    assert!(refused.is_leasing());
    assert_eq!(counted(&lane), (1, 0, 0, 0));
    let (_, wakes) = refused
        .lease_ended(&lane, Some(Rejection::FleetUnavailable), now)
        .unwrap();
    wakes.run();
    assert!(refused.lease_ended(&lane, None, now).is_none());
    assert_eq!(counted(&lane), (0, 0, 0, 1));
    let mut dropped = Turn::new(TransportId::DIRECT, true);
    arrive(&lane, &mut dropped);
    dropped.abandon(&lane, now).unwrap().run();
    let stats = lane.gate.stats(now);
    assert_eq!(
        (stats.in_flight, stats.admitted, stats.cancelled),
        (0, 0, 1)
    );
    assert_eq!(counted(&lane), (0, 0, 0, 1));
}

#[test]
fn a_running_turn_lends_its_slot_to_a_human_wait_and_takes_it_back() {
    let lane = lane(1, 1, false);
    let mut turn = Turn::new(TransportId::DIRECT, false);
    arrive(&lane, &mut turn);
    let (held, _) = turn.start(&lane, true, now);
    let held = held.unwrap();
    held.lend(&lane.gate, now()).run();
    assert!(!held.holds_slot());
    assert_eq!(lane.gate.stats(now).awaiting_human, 1);
    // The lent slot runs another turn meanwhile.
    let mut other = Turn::new(TransportId::DIRECT, false);
    assert_eq!(arrive(&lane, &mut other), Arrived::Granted);
    held.take_back(&lane.gate, now());
    assert!(held.holds_slot());
    turn.end(&lane, || None, || None).unwrap().run();
    other.abandon(&lane, now).unwrap().run();
    // The hook outliving the turn changes nothing.
    held.lend(&lane.gate, now()).run();
    let stats = lane.gate.stats(now);
    assert_eq!((stats.in_flight, stats.awaiting_human), (0, 0));
}

#[test]
fn a_turn_of_the_parent_of_a_fork_leaves_the_childs_gate_alone() {
    let lane = lane(1, 1, false);
    let mut parents = Turn::new(TransportId::DIRECT, false);
    arrive(&lane, &mut parents);
    parents.start(&lane, false, now).1.run();
    drop(lane.gate.reset());
    lane.transports.reset();
    lane.epoch.set(1);
    assert!(parents.end(&lane, || None, || None).is_none());
    assert_eq!(lane.gate.stats(now).in_flight, 0);
    assert_eq!(counted(&lane), (0, 0, 0, 0));
}

#[test]
fn a_queued_turn_is_refused_at_the_earlier_of_its_queue_timeout_and_its_deadline() {
    let lane = lane(1, 1, false);
    let turn = Turn::new(TransportId::DIRECT, false);
    let (at, soon) = (Duration::from_secs(5), Duration::from_secs(2));
    let ends = |t, d| turn.wait_deadline(&lane, t, d).map(|e| (e.at, e.reason));
    assert_eq!(ends(None, None), None);
    assert_eq!(ends(Some(at), None), Some((at, Rejection::Timeout)));
    assert_eq!(
        ends(Some(at), Some(soon)),
        Some((soon, Rejection::Deadline))
    );
    assert_eq!(ends(Some(soon), Some(at)), Some((soon, Rejection::Timeout)));
    assert_eq!(ends(None, Some(at)), Some((at, Rejection::Deadline)));
}
