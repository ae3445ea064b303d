//! Structured logs: one JSON object per line on stderr, and refusal logs limited to one line
//! per reason per second (with how many were not logged), so an overload is not also a log
//! storm. The fleet crate's `log` records (outages, recoveries) come out the same way; URLs in
//! them are already redacted by the fleet crate, and the broker never logs its own.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use admitgate_passage::core_api::Rejection;

struct JsonLines;

fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len().saturating_add(2));
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out
}

fn timestamp() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Writes one structured line: `event` plus `fields` (already JSON values).
pub fn line(level: &str, event: &str, fields: &[(&str, String)]) {
    let mut out = format!(
        "{{\"ts\":{:.3},\"level\":\"{level}\",\"logger\":\"admitgate.broker\",\"event\":\"{}\"",
        timestamp(),
        escape(event)
    );
    for (key, value) in fields {
        out.push_str(&format!(",\"{key}\":{value}"));
    }
    out.push_str("}\n");
    let _ = std::io::stderr().lock().write_all(out.as_bytes());
}

/// A string as a JSON value.
pub fn text(value: &str) -> String {
    format!("\"{}\"", escape(value))
}

impl log::Log for JsonLines {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::Level::Info
    }

    fn log(&self, record: &log::Record<'_>) {
        if self.enabled(record.metadata()) {
            let level = record.level().as_str().to_ascii_lowercase();
            line(
                &level,
                "log",
                &[
                    ("target", text(record.target())),
                    ("message", text(&record.args().to_string())),
                ],
            );
        }
    }

    fn flush(&self) {}
}

static LOGGER: JsonLines = JsonLines;

/// Routes `log` records to the JSON lines (once per process; a second call does nothing).
pub fn install() {
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(log::LevelFilter::Info);
    }
}

/// Per reason: the second of the last line, and refusals since then not logged.
#[derive(Default)]
pub struct RefusalLog {
    last: [AtomicU64; Rejection::ALL.len()],
    suppressed: [AtomicU64; Rejection::ALL.len()],
}

impl RefusalLog {
    /// Logs a refusal unless this reason was logged in the current second.
    pub fn refused(&self, reason: Rejection, transport: &str, in_flight: u64, limit: u32) {
        let second = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
            .saturating_add(1);
        let (Some(last), Some(suppressed)) = (
            self.last.get(reason.index()),
            self.suppressed.get(reason.index()),
        ) else {
            return;
        };
        let previous = last.load(Ordering::Relaxed);
        if previous == second
            || last
                .compare_exchange(previous, second, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            suppressed.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let skipped = suppressed.swap(0, Ordering::Relaxed);
        line(
            "warning",
            "refused",
            &[
                ("reason", text(reason.as_str())),
                ("transport", text(transport)),
                ("in_flight", in_flight.to_string()),
                ("max_in_flight", limit.to_string()),
                ("suppressed_since_last", skipped.to_string()),
            ],
        );
    }
}
