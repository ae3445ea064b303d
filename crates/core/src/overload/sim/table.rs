//! The simulator's report as a text table.

use std::fmt::Write;

use super::run::Report;

/// One row per report, grouped under each scenario's name.
pub fn table(reports: &[Report]) -> String {
    let mut out = String::new();
    let mut scenario = None;
    for report in reports {
        if scenario != Some(&report.scenario) {
            scenario = Some(&report.scenario);
            let _ = writeln!(
                out,
                "\n{}\n  {:<34} {:>8} {:>8} {:>10} {:>9} {:>9}  limit at phase ends (capacity)",
                report.scenario, "gate", "goodput", "p99 ms", "429s", "busy", "left run"
            );
        }
        let limits: Vec<String> = report
            .phase_limits
            .iter()
            .map(|&(capacity, limit)| match limit {
                0 => format!("- ({capacity})"),
                _ => format!("{limit} ({capacity})"),
            })
            .collect();
        let _ = writeln!(
            out,
            "  {:<34} {:>8.3} {:>8.0} {:>9.1}% {:>8.1}% {:>9}  {}",
            report.candidate,
            report.goodput,
            report.p99.as_secs_f64() * 1000.0,
            report.throttled_fraction() * 100.0,
            report.refused_fraction() * 100.0,
            report.left_running,
            limits.join(", ")
        );
    }
    out
}
