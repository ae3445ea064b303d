//! Criterion benchmarks of admitgate's core state machine (no Python).
//!
//! Run with `cargo bench -p admitgate-core-bench` (about a minute after the build). Each
//! benchmark reports nanoseconds per operation:
//!
//! * `uncontended/arrive_close`: a turn that finds a free slot, then ends
//!   (`Gate::arrive` + `TurnSlot::close`, a no-op waker), with and without a scope.
//! * `handoff/queue_grant_claim`: ceiling 1, the slot held; a newcomer queues and registers
//!   its waker, the holder closes (granting the slot to it), the newcomer claims it and becomes
//!   the holder. One full FIFO hand-off per iteration.
//! * `shed_oldest/evict/{depth}`: `shed_oldest` with a full queue of `depth` registered
//!   waiters; a newcomer evicts the oldest, which claims its `Shed`. The time must not grow
//!   with the depth (O(1) eviction).
//! * `two_threads/*` (`iter_custom`): the aggregate wall time per operation when two threads
//!   drive one gate at once, next to the same operations on one thread: `arrive_close` with
//!   free slots (lock contention only), and `handoff` at ceiling 1 (every turn after the first
//!   waits, and is woken across threads with `Thread::unpark`).

use std::collections::VecDeque;
use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

use admitgate_core::{
    Arrival, Claim, ConcurrencyLimit, Decision, Gate, Registered, Rejection, TurnSlot, WaiterKey,
    Waker, Wakes,
};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

/// A waker that does nothing (the single-threaded benches poll with `claim`).
struct Noop;

impl Waker for Noop {
    fn wake(self) -> Wakes<Self> {
        Wakes::default()
    }
}

/// Wakes a parked thread.
struct Unpark(Thread);

impl Waker for Unpark {
    fn wake(self) -> Wakes<Self> {
        self.0.unpark();
        Wakes::default()
    }
}

const T0: Duration = Duration::ZERO;

fn limits(max: i64, depth: i64, overflow: &str) -> ConcurrencyLimit {
    ConcurrencyLimit::new(max, depth, overflow, 0).expect("valid limits")
}

fn admitted(arrival: Arrival) -> TurnSlot {
    match arrival {
        Arrival::Admitted(scope) => TurnSlot::new(scope),
        other => panic!("expected a free slot, got {other:?}"),
    }
}

fn queued(arrival: Arrival) -> WaiterKey {
    match arrival {
        Arrival::Queued(key) => key,
        other => panic!("expected to queue, got {other:?}"),
    }
}

/// arrive + close with a free slot.
fn arrive_close<W: Waker>(gate: &Gate<W>, scope: Option<&str>) {
    let (arrival, wakes) = gate.arrive(scope, None, Decision::Admit, || T0);
    wakes.run();
    let slot = admitted(arrival);
    slot.close(gate, None).run();
}

fn uncontended(c: &mut Criterion) {
    let mut group = c.benchmark_group("uncontended");
    group.throughput(Throughput::Elements(1));
    let gate: Gate<Noop> = Gate::new(limits(32, 128, "queue"));
    group.bench_function("arrive_close", |b| b.iter(|| arrive_close(&gate, None)));
    let scoped: Gate<Noop> =
        Gate::new(ConcurrencyLimit::new(32, 128, "queue", 4).expect("valid limits"));
    group.bench_function("arrive_close_scoped", |b| {
        b.iter(|| arrive_close(&scoped, Some(black_box("tenant-42"))))
    });
    group.finish();
}

fn handoff(c: &mut Criterion) {
    let mut group = c.benchmark_group("handoff");
    group.throughput(Throughput::Elements(1));
    let gate: Gate<Noop> = Gate::new(limits(1, 1024, "queue"));
    let (first, _) = gate.arrive(None, None, Decision::Admit, || T0);
    let mut holder = admitted(first);
    group.bench_function("queue_grant_claim", |b| {
        b.iter(|| {
            let (arrival, wakes) = gate.arrive(None, None, Decision::Admit, || T0);
            wakes.run();
            let key = queued(arrival);
            let (registered, _) = gate.register(key, Noop);
            debug_assert_eq!(registered, Registered::Waiting);
            holder.close(&gate, None).run();
            let (claim, wakes) = gate.claim(key, || T0);
            wakes.run();
            match claim {
                Claim::Admitted(scope) => holder = TurnSlot::new(scope),
                other => panic!("expected the slot, got {other:?}"),
            }
        })
    });
    group.finish();
    holder.close(&gate, None).run();
}

fn shed_oldest(c: &mut Criterion) {
    let mut group = c.benchmark_group("shed_oldest");
    group.throughput(Throughput::Elements(1));
    for depth in [1_000u32, 10_000, 100_000] {
        let gate: Gate<Noop> = Gate::new(limits(1, i64::from(depth), "shed_oldest"));
        let (first, _) = gate.arrive(None, None, Decision::Admit, || T0);
        let holder = admitted(first);
        let mut keys: VecDeque<WaiterKey> = VecDeque::with_capacity(depth as usize + 1);
        for _ in 0..depth {
            let (arrival, _) = gate.arrive(None, None, Decision::Admit, || T0);
            let key = queued(arrival);
            let _ = gate.register(key, Noop);
            keys.push_back(key);
        }
        group.bench_with_input(BenchmarkId::new("evict", depth), &depth, |b, _| {
            b.iter(|| {
                let (arrival, wakes) = gate.arrive(None, None, Decision::Admit, || T0);
                debug_assert_eq!(wakes.len(), 1);
                wakes.run();
                let key = queued(arrival);
                let _ = gate.register(key, Noop);
                keys.push_back(key);
                let victim = keys.pop_front().expect("a victim");
                let (claim, wakes) = gate.claim(victim, || T0);
                wakes.run();
                debug_assert!(matches!(claim, Claim::Refused(Rejection::Shed, _)));
                black_box(claim);
            })
        });
        holder.close(&gate, None).run();
    }
    group.finish();
}

/// One hand-off turn on a thread: arrive; if queued, wait (parked) for the slot; then close.
fn turn_parked(gate: &Gate<Unpark>) {
    let (arrival, wakes) = gate.arrive(None, None, Decision::Admit, || T0);
    wakes.run();
    let scope = match arrival {
        Arrival::Admitted(scope) => scope,
        Arrival::Queued(key) => {
            let (registered, _) = gate.register(key, Unpark(thread::current()));
            let _ = registered;
            loop {
                let (claim, wakes) = gate.claim(key, || T0);
                wakes.run();
                match claim {
                    Claim::Admitted(scope) => break scope,
                    Claim::Waiting => thread::park(),
                    other => panic!("unexpected claim {other:?}"),
                }
            }
        }
        Arrival::Rejected(reason, _) => panic!("rejected: {reason:?}"),
    };
    TurnSlot::new(scope).close(gate, None).run();
}

/// Wall time for `iters` operations split over `threads` threads (started together).
fn run_threads<W: Waker + 'static>(
    threads: u64,
    iters: u64,
    gate: Arc<Gate<W>>,
    op: fn(&Gate<W>),
) -> Duration {
    let per_thread = iters.div_ceil(threads);
    let barrier = Arc::new(Barrier::new(threads as usize + 1));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let gate = gate.clone();
            let barrier = barrier.clone();
            thread::spawn(move || {
                barrier.wait();
                for _ in 0..per_thread {
                    op(&gate);
                }
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    for handle in handles {
        handle.join().expect("bench thread");
    }
    start.elapsed()
}

fn two_threads(c: &mut Criterion) {
    let mut group = c.benchmark_group("two_threads");
    group.throughput(Throughput::Elements(1));
    for threads in [1u64, 2] {
        group.bench_function(BenchmarkId::new("arrive_close", threads), |b| {
            b.iter_custom(|iters| {
                let gate: Arc<Gate<Noop>> = Arc::new(Gate::new(limits(1_000, 128, "queue")));
                run_threads(threads, iters, gate, |g| arrive_close(g, None))
            })
        });
        group.bench_function(BenchmarkId::new("handoff_ceiling1", threads), |b| {
            b.iter_custom(|iters| {
                let gate: Arc<Gate<Unpark>> = Arc::new(Gate::new(limits(1, 128, "queue")));
                run_threads(threads, iters, gate, turn_parked)
            })
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(30);
    targets = uncontended, handoff, shed_oldest, two_threads
}
criterion_main!(benches);
