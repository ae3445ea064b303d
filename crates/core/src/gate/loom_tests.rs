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
