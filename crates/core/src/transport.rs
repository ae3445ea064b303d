//! Per-transport counters: which front door (JSON-RPC, REST, gRPC, a direct call) a turn
//! came through, and what happened to it there.
//!
//! Each transport name becomes a metric label, so a gate keeps at most [`MAX_TRANSPORTS`] of
//! them and refuses more with an error instead of growing without bound. Counters are
//! atomics updated by the binding as each outcome reaches its caller (a turn starts, waits,
//! is refused, ends), so they count what callers experienced; the gate's own lock is never
//! taken for them. `passthrough` is reserved for requests a front door lets through
//! ungated: it has request counts and durations, never admissions.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;

use super::gate::Rejection;
use super::histogram::{Histogram, HistogramSnapshot};

/// The most distinct transports one gate tracks (`passthrough` not included).
pub const MAX_TRANSPORTS: usize = 16;
/// The longest transport name.
pub const MAX_TRANSPORT_LEN: usize = 32;
/// The transport of turns that name none.
pub const DIRECT: &str = "direct";
/// The label of requests a front door passes through without gating.
pub const PASSTHROUGH: &str = "passthrough";

/// A transport registered on one gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransportId(u8);

impl TransportId {
    /// [`DIRECT`], registered on every gate.
    pub const DIRECT: TransportId = TransportId(0);

    /// The id of the transport registered `index`th; `None` past [`MAX_TRANSPORTS`], so
    /// every id names one of a gate's counters.
    fn at(index: usize) -> Option<TransportId> {
        if index >= MAX_TRANSPORTS {
            return None;
        }
        u8::try_from(index).ok().map(TransportId)
    }
}

/// Where a request's duration is recorded: a gated transport or the passthrough label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestLabel {
    /// A transport turns were admitted through.
    Gated(TransportId),
    /// Traffic the front door did not gate.
    Passthrough,
}

/// Why a transport name was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransportError {
    /// Empty, too long, or outside `[a-z0-9_]`.
    Malformed(String),
    /// `passthrough`, for an admission.
    Reserved,
    /// A new name beyond [`MAX_TRANSPORTS`].
    TooMany(String),
}

impl std::fmt::Display for TransportError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TransportError::Malformed(name) => write!(
                f,
                "transport must be 1 to {MAX_TRANSPORT_LEN} characters of [a-z0-9_], got {name:?}"
            ),
            TransportError::Reserved => write!(
                f,
                "transport {PASSTHROUGH:?} is reserved for ungated requests; admissions need another name"
            ),
            TransportError::TooMany(name) => write!(
                f,
                "transport {name:?} would be this gate's {}th; a gate tracks at most {MAX_TRANSPORTS} transports (each is a metric label)",
                MAX_TRANSPORTS + 1
            ),
        }
    }
}

impl std::error::Error for TransportError {}

/// The counters of one transport.
#[derive(Debug, Default)]
struct Counters {
    in_flight: AtomicU64,
    queued: AtomicU64,
    admitted: AtomicU64,
    rejected: [AtomicU64; Rejection::ALL.len()],
    requests: Histogram,
}

/// A copy of one transport's counters.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TransportStats {
    /// The transport's name.
    pub name: Arc<str>,
    /// Turns of this transport running (a turn lent to a human wait still counts).
    pub in_flight: u64,
    /// Turns of this transport waiting for a slot.
    pub queued: u64,
    /// Turns of this transport that started.
    pub admitted: u64,
    /// Refusals, per reason in [`Rejection::ALL`] order.
    pub rejected: [u64; Rejection::ALL.len()],
}

/// The transports of one gate and their counters.
#[derive(Debug)]
pub struct Transports {
    names: RwLock<Vec<Arc<str>>>,
    counters: [Counters; MAX_TRANSPORTS],
    passthrough: Histogram,
}

impl Default for Transports {
    fn default() -> Self {
        Self {
            names: RwLock::new(vec![Arc::from(DIRECT)]),
            counters: Default::default(),
            passthrough: Histogram::default(),
        }
    }
}

/// Takes one from a live count (turns running or waiting), never below zero.
///
/// Going below zero would be an accounting bug (a turn counted out twice, or a forked child
/// counting out its parent's turn): debug builds stop at it, release builds stay at zero, as
/// the gate's own counters do (`count`), rather than read 2^64 - 1.
fn count_out(counter: &AtomicU64, what: &str) {
    let positive = counter
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
        .is_ok();
    debug_assert!(positive, "a transport's {what} went below zero");
}

fn well_formed(name: &str) -> bool {
    (1..=MAX_TRANSPORT_LEN).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

impl Transports {
    /// The id of the transport `name`, registering it on first use.
    pub fn resolve(&self, name: &str) -> Result<TransportId, TransportError> {
        if name == DIRECT {
            return Ok(TransportId::DIRECT);
        }
        if !well_formed(name) {
            return Err(TransportError::Malformed(name.to_owned()));
        }
        if name == PASSTHROUGH {
            return Err(TransportError::Reserved);
        }
        if let Some(id) = Self::find(&self.names.read(), name) {
            return Ok(id);
        }
        let mut names = self.names.write();
        // Someone may have registered it between the two locks.
        if let Some(id) = Self::find(&names, name) {
            return Ok(id);
        }
        // The new name's position, which must name one of the counters.
        let Some(id) = TransportId::at(names.len()) else {
            return Err(TransportError::TooMany(name.to_owned()));
        };
        names.push(Arc::from(name));
        Ok(id)
    }

    fn find(names: &[Arc<str>], name: &str) -> Option<TransportId> {
        TransportId::at(names.iter().position(|n| &**n == name)?)
    }

    /// Where a front-door request labelled `name` is recorded.
    pub fn request_label(&self, name: &str) -> Result<RequestLabel, TransportError> {
        if name == PASSTHROUGH {
            return Ok(RequestLabel::Passthrough);
        }
        self.resolve(name).map(RequestLabel::Gated)
    }

    /// The counters of `id`: always there, as every id is `DIRECT` or made by
    /// [`TransportId::at`].
    fn counters(&self, id: TransportId) -> Option<&Counters> {
        self.counters.get(usize::from(id.0))
    }

    /// A turn of `id` started at once.
    pub fn admitted(&self, id: TransportId) {
        if let Some(c) = self.counters(id) {
            c.admitted.fetch_add(1, Ordering::Relaxed);
            c.in_flight.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A turn of `id` started waiting.
    pub fn queued(&self, id: TransportId) {
        if let Some(c) = self.counters(id) {
            c.queued.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A waiting turn of `id` stopped waiting: it started (`admitted`), or it was cancelled,
    /// shed or timed out (recorded separately as a rejection where it is one).
    pub fn dequeued(&self, id: TransportId, admitted: bool) {
        if let Some(c) = self.counters(id) {
            count_out(&c.queued, "queued");
        }
        if admitted {
            self.admitted(id);
        }
    }

    /// A running turn of `id` ended.
    pub fn finished(&self, id: TransportId) {
        if let Some(c) = self.counters(id) {
            count_out(&c.in_flight, "in_flight");
        }
    }

    /// A turn of `id` was refused (or shed) for `reason`.
    pub fn rejected(&self, id: TransportId, reason: Rejection) {
        if let Some(counter) = self
            .counters(id)
            .and_then(|c| c.rejected.get(reason.index()))
        {
            counter.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// One front-door request of `label` took `duration` from arrival to its last byte.
    pub fn record_request(&self, label: RequestLabel, duration: Duration) {
        match label {
            RequestLabel::Gated(id) => {
                if let Some(c) = self.counters(id) {
                    c.requests.record(duration);
                }
            }
            RequestLabel::Passthrough => self.passthrough.record(duration),
        }
    }

    /// Every registered transport's counters, in registration order.
    pub fn stats(&self) -> Vec<TransportStats> {
        let names = self.names.read().clone();
        names
            .into_iter()
            .zip(&self.counters)
            .map(|(name, c)| TransportStats {
                name,
                in_flight: c.in_flight.load(Ordering::Relaxed),
                queued: c.queued.load(Ordering::Relaxed),
                admitted: c.admitted.load(Ordering::Relaxed),
                rejected: c.rejected.each_ref().map(|r| r.load(Ordering::Relaxed)),
            })
            .collect()
    }

    /// Request counts and durations per label that has seen a request (`passthrough`
    /// included).
    pub fn request_stats(&self) -> Vec<(Arc<str>, HistogramSnapshot)> {
        let names = self.names.read().clone();
        let gated = names
            .into_iter()
            .zip(&self.counters)
            .map(|(name, c)| (name, c.requests.snapshot()));
        let passthrough = (Arc::from(PASSTHROUGH), self.passthrough.snapshot());
        gated
            .chain(std::iter::once(passthrough))
            .filter(|(_, snapshot)| snapshot.count > 0)
            .collect()
    }

    /// Forgets every count (a forked child starts empty); the names stay registered.
    pub fn reset(&self) {
        for c in &self.counters {
            c.in_flight.store(0, Ordering::Relaxed);
            c.queued.store(0, Ordering::Relaxed);
            c.admitted.store(0, Ordering::Relaxed);
            for r in &c.rejected {
                r.store(0, Ordering::Relaxed);
            }
            c.requests.reset();
        }
        self.passthrough.reset();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_validated_and_bounded() {
        let t = Transports::default();
        assert_eq!(t.resolve("direct"), Ok(TransportId::DIRECT));
        let rpc = t.resolve("jsonrpc").unwrap();
        assert_eq!(t.resolve("jsonrpc"), Ok(rpc));
        for bad in ["", "JSON", "a-b", "é", &"x".repeat(33)] {
            assert!(
                matches!(t.resolve(bad), Err(TransportError::Malformed(_))),
                "{bad:?}"
            );
        }
        assert_eq!(t.resolve("passthrough"), Err(TransportError::Reserved));
        assert_eq!(
            t.request_label("passthrough"),
            Ok(RequestLabel::Passthrough)
        );
        for i in 2..MAX_TRANSPORTS {
            t.resolve(&format!("t{i}")).unwrap();
        }
        let err = t.resolve("one_too_many").unwrap_err();
        assert!(err.to_string().contains("at most 16"), "{err}");
        assert_eq!(t.stats().len(), MAX_TRANSPORTS);
    }

    #[test]
    fn counters_follow_outcomes() {
        let t = Transports::default();
        let rest = t.resolve("rest").unwrap();
        t.admitted(rest);
        t.queued(rest);
        t.dequeued(rest, true);
        t.queued(rest);
        t.dequeued(rest, false);
        t.rejected(rest, Rejection::Shed);
        t.finished(rest);
        t.record_request(RequestLabel::Gated(rest), Duration::from_millis(2));
        t.record_request(RequestLabel::Passthrough, Duration::from_millis(2));
        let s = &t.stats()[1];
        assert_eq!((s.in_flight, s.queued, s.admitted), (1, 0, 2));
        assert_eq!(s.rejected[Rejection::Shed.index()], 1);
        let requests = t.request_stats();
        let names: Vec<&str> = requests.iter().map(|(n, _)| &**n).collect();
        assert_eq!(names, ["rest", "passthrough"]);
    }
}
