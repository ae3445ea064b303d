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

/// When a grant counts: once the primary holds it, or once a replica confirms it too.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Durability {
    /// A grant counts once the primary ran its script (one round trip). Replication is
    /// asynchronous: a failover can lose the leases granted within the replication lag before
    /// the primary died, and the new primary may grant that room again (see the crate docs).
    #[default]
    Primary,
    /// A grant counts only once `WAIT 1 <command_timeout>` confirms a replica holds it (one
    /// more round trip per call). A call no replica confirms in time is a failure of the
    /// backend: its grant is undone (the release is owed and sent before Redis is said to be up
    /// again) and the turn is decided by `on_backend_error`. Keeps the cap exact through a
    /// failover to the confirming replica.
    Replicated,
}

impl Durability {
    /// The name used in configuration files and by the Python binding.
    pub fn as_str(self) -> &'static str {
        match self {
            Durability::Primary => "primary",
            Durability::Replicated => "replicated",
        }
    }
}

impl fmt::Display for Durability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Durability {
    type Err = ConfigError;

    fn from_str(value: &str) -> Result<Self, ConfigError> {
        match value {
            "primary" => Ok(Durability::Primary),
            "replicated" => Ok(Durability::Replicated),
            _ => Err(ConfigError::new(
                "durability",
                format!("{value:?}"),
                "must be \"primary\" or \"replicated\"",
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
    /// `redis://[user:password@]host[:port][/db]` or `rediss://…` (TLS: rustls, `ring` provider)
    /// for one server; `redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]`
    /// for the primary a set of sentinels names; `redis+cluster://[user:password@]host:port[,...]`
    /// for a Redis Cluster's seed nodes (both also as `rediss+…` with TLS).
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
    /// When a grant counts: on the primary alone (the default) or once a replica confirms it.
    pub durability: Durability,
    /// A PEM client certificate for servers that require one (`tls-auth-clients yes`, managed
    /// services with mutual TLS), with `tls_key_file`; `rediss` URLs only.
    pub tls_cert_file: Option<PathBuf>,
    /// The PEM private key of `tls_cert_file`.
    pub tls_key_file: Option<PathBuf>,
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
            durability: Durability::Primary,
            tls_cert_file: None,
            tls_key_file: None,
        }
    }

    /// The URL with its password (or a lone user-info token) replaced by `***`: everything
    /// between `://` and the last `@` but the user name. A URL that does not parse as a Redis
    /// URL is not shown at all (a placeholder with its scheme and length), as its password
    /// cannot be told apart from the rest.
    pub fn redacted_url(&self) -> String {
        shown_url(&self.url)
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
        let shown_path = |path: &Option<PathBuf>| {
            format!("{:?}", path.as_ref().map(|p| p.display().to_string()))
        };
        for (field, path) in [
            ("tls_cert_file", &self.tls_cert_file),
            ("tls_key_file", &self.tls_key_file),
        ] {
            if path.is_some() && !self.url.starts_with("rediss") {
                return Err(ConfigError::new(
                    field,
                    shown_path(path),
                    "needs a rediss:// url (or rediss+sentinel://, rediss+cluster://)",
                ));
            }
        }
        match (&self.tls_cert_file, &self.tls_key_file) {
            (Some(_), None) => {
                return Err(ConfigError::new(
                    "tls_cert_file",
                    shown_path(&self.tls_cert_file),
                    "needs tls_key_file (its private key) too",
                ))
            }
            (None, Some(_)) => {
                return Err(ConfigError::new(
                    "tls_key_file",
                    shown_path(&self.tls_key_file),
                    "needs tls_cert_file (the client certificate) too",
                ))
            }
            _ => {}
        }
        if self.tls_ca_file.is_some() && !self.url.starts_with("rediss") {
            return Err(ConfigError::new(
                "tls_ca_file",
                format!(
                    "{:?}",
                    self.tls_ca_file.as_ref().map(|p| p.display().to_string())
                ),
                "needs a rediss:// url (or rediss+sentinel://, rediss+cluster://)",
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
            durability,
            tls_cert_file,
            tls_key_file,
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
            .field("durability", durability)
            .field("tls_cert_file", tls_cert_file)
            .field("tls_key_file", tls_key_file)
            .finish()
    }
}

impl fmt::Display for FleetConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "fleet limit {:?} on {} (max_in_flight={}, max_in_flight_per_scope={}, lease_ttl={:?}, \
             on_backend_error={}, durability={}, replica {})",
            self.key,
            self.redacted_url(),
            self.max_in_flight,
            self.max_in_flight_per_scope,
            self.lease_ttl,
            self.on_backend_error,
            self.durability,
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

/// A URL split around its user-info: `(scheme and "://", user-info, the rest from its `@` on)`,
/// or `None` when it has no `@`. The user-info runs to the LAST `@` of the URL, not to the
/// first `/`, `?` or `#`: a password holding one of those (as base64 secrets do) ends a
/// parser's authority early, and a split at that point would print the rest of it. An `@` in
/// a query is taken for user-info too (hiding the host then: too much hidden beats a leak).
/// Without `://` the scheme part is empty and everything before the last `@` is user-info.
/// Slices, not offsets, so that putting the URL back together cannot cut a character in two.
fn split_userinfo(url: &str) -> Option<(&str, &str, &str)> {
    let (userinfo_and_rest, after) = match url.rsplit_once('@') {
        Some((before, _)) => (before, url.get(before.len()..)?),
        None => return None,
    };
    match userinfo_and_rest.split_once("://") {
        // A `://` after something that is not a scheme is part of the password.
        Some((scheme, userinfo)) if is_scheme(scheme) => {
            // `scheme` and `://` are a prefix of `url`.
            let scheme = url.get(..scheme.len().checked_add(3)?)?;
            Some((scheme, userinfo, after))
        }
        _ => Some(("", userinfo_and_rest, after)),
    }
}

/// Whether `text` is a URL scheme (RFC 3986: a letter, then letters, digits, `+`, `-`, `.`),
/// and short enough to be one worth printing.
fn is_scheme(text: &str) -> bool {
    text.len() <= 16
        && text.starts_with(|c: char| c.is_ascii_alphabetic())
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
}

/// The user-info's password: after its first `:`, or the whole user-info when it has no colon
/// (some clients read a lone token as a password). `None` when the user name shown would not
/// be the user name alone: a user-info spanning an `@` (a lone token, then an `@` in the
/// password or the query) is hidden whole.
fn split_password(userinfo: &str) -> (Option<&str>, &str) {
    match userinfo.split_once(':') {
        Some((user, password)) if !user.contains('@') => (Some(user), password),
        _ => (None, userinfo),
    }
}

/// The URL with its user-info's password replaced by `***` (see [`split_userinfo`] for where
/// the user-info ends); a user-info without a colon, or whose user part holds an `@`, is
/// replaced whole. Textual: it never parses, so it cannot fail; [`shown_url`] is what
/// messages print.
pub(crate) fn redact_url(url: &str) -> String {
    let Some((scheme, userinfo, after)) = split_userinfo(url) else {
        return url.to_owned();
    };
    match split_password(userinfo) {
        (Some(user), _) => format!("{scheme}{user}:***{after}"),
        (None, _) => format!("{scheme}***{after}"),
    }
}

/// The URL as messages, `Debug`, `Display` and stats print it: [`redact_url`] of a URL that
/// parses as a Redis URL; for one that does not, a placeholder that shows none of it (a URL
/// that does not parse may hold its password anywhere: after a typo'd `@`, or with none), only
/// its scheme when that is a plain word, and its length.
pub(crate) fn shown_url(url: &str) -> String {
    let parses = match crate::topology::scheme(url) {
        Some((crate::topology::Kind::Single, _)) | None => {
            redis::IntoConnectionInfo::into_connection_info(url).is_ok()
        }
        Some(_) => crate::topology::parse_nodes(url).is_ok(),
    };
    if parses {
        return redact_url(url);
    }
    let scheme = url
        .split_once("://")
        .map(|(scheme, _)| scheme)
        .filter(|s| is_scheme(s));
    let length = url.chars().count();
    match scheme {
        Some(scheme) => format!(
            "<a {scheme}:// URL of {length} characters, not shown: it does not parse, so a \
             password in it could be anywhere>"
        ),
        None => format!(
            "<a value of {length} characters, not shown: it does not parse as a URL, so a \
             password in it could be anywhere>"
        ),
    }
}

/// The secrets a URL carries, so messages from the driver can be scrubbed of them: the
/// password (or lone token) as [`split_userinfo`] reads it and as a URL parser reads it (the
/// user-info ending at the first `/`, `?` or `#`), each as written and percent-decoded.
pub(crate) fn url_secrets(url: &str) -> Vec<String> {
    let mut raws = Vec::new();
    if let Some((_, userinfo, _)) = split_userinfo(url) {
        raws.push(split_password(userinfo).1);
    }
    // How the driver's parser reads it: the authority ends at the first `/`, `?` or `#`.
    if let Some((_, rest)) = url.split_once("://") {
        let (authority, _) = rest.split_once(['/', '?', '#']).unwrap_or((rest, ""));
        if let Some((userinfo, _)) = authority.rsplit_once('@') {
            raws.push(match userinfo.split_once(':') {
                Some((_, password)) => password,
                None => userinfo,
            });
        }
    }
    let mut secrets: Vec<String> = Vec::new();
    for raw in raws {
        for secret in [raw.to_owned(), percent_decode(raw)] {
            if !secret.is_empty() && !secrets.contains(&secret) {
                secrets.push(secret);
            }
        }
    }
    // Longest first, so that scrubbing one cannot leave a piece of a longer one.
    secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
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
    let shown = || format!("{:?}", shown_url(url));
    let Some((kind, _)) = crate::topology::scheme(url) else {
        return Err(ConfigError::new(
            "url",
            shown(),
            "must start with redis://, rediss://, redis+sentinel://, rediss+sentinel://, \
             redis+cluster:// or rediss+cluster://",
        ));
    };
    if url.contains("#insecure") {
        return Err(ConfigError::new(
            "url",
            shown(),
            "#insecure (no certificate check) is not supported; pass tls_ca_file for a private CA",
        ));
    }
    // An `@` after the first `/`, `?` or `#` of the authority: a password holding one of those
    // unescaped (the driver would read the text before it as the host, and no password, or
    // only its start), or an `@` in the path, query or fragment. Either way the driver and the
    // redaction (which hides up to the last `@`) would disagree about where the password is.
    let after_authority = url
        .split_once("://")
        .and_then(|(_, rest)| rest.split_once(['/', '?', '#']))
        .map(|(_, after)| after);
    if after_authority.is_some_and(|after| after.contains('@')) {
        return Err(ConfigError::new(
            "url",
            shown(),
            "has an @ after a /, ? or #: percent-encode any / ? # @ or % in the password \
             (e.g. / as %2F)",
        ));
    }
    if kind != crate::topology::Kind::Single {
        return crate::topology::parse_nodes(url)
            .map(|_| ())
            .map_err(|reason| ConfigError::new("url", shown(), reason));
    }
    let info = redis::IntoConnectionInfo::into_connection_info(url).map_err(|_| {
        ConfigError::new(
            "url",
            shown(),
            "is not a valid Redis URL (redis[s]://[user:password@]host[:port][/db]; \
             percent-encode any / ? # @ or % in the password, e.g. / as %2F)",
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

/// A budget's or limiter's `name` (`FleetBudget`, `FleetWindowLockout`): it namespaces their
/// Redis keys, inside a hash tag, so no braces; and it appears in logs and metrics labels.
pub(crate) fn validate_name(name: &str) -> Result<(), ConfigError> {
    let bad = |why: &str| ConfigError::new("name", format!("{name:?}"), why.to_owned());
    if name.is_empty() || name.len() > 100 {
        return Err(bad("must be 1 to 100 characters"));
    }
    if name
        .chars()
        .any(|c| c == '{' || c == '}' || c.is_whitespace() || c.is_control())
    {
        return Err(bad("must not contain braces, spaces or control characters"));
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
        // The user-info runs to the last @, even one in the query (too much hidden beats a
        // leak: `redis://tok?en@h` parses with host `tok`, so only the last @ is safe).
        assert_eq!(redact_url("redis://h:1/0?x=a@b"), "redis://h:***@b");
        assert_eq!(redact_url("redis://tok?en@h"), "redis://***@h");
        assert_eq!(redact_url("redis://u:p@h/0?x=a@b"), "redis://u:***@b");
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
        assert_eq!(redact_url("redis://a:b@c@h/x@y"), "redis://a:***@y");
        // A lone token followed by an @ and a colon: the "user" would be the token.
        assert_eq!(redact_url("redis://tok@h:1/0?a=b@c"), "redis://***@c");
        // No `://`: everything before the last @ but a plain user name is hidden.
        assert_eq!(redact_url("redis:/a:b@h"), "redis:***@h");
        assert_eq!(redact_url("redis//a:b@h"), "redis//a:***@h");
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
            assert!(text.contains("***") || text.contains("not shown"), "{text}");
        }
    }

    /// The report of issue 15: a base64 password's `/` ended the authority, and the URL that
    /// failed to parse was echoed whole.
    #[test]
    fn a_password_holding_a_slash_is_not_echoed() {
        let url = "redis://:Zm9v/YmFy+cXV4@127.0.0.1:6379/0";
        let err = config(url).validate().unwrap_err();
        let text = err.to_string();
        assert_eq!(err.field, "url", "{text}");
        for piece in ["Zm9v", "YmFy", "cXV4"] {
            assert!(!text.contains(piece), "{text}");
            assert!(!redact_url(url).contains(piece));
            assert!(!config(url).redacted_url().contains(piece));
        }
        assert!(text.contains("percent-encode"), "{text}");
        // Percent-encoded, it is valid and shown redacted.
        let encoded = config("redis://:Zm9v%2FYmFy%2BcXV4@127.0.0.1:6379/0");
        encoded.validate().unwrap();
        assert_eq!(encoded.redacted_url(), "redis://:***@127.0.0.1:6379/0");
        assert!(url_secrets(&encoded.url).contains(&"Zm9v/YmFy+cXV4".to_owned()));
    }

    /// `redis://tok?en@h` parses (host `tok`, no password): the driver would dial `tok` and
    /// print it, a piece of the token. An @ after a / ? or # is refused, so every accepted URL
    /// has the password where both the driver and the redaction see it.
    #[test]
    fn an_at_after_the_authority_is_refused() {
        for url in [
            "redis://tok?en@127.0.0.1",
            "redis://tok#en@127.0.0.1",
            "redis://admin:pa/ss@127.0.0.1:6379/0",
            "redis://127.0.0.1:6379/0?x=a@b",
        ] {
            let err = config(url).validate().unwrap_err();
            let text = err.to_string();
            assert_eq!(err.field, "url", "{text}");
            assert!(text.contains("percent-encode"), "{text}");
            for piece in ["tok", "en@", "pa/ss", "ss@"] {
                assert!(!text.contains(piece), "{text}");
            }
        }
        config("redis://admin:pa%2Fss@127.0.0.1:6379/0?protocol=resp3")
            .validate()
            .unwrap();
    }

    /// A URL that does not parse is never echoed, even redacted: with no `@` (or a typo'd
    /// one) its password cannot be told apart from the rest.
    #[test]
    fn a_url_that_does_not_parse_is_not_shown() {
        for url in [
            "redis://admin:hunter22",
            "redis:/admin:hunter22@h",
            "http://admin:hunter22@h:1",
            "redis://admin:hunter22@",
            "hunter22",
        ] {
            let shown = config(url).redacted_url();
            assert!(!shown.contains("hunter22"), "{shown}");
            assert!(shown.contains("not shown"), "{shown}");
            let text = config(url).validate().unwrap_err().to_string();
            assert!(!text.contains("hunter22"), "{text}");
        }
        assert!(config("http://a:b@h").redacted_url().contains("http://"));
        // Not a plain word: the scheme is not shown either.
        assert!(!config("hun ter22://x").redacted_url().contains("ter22"));
    }

    /// A tiny deterministic generator (xorshift64*): the crate has no proptest.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// Percent-encodes every byte but unreserved ones, as a careful user writes a password.
    fn percent_encode(text: &str) -> String {
        text.bytes()
            .map(|b| {
                if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                    char::from(b).to_string()
                } else {
                    format!("%{b:02X}")
                }
            })
            .collect()
    }

    /// Passwords of the URL alphabet (every delimiter, escapes, a few non-ASCII characters),
    /// with a `Q` (absent from everything else a message holds) at least every four
    /// characters: a message without a `Q` shows no four characters of the password.
    #[test]
    fn no_password_is_ever_shown_whatever_it_holds() {
        const ALPHABET: &[&str] = &[
            "/", "?", "#", "@", ":", "%", "%2F", "%40", "%3", "%%", "+", "=", "a", "b", "z", "0",
            "9", ".", "-", "_", "~", "!", "$", "&", "'", "(", ")", "*", ",", ";", "[", "]", " ",
            "é", "€", "//", "://", "@@", "\\",
        ];
        let shapes: &[fn(&str) -> String] = &[
            |pw| format!("redis://admin:{pw}@127.0.0.1:6379/0"),
            |pw| format!("rediss://admin:{pw}@127.0.0.1:6380"),
            |pw| format!("redis://:{pw}@127.0.0.1"),
            |pw| format!("redis://admin:{pw}@127.0.0.1:6379/0?protocol=resp3"),
            |pw| format!("redis://admin:{pw}@127.0.0.1:6379/0#insecure"),
            // No host: with an @ in the password, what follows it would be the host.
            |pw| format!("redis://admin:{}", pw.replace('@', "")),
            |pw| format!("redis:/admin:{pw}@127.0.0.1"),
            |pw| format!("http://admin:{pw}@127.0.0.1"),
            |pw| format!("redis://admin:{pw}@"),
            |pw| format!("redis://admin:{pw}@127.0.0.1@other"),
        ];
        let mut rng = Rng(0x5EED_0F15_5EC2_E750);
        for round in 0..1000 {
            let mut password = String::from("Q");
            for _ in 0..rng.below(12) {
                for _ in 0..rng.below(4) {
                    password.push_str(ALPHABET[rng.below(ALPHABET.len())]);
                }
                password.push('Q');
            }
            let lone_token = password.replace(':', "");
            let mut urls: Vec<String> = shapes.iter().map(|shape| shape(&password)).collect();
            urls.push(format!("redis://{lone_token}@127.0.0.1:6379"));
            urls.push(format!(
                "redis://admin:{}@127.0.0.1/1",
                percent_encode(&password)
            ));
            urls.push(format!(
                "redis://{}@127.0.0.1/1",
                percent_encode(&lone_token)
            ));
            for url in urls {
                let c = config(&url);
                let mut shown = vec![c.redacted_url(), format!("{c:?}"), format!("{c}")];
                // Textual redaction alone hides what precedes an @ (with none, only the
                // parse check in `redacted_url` keeps the password out).
                if url.rfind('@') > url.rfind('Q') {
                    shown.push(redact_url(&url));
                }
                if let Err(err) = c.validate() {
                    shown.push(err.to_string());
                    shown.push(err.value);
                }
                for text in shown {
                    assert!(
                        !text.contains('Q'),
                        "round {round}: {url:?} shown as {text:?}"
                    );
                }
                // What the driver takes for the password is among the secrets scrubbed from
                // its messages.
                if let Ok(info) = redis::IntoConnectionInfo::into_connection_info(url.as_str()) {
                    let settings = info.redis_settings();
                    let secrets = url_secrets(&url);
                    for known in [settings.password(), settings.username()]
                        .into_iter()
                        .flatten()
                    {
                        if known.contains('Q') {
                            assert!(
                                secrets.iter().any(|s| s == known),
                                "round {round}: {url:?}: {known:?} not in {secrets:?}"
                            );
                        }
                    }
                }
            }
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
