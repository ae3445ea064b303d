//! Criterion benchmarks of the BotOS drop-ins' local decision (`window_lockout`: a window from a
//! key's first request, then a lockout), no Python, no Redis.
//!
//! Run with `cargo bench -p admitgate-budget-bench --bench window_lockout`. Nanoseconds per
//! decision, hashing the scope and identity included:
//!
//! * `window_lockout/allowed`: one key whose windows keep ending (always allowed).
//! * `window_lockout/locked`: one key locked out (every decision a refusal with its hint).
//! * `window_lockout/random_keys`: a new key each decision, the clock advancing 10 µs
//!   (100,000/s) with 1 s windows: inserts, sweeps of idle keys, table growth.

use std::hint::black_box;

use admitgate_budget::{WindowLockout, WindowLockoutRule, WindowVerdict};
use criterion::{criterion_group, criterion_main, Criterion};

fn limiter(max: u64, window: f64, lockout: f64) -> WindowLockout {
    WindowLockout::new(
        WindowLockoutRule::new(max, window, lockout).unwrap(),
        1 << 20,
    )
    .unwrap()
}

fn decisions(c: &mut Criterion) {
    let allowed = limiter(5, 1e-9, 0.0);
    let mut now = 1.0;
    c.bench_function("window_lockout/allowed", |b| {
        b.iter(|| {
            now += 1e-6;
            let key = allowed.key(black_box("approval_resolve"), black_box("203.0.113.7"));
            assert_eq!(allowed.check(key, now), WindowVerdict::Allowed);
        })
    });
    let locked = limiter(1, 60.0, 1e9);
    let key = locked.key("magic_link", "203.0.113.7");
    locked.check(key, 0.0);
    locked.check(key, 0.0);
    let mut now = 1.0;
    c.bench_function("window_lockout/locked", |b| {
        b.iter(|| {
            now += 1e-6;
            let key = locked.key(black_box("magic_link"), black_box("203.0.113.7"));
            assert!(matches!(
                locked.check(key, now),
                WindowVerdict::Limited { .. }
            ));
        })
    });
    let random = limiter(5, 1.0, 0.0);
    let (mut now, mut i) = (0.0, 0u64);
    c.bench_function("window_lockout/random_keys", |b| {
        b.iter(|| {
            now += 1e-5;
            i += 1;
            let key = random.key("ws_upgrade", black_box(&i.to_string()));
            black_box(random.check(key, now));
        })
    });
}

criterion_group!(benches, decisions);
criterion_main!(benches);
