//! The issue's scenarios, short and seeded: a test fails if the adaptive gate's goodput,
//! provider 429s or learned limit miss their bounds in any of them.

use std::time::Duration;

use super::*;

/// Each capacity phase (and each fixed-capacity run is three of them) lasts this long.
const PHASE: Duration = Duration::from_secs(4);
const SEED: u64 = 17;

fn scenario(name: &str) -> Scenario {
    standard(PHASE, SEED)
        .into_iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("no scenario {name:?}"))
}

/// The adaptive gate, not told the capacity (upper bound 64), meets the issue's bounds.
fn meets_the_bounds(name: &str) -> Report {
    let report = run(&scenario(name), &Candidate::adaptive(64));
    assert!(
        report.goodput >= 0.9,
        "{name}: goodput {:.3} < 0.9",
        report.goodput
    );
    assert!(
        report.throttled_fraction() <= 0.03,
        "{name}: {:.1}% of provider calls were 429s",
        report.throttled_fraction() * 100.0
    );
    for &(capacity, limit) in &report.phase_limits {
        let off = limit.abs_diff(capacity) as f64 / capacity as f64;
        assert!(
            off <= 0.25,
            "{name}: learned {limit} for a capacity of {capacity}"
        );
    }
    report
}

#[test]
fn impatient_clients() {
    meets_the_bounds("patience 0.2s");
}

#[test]
fn impatient_clients_with_deadlines() {
    meets_the_bounds("patience 0.2s, deadlines");
}

#[test]
fn half_second_clients() {
    meets_the_bounds("patience 0.5s");
}

#[test]
fn half_second_clients_with_deadlines() {
    meets_the_bounds("patience 0.5s, deadlines");
}

#[test]
fn capacity_moving_8_4_16() {
    let report = meets_the_bounds("capacity 8>4>16, patience 0.5s");
    let capacities: Vec<u64> = report.phase_limits.iter().map(|&(c, _)| c).collect();
    assert_eq!(capacities, [8, 4, 16]);
}

#[test]
fn capacity_moving_8_4_16_with_deadlines() {
    meets_the_bounds("capacity 8>4>16, patience 0.5s, deadlines");
}

/// With patient clients, no worse than today's fixed gate told the capacity (within the
/// noise of its probes: 2% of goodput).
#[test]
fn patient_clients_no_worse_than_a_fixed_gate_told_the_capacity() {
    for name in ["patience 2.0s", "patience 2.0s, deadlines"] {
        let adaptive = meets_the_bounds(name);
        let fixed = run(&scenario(name), &Candidate::fixed(8));
        assert!(
            adaptive.goodput >= fixed.goodput - 0.02,
            "{name}: adaptive {:.3} < fixed {:.3}",
            adaptive.goodput,
            fixed.goodput
        );
    }
}

#[test]
fn the_fixed_fifo_gate_loses_impatient_clients_as_the_issue_measured() {
    // The issue's own measurement of today's gate (0.45 of the limit): the simulator
    // reproduces the failure it is meant to show, not only the fix.
    let report = run(&scenario("patience 0.2s"), &Candidate::fixed(8));
    assert!(report.goodput < 0.6, "{:.3}", report.goodput);
    assert!(report.left_running > 0);
}

#[test]
fn a_run_replays_exactly_from_its_seed() {
    let scenario = scenario("capacity 8>4>16, patience 0.5s");
    let candidate = Candidate::adaptive(64);
    assert_eq!(run(&scenario, &candidate), run(&scenario, &candidate));
}

/// LLM turn durations are heavy-tailed: a latency signal read from one window's mean backs
/// off on noise and ratchets the ceiling down. Not one of the issue's scenarios; a guard.
#[test]
fn heavy_tailed_service_times_do_not_ratchet_the_ceiling() {
    for (service_ms, patience_s) in [(50, 0.5), (2000, 10.0)] {
        let mut scenario = scenario("capacity 8>4>16, patience 0.5s");
        scenario.provider.service_sigma = 1.0;
        scenario.provider.service_mean = Duration::from_millis(service_ms);
        scenario.clients.patience = Duration::from_secs_f64(patience_s);
        let scale = u32::try_from(service_ms / 50).unwrap();
        scenario.duration = PHASE * 3 * scale;
        scenario.provider.capacity = vec![
            (Duration::ZERO, 8),
            (PHASE * scale, 4),
            (PHASE * 2 * scale, 16),
        ];
        let report = run(&scenario, &Candidate::adaptive(64));
        assert!(
            report.goodput >= 0.9,
            "{service_ms} ms: goodput {:.3}, limits {:?}",
            report.goodput,
            report.phase_limits
        );
        assert!(report.throttled_fraction() <= 0.03, "{service_ms} ms");
        for &(capacity, limit) in &report.phase_limits {
            assert!(
                limit.abs_diff(capacity) * 4 <= capacity,
                "{service_ms} ms: {:?}",
                report.phase_limits
            );
        }
    }
}

/// Two kinds of traffic at 10x overload: people (5% of arrivals, 2 s patience) and a batch
/// (0.5 s patience). With classes the people are served and the batch takes what they leave;
/// with FIFO the people wait behind the batch and many leave.
#[test]
fn classes_serve_the_interactive_traffic_and_the_batch_takes_the_rest() {
    use crate::queue::{Order, Priorities, PriorityClass};
    let scenario = Scenario {
        name: "classes".to_owned(),
        provider: Provider {
            capacity: vec![(Duration::ZERO, 16)],
            service_mean: Duration::from_millis(50),
            service_sigma: 0.25,
            refusal_latency: Duration::from_millis(1),
        },
        clients: Clients {
            patience: Duration::from_millis(500),
            load: 10.0,
            send_deadline: false,
        },
        duration: Duration::from_secs(8),
        seed: SEED,
        traffic: vec![
            Traffic {
                class: "interactive".to_owned(),
                share: 0.05,
                patience: Some(Duration::from_secs(2)),
            },
            Traffic {
                class: "batch".to_owned(),
                share: 0.95,
                patience: None,
            },
        ],
        tenants: 10,
    };
    let classes = Priorities::new(
        vec![
            PriorityClass::shared("interactive", 0.5, 1.0),
            PriorityClass::shared("batch", 0.2, 1.0),
        ],
        None,
    )
    .unwrap();
    let fifo = Candidate {
        queue_depth: 64,
        ..Candidate::fixed(16)
    };
    let classed = Candidate {
        order: Some(Order {
            priorities: classes,
            fair: true,
            weights: Default::default(),
        }),
        ..fifo.clone()
    };
    let with = run(&scenario, &classed);
    let without = run(&scenario, &fifo);
    let served = |r: &Report, i: usize| r.classes[i].served as f64 / r.classes[i].offered as f64;
    assert!(served(&with, 0) >= 0.99, "{:?}", with.classes[0]);
    assert!(with.classes[0].p99_wait <= Duration::from_millis(100));
    assert!(served(&without, 0) < served(&with, 0));
    assert!(with.goodput >= 0.9, "{}", with.goodput);
    let sum: f64 = with.classes.iter().map(|c| c.goodput).sum();
    assert!((sum - with.goodput).abs() < 1e-9);
    assert_eq!(with.classes[0].timeline.len(), with.timeline.len());
    // A scenario without kinds draws nothing more: its run is the simulator's as before.
    let plain = Scenario {
        traffic: Vec::new(),
        tenants: 0,
        ..scenario.clone()
    };
    assert!(run(&plain, &fifo).classes.is_empty());
}
