//! The caller's deadline, read from its request as the in-process front doors read it.
//!
//! * gRPC: the `grpc-timeout` header (the gRPC HTTP/2 protocol: 1 to 8 ASCII digits and a
//!   unit, `H`, `M`, `S`, `m`, `u` or `n`), which the gRPC interceptor sees as
//!   `context.time_remaining()`.
//! * HTTP (JSON-RPC, REST): Envoy's `x-envoy-expected-rq-timeout-ms`, 1 to 10 ASCII digits
//!   of milliseconds, `admitgate._frontdoor.header_deadline_s`' rule.
//!
//! Only the first occurrence of a header counts, and a value of any other shape is ignored
//! (the request has no deadline), never an error: a client's malformed hint must not cost
//! it its request. Both parsers look at each byte once, and at no more than 10 of them.
//!
//! An admitted request is forwarded with what is left of its deadline
//! ([`rewrite_remaining`]), so the agent sees the time the caller still waits, not the time
//! it waited before it spent some in the broker's queue.

use std::time::{Duration, Instant};

use http::{HeaderMap, HeaderName, HeaderValue};

/// gRPC's deadline header.
pub const GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");
/// `admitgate._frontdoor.DEADLINE_HEADER`.
pub const ENVOY_TIMEOUT: HeaderName = HeaderName::from_static("x-envoy-expected-rq-timeout-ms");

/// `grpc-timeout`'s value: at most 8 digits, then the unit.
const GRPC_MAX_DIGITS: usize = 8;
/// `x-envoy-expected-rq-timeout-ms`' value: at most 10 digits (the Python rule).
const ENVOY_MAX_DIGITS: usize = 10;

/// A `grpc-timeout` value as a duration, or `None` when it is not of the protocol's shape.
pub fn parse_grpc_timeout(value: &[u8]) -> Option<Duration> {
    let (unit, digits) = value.split_last()?;
    let amount = ascii_number(digits, GRPC_MAX_DIGITS)?;
    Some(match unit {
        b'H' => Duration::from_secs(amount.checked_mul(3600)?),
        b'M' => Duration::from_secs(amount.checked_mul(60)?),
        b'S' => Duration::from_secs(amount),
        b'm' => Duration::from_millis(amount),
        b'u' => Duration::from_micros(amount),
        b'n' => Duration::from_nanos(amount),
        _ => return None,
    })
}

/// An `x-envoy-expected-rq-timeout-ms` value as a duration, or `None` when it is not 1 to
/// 10 ASCII digits.
pub fn parse_envoy_timeout(value: &[u8]) -> Option<Duration> {
    ascii_number(value, ENVOY_MAX_DIGITS).map(Duration::from_millis)
}

/// `digits` as a number: 1 to `max` ASCII digits (`max` ≤ 19, so it never overflows).
fn ascii_number(digits: &[u8], max: usize) -> Option<u64> {
    if digits.is_empty() || digits.len() > max {
        return None;
    }
    digits.iter().try_fold(0u64, |number, &byte| {
        let digit = byte.checked_sub(b'0').filter(|d| *d <= 9)?;
        number.checked_mul(10)?.checked_add(u64::from(digit))
    })
}

/// The header a request's deadline is read from: `grpc-timeout` for a gRPC call, Envoy's
/// for anything else (as the gRPC interceptor and the HTTP middleware each read one).
pub fn header_for(grpc: bool) -> HeaderName {
    if grpc {
        GRPC_TIMEOUT
    } else {
        ENVOY_TIMEOUT
    }
}

/// How long the caller of a request with `headers` will wait, if it said so.
pub fn timeout(headers: &HeaderMap, grpc: bool) -> Option<Duration> {
    let value = headers.get(header_for(grpc))?.as_bytes();
    if grpc {
        parse_grpc_timeout(value)
    } else {
        parse_envoy_timeout(value)
    }
}

/// The caller's deadline: `timeout` after `received` (`None` past the clock's range).
pub fn deadline(received: Instant, timeout: Option<Duration>) -> Option<Instant> {
    received.checked_add(timeout?)
}

/// Sets the request's deadline header to what is left of `deadline` at `now`, in the
/// header's own format (at least 1 ms, or `1n`: a zero would mean no deadline to some).
pub fn rewrite_remaining(headers: &mut HeaderMap, grpc: bool, deadline: Instant, now: Instant) {
    let left = deadline.saturating_duration_since(now);
    let value = if grpc {
        grpc_timeout_value(left)
    } else {
        let ms = u64::try_from(left.as_millis()).unwrap_or(u64::MAX).max(1);
        ms.min(9_999_999_999).to_string()
    };
    if let Ok(value) = HeaderValue::from_str(&value) {
        headers.insert(header_for(grpc), value);
    }
}

/// `left` as a `grpc-timeout` value: the finest unit whose amount fits in 8 digits
/// (rounded down, as grpc-go and the C core send it).
pub fn grpc_timeout_value(left: Duration) -> String {
    let limit = 99_999_999u128;
    let nanos = left.as_nanos().max(1);
    for (unit, per) in [
        ('n', 1u128),
        ('u', 1_000),
        ('m', 1_000_000),
        ('S', 1_000_000_000),
        ('M', 60_000_000_000),
    ] {
        let amount = nanos.checked_div(per).unwrap_or(0);
        if amount <= limit {
            return format!("{}{unit}", amount.max(1));
        }
    }
    let hours = nanos.checked_div(3_600_000_000_000).unwrap_or(0);
    format!("{}H", hours.min(limit))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// xorshift64*, seeded: the generated inputs are the same on every run.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// The protocol's grammar, written out the slow way, for the generated inputs.
    fn grpc_model(value: &[u8]) -> Option<Duration> {
        let text = std::str::from_utf8(value).ok()?;
        let unit = text.chars().last()?;
        let digits = &text[..text.len() - unit.len_utf8()];
        if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let n: u64 = digits.parse().ok()?;
        let nanos_per: u64 = match unit {
            'H' => 3_600_000_000_000,
            'M' => 60_000_000_000,
            'S' => 1_000_000_000,
            'm' => 1_000_000,
            'u' => 1_000,
            'n' => 1,
            _ => return None,
        };
        let total = u128::from(n) * u128::from(nanos_per);
        Some(Duration::new(
            (total / 1_000_000_000) as u64,
            (total % 1_000_000_000) as u32,
        ))
    }

    /// `header_deadline_s`' rule: `0 < len(value) <= 10 and value.isdigit()`.
    fn envoy_model(value: &[u8]) -> Option<Duration> {
        if value.is_empty() || value.len() > 10 || !value.iter().all(u8::is_ascii_digit) {
            return None;
        }
        std::str::from_utf8(value)
            .ok()?
            .parse()
            .ok()
            .map(Duration::from_millis)
    }

    #[test]
    fn grpc_timeouts_of_the_protocols_shape() {
        let ok = |v: &str| parse_grpc_timeout(v.as_bytes());
        assert_eq!(ok("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(ok("2M"), Some(Duration::from_secs(120)));
        assert_eq!(ok("30S"), Some(Duration::from_secs(30)));
        assert_eq!(ok("250m"), Some(Duration::from_millis(250)));
        assert_eq!(ok("7u"), Some(Duration::from_micros(7)));
        assert_eq!(ok("99999999n"), Some(Duration::from_nanos(99_999_999)));
        assert_eq!(ok("0m"), Some(Duration::ZERO));
        assert_eq!(ok("00000001S"), Some(Duration::from_secs(1)));
        for bad in [
            "",
            "m",
            "S",
            "123",
            "123456789m",
            "1s",
            "1h",
            "1 m",
            " 1m",
            "1m ",
            "+1m",
            "-1m",
            "1.5S",
            "1mm",
            "1x",
            "١m",
            "1\u{0}m",
        ] {
            assert_eq!(ok(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn envoy_timeouts_are_one_to_ten_ascii_digits() {
        let ok = |v: &str| parse_envoy_timeout(v.as_bytes());
        assert_eq!(ok("1500"), Some(Duration::from_millis(1500)));
        assert_eq!(ok("0"), Some(Duration::ZERO));
        assert_eq!(ok("9999999999"), Some(Duration::from_millis(9_999_999_999)));
        assert_eq!(ok("0000000001"), Some(Duration::from_millis(1)));
        for bad in [
            "",
            "00000000001",
            "1.5",
            "-1",
            "+1",
            " 1",
            "1 ",
            "1e3",
            "٣",
            "0x10",
        ] {
            assert_eq!(ok(bad), None, "{bad:?}");
        }
    }

    /// Generated values, mostly near the valid shapes (digits, a unit, one byte off),
    /// against the grammars written out the slow way.
    #[test]
    fn generated_values_parse_as_the_grammars_say() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let alphabet: &[u8] = b"0123456789000HMSmun hs.+-e\t\x00\xc2\xb9\xff";
        for _ in 0..100_000 {
            let len = rng.below(13);
            let value: Vec<u8> = (0..len)
                .map(|_| alphabet[rng.below(alphabet.len())])
                .collect();
            assert_eq!(parse_grpc_timeout(&value), grpc_model(&value), "{value:?}");
            assert_eq!(
                parse_envoy_timeout(&value),
                envoy_model(&value),
                "{value:?}"
            );
        }
    }

    /// Hostile shapes: long runs of digits, a megabyte of them, cost one look at no more
    /// than the first bytes past the limit.
    #[test]
    fn parsers_are_bounded_on_adversarial_values() {
        let mut huge = vec![b'9'; 1 << 20];
        huge.push(b'm');
        let started = Instant::now();
        for _ in 0..1_000 {
            assert_eq!(parse_grpc_timeout(&huge), None);
            assert_eq!(parse_envoy_timeout(&huge), None);
        }
        // A linear scan of 1 MiB a thousand times would take far longer than this.
        assert!(
            started.elapsed() < Duration::from_millis(200),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(
            parse_grpc_timeout(b"99999999H"),
            Some(Duration::from_secs(99_999_999 * 3600))
        );
    }

    #[test]
    fn only_the_first_header_counts_and_the_transport_picks_the_header() {
        let mut h = HeaderMap::new();
        h.append(ENVOY_TIMEOUT, HeaderValue::from_static("x"));
        h.append(ENVOY_TIMEOUT, HeaderValue::from_static("100"));
        h.insert(GRPC_TIMEOUT, HeaderValue::from_static("5S"));
        assert_eq!(timeout(&h, false), None);
        assert_eq!(timeout(&h, true), Some(Duration::from_secs(5)));
        h.remove(GRPC_TIMEOUT);
        assert_eq!(timeout(&h, true), None);
    }

    #[test]
    fn the_rest_of_a_deadline_is_forwarded_in_the_headers_format() {
        assert_eq!(grpc_timeout_value(Duration::from_millis(1500)), "1500000u");
        assert_eq!(grpc_timeout_value(Duration::from_nanos(5)), "5n");
        assert_eq!(grpc_timeout_value(Duration::ZERO), "1n");
        assert_eq!(grpc_timeout_value(Duration::from_secs(200_000)), "200000S");
        assert_eq!(
            grpc_timeout_value(Duration::from_secs(200_000_000)),
            "3333333M"
        );
        assert_eq!(
            grpc_timeout_value(Duration::from_secs(u64::MAX)),
            "99999999H"
        );
        let mut rng = Rng(7);
        for _ in 0..10_000 {
            let left = Duration::from_nanos(rng.next() >> rng.below(64));
            let value = grpc_timeout_value(left);
            let parsed = parse_grpc_timeout(value.as_bytes()).unwrap();
            assert!(
                parsed <= left.max(Duration::from_nanos(1)),
                "{left:?} {value}"
            );
        }
        let now = Instant::now();
        let mut h = HeaderMap::new();
        h.insert(ENVOY_TIMEOUT, HeaderValue::from_static("5000"));
        rewrite_remaining(&mut h, false, now + Duration::from_millis(1200), now);
        assert_eq!(h[ENVOY_TIMEOUT], "1200");
        rewrite_remaining(&mut h, false, now, now + Duration::from_secs(1));
        assert_eq!(h[ENVOY_TIMEOUT], "1");
        rewrite_remaining(&mut h, true, now + Duration::from_secs(2), now);
        assert_eq!(h[GRPC_TIMEOUT], "2000000u");
    }
}
