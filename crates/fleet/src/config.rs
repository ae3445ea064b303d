//! What a fleet limit is configured with, validated before anything touches the network.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

/// The largest cap accepted, the same bound the local gate uses for its counts.
const MAX_COUNT: u32 = i32::MAX.unsigned_abs();

/// What a replica does with an admission while Redis cannot be reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OnBackendError {
    /// Admit against the replica's local ceiling alone (availability over the exact quota): while
    /// Redis is down, N replicas may admit up to N times their local ceilings. Leases taken this
    /// way are registered in Redis when it returns (or counted lost when there is no room).
    Local,
    /// Refuse the admission with [`FleetError::Unavailable`](crate::FleetError::Unavailable)
    /// (reason `fleet_unavailable`): the fleet cap is never exceeded, at the price of refusing
    /// work during an outage.
    Reject,
}

impl OnBackendError {
    /// The name used in configuration files and by the Python binding.
    pub fn as_str(self) -> &'static str {
        match self {
            OnBackendError::Local => "local",
            OnBackendError::Reject => "reject",
        }
    }
}

impl fmt::Display for OnBackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for OnBackendError {
    type Err = ConfigError;

    fn from_str(value: &str) -> Result<Self, ConfigError> {
        match value {
            "local" => Ok(OnBackendError::Local),
            "reject" => Ok(OnBackendError::Reject),
            _ => Err(ConfigError::new(
                "on_backend_error",
                format!("{value:?}"),
                "must be \"local\" or \"reject\"",
            )),
        }
    }
}

/// A setting that was refused, naming the field and the value (a URL's password redacted).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// The field, as named in [`FleetConfig`] (and by the Python binding).
    pub field: &'static str,
    /// The refused value, printed; a URL appears with its password redacted.
    pub value: String,
    /// What the value must be.
    pub reason: String,
}

impl ConfigError {
    pub(crate) fn new(field: &'static str, value: String, reason: impl Into<String>) -> Self {
        ConfigError {
            field,
            value,
            reason: reason.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}: {}", self.field, self.value, self.reason)
    }
}

impl std::error::Error for ConfigError {}

/// The settings of one fleet-wide limit. Build with [`FleetConfig::new`], adjust the public
/// fields, and hand it to [`FleetLimit::new`](crate::FleetLimit::new), which validates it.
///
/// `Debug` and `Display` never show the URL's password.
#[derive(Clone, PartialEq, Eq)]
pub struct FleetConfig {
    /// `redis://[user:password@]host[:port][/db]` or `rediss://…` (TLS: rustls, `ring` provider).
    pub url: String,
    /// Names the limit: every replica with the same `key` (on the same Redis) shares one cap. All
    /// of its Redis keys carry the hash tag `{key}`, so braces are refused.
    pub key: String,
    /// The cap for the whole fleet. Each replica enforces the value it was configured with; see
    /// the crate docs on rolling deploys.
    pub max_in_flight: u32,
    /// A tenant's (scope's) slice of the fleet cap; 0 turns per-scope slices off.
    pub max_in_flight_per_scope: u32,
    /// How long a lease outlives its last renewal: a replica that dies (or pauses) loses its
    /// leases this long after its last heartbeat.
    pub lease_ttl: Duration,
    /// Bound on establishing a connection (TCP, TLS, AUTH).
    pub connect_timeout: Duration,
    /// How long one command's reply is awaited (with `connect_timeout`) before a PING asks
    /// whether Redis is alive (a slow reply is not an outage); also the claim window of a grant
    /// to this replica's tickets. At most half of `lease_ttl`.
    pub command_timeout: Duration,
    /// What admissions do while Redis cannot be reached.
    pub on_backend_error: OnBackendError,
    /// Names this replica in lease ids (visible in Redis, e.g. `ZRANGE {key}:holders 0 -1`):
    /// letters, digits and `._:@/-`, at most 100 characters. Defaults to `<hostname>-<pid>`.
    pub replica_id: String,
    /// How often this replica renews its leases and tickets; `None`: a third of `lease_ttl`.
    pub heartbeat_interval: Option<Duration>,
    /// While this replica has turns waiting, how often it re-checks even without a pushed
    /// notification (a pub/sub message can be lost); also bounds how soon the lease of a dead
    /// holder goes to a waiter after it expires.
    pub recheck_interval: Duration,
    /// While Redis is down, how often a probe checks whether it is back.
    pub probe_interval: Duration,
    /// A PEM file of the CA that signed the server's certificate, for `rediss://` servers with a
    /// private CA; `None` trusts the system's roots.
    pub tls_ca_file: Option<PathBuf>,
}

impl FleetConfig {
    /// Settings with the defaults: no per-scope slice, 10 s lease TTL, 2 s connect and 1 s
    /// command timeouts, `on_backend_error = local`, heartbeat every TTL/3, re-check every 1 s,
    /// probe every 1 s, replica id `<hostname>-<pid>`.
    pub fn new(url: impl Into<String>, key: impl Into<String>, max_in_flight: u32) -> Self {
        FleetConfig {
            url: url.into(),
            key: key.into(),
            max_in_flight,
            max_in_flight_per_scope: 0,
            lease_ttl: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(2),
            command_timeout: Duration::from_secs(1),
            on_backend_error: OnBackendError::Local,
            replica_id: default_replica_id(),
            heartbeat_interval: None,
            recheck_interval: Duration::from_secs(1),
            probe_interval: Duration::from_secs(1),
            tls_ca_file: None,
        }
    }

    /// The URL with its password (or a lone user-info token) replaced by `***`.
    pub fn redacted_url(&self) -> String {
        redact_url(&self.url)
    }

    /// The heartbeat period in force: the configured one, else a third of `lease_ttl`.
    pub fn effective_heartbeat_interval(&self) -> Duration {
        self.heartbeat_interval
            .unwrap_or_else(|| fraction(self.lease_ttl, 3))
    }

    /// Checks every field; the error names the first bad one and its value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        validate_url(&self.url)?;
        validate_key(&self.key)?;
        if self.max_in_flight == 0 || self.max_in_flight > MAX_COUNT {
            return Err(ConfigError::new(
                "max_in_flight",
                self.max_in_flight.to_string(),
                format!("must be between 1 and {MAX_COUNT}"),
            ));
        }
        if self.max_in_flight_per_scope > self.max_in_flight {
            return Err(ConfigError::new(
                "max_in_flight_per_scope",
                self.max_in_flight_per_scope.to_string(),
                format!(
                    "must be between 0 (off) and max_in_flight ({})",
                    self.max_in_flight
                ),
            ));
        }
        check_duration(
            "lease_ttl",
            self.lease_ttl,
            Duration::from_millis(100),
            Duration::from_secs(3600),
        )?;
        check_duration(
            "connect_timeout",
            self.connect_timeout,
            Duration::from_millis(10),
            Duration::from_secs(60),
        )?;
        check_duration(
            "command_timeout",
            self.command_timeout,
            Duration::from_millis(10),
            fraction(self.lease_ttl, 2),
        )
        .map_err(|mut e| {
            e.reason
                .push_str(" (at most half of lease_ttl, so a renewal lands in time)");
            e
        })?;
        if let Some(every) = self.heartbeat_interval {
            // A renewal sent at the end of the interval must still land before the TTL runs out.
            check_duration(
                "heartbeat_interval",
                every,
                Duration::from_millis(10),
                self.lease_ttl.saturating_sub(self.command_timeout),
            )
            .map_err(|mut e| {
                e.reason.push_str(
                    " (at most lease_ttl - command_timeout, so leases are renewed in time)",
                );
                e
            })?;
        }
        check_duration(
            "recheck_interval",
            self.recheck_interval,
            Duration::from_millis(10),
            Duration::from_secs(60),
        )?;
        check_duration(
            "probe_interval",
            self.probe_interval,
            Duration::from_millis(10),
            Duration::from_secs(60),
        )?;
        validate_replica_id(&self.replica_id)?;
        if self.tls_ca_file.is_some() && !self.url.starts_with("rediss://") {
            return Err(ConfigError::new(
                "tls_ca_file",
                format!(
                    "{:?}",
                    self.tls_ca_file.as_ref().map(|p| p.display().to_string())
                ),
                "needs a rediss:// url",
            ));
        }
        Ok(())
    }
}

impl fmt::Debug for FleetConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Destructured so that a new field cannot be forgotten here (or print a secret).
        let FleetConfig {
            url: _,
            key,
            max_in_flight,
            max_in_flight_per_scope,
            lease_ttl,
            connect_timeout,
            command_timeout,
            on_backend_error,
            replica_id,
            heartbeat_interval,
            recheck_interval,
            probe_interval,
            tls_ca_file,
        } = self;
        f.debug_struct("FleetConfig")
            .field("url", &self.redacted_url())
            .field("key", key)
            .field("max_in_flight", max_in_flight)
            .field("max_in_flight_per_scope", max_in_flight_per_scope)
            .field("lease_ttl", lease_ttl)
            .field("connect_timeout", connect_timeout)
            .field("command_timeout", command_timeout)
            .field("on_backend_error", on_backend_error)
            .field("replica_id", replica_id)
            .field("heartbeat_interval", heartbeat_interval)
            .field("recheck_interval", recheck_interval)
            .field("probe_interval", probe_interval)
            .field("tls_ca_file", tls_ca_file)
            .finish()
    }
}

impl fmt::Display for FleetConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "fleet limit {:?} on {} (max_in_flight={}, max_in_flight_per_scope={}, lease_ttl={:?}, \
             on_backend_error={}, replica {})",
            self.key,
            self.redacted_url(),
            self.max_in_flight,
            self.max_in_flight_per_scope,
            self.lease_ttl,
            self.on_backend_error,
            self.replica_id
        )
    }
}

/// `duration / parts`, for a constant `parts` above zero: `checked_div` fails only for zero, so
/// its fallback (zero) is never taken.
fn fraction(duration: Duration, parts: u32) -> Duration {
    debug_assert!(parts > 0, "a duration divided into no parts");
    duration.checked_div(parts).unwrap_or(Duration::ZERO)
}

fn check_duration(
    field: &'static str,
    value: Duration,
    min: Duration,
    max: Duration,
) -> Result<(), ConfigError> {
    if value < min || value > max {
        return Err(ConfigError::new(
            field,
            format!("{value:?}"),
            format!("must be between {min:?} and {max:?}"),
        ));
    }
    Ok(())
}

/// A URL split around its user-info (the text between `://` and the last `@` of the authority):
/// `(scheme, user-info, the rest from that `@` on)`, or `None` when it has none. Slices, not
/// offsets, so that putting the URL back together cannot cut a character in two.
fn split_userinfo(url: &str) -> Option<(&str, &str, &str)> {
    let (scheme, rest) = url.split_once("://")?;
    let (authority, _) = rest.split_once(['/', '?', '#']).unwrap_or((rest, ""));
    let (userinfo, _) = authority.rsplit_once('@')?;
    // `userinfo` is a prefix of `rest`, so this is the `@` and what follows it.
    let after = rest.get(userinfo.len()..)?;
    Some((scheme, userinfo, after))
}

/// The URL with its password replaced by `***`; a user-info without a colon (which some clients
/// read as a password) is replaced whole.
pub(crate) fn redact_url(url: &str) -> String {
    let Some((scheme, userinfo, after)) = split_userinfo(url) else {
        return url.to_owned();
    };
    let shown = match userinfo.split_once(':') {
        Some((user, _)) => format!("{user}:***"),
        None => "***".to_owned(),
    };
    format!("{scheme}://{shown}{after}")
}

/// The secrets a URL carries (the password as written and percent-decoded), so messages from the
/// driver can be scrubbed of them.
pub(crate) fn url_secrets(url: &str) -> Vec<String> {
    let Some((_, userinfo, _)) = split_userinfo(url) else {
        return Vec::new();
    };
    let raw = match userinfo.split_once(':') {
        Some((_, password)) => password,
        None => userinfo,
    };
    let mut secrets = Vec::new();
    if !raw.is_empty() {
        secrets.push(raw.to_owned());
        let decoded = percent_decode(raw);
        if decoded != raw && !decoded.is_empty() {
            secrets.push(decoded);
        }
    }
    secrets
}

/// `%XX` escapes decoded (a `%` not followed by two hex digits is kept as it is); invalid UTF-8
/// in the result is replaced.
fn percent_decode(text: &str) -> String {
    let hex = |b: u8| char::from(b).to_digit(16);
    // Two hex digits make a byte: at most 15 * 16 + 15.
    let byte = |hi: u8, lo: u8| {
        let value = hex(hi)?.checked_mul(16)?.checked_add(hex(lo)?)?;
        u8::try_from(value).ok()
    };
    let mut out = Vec::with_capacity(text.len());
    let mut rest = text.as_bytes();
    while let Some((&first, tail)) = rest.split_first() {
        if let [b'%', hi, lo, after @ ..] = rest {
            if let Some(decoded) = byte(*hi, *lo) {
                out.push(decoded);
                rest = after;
                continue;
            }
        }
        out.push(first);
        rest = tail;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn validate_url(url: &str) -> Result<(), ConfigError> {
    let shown = || format!("{:?}", redact_url(url));
    if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
        return Err(ConfigError::new(
            "url",
            shown(),
            "must start with redis:// or rediss://",
        ));
    }
    if url.contains("#insecure") {
        return Err(ConfigError::new(
            "url",
            shown(),
            "#insecure (no certificate check) is not supported; pass tls_ca_file for a private CA",
        ));
    }
    let info = redis::IntoConnectionInfo::into_connection_info(url).map_err(|_| {
        ConfigError::new(
            "url",
            shown(),
            "is not a valid Redis URL (redis[s]://[user:password@]host[:port][/db])",
        )
    })?;
    match info.addr() {
        redis::ConnectionAddr::Tcp(host, _) | redis::ConnectionAddr::TcpTls { host, .. }
            if !host.is_empty() =>
        {
            Ok(())
        }
        _ => Err(ConfigError::new("url", shown(), "needs a host")),
    }
}

fn validate_key(key: &str) -> Result<(), ConfigError> {
    let bad = |reason: &str| Err(ConfigError::new("key", format!("{key:?}"), reason));
    if key.is_empty() || key.trim().is_empty() {
        return bad("must not be empty");
    }
    if key.len() > 200 {
        return bad("must be at most 200 bytes");
    }
    if key.contains(['{', '}']) {
        return bad("must not contain braces: the limit's keys use {key} as their hash tag");
    }
    if key.chars().any(char::is_control) {
        return bad("must not contain control characters");
    }
    Ok(())
}

fn validate_replica_id(id: &str) -> Result<(), ConfigError> {
    let ok = !id.is_empty()
        && id.len() <= 100
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._:@/-".contains(c));
    if ok {
        Ok(())
    } else {
        Err(ConfigError::new(
            "replica_id",
            format!("{id:?}"),
            "must be 1 to 100 characters among letters, digits and ._:@/-",
        ))
    }
}

/// `<hostname>-<pid>`, reduced to the characters a replica id allows.
fn default_replica_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_default();
    let host: String = host
        .trim()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || "._-".contains(*c))
        .take(80)
        .collect();
    let host = if host.is_empty() {
        "replica".to_owned()
    } else {
        host
    };
    format!("{host}-{}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(url: &str) -> FleetConfig {
        FleetConfig::new(url, "agent:coordinator", 20)
    }

    #[test]
    fn defaults_validate() {
        let c = config("redis://127.0.0.1:6379/0");
        c.validate().unwrap();
        assert_eq!(
            c.effective_heartbeat_interval(),
            Duration::from_secs(10) / 3
        );
        validate_replica_id(&c.replica_id).unwrap();
    }

    #[test]
    fn redaction_hides_the_password_everywhere() {
        let c = config("rediss://admin:s3cr%40t-pw@redis.internal:6380/2");
        assert_eq!(c.redacted_url(), "rediss://admin:***@redis.internal:6380/2");
        for shown in [format!("{c:?}"), format!("{c}"), c.redacted_url()] {
            assert!(!shown.contains("s3cr"), "{shown}");
            assert!(shown.contains("redis.internal"), "{shown}");
        }
        assert_eq!(
            url_secrets(&c.url),
            vec!["s3cr%40t-pw".to_owned(), "s3cr@t-pw".to_owned()]
        );
        // A lone token is treated as a secret; no user-info leaves the URL alone.
        assert_eq!(redact_url("redis://tok3n@h:1"), "redis://***@h:1");
        assert_eq!(redact_url("redis://:pw@h"), "redis://:***@h");
        assert_eq!(redact_url("redis://h:1/0"), "redis://h:1/0");
        // An @ in the path or query is not user-info.
        assert_eq!(redact_url("redis://h:1/0?x=a@b"), "redis://h:1/0?x=a@b");
    }

    #[test]
    fn odd_user_info_is_redacted_without_panicking() {
        // Multi-byte characters around every separator, and truncated escapes.
        assert_eq!(
            redact_url("redis://é:ü€@hôst:1/ö"),
            "redis://é:***@hôst:1/ö"
        );
        assert_eq!(redact_url("redis://€@h"), "redis://***@h");
        assert_eq!(redact_url("redis://@h"), "redis://***@h");
        assert_eq!(redact_url("redis://a:b@"), "redis://a:***@");
        assert_eq!(redact_url("redis://a:b@c@h/x@y"), "redis://a:***@h/x@y");
        assert_eq!(redact_url("redis:/a:b@h"), "redis:/a:b@h");
        assert_eq!(url_secrets("redis://u:%@h"), vec!["%".to_owned()]);
        assert_eq!(url_secrets("redis://u:%4@h"), vec!["%4".to_owned()]);
        assert_eq!(
            url_secrets("redis://u:%zz%41%@h"),
            vec!["%zz%41%".to_owned(), "%zzA%".to_owned()]
        );
        assert_eq!(
            url_secrets("redis://u:%C3%A9%FF@h"),
            vec!["%C3%A9%FF".to_owned(), "é\u{FFFD}".to_owned()]
        );
        assert!(url_secrets("redis://u:@h").is_empty());
        assert_eq!(percent_decode("%%41%4"), "%A%4");
    }

    #[test]
    fn a_bad_url_is_refused_without_its_password() {
        for url in [
            "http://user:hunter22@h:1",
            "redis://user:hunter22@:notaport",
            "rediss://user:hunter22@h:1/#insecure",
        ] {
            let err = config(url).validate().unwrap_err();
            assert_eq!(err.field, "url");
            let text = err.to_string();
            assert!(!text.contains("hunter22"), "{text}");
            assert!(text.contains("***"), "{text}");
        }
    }

    #[test]
    fn every_field_is_checked_and_named() {
        let base = config("redis://h");
        let cases: Vec<(FleetConfig, &str, &str)> = vec![
            (
                FleetConfig {
                    max_in_flight: 0,
                    ..base.clone()
                },
                "max_in_flight",
                "0",
            ),
            (
                FleetConfig {
                    max_in_flight: u32::MAX,
                    ..base.clone()
                },
                "max_in_flight",
                "4294967295",
            ),
            (
                FleetConfig {
                    max_in_flight_per_scope: 21,
                    ..base.clone()
                },
                "max_in_flight_per_scope",
                "21",
            ),
            (
                FleetConfig {
                    key: String::new(),
                    ..base.clone()
                },
                "key",
                "\"\"",
            ),
            (
                FleetConfig {
                    key: "a{b}".into(),
                    ..base.clone()
                },
                "key",
                "a{b}",
            ),
            (
                FleetConfig {
                    lease_ttl: Duration::from_millis(5),
                    ..base.clone()
                },
                "lease_ttl",
                "5ms",
            ),
            (
                FleetConfig {
                    connect_timeout: Duration::ZERO,
                    ..base.clone()
                },
                "connect_timeout",
                "0ns",
            ),
            (
                FleetConfig {
                    command_timeout: Duration::from_secs(6),
                    ..base.clone()
                },
                "command_timeout",
                "6s",
            ),
            (
                FleetConfig {
                    heartbeat_interval: Some(Duration::from_millis(9500)),
                    ..base.clone()
                },
                "heartbeat_interval",
                "9.5s",
            ),
            (
                FleetConfig {
                    recheck_interval: Duration::ZERO,
                    ..base.clone()
                },
                "recheck_interval",
                "0ns",
            ),
            (
                FleetConfig {
                    probe_interval: Duration::from_secs(61),
                    ..base.clone()
                },
                "probe_interval",
                "61s",
            ),
            (
                FleetConfig {
                    replica_id: "pod 1".into(),
                    ..base.clone()
                },
                "replica_id",
                "pod 1",
            ),
            (
                FleetConfig {
                    tls_ca_file: Some("/tmp/ca.pem".into()),
                    ..base.clone()
                },
                "tls_ca_file",
                "/tmp/ca.pem",
            ),
        ];
        for (cfg, field, value) in cases {
            let err = cfg.validate().expect_err(field);
            assert_eq!(err.field, field, "{err}");
            let text = err.to_string();
            assert!(text.starts_with(field) && text.contains(value), "{text}");
        }
    }

    #[test]
    fn on_backend_error_parses_its_names() {
        assert_eq!(
            "local".parse::<OnBackendError>().unwrap(),
            OnBackendError::Local
        );
        assert_eq!(
            "reject".parse::<OnBackendError>().unwrap(),
            OnBackendError::Reject
        );
        let err = "Local".parse::<OnBackendError>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "on_backend_error \"Local\": must be \"local\" or \"reject\""
        );
    }
}
