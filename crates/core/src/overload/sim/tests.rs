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
