//! The Prometheus text format's pieces the broker's metric families share: `metrics` renders
//! the gate's and the broker's, `priority` and `rate_limit` render their own families with it
//! (a module of its own, so neither has to import the module that calls it).

use std::fmt::Write as _;

/// A family's `# HELP` and `# TYPE` lines.
pub(crate) fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}
