//! Budgets at the broker's door: `--rate-limit` and `--rate-key` read, a request's identity
//! taken from it, the refusal's `RateLimit-Policy` / `RateLimit` fields, and the agent's
//! usage report (`admitgate-usage-tokens`) read and stripped before the client.
//!
//! The budget itself (its decision, reservation, settle and cancel, fleet-wide on Redis) is
//! passage's step of a turn: this module only translates between it and HTTP.
//!
//! * `--rate-limit requests=60/min,tokens=100000/min,cost=2000`: any number of `requests=`
//!   and `tokens=` rates (`N/s`, `N/min`, `N/h`, `N/day`), and the token estimate each
//!   gated request reserves (`cost=`, default 0: tokens are then counted from the agent's
//!   reports alone).
//! * `--rate-key header:x-api-key|header:authorization|tenant`: whose budget a request
//!   spends, the first of these sources the request carries (`header:NAME`, also spelled
//!   `metadata:NAME` for gRPC, or `tenant`, the `--tenant-from` tenant). A request with none
//!   of them spends the one anonymous budget, so leaving the header out escapes nothing.
//!   Without `--rate-key`, every request spends one budget: the agent's whole quota.
//! * The identity is passed on as bytes, prefixed with its source, and hashed before
//!   anything keeps it (the local budget's keyed hash, the fleet's SHA-1): its value is never
//!   logged, exported or answered.
//! * Refusal fields: `draft-ietf-httpapi-ratelimit-headers-11` (May 2026), sections 3 and 4:
//!   `RateLimit-Policy: "requests-per-min";q=60;w=60, "tokens-per-min";q=100000;w=60;qu="tokens"`
//!   and `RateLimit: "requests-per-min";r=0;t=17` for the limit that refused (`t` is the
//!   whole seconds until the same request fits, as `Retry-After`). No partition key (`pk`)
//!   is sent: it would echo the identity. The draft's unit registry has no unit for model
//!   tokens; `qu="tokens"` names it.

use std::fmt::Write as _;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use std::sync::Arc;

use admitgate_budget::{Budget, Limit, Meter, Rate, DEFAULT_MAX_KEYS};
use admitgate_fleet::{BudgetFallback, FleetBudget, FleetLimit};
use admitgate_passage::budget::{BudgetBackend, OnLimit, RateLimitStats, RateLimiter, RateLimits};
use admitgate_passage::Permit;
use http::{HeaderMap, HeaderName, HeaderValue};

/// The response header (HTTP/1.1) or trailer (HTTP/2, gRPC trailing metadata) an agent
/// reports a turn's token use in; the broker settles it and never passes it on.
pub const USAGE_HEADER: HeaderName = HeaderName::from_static("admitgate-usage-tokens");
/// `RateLimit-Policy` (the draft's policy field).
pub const POLICY_HEADER: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit` (the draft's service-limit field).
pub const LIMIT_HEADER: HeaderName = HeaderName::from_static("ratelimit");

/// The most sources one `--rate-key` may chain.
const MAX_SOURCES: usize = 8;
/// The longest usage value read (15 digits: more than any budget holds).
const MAX_USAGE_DIGITS: usize = 15;

/// What `--rate-limit` says: the limits and the token estimate a request reserves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RateLimitSpec {
    /// The limits, in the order given.
    pub limits: Vec<Limit>,
    /// The tokens each gated request reserves at admission (settled to its reported use).
    pub cost: u64,
    /// Each limit's policy name in the refusal fields (`requests-per-min`).
    pub policies: Vec<String>,
    /// What a request over the budget does: refused at once, or waits (within its queue
    /// timeout and deadline) until it fits.
    pub on_limit: OnLimit,
    /// What decisions do while the fleet's Redis is down (with `--fleet`).
    pub on_backend_error: BudgetFallback,
}

/// A bad value, with what is wrong with it (the caller names the flag).
fn bad(flag: &str, text: &str, why: impl std::fmt::Display) -> String {
    format!("{flag} {text:?}: {why}")
}

impl RateLimitSpec {
    /// Parses `requests=60/min,tokens=100000/min,cost=2000`; an error is one line naming
    /// `flag` and the bad value.
    pub fn parse(flag: &str, text: &str) -> Result<Self, String> {
        let mut limits = Vec::new();
        let mut cost = None;
        let mut on_limit = OnLimit::Reject;
        let mut on_backend_error = BudgetFallback::Local;
        for part in text.split(',') {
            let part = part.trim();
            let Some((name, value)) = part.split_once('=') else {
                return Err(bad(
                    flag,
                    text,
                    format_args!(
                        "expected requests=N/T, tokens=N/T or cost=N separated by commas, got {part:?}"
                    ),
                ));
            };
            let (name, value) = (name.trim(), value.trim());
            let meter = match name {
                "requests" => Meter::Requests,
                "tokens" => Meter::Tokens,
                "cost" => {
                    if cost.is_some() {
                        return Err(bad(flag, text, "cost= is given twice"));
                    }
                    if value.is_empty()
                        || value.len() > MAX_USAGE_DIGITS
                        || !value.bytes().all(|b| b.is_ascii_digit())
                    {
                        return Err(bad(
                            flag,
                            text,
                            format_args!("cost= must be a whole number of tokens, got {value:?}"),
                        ));
                    }
                    cost = value.parse::<u64>().ok();
                    continue;
                }
                "on_limit" => {
                    on_limit = value.parse().map_err(|e| bad(flag, text, e))?;
                    continue;
                }
                "on_backend_error" => {
                    on_backend_error = value.parse().map_err(|e| bad(flag, text, e))?;
                    continue;
                }
                other => {
                    return Err(bad(
                        flag,
                        text,
                        format_args!("unknown part {other:?} (requests=, tokens=, cost=, on_limit= or on_backend_error=)"),
                    ))
                }
            };
            // (A flag has no tuple form: the message's hint at `(N, seconds)` is dropped.)
            let rate = Rate::parse(name, value).map_err(|e| {
                bad(
                    flag,
                    text,
                    e.to_string().replace(" (or give (N, seconds))", ""),
                )
            })?;
            limits.push(Limit::sliding(meter, rate));
        }
        if limits.is_empty() {
            return Err(bad(
                flag,
                text,
                "needs at least one requests= or tokens= rate",
            ));
        }
        if limits.len() > MAX_POLICIES {
            return Err(bad(
                flag,
                text,
                format_args!("at most {MAX_POLICIES} rates"),
            ));
        }
        let cost = cost.unwrap_or(0);
        if let Some(limit) = limits
            .iter()
            .find(|l| l.meter == Meter::Tokens && l.rate.amount() < cost)
        {
            return Err(bad(
                flag,
                text,
                format_args!(
                    "cost={cost} is more than tokens={} allows in a whole window: every request would be refused",
                    limit.rate
                ),
            ));
        }
        if cost > 0 && !limits.iter().any(|l| l.meter == Meter::Tokens) {
            return Err(bad(flag, text, "cost= needs a tokens= rate"));
        }
        let policies = policy_names(&limits);
        Ok(Self {
            limits,
            cost,
            policies,
            on_limit,
            on_backend_error,
        })
    }

    /// The passage's rate limits for this spec: one limiter named `name` (the namespace of
    /// its keys in Redis), fleet-wide on `fleet`'s connection when there is one.
    pub fn rate_limits(
        &self,
        name: &str,
        fleet: Option<&FleetLimit>,
    ) -> Result<RateLimits, String> {
        let local =
            Budget::new(self.limits.clone(), DEFAULT_MAX_KEYS).map_err(|e| e.to_string())?;
        let backend = match fleet {
            None => BudgetBackend::Local(Box::new(local)),
            Some(fleet) => BudgetBackend::Fleet(
                FleetBudget::new(fleet, name, local, self.on_backend_error)
                    .map_err(|e| e.to_string())?,
            ),
        };
        let limiter = RateLimiter::new(name, backend, self.on_limit);
        Ok(RateLimits::new(vec![Arc::new(limiter)]))
    }

    /// The `RateLimit-Policy` value: every limit, as the draft writes a quota policy.
    pub fn policy_value(&self) -> String {
        let mut out = String::new();
        for (i, (limit, name)) in self.limits.iter().zip(&self.policies).enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            let _ = write!(
                out,
                "\"{name}\";q={};w={}",
                limit.rate.amount(),
                window_seconds(limit.rate.window())
            );
            if limit.meter == Meter::Tokens {
                out.push_str(";qu=\"tokens\"");
            }
        }
        out
    }

    /// The `RateLimit` value of a refusal by limit `index`: none of it is left, for
    /// `retry_after` (whole seconds, rounded up; no `t` when it never fits).
    pub fn limit_value(&self, index: usize, retry_after: Option<Duration>) -> Option<String> {
        let name = self.policies.get(index)?;
        let mut out = format!("\"{name}\";r=0");
        if let Some(wait) = retry_after {
            let _ = write!(out, ";t={}", crate::refusal::whole_seconds(wait));
        }
        Some(out)
    }

    /// Adds the refusal fields to a 429's `headers`.
    pub fn add_refusal_headers(
        &self,
        headers: &mut HeaderMap,
        index: usize,
        retry_after: Option<Duration>,
    ) {
        if let Ok(value) = HeaderValue::from_str(&self.policy_value()) {
            headers.insert(POLICY_HEADER, value);
        }
        if let Some(value) = self
            .limit_value(index, retry_after)
            .and_then(|v| HeaderValue::from_str(&v).ok())
        {
            headers.insert(LIMIT_HEADER, value);
        }
    }
}

/// A window as the draft's `w` (whole seconds, at least 1).
fn window_seconds(window: Duration) -> u64 {
    crate::refusal::whole_seconds(window).max(1)
}

/// Each limit's policy name: `requests-per-min`, `tokens-per-day`, `requests-per-90s`; a
/// name given twice gets `-2`, `-3`.
fn policy_names(limits: &[Limit]) -> Vec<String> {
    let mut names: Vec<String> = Vec::with_capacity(limits.len());
    for limit in limits {
        let window = limit.rate.window();
        let unit = match (window.subsec_nanos(), window.as_secs()) {
            (0, 1) => "s".to_owned(),
            (0, 60) => "min".to_owned(),
            (0, 3600) => "h".to_owned(),
            (0, 86_400) => "day".to_owned(),
            _ => format!("{}s", window_seconds(window)),
        };
        let base = format!("{}-per-{unit}", limit.meter.name());
        let mut name = base.clone();
        let mut n = 1u32;
        while names.contains(&name) {
            n = n.saturating_add(1);
            name = format!("{base}-{n}");
        }
        names.push(name);
    }
    names
}

/// Where a request's identity is read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeySource {
    /// A request header (an HTTP/2 header, so also gRPC metadata), first value.
    Header(HeaderName),
    /// The request's tenant, as `--tenant-from` reads it.
    Tenant,
}

/// `--rate-key`: the sources tried in order; none at all: one budget for every request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RateKey {
    sources: Vec<KeySource>,
}

/// The identity byte of a request that carries none of its `--rate-key` sources.
const ANONYMOUS: u8 = 0xff;

impl RateKey {
    /// Parses `header:x-api-key|header:authorization|tenant` (`metadata:NAME` is the same as
    /// `header:NAME`); an error is one line naming `flag` and the bad value.
    pub fn parse(flag: &str, text: &str) -> Result<Self, String> {
        let mut sources = Vec::new();
        for part in text.split('|') {
            let part = part.trim();
            let source = if part == "tenant" {
                KeySource::Tenant
            } else if let Some(name) = part
                .strip_prefix("header:")
                .or_else(|| part.strip_prefix("metadata:"))
            {
                let name = name.trim();
                let valid = !name.is_empty()
                    && name == name.to_ascii_lowercase()
                    && !name.ends_with("-bin");
                match HeaderName::from_bytes(name.as_bytes()) {
                    Ok(header) if valid => KeySource::Header(header),
                    _ => {
                        return Err(bad(
                            flag,
                            text,
                            format_args!(
                                "{name:?} is not a lowercase header name (nor a -bin metadata key)"
                            ),
                        ))
                    }
                }
            } else {
                return Err(bad(
                    flag,
                    text,
                    format_args!(
                        "each source must be header:NAME, metadata:NAME or tenant, got {part:?}"
                    ),
                ));
            };
            sources.push(source);
        }
        if sources.len() > MAX_SOURCES {
            return Err(bad(
                flag,
                text,
                format_args!("at most {MAX_SOURCES} sources"),
            ));
        }
        Ok(Self { sources })
    }

    /// Whether a source is the tenant (which needs `--tenant-from`).
    pub fn uses_tenant(&self) -> bool {
        self.sources.contains(&KeySource::Tenant)
    }

    /// The request's identity: its first source present (and not empty), as bytes prefixed
    /// with the source's index (a tenant and an API key of the same text are two
    /// identities), or the anonymous identity. Hashed by the budget before it is kept.
    pub fn identity(&self, headers: &HeaderMap, tenant: &str) -> Vec<u8> {
        for (index, source) in self.sources.iter().enumerate() {
            let value = match source {
                KeySource::Header(name) => headers.get(name).map(HeaderValue::as_bytes),
                KeySource::Tenant => Some(tenant.as_bytes()),
            };
            if let Some(value) = value.filter(|v| !v.is_empty()) {
                let mut identity = Vec::with_capacity(value.len().saturating_add(1));
                identity.push(u8::try_from(index).unwrap_or(ANONYMOUS));
                identity.extend_from_slice(value);
                return identity;
            }
        }
        vec![ANONYMOUS]
    }
}

/// What a response said about its turn's token use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Usage {
    /// Nothing reported.
    Absent,
    /// This many tokens.
    Tokens(u64),
    /// A value that is not 1 to 15 ASCII digits, or given twice: ignored.
    Malformed,
}

/// Takes [`USAGE_HEADER`] out of `headers` (every value of it), and what it reported.
pub fn take_usage(headers: &mut HeaderMap) -> Usage {
    let mut values = headers.get_all(&USAGE_HEADER).iter();
    let Some(first) = values.next() else {
        return Usage::Absent;
    };
    let usage = if values.next().is_some() {
        Usage::Malformed
    } else {
        parse_usage(first.as_bytes())
    };
    headers.remove(&USAGE_HEADER);
    usage
}

/// A usage value: 1 to 15 ASCII digits (surrounding spaces allowed).
pub fn parse_usage(value: &[u8]) -> Usage {
    let text = value.trim_ascii();
    if text.is_empty() || text.len() > MAX_USAGE_DIGITS || !text.iter().all(u8::is_ascii_digit) {
        return Usage::Malformed;
    }
    std::str::from_utf8(text)
        .ok()
        .and_then(|t| t.parse().ok())
        .map_or(Usage::Malformed, Usage::Tokens)
}

/// Settles `usage` against the turn `permit` holds (once: passage ignores later reports);
/// whether it reached a reservation.
pub fn settle(permit: &mut Permit, usage: Usage) -> bool {
    match usage {
        Usage::Tokens(tokens) => permit.report_usage(tokens),
        Usage::Absent | Usage::Malformed => false,
    }
}

/// The door's own counters: usage reports by outcome, refusals by policy (the budget's own
/// counters are passage's).
#[derive(Debug, Default)]
pub struct DoorCounters {
    /// Reports settled against a turn's reservation.
    pub settled: AtomicU64,
    /// Malformed reports: ignored, and stripped.
    pub malformed: AtomicU64,
    /// Well-formed reports on a response with nothing to settle (not gated, no budget, or
    /// already settled): stripped.
    pub unmatched: AtomicU64,
    /// Refusals by each policy of `--rate-limit` (in its order).
    pub refused_by: [AtomicU64; MAX_POLICIES],
}

/// The most policies whose refusals are counted one by one.
pub const MAX_POLICIES: usize = 16;

impl DoorCounters {
    /// Counts a refusal by policy `index`.
    pub fn refused(&self, index: usize) {
        if let Some(cell) = self.refused_by.get(index) {
            cell.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts one report's outcome: `settled` tells whether it reached a reservation.
    pub fn count(&self, usage: Usage, settled: bool) {
        let cell = match (usage, settled) {
            (Usage::Absent, _) => return,
            (Usage::Malformed, _) => &self.malformed,
            (Usage::Tokens(_), true) => &self.settled,
            (Usage::Tokens(_), false) => &self.unmatched,
        };
        cell.fetch_add(1, Ordering::Relaxed);
    }
}

/// A counter family: its name, its help, and how it is read from a limiter's stats.
type Counter = (&'static str, &'static str, fn(&RateLimitStats) -> u64);

/// The budget's figures in `/metrics`, when `--rate-limit` is set: per limit (its policy
/// name, never an identity) and the usage reports.
pub fn render_metrics(
    out: &mut String,
    spec: Option<&RateLimitSpec>,
    passage: &admitgate_passage::Passage,
    usage: &DoorCounters,
) {
    let Some(spec) = spec else {
        return;
    };
    let family = crate::exposition::family;
    let counters: &[Counter] = &[
        ("broker_rate_limit_allowed_total", "Requests the budget allowed.", |s| s.allowed),
        ("broker_rate_limit_limited_total", "Requests the budget refused (rate_limited).", |s| s.limited),
        ("broker_rate_limit_waited_total", "Requests that waited for the budget (on_limit=wait).", |s| s.waited),
        ("broker_rate_limit_unavailable_total", "Requests refused because the fleet's Redis was down (on_backend_error=reject).", |s| s.unavailable),
        ("broker_rate_limit_tokens_reserved_total", "Token estimates reserved at admission (cost=).", |s| s.tokens_reserved),
        ("broker_rate_limit_settled_total", "Reservations settled to the agent's usage report.", |s| s.settled),
        ("broker_rate_limit_tokens_settled_total", "Tokens the settled usage reports said were used.", |s| s.tokens_settled),
        ("broker_rate_limit_returned_total", "Reservations given back whole (refused by the gate, or the client left, before the request ran).", |s| s.returned),
        ("broker_rate_limit_tokens_returned_total", "Tokens those reservations held.", |s| s.tokens_returned),
    ];
    let limiters: Vec<_> = passage
        .rate_limits()
        .limiters()
        .iter()
        .map(|l| (l.name().to_owned(), l.stats()))
        .collect();
    for (name, help, read) in counters {
        family(
            out,
            name,
            "counter",
            &format!("{help} By limit (its name), never by identity."),
        );
        for (limit, stats) in &limiters {
            let _ = writeln!(
                out,
                "{name}{{limit=\"{}\"}} {}",
                crate::logging::text(limit).trim_matches('"'),
                read(stats)
            );
        }
    }
    family(
        out,
        "broker_rate_limit_keys",
        "gauge",
        "Identities the budget holds in memory now (hashed).",
    );
    for (limit, stats) in &limiters {
        let _ = writeln!(
            out,
            "broker_rate_limit_keys{{limit=\"{}\"}} {}",
            crate::logging::text(limit).trim_matches('"'),
            stats.keys
        );
    }
    family(
        out,
        "broker_rate_limit_refused_total",
        "counter",
        "Requests refused rate_limited, by the policy that refused (its RateLimit-Policy name).",
    );
    for (policy, cell) in spec.policies.iter().zip(usage.refused_by.iter()) {
        let _ = writeln!(
            out,
            "broker_rate_limit_refused_total{{policy=\"{policy}\"}} {}",
            cell.load(Ordering::Relaxed)
        );
    }
    family(
        out,
        "broker_rate_limit_usage_reports_total",
        "counter",
        "Usage reports (admitgate-usage-tokens) by outcome: settled against a turn, \
         malformed (ignored), unmatched (nothing to settle); all stripped.",
    );
    for (outcome, cell) in [
        ("settled", &usage.settled),
        ("malformed", &usage.malformed),
        ("unmatched", &usage.unmatched),
    ] {
        let _ = writeln!(
            out,
            "broker_rate_limit_usage_reports_total{{outcome=\"{outcome}\"}} {}",
            cell.load(Ordering::Relaxed)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_limits_parse_and_name_their_policies() {
        let spec = RateLimitSpec::parse(
            "--rate-limit",
            "requests=60/min, requests=1000/day,tokens=100_000/min,cost=2000",
        )
        .unwrap();
        assert_eq!(spec.limits.len(), 3);
        assert_eq!(spec.cost, 2000);
        assert_eq!(
            spec.policies,
            ["requests-per-min", "requests-per-day", "tokens-per-min"]
        );
        assert_eq!(
            spec.policy_value(),
            "\"requests-per-min\";q=60;w=60, \"requests-per-day\";q=1000;w=86400, \"tokens-per-min\";q=100000;w=60;qu=\"tokens\""
        );
        assert_eq!(
            spec.limit_value(2, Some(Duration::from_millis(16_001)))
                .unwrap(),
            "\"tokens-per-min\";r=0;t=17"
        );
        assert_eq!(
            spec.limit_value(0, None).unwrap(),
            "\"requests-per-min\";r=0"
        );
        let twice = RateLimitSpec::parse("--rate-limit", "requests=5/s,requests=7/s").unwrap();
        assert_eq!(twice.policies, ["requests-per-s", "requests-per-s-2"]);
    }

    #[test]
    fn bad_rate_limits_name_the_flag_and_the_value() {
        for bad in [
            "",
            "requests",
            "requests=60",
            "requests=60/fortnight",
            "requests=0/min",
            "request=60/min",
            "cost=5",
            "tokens=100/min,cost=101",
            "tokens=100/min,cost=x",
            "tokens=100/min,cost=1,cost=2",
        ] {
            let e = RateLimitSpec::parse("--rate-limit", bad).unwrap_err();
            assert!(
                e.starts_with(&format!("--rate-limit {bad:?}: ")),
                "{bad}: {e}"
            );
            assert!(!e.contains('\n'), "{e}");
        }
    }

    #[test]
    fn rate_keys_parse_and_read_the_first_source_present() {
        let key = RateKey::parse(
            "--rate-key",
            "header:x-api-key|metadata:authorization|tenant",
        )
        .unwrap();
        assert!(key.uses_tenant());
        let mut headers = HeaderMap::new();
        assert_eq!(key.identity(&headers, ""), vec![ANONYMOUS]);
        assert_eq!(key.identity(&headers, "acme"), b"\x02acme");
        headers.insert("authorization", HeaderValue::from_static("Bearer t"));
        assert_eq!(key.identity(&headers, "acme"), b"\x01Bearer t");
        headers.insert("x-api-key", HeaderValue::from_static(""));
        assert_eq!(key.identity(&headers, "acme"), b"\x01Bearer t");
        headers.insert("x-api-key", HeaderValue::from_static("k1"));
        assert_eq!(key.identity(&headers, "acme"), b"\x00k1");
        // The same text from two sources is two identities.
        assert_ne!(
            key.identity(&HeaderMap::new(), "k1"),
            key.identity(&headers, "")
        );
        assert_eq!(RateKey::default().identity(&headers, "x"), vec![ANONYMOUS]);
        for bad in [
            "",
            "header:",
            "header:X-Api-Key",
            "header:a b",
            "metadata:key-bin",
            "cookie:sid",
            "tenant|",
        ] {
            let e = RateKey::parse("--rate-key", bad).unwrap_err();
            assert!(e.starts_with(&format!("--rate-key {bad:?}: ")), "{e}");
        }
    }

    #[test]
    fn usage_is_taken_out_whatever_its_value() {
        let mut headers = HeaderMap::new();
        assert_eq!(take_usage(&mut headers), Usage::Absent);
        headers.insert(USAGE_HEADER, HeaderValue::from_static(" 1234 "));
        headers.insert("x-other", HeaderValue::from_static("1"));
        assert_eq!(take_usage(&mut headers), Usage::Tokens(1234));
        assert!(!headers.contains_key(&USAGE_HEADER));
        assert!(headers.contains_key("x-other"));
        for bad in ["", "-1", "1.5", "12a", "1e3", "0x10", "9999999999999999"] {
            headers.insert(USAGE_HEADER, HeaderValue::from_str(bad).unwrap());
            assert_eq!(take_usage(&mut headers), Usage::Malformed, "{bad:?}");
            assert!(!headers.contains_key(&USAGE_HEADER));
        }
        headers.append(USAGE_HEADER, HeaderValue::from_static("1"));
        headers.append(USAGE_HEADER, HeaderValue::from_static("2"));
        assert_eq!(take_usage(&mut headers), Usage::Malformed);
        assert!(!headers.contains_key(&USAGE_HEADER));
        let counters = DoorCounters::default();
        counters.count(Usage::Tokens(3), true);
        counters.count(Usage::Tokens(3), false);
        counters.count(Usage::Malformed, true);
        counters.count(Usage::Absent, true);
        assert_eq!(counters.settled.load(Ordering::Relaxed), 1);
        assert_eq!(counters.unmatched.load(Ordering::Relaxed), 1);
        assert_eq!(counters.malformed.load(Ordering::Relaxed), 1);
    }
}
