//! Criterion benchmarks of a local budget decision (no Python, no Redis).
//!
//! Run with `cargo bench -p admitgate-budget-bench`. Each reports nanoseconds per decision:
//!
//! * `allowed/{limits}`: one identity, reserve then cancel (so it stays allowed), with one
//!   limit (60/min) and three (60/min, 1000/day, 100000 tokens/min). Includes hashing the
//!   identity.
//! * `limited/sliding`: one identity held at its limit (60/min): every decision is a refusal
//!   with its exact retry time.
//! * `random_keys/{sliding,gcra}`: a new identity each decision, the clock advancing 10 µs
//!   (100,000/s): inserts, sweeps of idle keys, table growth.

use std::hint::black_box;
use std::time::Duration;

use admitgate_budget::{Budget, Decision, Limit, Meter, Rate, DEFAULT_MAX_KEYS};
use criterion::{criterion_group, criterion_main, Criterion};

fn rate(text: &str) -> Rate {
    Rate::parse("bench", text).unwrap()
}

fn one_limit() -> Vec<Limit> {
    vec![Limit::sliding(Meter::Requests, rate("60/min"))]
}

fn three_limits() -> Vec<Limit> {
    vec![
        Limit::sliding(Meter::Requests, rate("60/min")),
        Limit::sliding(Meter::Requests, rate("1000/day")),
        Limit::sliding(Meter::Tokens, rate("100000/min")),
    ]
}

fn allowed(c: &mut Criterion) {
    for (name, limits) in [("one", one_limit()), ("three", three_limits())] {
        let budget = Budget::new(limits, DEFAULT_MAX_KEYS).unwrap();
        let mut now = Duration::from_secs(1);
        c.bench_function(&format!("allowed/{name}"), |b| {
            b.iter(|| {
                now += Duration::from_nanos(100);
                let key = budget.key(black_box(b"sk-tenant-42-api-key"));
                match budget.reserve(key, black_box(1_000), now) {
                    Decision::Allowed(r) => budget.cancel(r),
                    Decision::Limited(l) => panic!("{l:?}"),
                }
            })
        });
    }
}

fn limited(c: &mut Criterion) {
    let budget = Budget::new(one_limit(), DEFAULT_MAX_KEYS).unwrap();
    let key = budget.key(b"sk-tenant-42-api-key");
    for i in 0..60 {
        let _ = budget.reserve(key, 0, Duration::from_millis(i));
    }
    let mut now = Duration::from_secs(1);
    c.bench_function("limited/sliding", |b| {
        b.iter(|| {
            now += Duration::from_nanos(100);
            let key = budget.key(black_box(b"sk-tenant-42-api-key"));
            black_box(budget.reserve(key, 0, now))
        })
    });
}

fn random_keys(c: &mut Criterion) {
    let gcra = vec![Limit::gcra(Meter::Requests, rate("60/min"), 10).unwrap()];
    let short = vec![Limit::sliding(Meter::Requests, rate("60/s"))];
    for (name, limits) in [("sliding", short), ("gcra", gcra)] {
        let budget = Budget::new(limits, DEFAULT_MAX_KEYS).unwrap();
        let mut i = 0u64;
        c.bench_function(&format!("random_keys/{name}"), |b| {
            b.iter(|| {
                i += 1;
                let key = budget.key(&i.to_le_bytes());
                black_box(budget.reserve(key, 0, Duration::from_micros(10 * i)))
            })
        });
    }
}

criterion_group!(benches, allowed, limited, random_keys);
criterion_main!(benches);
