//! Generated operation sequences against a brute-force model.
//!
//! Each case drives a real [`Budget`] with random reserves, settles, cancels and clock steps
//! (a few identities, several limits, windows crossed many times) and checks, after every
//! decision, that it is exactly the model's: allowed iff every limit's amounts in
//! `(now - T, now]` plus the cost fit, and otherwise the smallest time at which they would.
//! At the end the promise itself is checked on the admissions that stood: at most `N` requests
//! per identity in any half-open interval of length `T`. Every failure names its seed.

use std::collections::HashMap;
use std::time::Duration;

use crate::{Budget, Decision, Limit, Meter, Rate, Reservation};

const MS: u64 = 1_000_000;

/// The model: every amount recorded, per identity and limit, never forgotten.
#[derive(Default)]
struct Model {
    /// (identity, limit) -> [(at, amount)]
    entries: HashMap<(u32, usize), Vec<(u64, u64)>>,
}

impl Model {
    fn in_window(&self, who: u32, limit: usize, window: u64, t: u64) -> u64 {
        self.entries.get(&(who, limit)).map_or(0, |es| {
            es.iter()
                .filter(|(at, _)| at + window > t)
                .map(|(_, a)| a)
                .sum()
        })
    }

    /// `None`: allowed now. `Some(None)`: never. `Some(Some(t))`: allowed from `t`.
    fn decide(&self, limits: &[Limit], who: u32, now: u64, tokens: u64) -> Option<Option<u64>> {
        let fits = |t: u64| {
            limits.iter().enumerate().all(|(i, l)| {
                let cost = l.cost(tokens);
                self.in_window(who, i, l.rate.window_ns(), t) + cost <= l.rate.amount()
            })
        };
        if fits(now) {
            return None;
        }
        if limits.iter().any(|l| l.cost(tokens) > l.rate.amount()) {
            return Some(None);
        }
        let mut candidates: Vec<u64> = limits
            .iter()
            .enumerate()
            .flat_map(|(i, l)| {
                let w = l.rate.window_ns();
                self.entries
                    .get(&(who, i))
                    .into_iter()
                    .flatten()
                    .map(move |(at, _)| at + w)
            })
            .filter(|&t| t > now)
            .collect();
        candidates.sort_unstable();
        Some(candidates.into_iter().find(|&t| fits(t)))
    }

    fn add(&mut self, who: u32, limit: usize, at: u64, amount: u64) {
        if amount > 0 {
            self.entries
                .entry((who, limit))
                .or_default()
                .push((at, amount));
        }
    }

    fn take_back(&mut self, who: u32, limit: usize, at: u64, mut amount: u64) {
        if let Some(es) = self.entries.get_mut(&(who, limit)) {
            for (t, a) in es.iter_mut().filter(|(t, _)| *t == at) {
                let taken = amount.min(*a);
                *a -= taken;
                amount -= taken;
                let _ = t;
            }
            es.retain(|(_, a)| *a > 0);
        }
    }
}

fn rate(amount: u64, window_ms: u64) -> Rate {
    Rate::new("test", amount, Duration::from_millis(window_ms)).unwrap()
}

fn random_limits(rng: &mut fastrand::Rng) -> Vec<Limit> {
    let mut limits = vec![Limit::sliding(
        Meter::Requests,
        rate(rng.u64(1..=6), rng.u64(1..=5)),
    )];
    if rng.bool() {
        limits.push(Limit::sliding(
            Meter::Requests,
            rate(rng.u64(4..=20), rng.u64(5..=20)),
        ));
    }
    if rng.bool() {
        limits.push(Limit::sliding(
            Meter::Tokens,
            rate(rng.u64(50..=500), rng.u64(1..=10)),
        ));
    }
    limits
}

struct Held {
    who: u32,
    reservation: Reservation,
    at: u64,
}

/// Runs one generated case; returns the admitted request times per identity (cancelled ones
/// removed) for the final check.
fn run_case(seed: u64, steps: usize) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let limits = random_limits(&mut rng);
    let budget = Budget::new(limits.clone(), 1 << 16).unwrap();
    let identities = rng.u32(1..=4);
    let keys: Vec<_> = (0..identities)
        .map(|i| budget.key(format!("identity-{i}").as_bytes()))
        .collect();
    let mut model = Model::default();
    let mut held: Vec<Held> = Vec::new();
    let mut standing: HashMap<u32, Vec<(u64, usize)>> = HashMap::new(); // who -> [(at, id)]
    let mut cancelled = std::collections::HashSet::new();
    let mut now = 0u64;
    let mut next_id = 0usize;
    let max_tokens = limits
        .iter()
        .filter(|l| l.meter == Meter::Tokens)
        .map(|l| l.rate.amount())
        .max()
        .unwrap_or(100);
    for step in 0..steps {
        // Clock: often still, sometimes a little, sometimes past whole windows.
        // Steps are mostly whole quarter-milliseconds, so times often land exactly on a
        // window's edge (the half-open boundary is where an off-by-one would hide).
        now += match rng.u8(0..10) {
            0..=2 => 0,
            3..=6 => rng.u64(0..4) * (MS / 4),
            7 => rng.u64(0..MS / 2),
            8 => rng.u64(0..12) * (MS / 4),
            _ => rng.u64(0..25 * MS),
        };
        let ctx = || format!("seed {seed} step {step} limits {limits:?}");
        match rng.u8(0..10) {
            0..=5 => {
                let who = rng.u32(0..identities);
                let tokens = rng.u64(0..=max_tokens + max_tokens / 5);
                let expected = model.decide(&limits, who, now, tokens);
                let got = budget.reserve(keys[who as usize], tokens, Duration::from_nanos(now));
                match (got, expected) {
                    (Decision::Allowed(reservation), None) => {
                        for (i, l) in limits.iter().enumerate() {
                            model.add(who, i, now, l.cost(tokens));
                        }
                        standing.entry(who).or_default().push((now, next_id));
                        held.push(Held {
                            who,
                            reservation,
                            at: now,
                        });
                        let _ = next_id;
                        next_id += 1;
                    }
                    (Decision::Limited(l), Some(retry)) => {
                        assert_eq!(
                            l.retry_at,
                            retry.map(Duration::from_nanos),
                            "{}: retry time",
                            ctx()
                        );
                    }
                    (got, expected) => panic!("{}: got {got:?}, model {expected:?}", ctx()),
                }
            }
            6..=7 if !held.is_empty() => {
                let h = held.swap_remove(rng.usize(0..held.len()));
                let estimate = h.reservation.tokens();
                let used = match rng.u8(0..3) {
                    0 => estimate,
                    1 => rng.u64(0..=estimate),
                    _ => estimate + rng.u64(0..=max_tokens),
                };
                let s = budget.settle(h.reservation, used, Duration::from_nanos(now));
                assert_eq!(s.refunded, estimate.saturating_sub(used));
                assert_eq!(s.debt, used.saturating_sub(estimate));
                for (i, l) in limits.iter().enumerate() {
                    if l.meter == Meter::Tokens {
                        model.take_back(h.who, i, h.at, s.refunded);
                        model.add(h.who, i, now, s.debt);
                    }
                }
            }
            8 if !held.is_empty() => {
                let h = held.swap_remove(rng.usize(0..held.len()));
                let tokens = h.reservation.tokens();
                budget.cancel(h.reservation);
                for (i, l) in limits.iter().enumerate() {
                    model.take_back(h.who, i, h.at, l.cost(tokens));
                }
                if let Some(times) = standing.get_mut(&h.who) {
                    if let Some(pos) = times
                        .iter()
                        .position(|(t, id)| *t == h.at && !cancelled.contains(id))
                    {
                        cancelled.insert(times[pos].1);
                        times.remove(pos);
                    }
                }
            }
            _ => {}
        }
    }
    // The promise: at most N requests per identity in any half-open window of length T.
    for (i, l) in limits.iter().enumerate() {
        if l.meter != Meter::Requests {
            continue;
        }
        let w = l.rate.window_ns();
        for (who, times) in &standing {
            let mut ts: Vec<u64> = times.iter().map(|(t, _)| *t).collect();
            ts.sort_unstable();
            let mut start = 0;
            for end in 0..ts.len() {
                while ts[start] + w <= ts[end] {
                    start += 1;
                }
                assert!(
                    (end - start + 1) as u64 <= l.rate.amount(),
                    "seed {seed}: identity {who} limit {i} ({}) had {} in one window",
                    l.rate,
                    end - start + 1
                );
            }
        }
    }
}

#[test]
fn generated_sequences_match_the_brute_force_model() {
    let base = std::env::var("BUDGET_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_b0d6u64);
    for case in 0..400 {
        run_case(base.wrapping_add(case), 300);
    }
}

#[test]
fn gcra_never_passes_more_than_amount_plus_burst_minus_one_per_window() {
    for seed in 0..300u64 {
        let mut rng = fastrand::Rng::with_seed(seed);
        let amount = rng.u64(1..=8);
        let burst = rng.u64(1..=6);
        let window = rng.u64(1..=7) * MS;
        let limit = Limit::gcra(
            Meter::Requests,
            Rate::new("r", amount, Duration::from_nanos(window)).unwrap(),
            burst,
        )
        .unwrap();
        let budget = Budget::new(vec![limit], 1024).unwrap();
        let key = budget.key(b"k");
        let mut now = 0u64;
        let mut times = Vec::new();
        for _ in 0..400 {
            now += rng.u64(0..MS / 3);
            match budget.reserve(key, 0, Duration::from_nanos(now)) {
                Decision::Allowed(_) => times.push(now),
                Decision::Limited(l) => {
                    // The retry time is exact: refused just before it, allowed at it.
                    let at = l.retry_at.unwrap();
                    assert!(at > Duration::from_nanos(now));
                    let before = at - Duration::from_nanos(1);
                    if before > Duration::from_nanos(now) {
                        assert!(matches!(
                            budget.reserve(key, 0, before),
                            Decision::Limited(_)
                        ));
                    }
                    match budget.reserve(key, 0, at) {
                        Decision::Allowed(r) => budget.cancel(r),
                        other => panic!("seed {seed}: refused at its retry time: {other:?}"),
                    }
                }
            }
        }
        let mut start = 0;
        for end in 0..times.len() {
            while times[start] + window <= times[end] {
                start += 1;
            }
            assert!(
                (end - start) as u64 + 1 < amount + burst,
                "seed {seed}: {} in one window, amount {amount} burst {burst}",
                end - start + 1
            );
        }
    }
}

#[test]
fn a_clock_that_steps_back_never_records_out_of_order() {
    let budget = Budget::new(vec![Limit::sliding(Meter::Requests, rate(2, 10))], 64).unwrap();
    let key = budget.key(b"k");
    assert!(matches!(
        budget.reserve(key, 0, Duration::from_millis(5)),
        Decision::Allowed(_)
    ));
    // Read as 5 ms: the window is (5 - 10, 5] whatever the clock said.
    assert!(matches!(
        budget.reserve(key, 0, Duration::from_millis(1)),
        Decision::Allowed(_)
    ));
    match budget.reserve(key, 0, Duration::from_millis(2)) {
        Decision::Limited(l) => assert_eq!(l.retry_at, Some(Duration::from_millis(15))),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_cost_above_the_whole_window_is_refused_with_no_retry_time() {
    let budget = Budget::new(
        vec![
            Limit::sliding(Meter::Requests, rate(10, 10)),
            Limit::sliding(Meter::Tokens, rate(100, 10)),
        ],
        64,
    )
    .unwrap();
    let key = budget.key(b"k");
    match budget.reserve(key, 101, Duration::ZERO) {
        Decision::Limited(l) => assert_eq!((l.retry_at, l.limit), (None, 1)),
        other => panic!("{other:?}"),
    }
    assert_eq!(budget.stats().limited_by, vec![0, 1]);
}

#[test]
fn a_debt_delays_the_next_turn_until_it_leaves_the_window() {
    let budget = Budget::new(vec![Limit::sliding(Meter::Tokens, rate(100, 10))], 64).unwrap();
    let key = budget.key(b"k");
    let Decision::Allowed(r) = budget.reserve(key, 10, Duration::ZERO) else {
        panic!()
    };
    // Used 250: 240 of debt at 3 ms, more than the window holds; held until 3 + 10 ms.
    let s = budget.settle(r, 250, Duration::from_millis(3));
    assert_eq!(s.debt, 240);
    match budget.reserve(key, 0, Duration::from_millis(4)) {
        Decision::Limited(l) => assert_eq!(l.retry_at, Some(Duration::from_millis(13))),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        budget.reserve(key, 100, Duration::from_millis(13)),
        Decision::Allowed(_)
    ));
    let stats = budget.stats();
    assert_eq!(
        (stats.tokens_reserved, stats.tokens_debt, stats.settled),
        (110, 240, 1)
    );
}

#[test]
fn random_keys_at_100k_per_second_hold_memory_bounded() {
    // One identity per 10 µs (100,000/s) for 3 s against a 1 s limit: about 100,000 live
    // identities at any time; the table holds at most about twice that (the sweep doubles).
    let budget = Budget::new(
        vec![Limit::sliding(Meter::Requests, rate(60, 1000))],
        1 << 20,
    )
    .unwrap();
    let mut peak_keys = 0;
    let mut peak_bytes = 0;
    for i in 0..300_000u64 {
        let now = Duration::from_micros(10 * i);
        let key = budget.key(&i.to_le_bytes());
        assert!(matches!(budget.reserve(key, 0, now), Decision::Allowed(_)));
        if i % 10_000 == 9_999 {
            peak_keys = peak_keys.max(budget.stats().keys);
            peak_bytes = peak_bytes.max(budget.memory_bytes());
        }
    }
    assert!(peak_keys <= 2 * 100_000 + 16 * 64, "held {peak_keys} keys");
    // 57 bytes of key plus a 4-entry log buffer (64 bytes), with growth slack.
    let per_key = peak_bytes as u64 / peak_keys;
    assert!(per_key < 160, "{per_key} bytes per key");
    assert!(budget.stats().reclaimed > 0);
    assert_eq!(budget.stats().evicted, 0);
}

/// A one-limit key: 8 bytes of hash, 40 of state, about 9 of index (57), plus the vectors'
/// growth slack (69 measured at 100,000 keys).
#[test]
fn a_one_limit_key_takes_under_72_bytes_with_no_allocation_of_its_own() {
    let limit = Limit::gcra(Meter::Requests, rate(60, 60_000), 10).unwrap();
    let budget = Budget::new(vec![limit], 1 << 20).unwrap();
    for i in 0..100_000u64 {
        let key = budget.key(&i.to_le_bytes());
        let _ = budget.reserve(key, 0, Duration::from_micros(i));
    }
    let per_key = budget.memory_bytes() / 100_000;
    assert!(per_key < 72, "{per_key} bytes per key");
}

#[test]
fn past_the_key_cap_the_soonest_idle_is_evicted_and_counted() {
    let budget = Budget::new(vec![Limit::sliding(Meter::Requests, rate(1, 1000))], 16 * 8).unwrap();
    for i in 0..10_000u64 {
        let key = budget.key(&i.to_le_bytes());
        let _ = budget.reserve(key, 0, Duration::from_micros(i));
    }
    let stats = budget.stats();
    assert!(stats.keys <= 16 * 8, "{stats:?}");
    assert!(stats.evicted > 0, "{stats:?}");
}

#[test]
fn cancelled_reservations_add_up() {
    let budget = Budget::new(
        vec![
            Limit::sliding(Meter::Requests, rate(2, 10)),
            Limit::sliding(Meter::Tokens, rate(100, 10)),
        ],
        64,
    )
    .unwrap();
    let key = budget.key(b"k");
    for _ in 0..10 {
        let Decision::Allowed(a) = budget.reserve(key, 60, Duration::ZERO) else {
            panic!()
        };
        budget.cancel(a);
    }
    let Decision::Allowed(_) = budget.reserve(key, 100, Duration::ZERO) else {
        panic!()
    };
    let stats = budget.stats();
    assert_eq!(
        (stats.allowed, stats.returned, stats.tokens_returned),
        (11, 10, 600)
    );
}

#[test]
fn recorded_admissions_count_without_being_decided() {
    let budget = Budget::new(vec![Limit::sliding(Meter::Requests, rate(2, 10))], 64).unwrap();
    let key = budget.key(b"k");
    let _ = budget.record(key, 0, Duration::ZERO);
    let second = budget.record(key, 0, Duration::from_millis(1));
    // Over the limit by a third record: still recorded (decided elsewhere).
    let _ = budget.record(key, 0, Duration::from_millis(2));
    match budget.reserve(key, 0, Duration::from_millis(3)) {
        Decision::Limited(l) => assert_eq!(l.retry_at, Some(Duration::from_millis(11))),
        other => panic!("{other:?}"),
    }
    budget.cancel(second);
    match budget.reserve(key, 0, Duration::from_millis(3)) {
        Decision::Limited(l) => assert_eq!(l.retry_at, Some(Duration::from_millis(10))),
        other => panic!("{other:?}"),
    }
}

/// Four threads deciding for the same five identities at once on one real clock: by the times
/// the admissions were recorded, never more than N per identity in any window of length T, and
/// every refusal's retry time is in the future of its decision.
#[test]
fn threads_deciding_at_once_never_pass_more_than_n_per_window() {
    use std::sync::{Arc, Mutex};
    use std::time::Instant;
    let (n, window) = (7u64, Duration::from_millis(20));
    let budget = Arc::new(
        Budget::new(
            vec![Limit::sliding(
                Meter::Requests,
                Rate::new("r", n, window).unwrap(),
            )],
            1024,
        )
        .unwrap(),
    );
    let origin = Instant::now();
    let admitted: Arc<Mutex<HashMap<usize, Vec<Duration>>>> = Arc::default();
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let (budget, admitted) = (budget.clone(), admitted.clone());
            std::thread::spawn(move || {
                for i in 0..20_000usize {
                    let who = (i + t) % 5;
                    let key = budget.key(&who.to_le_bytes());
                    let now = origin.elapsed();
                    match budget.reserve(key, 0, now) {
                        Decision::Allowed(r) => admitted
                            .lock()
                            .unwrap()
                            .entry(who)
                            .or_default()
                            .push(r.at()),
                        Decision::Limited(l) => assert!(l.retry_at.unwrap() > now),
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let admitted = admitted.lock().unwrap();
    for (who, times) in admitted.iter() {
        let mut times = times.clone();
        times.sort();
        let mut start = 0;
        for end in 0..times.len() {
            while times[start] + window <= times[end] {
                start += 1;
            }
            assert!(
                ((end - start) as u64) < n,
                "identity {who}: {} in one window",
                end - start + 1
            );
        }
        assert!(
            times.len() as u64 >= n,
            "identity {who}: {} admitted",
            times.len()
        );
    }
}
