//! Seeded model tests of the gate with overload control: random arrivals, ends, refusals,
//! cancellations and timer expiries, with the invariants checked after every step.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::super::{Arrival, Claim, Gate, Rejection, Stats, TurnSlot, WaiterKey, Waker, Wakes};
use super::TurnEnd;
use crate::overload::sim::Rng;
use crate::overload::{CapacitySearch, CapacitySearchConfig, Discipline, Outcome};
use crate::policy::{ConcurrencyLimit, Decision};

/// Notes which turn it woke.
struct Note {
    id: usize,
    woken: Arc<Mutex<Vec<usize>>>,
}

impl Waker for Note {
    fn wake(self) -> Wakes<Self> {
        self.woken.lock().push(self.id);
        Wakes::default()
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Options {
    /// `None`: overload control off (today's gate).
    discipline: Option<Discipline>,
    adaptive: bool,
    deadlines: bool,
    scoped: bool,
}

#[derive(Debug, Default, PartialEq)]
struct Tally {
    arrivals: u64,
    /// Ids in the order they started running.
    started: Vec<usize>,
    refused: u64,
    cancelled: u64,
    deadline_refusals_at_once: u64,
}

struct Model {
    gate: Gate<Note>,
    options: Options,
    woken: Arc<Mutex<Vec<usize>>>,
    waiting: Vec<(usize, WaiterKey)>,
    running: Vec<(usize, TurnSlot, Duration, u64)>,
    now: Duration,
    tally: Tally,
}

impl Model {
    fn new(options: Options) -> Self {
        let per_scope = if options.scoped { 2 } else { 0 };
        let gate = Gate::new(ConcurrencyLimit::new(6, 8, "shed_oldest", per_scope).unwrap());
        if let Some(discipline) = options.discipline {
            let controller = options.adaptive.then(|| {
                Box::new(CapacitySearch::new(CapacitySearchConfig::new(6)))
                    as Box<dyn crate::overload::LimitController>
            });
            gate.enable_overload(controller, discipline);
        }
        Self {
            gate,
            options,
            woken: Arc::default(),
            waiting: Vec::new(),
            running: Vec::new(),
            now: Duration::ZERO,
            tally: Tally::default(),
        }
    }

    fn stats(&self) -> Stats {
        self.gate.stats(|| self.now)
    }

    fn start(&mut self, id: usize, scope: Option<Arc<str>>) {
        let in_flight = if self.gate.times_turns() {
            let (in_flight, wakes) = self.gate.turn_started(self.now);
            wakes.run();
            in_flight
        } else {
            0
        };
        self.tally.started.push(id);
        self.running
            .push((id, TurnSlot::new(scope), self.now, in_flight));
    }

    fn settle(&mut self) {
        loop {
            let woken = std::mem::take(&mut *self.woken.lock());
            if woken.is_empty() {
                break;
            }
            for id in woken {
                let Some(at) = self.waiting.iter().position(|&(i, _)| i == id) else {
                    continue;
                };
                let (_, key) = self.waiting.remove(at);
                let now = self.now;
                let (claim, wakes) = self.gate.claim(key, || now);
                wakes.run();
                match claim {
                    Claim::Admitted(scope) => self.start(id, scope),
                    Claim::Refused(..) => self.tally.refused += 1,
                    other => panic!("woken turn {id} found {other:?}"),
                }
            }
        }
        self.gate.check_invariants();
    }

    fn arrive(&mut self, rng: &mut Rng) {
        let id = self.tally.arrivals as usize;
        self.tally.arrivals += 1;
        let scope = match (self.options.scoped, rng.next_u64() % 3) {
            (false, _) | (true, 0) => None,
            (true, 1) => Some("a"),
            (true, _) => Some("b"),
        };
        let deadline = (self.options.deadlines && rng.next_u64().is_multiple_of(2))
            .then(|| self.now + Duration::from_millis(rng.next_u64() % 120));
        let before = self.stats();
        let runs_at_once = before.in_flight < before.limit
            && before.queued == 0
            && before.granted_unclaimed == 0
            && scope.is_none();
        let now = self.now;
        let (arrival, wakes) = if self.options.deadlines {
            self.gate
                .arrive_by(scope, None, Decision::Admit, deadline, || now)
        } else {
            self.gate.arrive(scope, None, Decision::Admit, || now)
        };
        wakes.run();
        match arrival {
            Arrival::Admitted(scope) => self.start(id, scope),
            Arrival::Queued(key) => {
                let note = Note {
                    id,
                    woken: self.woken.clone(),
                };
                if let (_, Some(note)) = self.gate.register(key, note) {
                    self.woken.lock().push(note.id);
                }
                self.waiting.push((id, key));
            }
            Arrival::Rejected(reason, _) => {
                if reason == Rejection::Deadline && runs_at_once {
                    self.tally.deadline_refusals_at_once += 1;
                }
                self.tally.refused += 1;
            }
        }
    }

    fn end(&mut self, rng: &mut Rng) {
        if self.running.is_empty() {
            return;
        }
        let at = (rng.next_u64() % self.running.len() as u64) as usize;
        let (_, slot, started_at, in_flight) = self.running.swap_remove(at);
        // Drawn whether reported or not, so gates compared on one seed see the same steps.
        let outcome = match rng.next_u64() % 8 {
            0 => Outcome::Throttled { retry_after: None },
            1 => Outcome::Ignored,
            _ => Outcome::Success,
        };
        let wakes = if self.gate.times_turns() {
            let end = TurnEnd {
                started_at,
                ended_at: self.now,
                in_flight,
                outcome,
                remaining: None,
            };
            slot.finish(&self.gate, None, end)
        } else {
            slot.close(&self.gate, None)
        };
        wakes.run();
    }

    fn withdraw(&mut self, rng: &mut Rng) {
        if self.waiting.is_empty() {
            return;
        }
        let at = (rng.next_u64() % self.waiting.len() as u64) as usize;
        let (id, key) = self.waiting.remove(at);
        let (_, wakes) = self.gate.cancel(key);
        wakes.run();
        self.tally.cancelled += 1;
        // A withdrawn turn's waker may have been queued already: forget it.
        self.woken.lock().retain(|&i| i != id);
    }

    fn expire(&mut self, rng: &mut Rng) {
        let Some(&(_, key)) = self.waiting.first() else {
            return;
        };
        let reason = if rng.next_u64().is_multiple_of(2) {
            Rejection::Timeout
        } else {
            Rejection::Deadline
        };
        let (_, wakes) = self.gate.expire_for(key, reason);
        wakes.run();
    }

    fn step(&mut self, rng: &mut Rng) {
        self.now += Duration::from_micros(rng.next_u64() % 20_000);
        match rng.next_u64() % 10 {
            0..=4 => self.arrive(rng),
            5..=7 => self.end(rng),
            8 => self.withdraw(rng),
            _ => self.expire(rng),
        }
        self.settle();
        let stats = self.stats();
        assert!(stats.limit >= 1 && stats.limit <= 6, "{stats:?}");
        assert_eq!(stats.in_flight, self.running.len() as u64, "{stats:?}");
        assert_eq!(stats.queued, self.waiting.len() as u64, "{stats:?}");
    }

    fn run(options: Options, seed: u64, steps: usize) -> Self {
        let mut model = Self::new(options);
        let mut rng = Rng::new(seed);
        for _ in 0..steps {
            model.step(&mut rng);
        }
        model
    }
}

const DISCIPLINES: [Option<Discipline>; 4] = [
    None,
    Some(Discipline::Fifo),
    Some(Discipline::Codel),
    Some(Discipline::AdaptiveLifo),
];

#[test]
fn counters_add_up_under_every_discipline() {
    for discipline in DISCIPLINES {
        for (adaptive, deadlines, scoped) in [
            (false, false, false),
            (true, false, false),
            (true, true, false),
            (true, true, true),
            (false, true, true),
        ] {
            let adaptive = adaptive && discipline.is_some();
            let options = Options {
                discipline,
                adaptive,
                deadlines,
                scoped,
            };
            for seed in 0..12 {
                let model = Model::run(options, seed, 600);
                let stats = model.stats();
                let tally = &model.tally;
                assert_eq!(
                    stats.admitted,
                    tally.started.len() as u64,
                    "{options:?} {seed}"
                );
                assert_eq!(stats.cancelled, tally.cancelled, "{options:?} {seed}");
                assert_eq!(
                    stats.rejected + stats.shed,
                    tally.refused,
                    "{options:?} {seed}"
                );
                assert_eq!(
                    stats.admitted + stats.rejected + stats.shed + stats.cancelled + stats.queued,
                    tally.arrivals,
                    "every arrival is admitted, refused, cancelled or waiting: {options:?} {seed}"
                );
            }
        }
    }
}

#[test]
fn fifo_with_overload_control_on_is_todays_order_exactly() {
    for scoped in [false, true] {
        for seed in 0..40 {
            let options = |discipline| Options {
                discipline,
                adaptive: false,
                deadlines: false,
                scoped,
            };
            let today = Model::run(options(None), seed, 800);
            let fifo = Model::run(options(Some(Discipline::Fifo)), seed, 800);
            assert_eq!(today.tally, fifo.tally, "seed {seed}");
            assert_eq!(today.stats(), fifo.stats(), "seed {seed}");
        }
    }
}

#[test]
fn a_deadline_never_refuses_a_turn_that_would_run_at_once() {
    for discipline in DISCIPLINES {
        for seed in 0..20 {
            let model = Model::run(
                Options {
                    discipline,
                    adaptive: discipline.is_some(),
                    deadlines: true,
                    scoped: false,
                },
                seed,
                600,
            );
            assert_eq!(model.tally.deadline_refusals_at_once, 0, "{discipline:?}");
        }
    }
}

#[test]
fn a_turn_that_cannot_finish_in_time_is_refused_at_once_and_counted() {
    let gate: Gate<Note> = Gate::new(ConcurrencyLimit::new(1, 4, "reject", 0).unwrap());
    gate.enable_overload(None, Discipline::Fifo);
    let ms = Duration::from_millis;
    // One turn of 100 ms teaches the service time.
    let (arrival, _) = gate.arrive_by(None, None, Decision::Admit, None, || ms(0));
    assert_eq!(arrival, Arrival::Admitted(None));
    let (in_flight, _) = gate.turn_started(ms(0));
    let end = TurnEnd {
        started_at: ms(0),
        ended_at: ms(100),
        in_flight,
        outcome: Outcome::Success,
        remaining: None,
    };
    drop(TurnSlot::new(None).finish(&gate, None, end));
    assert_eq!(gate.stats(|| ms(100)).in_flight, 0);
    // The slot is taken: a turn with 50 ms left would queue, and cannot finish.
    let _held = gate.arrive_by(None, None, Decision::Admit, None, || ms(100));
    let (arrival, _) = gate.arrive_by(None, None, Decision::Admit, Some(ms(150)), || ms(100));
    assert_eq!(arrival, Arrival::Rejected(Rejection::Deadline, None));
    // With 150 ms left it queues, and its timer is due when 100 ms are left.
    let (arrival, _) = gate.arrive_by(None, None, Decision::Admit, Some(ms(250)), || ms(100));
    let Arrival::Queued(key) = arrival else {
        panic!("{arrival:?}")
    };
    assert_eq!(gate.deadline_timer(ms(250)), ms(150));
    let (expired, _) = gate.expire_for(key, Rejection::Deadline);
    assert!(expired);
    let (claim, _) = gate.claim(key, || ms(150));
    // No retry hint, as for the refusal on arrival: the caller's own deadline cannot be met,
    // which retrying sooner does not change.
    assert_eq!(claim, Claim::Refused(Rejection::Deadline, None));
    let stats = gate.stats(|| ms(150));
    assert_eq!((stats.admitted, stats.rejected), (2, 2));
    gate.check_invariants();
}

#[test]
fn a_standing_queue_serves_the_newest_and_refuses_the_stale() {
    let gate: Gate<Note> = Gate::new(ConcurrencyLimit::new(1, 16, "reject", 0).unwrap());
    gate.enable_overload(None, Discipline::AdaptiveLifo);
    let woken: Arc<Mutex<Vec<usize>>> = Arc::default();
    let ms = Duration::from_millis;
    let finish = |started: u64, ended: u64| {
        let end = TurnEnd {
            started_at: ms(started),
            ended_at: ms(ended),
            in_flight: 1,
            outcome: Outcome::Success,
            remaining: None,
        };
        TurnSlot::new(None).finish(&gate, None, end).run();
    };
    // Teach a 10 ms service time.
    let _ = gate.arrive_by(None, None, Decision::Admit, None, || ms(0));
    finish(0, 10);
    let _ = gate.arrive_by(None, None, Decision::Admit, None, || ms(10));
    // Waiters arrive at 11, 12, ... 16 ms; the queue never drains.
    let mut keys = Vec::new();
    for (id, at) in (11..=16).enumerate() {
        let (arrival, _) = gate.arrive_by(None, None, Decision::Admit, None, || ms(at));
        let Arrival::Queued(key) = arrival else {
            panic!("{arrival:?}")
        };
        let _ = gate.register(
            key,
            Note {
                id,
                woken: woken.clone(),
            },
        );
        keys.push(key);
    }
    // At 40 ms the queue has stood for 29 ms (> 2 service times): the waiters older than
    // 10 ms are refused, and the newest of the rest runs.
    let _ = gate.arrive_by(None, None, Decision::Admit, None, || ms(40));
    finish(10, 40);
    let woken = woken.lock().clone();
    assert!(woken.contains(&5), "the newest ran: {woken:?}");
    let (claim, _) = gate.claim(keys[0], || ms(40));
    assert!(
        matches!(claim, Claim::Refused(Rejection::Timeout, _)),
        "{claim:?}"
    );
    gate.check_invariants();
}

/// Serves `served` unscoped waiters newest first past `blocked` newer waiters of tenants at
/// their limit (one each, every tenant running its one turn); returns how long the serving
/// took (not the set-up) and checks every one was served.
fn serve_past_blocked_tenants(blocked: usize, served: usize) -> Duration {
    let max = u32::try_from(blocked + 1).unwrap();
    let limits = ConcurrencyLimit::new(i64::from(max), 1_000_000, "reject", 1).unwrap();
    let gate: Gate<Note> = Gate::new(limits);
    gate.enable_overload(None, Discipline::AdaptiveLifo);
    let ms = Duration::from_millis;
    // A 100 ms service time: the queue stands after 200 ms, waits are capped at 100 ms.
    let _ = gate.arrive_by(None, None, Decision::Admit, None, || ms(0));
    let end = TurnEnd {
        started_at: ms(0),
        ended_at: ms(100),
        in_flight: 1,
        outcome: Outcome::Success,
        remaining: None,
    };
    drop(TurnSlot::new(None).finish(&gate, None, end));
    let tenants: Vec<String> = (0..blocked).map(|i| format!("t{i}")).collect();
    for tenant in &tenants {
        let (arrival, _) = gate.arrive_by(Some(tenant), None, Decision::Admit, None, || ms(0));
        assert!(matches!(arrival, Arrival::Admitted(_)), "{arrival:?}");
    }
    let (running, _) = gate.arrive_by(None, None, Decision::Admit, None, || ms(0));
    assert_eq!(running, Arrival::Admitted(None));
    // A waiter from the start keeps the queue standing (it is refused as stale later).
    let _ = gate.arrive_by(None, None, Decision::Admit, None, || ms(0));
    let mut keys = Vec::new();
    for _ in 0..served {
        let (arrival, _) = gate.arrive_by(None, None, Decision::Admit, None, || ms(300));
        let Arrival::Queued(key) = arrival else {
            panic!("{arrival:?}")
        };
        keys.push(key);
    }
    for tenant in &tenants {
        let (arrival, _) = gate.arrive_by(Some(tenant), None, Decision::Admit, None, || ms(300));
        assert!(matches!(arrival, Arrival::Queued(_)), "{arrival:?}");
    }
    let started = std::time::Instant::now();
    for _ in 0..served {
        // The unscoped turn running ends; its slot goes to the newest unscoped waiter, behind
        // every blocked tenant's.
        drop(TurnSlot::new(None).close(&gate, None));
        let granted = keys.pop().map(|key| gate.claim(key, || ms(300)).0).unwrap();
        assert_eq!(granted, Claim::Admitted(None));
    }
    let took = started.elapsed();
    let stats = gate.stats(|| ms(300));
    assert_eq!(stats.queued, blocked as u64);
    gate.check_invariants();
    took
}

#[test]
fn newest_first_walks_past_blocked_tenants_in_bounded_time() {
    // Per grant, the selection must not cost in proportion to the blocked waiters: serving
    // past 10,000 of them takes about as long as past 100 (a walk made it ~100x as long).
    // The best of three runs of each, interleaved, so a busy machine slows both alike.
    let (mut few, mut many) = (Duration::MAX, Duration::MAX);
    for _ in 0..3 {
        few = few.min(serve_past_blocked_tenants(100, 1_000));
        many = many.min(serve_past_blocked_tenants(10_000, 1_000));
    }
    let ratio = many.as_secs_f64() / few.as_secs_f64().max(1e-6);
    eprintln!("newest first: {many:?} past 10,000 vs {few:?} past 100 ({ratio:.1}x)");
    assert!(
        ratio < 10.0,
        "{many:?} past 10,000 vs {few:?} past 100 ({ratio:.1}x)"
    );
}

/// Issue 22 items 13 and 17, at the core: a waiter's next look follows the estimate; a look
/// refuses only what is due then; a waiter whose deadline the grown estimate no longer fits is
/// refused at once and never granted; under a standing queue each waiter's look comes at about
/// one service time.
#[test]
fn a_waiter_is_looked_at_again_as_the_estimate_moves() {
    let gate: Gate<Note> = Gate::new(ConcurrencyLimit::new(1, 8, "reject", 0).unwrap());
    gate.enable_overload(None, Discipline::Fifo);
    let ms = Duration::from_millis;
    let turn = |start: u64, end: u64| {
        let (arrival, _) = gate.arrive_by(None, None, Decision::Admit, None, || ms(start));
        assert_eq!(arrival, Arrival::Admitted(None), "at {start}");
        let (in_flight, _) = gate.turn_started(ms(start));
        TurnEnd {
            started_at: ms(start),
            ended_at: ms(end),
            in_flight,
            outcome: Outcome::Success,
            remaining: None,
        }
    };
    // A 400 ms estimate; the slot taken; a waiter with 1 s of deadline: looked at at 600 ms.
    let end = turn(0, 400);
    drop(TurnSlot::new(None).finish(&gate, None, end));
    let held = turn(400, 0);
    let (arrival, _) = gate.arrive_by(None, None, Decision::Admit, Some(ms(1400)), || ms(400));
    let Arrival::Queued(key) = arrival else {
        panic!("{arrival:?}")
    };
    assert_eq!(
        gate.next_check(key, Some(ms(1400))),
        Some((ms(1000) + Duration::from_micros(1), Rejection::Deadline))
    );
    // Meanwhile turns became fast (the estimate is the gate's, whoever ran them): 40 turns of
    // 1 ms, recorded straight into the estimate.
    for _ in 0..40 {
        let mut state = gate.state.lock();
        if let Some(overload) = state.overload.as_mut() {
            overload.service.record(ms(1));
        }
    }
    // The look at 1000 ms refuses nothing: 400 ms left for 1 ms turns. The next is later.
    let (refused, _) = gate.recheck(key, Some(ms(1400)), ms(1000));
    assert!(!refused);
    let (at, reason) = gate.next_check(key, Some(ms(1400))).unwrap();
    assert!(at > ms(1390) && reason == Rejection::Deadline, "{at:?}");
    // Turns become slow: the held turn ends at 1300 ms after 900 ms, the estimate grows to
    // ~115 ms, and 100 ms left no longer fits it: the waiter is refused as the slot frees,
    // never granted it.
    let slow = TurnEnd {
        started_at: ms(400),
        ended_at: ms(1300),
        ..held
    };
    let wakes = TurnSlot::new(None).finish(&gate, None, slow);
    drop(wakes);
    let (claim, _) = gate.claim(key, || ms(1300));
    assert_eq!(claim, Claim::Refused(Rejection::Deadline, None));
    gate.check_invariants();

    // The adaptive queue: a 50 ms estimate, the slot taken, waiters at 0, 10, 20 ms after the
    // queue formed: each looked at when it will have waited one service time, and no sooner
    // than the queue stands (two service times).
    let queue: Gate<Note> = Gate::new(ConcurrencyLimit::new(1, 8, "reject", 0).unwrap());
    queue.enable_overload(None, Discipline::AdaptiveLifo);
    let (_, _) = queue.arrive_by(None, None, Decision::Admit, None, || ms(0));
    let (in_flight, _) = queue.turn_started(ms(0));
    drop(TurnSlot::new(None).finish(
        &queue,
        None,
        TurnEnd {
            started_at: ms(0),
            ended_at: ms(50),
            in_flight,
            outcome: Outcome::Success,
            remaining: None,
        },
    ));
    let (_, _) = queue.arrive_by(None, None, Decision::Admit, None, || ms(50));
    let keys: Vec<WaiterKey> = [100u64, 110, 200]
        .iter()
        .map(|&t| {
            match queue
                .arrive_by(None, None, Decision::Admit, None, || ms(t))
                .0
            {
                Arrival::Queued(key) => key,
                other => panic!("{other:?}"),
            }
        })
        .collect();
    let due: Vec<Duration> = keys
        .iter()
        .map(|&key| queue.next_check(key, None).unwrap().0)
        .collect();
    let past = Duration::from_micros(1);
    assert_eq!(due, [ms(200) + past, ms(200) + past, ms(250) + past]);
    // Looked at too early (an estimate that moved), a waiter stays; at its time it leaves.
    assert!(!queue.recheck(keys[0], None, ms(150)).0);
    assert!(queue.recheck(keys[0], None, due[0]).0);
    assert!(queue.recheck(keys[1], None, due[1]).0);
    // The newest is within its cap when the slot frees: it is served.
    drop(TurnSlot::new(None).close(&queue, None));
    let (claim, _) = queue.claim(keys[2], || ms(210));
    assert_eq!(claim, Claim::Admitted(None));
    queue.check_invariants();
}

#[test]
fn a_look_that_finds_nothing_due_asks_again_later_never_at_the_same_instant() {
    // `python -m benchmarks --quick` hung in the simulator: a look at exactly deadline minus
    // the estimate found exactly one turn left (which still fits) and asked to look again at
    // that same instant, for ever, with the simulated clock never moving.
    let gate: Gate<Note> = Gate::new(ConcurrencyLimit::new(1, 8, "reject", 0).unwrap());
    gate.enable_overload(None, Discipline::Fifo);
    let ms = Duration::from_millis;
    // A 400 ms estimate, the slot taken, a waiter with a deadline at 1400 ms.
    let (arrival, _) = gate.arrive_by(None, None, Decision::Admit, None, || ms(0));
    assert_eq!(arrival, Arrival::Admitted(None));
    let (in_flight, _) = gate.turn_started(ms(0));
    let end = TurnEnd {
        started_at: ms(0),
        ended_at: ms(400),
        in_flight,
        outcome: Outcome::Success,
        remaining: None,
    };
    drop(TurnSlot::new(None).finish(&gate, None, end));
    let (arrival, _) = gate.arrive_by(None, None, Decision::Admit, None, || ms(400));
    assert_eq!(arrival, Arrival::Admitted(None));
    let (arrival, _) = gate.arrive_by(None, None, Decision::Admit, Some(ms(1400)), || ms(400));
    let Arrival::Queued(key) = arrival else {
        panic!("{arrival:?}")
    };
    let (first, reason) = gate.next_check(key, Some(ms(1400))).unwrap();
    assert!(
        first > ms(1000) && reason == Rejection::Deadline,
        "{first:?}"
    );
    // A look at exactly 1000 ms (400 ms left for a 400 ms turn: it still fits) refuses
    // nothing, and the next look it asks for is later than that look.
    let (refused, _) = gate.recheck(key, Some(ms(1400)), ms(1000));
    assert!(!refused);
    let (again, _) = gate.next_check(key, Some(ms(1400))).unwrap();
    assert!(again > ms(1000), "{again:?}");
    // At the look it asked for, the waiter is refused.
    let (refused, _) = gate.recheck(key, Some(ms(1400)), again);
    assert!(refused);
    gate.check_invariants();
}
