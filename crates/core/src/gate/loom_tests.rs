//! loom models: every interleaving of the gate's operations on a few threads.
//!
//! Run with `RUSTFLAGS="--cfg admitgate_loom" cargo test --release loom` (bound the search
//! with `LOOM_MAX_PREEMPTIONS`). Each model checks, at the end and wherever a thread can
//! observe it, that slots add up: in flight never exceeds the ceiling (nor a tenant its
//! sub-limit) except by a human-wait borrow, every slot is returned exactly once, and no
//! eligible waiter waits while a slot is free.

use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;
use std::time::Duration;

use super::*;
use crate::policy::ConcurrencyLimit;

/// Counts wake-ups and unparks the waiting thread, so waiters block (as loom can model)
/// instead of spinning.
#[derive(Clone)]
struct Flag {
    woken: Arc<AtomicUsize>,
    thread: Option<thread::Thread>,
}

impl Waker for Flag {
    fn wake(self) -> Wakes<Self> {
        self.woken.fetch_add(1, Ordering::SeqCst);
        if let Some(thread) = &self.thread {
            thread.unpark();
        }
        Wakes::default()
    }
}

impl Flag {
    /// A flag that wakes the current thread, which will `wait` on it.
    fn new() -> Self {
        Self {
            woken: Arc::new(AtomicUsize::new(0)),
            thread: Some(thread::current()),
        }
    }

    /// A flag that only counts (nobody parks on it: a stray unpark would disturb `join`).
    fn counting() -> Self {
        Self {
            woken: Arc::new(AtomicUsize::new(0)),
            thread: None,
        }
    }

    fn woken(&self) -> usize {
        self.woken.load(Ordering::SeqCst)
    }

    /// Parks until woken.
    fn wait(&self) {
        while self.woken() == 0 {
            thread::park();
        }
    }
}

type G = Arc<Gate<Flag>>;

fn gate(max: i64, depth: i64, overflow: &str, per_scope: i64) -> G {
    Arc::new(Gate::new(
        ConcurrencyLimit::new(max, depth, overflow, per_scope).unwrap(),
    ))
}

/// What one simulated turn ended as.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
enum End {
    Ran,
    Rejected,
    Shed,
    Cancelled,
}

/// A full turn: arrive, wait if queued (spinning on the flag with loom yields), run, close.
/// `cancel_if_queued` withdraws instead of waiting.
fn turn(g: &G, scope: &str, cancel_if_queued: bool) -> End {
    turn_with_borrows(g, scope, cancel_if_queued, 0)
}

/// [`turn`], tolerating `borrowed` slots taken by human-wait resumes beyond the ceiling.
fn turn_with_borrows(g: &G, scope: &str, cancel_if_queued: bool, borrowed: u64) -> End {
    let (arrival, wakes) = g.arrive(Some(scope), None, Decision::Admit, || Duration::ZERO);
    wakes.run();
    let slot = match arrival {
        Arrival::Admitted(key) => TurnSlot::new(key),
        Arrival::Rejected(..) => return End::Rejected,
        Arrival::Queued(key) => {
            let flag = Flag::new();
            let (registered, _) = g.register(key, flag.clone());
            if cancel_if_queued {
                let (_, wakes) = g.cancel(key);
                wakes.run();
                // Withdrawn, or evicted first without seeing it: either way a cancellation.
                return End::Cancelled;
            }
            if registered == Registered::Waiting {
                flag.wait();
            }
            let (claim, wakes) = g.claim(key, || Duration::ZERO);
            wakes.run();
            match claim {
                Claim::Admitted(key) => TurnSlot::new(key),
                Claim::Refused(Rejection::Shed, _) => return End::Shed,
                other => panic!("woken but {other:?}"),
            }
        }
    };
    let facts = g.facts(slot.scope());
    let limits = *g.state.lock().limits();
    assert!(facts.in_flight <= u64::from(limits.max_concurrent_runs) + borrowed);
    if limits.max_per_scope > 0 {
        assert!(facts.scope_in_flight <= u64::from(limits.max_per_scope) + borrowed);
    }
    slot.close(g, None).run();
    End::Ran
}

fn settle(g: &G, ends: &[End]) {
    g.check_invariants();
    let s = g.stats(|| Duration::ZERO);
    assert_eq!(
        (s.in_flight, s.queued, s.awaiting_human, s.granted_unclaimed),
        (0, 0, 0, 0)
    );
    let count = |e: End| ends.iter().filter(|&&x| x == e).count() as u64;
    assert_eq!(s.admitted, count(End::Ran));
    assert_eq!(s.rejected, count(End::Rejected));
    assert_eq!(s.shed, count(End::Shed));
    assert_eq!(s.cancelled, count(End::Cancelled));
}

#[test]
fn loom_concurrent_admit_release() {
    loom::model(|| {
        let g = gate(1, 2, "queue", 0);
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let g = g.clone();
                thread::spawn(move || turn(&g, "", false))
            })
            .collect();
        let mut ends = vec![turn(&g, "", false)];
        ends.extend(handles.into_iter().map(|h| h.join().unwrap()));
        assert!(ends.iter().all(|&e| e == End::Ran));
        settle(&g, &ends);
    });
}

#[test]
fn loom_concurrent_cancel_while_queued() {
    loom::model(|| {
        let g = gate(1, 2, "reject", 0);
        let first = {
            let g = g.clone();
            thread::spawn(move || turn(&g, "", false))
        };
        let quitter = {
            let g = g.clone();
            thread::spawn(move || turn(&g, "", true))
        };
        let mut ends = vec![turn(&g, "", false)];
        ends.push(first.join().unwrap());
        ends.push(quitter.join().unwrap());
        settle(&g, &ends);
    });
}

#[test]
fn loom_release_races_cancel_of_granted_waiter() {
    loom::model(|| {
        let g = gate(1, 4, "reject", 0);
        let (held, _) = g.arrive(None, None, Decision::Admit, || Duration::ZERO);
        let Arrival::Admitted(scope) = held else {
            panic!()
        };
        let slot = TurnSlot::new(scope);
        let (q1, _) = g.arrive(None, None, Decision::Admit, || Duration::ZERO);
        let Arrival::Queued(k1) = q1 else { panic!() };
        let (q2, _) = g.arrive(None, None, Decision::Admit, || Duration::ZERO);
        let Arrival::Queued(k2) = q2 else { panic!() };
        let f2 = Flag::counting();
        assert_eq!(g.register(k2, f2.clone()).0, Registered::Waiting);
        let releaser = {
            let g = g.clone();
            thread::spawn(move || slot.close(&g, None).run())
        };
        // k1's owner is cancelled at the same time as the slot is handed to it.
        let (cancelled, wakes) = g.cancel(k1);
        wakes.run();
        releaser.join().unwrap();
        assert!(matches!(
            cancelled,
            Cancelled::Withdrawn | Cancelled::ReturnedSlot
        ));
        // Whatever the order, the slot reached k2.
        assert_eq!(f2.woken(), 1);
        let (claim, _) = g.claim(k2, || Duration::ZERO);
        assert_eq!(claim, Claim::Admitted(None));
        let s = g.stats(|| Duration::ZERO);
        assert_eq!(
            (s.in_flight, s.queued, s.cancelled, s.admitted),
            (1, 0, 1, 2)
        );
        g.check_invariants();
    });
}

#[test]
fn loom_shed_oldest_eviction_races_release() {
    loom::model(|| {
        let g = gate(1, 1, "shed_oldest", 0);
        let (held, _) = g.arrive(None, None, Decision::Admit, || Duration::ZERO);
        let Arrival::Admitted(scope) = held else {
            panic!()
        };
        let slot = TurnSlot::new(scope);
        let (q, _) = g.arrive(None, None, Decision::Admit, || Duration::ZERO);
        let Arrival::Queued(victim) = q else { panic!() };
        let releaser = {
            let g = g.clone();
            thread::spawn(move || slot.close(&g, None).run())
        };
        let newcomer = {
            let g = g.clone();
            thread::spawn(move || turn(&g, "", false))
        };
        releaser.join().unwrap();
        // The victim either got the released slot or was evicted: never both, never neither.
        let (claim, wakes) = g.claim(victim, || Duration::ZERO);
        wakes.run();
        let victim_end = match claim {
            Claim::Admitted(key) => {
                TurnSlot::new(key).close(&g, None).run();
                End::Ran
            }
            Claim::Refused(Rejection::Shed, _) => End::Shed,
            Claim::Waiting => {
                // The newcomer ran first and holds the slot; the victim is next.
                let flag = Flag::new();
                if g.register(victim, flag.clone()).0 == Registered::Waiting {
                    flag.wait();
                }
                let (c, wakes) = g.claim(victim, || Duration::ZERO);
                wakes.run();
                match c {
                    Claim::Admitted(key) => {
                        TurnSlot::new(key).close(&g, None).run();
                        End::Ran
                    }
                    Claim::Refused(Rejection::Shed, _) => End::Shed,
                    other => panic!("{other:?}"),
                }
            }
            other => panic!("victim: {other:?}"),
        };
        let newcomer_end = newcomer.join().unwrap();
        settle(&g, &[End::Ran, victim_end, newcomer_end]);
    });
}

#[test]
fn loom_per_scope_handoff() {
    loom::model(|| {
        let g = gate(2, 4, "queue", 1);
        let a = {
            let g = g.clone();
            thread::spawn(move || turn(&g, "a", false))
        };
        let b = {
            let g = g.clone();
            thread::spawn(move || turn(&g, "b", false))
        };
        let mut ends = vec![turn(&g, "a", false)];
        ends.push(a.join().unwrap());
        ends.push(b.join().unwrap());
        settle(&g, &ends);
    });
}

#[test]
fn loom_human_wait_lend_and_borrow() {
    loom::model(|| {
        let g = gate(1, 2, "queue", 0);
        let (held, _) = g.arrive(None, None, Decision::Admit, || Duration::ZERO);
        let Arrival::Admitted(scope) = held else {
            panic!()
        };
        let slot = Arc::new(TurnSlot::new(scope));
        // A worker thread parks the turn on a person and resumes it ...
        let approval = {
            let (g, slot) = (g.clone(), slot.clone());
            thread::spawn(move || {
                slot.suspend(&g).run();
                slot.resume(&g);
            })
        };
        // ... while another turn arrives and runs (the resume may borrow one slot).
        let other = {
            let g = g.clone();
            thread::spawn(move || turn_with_borrows(&g, "", false, 1))
        };
        approval.join().unwrap();
        slot.close(&g, None).run();
        let other_end = other.join().unwrap();
        assert_eq!(other_end, End::Ran);
        settle(&g, &[End::Ran, End::Ran]);
        assert!(
            g.stats(|| Duration::ZERO).peak_in_flight <= 2,
            "at most one borrowed slot"
        );
    });
}

/// A body that must never run beside another (ceiling 1): counts bodies running at once.
fn body(running: &AtomicUsize) {
    assert_eq!(
        running.fetch_add(1, Ordering::SeqCst),
        0,
        "two bodies at once"
    );
    running.fetch_sub(1, Ordering::SeqCst);
}

#[test]
fn loom_passthrough_turn_races_a_reconfigure_that_sets_a_ceiling() {
    // A gate enforcing nothing lets a turn through (re-checking the ceiling after taking its
    // ticket, as the binding does) while another thread sets a ceiling of 1 and sends a turn
    // through it: however they interleave, the two bodies never run at once, and the slot
    // the gate adopted is returned exactly once.
    loom::model(|| {
        let g = gate(0, 2, "queue", 0);
        let running = Arc::new(AtomicUsize::new(0));
        let passer = {
            let (g, running) = (g.clone(), running.clone());
            thread::spawn(move || {
                let ticket = g.pass_through();
                if g.limits().max_concurrent_runs == 0 {
                    body(&running);
                    g.end_pass_through(ticket, None).run();
                    return None;
                }
                // The gate enforces a ceiling now: undo, and arrive like any other turn.
                g.end_pass_through(ticket, None).run();
                Some(gated_turn(&g, &running))
            })
        };
        let (_, wakes) = g.reconfigure(ConcurrencyLimit::new(1, 2, "queue", 0).unwrap(), None);
        wakes.run();
        let mut ends = vec![gated_turn(&g, &running)];
        ends.extend(passer.join().unwrap());
        settle(&g, &ends);
    });
}

/// A turn through the gate whose body is counted by `running`.
fn gated_turn(g: &G, running: &AtomicUsize) -> End {
    let (arrival, wakes) = g.arrive(None, None, Decision::Admit, || Duration::ZERO);
    wakes.run();
    let scope = match arrival {
        Arrival::Admitted(scope) => scope,
        Arrival::Queued(key) => {
            let flag = Flag::new();
            if g.register(key, flag.clone()).0 == Registered::Waiting {
                flag.wait();
            }
            let (claim, wakes) = g.claim(key, || Duration::ZERO);
            wakes.run();
            match claim {
                Claim::Admitted(scope) => scope,
                other => panic!("woken but {other:?}"),
            }
        }
        Arrival::Rejected(..) => return End::Rejected,
    };
    body(running);
    TurnSlot::new(scope).close(g, None).run();
    End::Ran
}

/// A gate of two classes, `hi` (0) and `lo` (1), with `lo` guaranteed `lo_min` of the limit.
fn classed_gate(max: i64, depth: i64, lo_min: f64) -> G {
    let g = gate(max, depth, "reject", 0);
    let classes = vec![
        crate::PriorityClass::new("hi"),
        crate::PriorityClass::shared("lo", lo_min, 1.0),
    ];
    let order = crate::Order {
        priorities: crate::Priorities::new(classes, None).unwrap(),
        fair: true,
        weights: Default::default(),
    };
    g.set_order(order).unwrap().run();
    g
}

/// [`turn`] in class `class`; checks the class stays within its cap while it runs.
fn class_turn(g: &G, scope: &str, class: crate::ClassId) -> End {
    let arrival = Entrant {
        scope: Some(scope),
        class,
        deadline: None,
    };
    let (arrival, wakes) = g.arrive_as(arrival, None, Decision::Admit, || Duration::ZERO);
    wakes.run();
    let slot = match arrival {
        Arrival::Admitted(key) => TurnSlot::in_class(key, class),
        Arrival::Rejected(..) => return End::Rejected,
        Arrival::Queued(key) => {
            let flag = Flag::new();
            let (registered, _) = g.register(key, flag.clone());
            if registered == Registered::Waiting {
                flag.wait();
            }
            let (claim, wakes) = g.claim(key, || Duration::ZERO);
            wakes.run();
            match claim {
                Claim::Admitted(key) => TurnSlot::in_class(key, class),
                Claim::Refused(Rejection::Shed, _) => return End::Shed,
                other => panic!("woken but {other:?}"),
            }
        }
    };
    let stats = g.class_stats();
    let mine = &stats[usize::from(class.0)];
    assert!(mine.in_flight <= mine.slots.cap);
    assert!(g.stats(|| Duration::ZERO).in_flight <= u64::from(g.limits().max_concurrent_runs));
    slot.close(g, None).run();
    End::Ran
}

/// Per class, the counters add up to what its turns experienced.
fn settle_classes(g: &G, ends: &[(crate::ClassId, End)]) {
    let all: Vec<End> = ends.iter().map(|&(_, e)| e).collect();
    settle(g, &all);
    for (i, class) in g.class_stats().iter().enumerate() {
        let count = |e: End| {
            ends.iter()
                .filter(|&&(c, x)| usize::from(c.0) == i && x == e)
                .count() as u64
        };
        assert_eq!(
            (class.in_flight, class.queued),
            (0, 0),
            "class {}",
            class.name
        );
        assert_eq!(class.tally.admitted, count(End::Ran));
        assert_eq!(class.tally.rejected, count(End::Rejected));
        assert_eq!(class.tally.shed, count(End::Shed));
    }
}

#[test]
fn loom_classes_lend_and_borrow_under_every_interleaving() {
    loom::model(|| {
        // Ceiling 2; lo is guaranteed one slot. hi holds both (borrowing lo's) while a hi and
        // a lo turn race the releases: every class stays within its cap, the slots add up,
        // and the counters per class say what each turn experienced.
        let g = classed_gate(2, 4, 0.5);
        let hi = crate::ClassId(0);
        let lo = crate::ClassId(1);
        let holders: Vec<TurnSlot> = (0..2)
            .map(|_| {
                let (a, _) = g.arrive_as(
                    Entrant {
                        scope: Some("h"),
                        class: hi,
                        deadline: None,
                    },
                    None,
                    Decision::Admit,
                    || Duration::ZERO,
                );
                let Arrival::Admitted(key) = a else { panic!() };
                TurnSlot::in_class(key, hi)
            })
            .collect();
        let threads: Vec<_> = [hi, lo]
            .into_iter()
            .map(|class| {
                let g = g.clone();
                thread::spawn(move || (class, class_turn(&g, "t", class)))
            })
            .collect();
        for slot in holders {
            slot.close(&g, None).run();
            g.check_invariants();
        }
        let mut ends: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        ends.extend([(hi, End::Ran), (hi, End::Ran)]);
        settle_classes(&g, &ends);
    });
}

#[test]
fn loom_a_full_queue_sheds_the_lower_class_racing_a_release() {
    loom::model(|| {
        // Ceiling 1, depth 1: a lo turn waits; a hi newcomer sheds it (or, if the holder's
        // release came first, the lo turn runs and hi queues or runs after it).
        let g = classed_gate(1, 1, 0.0);
        let hi = crate::ClassId(0);
        let lo = crate::ClassId(1);
        let (a, _) = g.arrive_as(
            Entrant {
                scope: None,
                class: lo,
                deadline: None,
            },
            None,
            Decision::Admit,
            || Duration::ZERO,
        );
        let Arrival::Admitted(key) = a else { panic!() };
        let holder = TurnSlot::in_class(key, lo);
        let low = {
            let g = g.clone();
            thread::spawn(move || (lo, class_turn(&g, "l", lo)))
        };
        let high = {
            let g = g.clone();
            thread::spawn(move || (hi, class_turn(&g, "h", hi)))
        };
        holder.close(&g, None).run();
        let ends = vec![(lo, End::Ran), low.join().unwrap(), high.join().unwrap()];
        assert_eq!(
            ends[2].1,
            End::Ran,
            "the more important turn is never refused"
        );
        settle_classes(&g, &ends);
    });
}
