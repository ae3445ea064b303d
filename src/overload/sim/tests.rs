use std::time::Duration;

use super::*;

fn candidates() -> Vec<Candidate> {
    let mut all = vec![
        Candidate::adaptive(64),
        Candidate::fixed(8),
        Candidate::no_gate(),
    ];
    all.extend(Candidate::baselines(64, 8));
    all
}

#[test]
fn print_standard_table() {
    let phase = Duration::from_secs(
        std::env::var("SIM_PHASE_S")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(3),
    );
    let mut reports = Vec::new();
    for scenario in standard(phase, 17) {
        for candidate in candidates() {
            reports.push(run(&scenario, &candidate));
        }
    }
    println!("{}", table(&reports));
}
