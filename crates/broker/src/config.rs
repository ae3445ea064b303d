//! The broker's settings: command-line flags, then a YAML file (`--config`), then defaults,
//! in that order of precedence (as the gateway's configuration).
//!
//! Every setting has one flag and one YAML key: the flag's name with `_` for `-`
//! (`--max-in-flight` is `max_in_flight`). An unknown YAML key is an error naming it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use serde::Deserialize;

use crate::rate_limit::{RateKey, RateLimitSpec};

/// admitgate broker: a sidecar that gates A2A traffic in front of an agent.
///
/// HTTP/1.1 and cleartext HTTP/2 on one port. A2A requests that start or continue work
/// (JSON-RPC SendMessage / SendStreamingMessage / SubscribeToTask, REST message:send,
/// message:stream, tasks/{id}:subscribe, the gRPC A2A service's same methods) take a slot
/// until their response body ends or their client leaves; everything else (agent card, UIs,
/// custom routes, health checks, WebSocket upgrades) is proxied untouched.
#[derive(Parser, Debug, Default, Clone)]
#[command(name = "admitgate-broker", version, about, long_about = None, allow_negative_numbers = true)]
pub struct Flags {
    /// Address to accept clients on (HTTP/1.1 and h2c prior knowledge). Default 127.0.0.1:8080.
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<SocketAddr>,
    /// The agent's HTTP address (http://host:port). Required (flag or YAML).
    #[arg(long, value_name = "URL")]
    pub upstream: Option<String>,
    /// Where gRPC calls go (h2c). Default: --upstream, over h2c.
    #[arg(long, value_name = "URL")]
    pub grpc_upstream: Option<String>,
    /// How requests other than gRPC reach --upstream: `http1` (HTTP/1.1, for an agent that
    /// speaks only HTTP/1.1), `h2` (cleartext HTTP/2 with prior knowledge, for an agent that
    /// speaks h2c) or `auto` (as the client spoke: HTTP/2 clients over h2c, HTTP/1.1 clients
    /// over HTTP/1.1; the agent must speak both on one port). WebSocket upgrades always go
    /// over HTTP/1.1. Default http1.
    #[arg(long, value_name = "PROTOCOL")]
    pub upstream_protocol: Option<String>,
    /// The agent's in-flight cap for gated A2A requests, shared by every transport; 0: no cap.
    /// Default 0.
    #[arg(long, value_name = "N")]
    pub max_in_flight: Option<i64>,
    /// How many gated requests may wait for a slot before the overflow policy applies.
    /// Default 0 (no queue: refuse at the cap, as a mesh broker does).
    #[arg(long, value_name = "N")]
    pub queue_depth: Option<i64>,
    /// What a request meets when the queue is full: reject, queue (wait beyond the depth) or
    /// shed_oldest (evict the oldest waiter). Default reject.
    #[arg(long, value_name = "POLICY")]
    pub overflow_policy: Option<String>,
    /// Seconds a request may wait for its slot (and fleet lease) before it is refused with
    /// `timeout`. Default: no limit.
    #[arg(long, value_name = "SECONDS")]
    pub queue_timeout: Option<f64>,
    /// Per-tenant cap within --max-in-flight; 0: none. Needs --tenant-from. Default 0.
    #[arg(long, value_name = "N")]
    pub max_in_flight_per_tenant: Option<i64>,
    /// Where a request's tenant is read: `header:NAME` (an HTTP header or gRPC metadata key)
    /// or `path` (the tenant the A2A SDK's router takes from a REST path,
    /// /{tenant}/message:send; JSON-RPC and gRPC have none). Default: no tenant.
    #[arg(long, value_name = "SOURCE")]
    pub tenant_from: Option<String>,
    /// Budgets per identity: `requests=60/min,tokens=100000/min` (any number of `requests=`
    /// and `tokens=` rates, N/s, N/min, N/h or N/day; `cost=N` the tokens each gated request
    /// reserves, default 0), exact across the fleet with --fleet. A request over it is
    /// refused 429 `rate_limited` with Retry-After and the RateLimit fields. Default: none.
    #[arg(long, value_name = "LIMITS")]
    pub rate_limit: Option<String>,
    /// Whose budget a request spends: the first present of `header:NAME` (gRPC metadata
    /// too), `tenant` (--tenant-from), joined by `|`, e.g.
    /// `header:x-api-key|header:authorization|tenant`; a request with none spends the
    /// anonymous budget. Values are hashed, never logged. Default: one budget for all.
    #[arg(long, value_name = "SOURCES")]
    pub rate_key: Option<String>,
    /// Gate `work` (default: requests that start or continue agent work) or `all` A2A requests.
    #[arg(long, value_name = "WHICH")]
    pub gate_methods: Option<String>,
    /// Where the A2A routes live on the agent (the SDK's path_prefix). Default "".
    #[arg(long, value_name = "PATH")]
    pub path_prefix: Option<String>,
    /// The JSON-RPC endpoint below --path-prefix; `none` when the agent serves no JSON-RPC.
    /// Default "/".
    #[arg(long, value_name = "PATH")]
    pub jsonrpc_path: Option<String>,
    /// Bytes of a JSON-RPC body read before admission to learn its method and id. Default 65536.
    #[arg(long, value_name = "BYTES")]
    pub max_peek_bytes: Option<usize>,
    /// Fleet-wide limit: a Redis URL (redis:// or rediss://); every broker of the agent with the
    /// same --fleet-key shares one exact cap (--max-in-flight). Default: none.
    #[arg(long, value_name = "URL")]
    pub fleet: Option<String>,
    /// The fleet limit's name in Redis. Default agent:default.
    #[arg(long, value_name = "KEY")]
    pub fleet_key: Option<String>,
    /// While Redis is unreachable: `local` (admit against this broker's cap alone) or `reject`.
    /// Default local.
    #[arg(long, value_name = "MODE")]
    pub fleet_on_error: Option<String>,
    /// A PEM file of the CA that signed a rediss:// fleet server's certificate. Default: the
    /// system's roots.
    #[arg(long, value_name = "FILE")]
    pub fleet_tls_ca_file: Option<PathBuf>,
    /// A PEM client certificate for a fleet server that requires one (mutual TLS), with
    /// --fleet-tls-key-file. Default: none.
    #[arg(long, value_name = "FILE")]
    pub fleet_tls_cert_file: Option<PathBuf>,
    /// The private key of --fleet-tls-cert-file. Default: none.
    #[arg(long, value_name = "FILE")]
    pub fleet_tls_key_file: Option<PathBuf>,
    /// When a fleet lease counts: `primary` (once the primary holds it) or `replicated` (once
    /// `WAIT 1` confirms a replica holds it: exact through a failover, one more round trip).
    /// Default primary.
    #[arg(long, value_name = "MODE")]
    pub fleet_durability: Option<String>,
    /// Serve /metrics (Prometheus), /livez and /readyz on this address. Default: none.
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<SocketAddr>,
    /// Seconds running requests may take to finish after SIGTERM/SIGINT. Default 15.
    #[arg(long, value_name = "SECONDS")]
    pub drain_timeout: Option<f64>,
    /// Seconds a new connection may take to send its first bytes (an HTTP/2 preface or a
    /// request line) before it is closed. Default 10.
    #[arg(long, value_name = "SECONDS")]
    pub first_bytes_timeout: Option<f64>,
    /// Seconds an idle upstream connection is kept for reuse; keep it below the agent's own
    /// keep-alive timeout (uvicorn: 5 s) so no request goes out on a closing connection.
    /// Default 0.5.
    #[arg(long, value_name = "SECONDS")]
    pub upstream_idle_timeout: Option<f64>,
    /// How many idle upstream connections are kept for reuse (per upstream); more are closed
    /// once idle. Default 128.
    #[arg(long, value_name = "N")]
    pub upstream_max_idle: Option<usize>,
    /// Memory-aware admission: queue new work at this fraction of the agent container's
    /// memory.max (cgroup v2), 0 for none. Default 0.
    #[arg(long, value_name = "RATIO")]
    pub memory_soft_ratio: Option<f64>,
    /// Memory-aware admission: refuse new work (503 memory_pressure) at this fraction of the
    /// container's memory.max, 0 for none. Default 0.
    #[arg(long, value_name = "RATIO")]
    pub memory_hard_ratio: Option<f64>,
    /// The cgroup v2 directory whose memory.current / memory.max are read. Default
    /// /sys/fs/cgroup (the pod's when the broker shares the agent's cgroup).
    #[arg(long, value_name = "DIR")]
    pub memory_cgroup: Option<PathBuf>,
    /// Seconds a gated request's body may take to arrive: the part buffered before it takes
    /// a slot (up to --max-buffered-body) from its head, the rest from its admission. A
    /// body late past it is answered 408 before admission, or cut (the slot freed) after.
    /// Default 30.
    #[arg(long, value_name = "SECONDS")]
    pub request_body_timeout: Option<f64>,
    /// Bytes of a gated request's body read before it takes a slot (HAProxy's
    /// http-buffer-request): a client sending its body slowly holds no slot meanwhile, and a
    /// queued client that leaves is seen. Default 1048576.
    #[arg(long, value_name = "BYTES")]
    pub max_buffered_body: Option<usize>,
    /// Seconds a gated request keeps its slot after its client left while the agent still
    /// answers: its response is read and discarded until it ends, for at most this long,
    /// then the upstream exchange is cut. 0: the slot is freed when the client leaves.
    /// Default 60.
    #[arg(long, value_name = "SECONDS")]
    pub abandoned_response_timeout: Option<f64>,
    /// Seconds a client may accept none of the bytes the broker has for it (its response, on
    /// a socket whose buffers are full) before its connection is closed (nginx's
    /// send_timeout). Its request is then treated as one whose client left. Default 60.
    #[arg(long, value_name = "SECONDS")]
    pub send_timeout: Option<f64>,
    /// Threads serving clients. 1: one thread does everything (a current-thread runtime: no
    /// work stealing, no wake crossing threads; the cheapest per request, for a sidecar
    /// given one CPU or less). N > 1: a multi-thread runtime with N workers. Default: the CPUs
    /// this process may use (its CPU affinity and cgroup CPU quota, rounded down, at least 1),
    /// at most 4.
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
    /// The path the readiness probe asks the agent for (`GET`; any answer counts), only
    /// when /readyz is served (--metrics-listen). Default the A2A agent card,
    /// /.well-known/agent-card.json below --path-prefix.
    #[arg(long, value_name = "PATH")]
    pub readiness_path: Option<String>,
    /// Priority classes and where a request's class comes from (`crate::priority`).
    #[command(flatten)]
    pub priorities: crate::priority::PriorityFlags,
    /// A YAML file with any of these settings (keys as the flags, with `_`); flags win.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// How the caller named these settings, for the messages about them.
    #[arg(skip)]
    pub naming: Naming,
}

/// How a message names a setting: as the caller typed it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Naming {
    /// Command-line flags: `--max-in-flight`.
    #[default]
    Flags,
    /// Keyword arguments (`admitgate.broker.serve(max_in_flight=...)`): `max_in_flight`.
    Keywords,
}

/// The name of setting `field` in a message: the config file's key (and the file) when the
/// value came from the file, else the flag or keyword as `naming` spells it.
fn setting_name(field: &str, naming: Naming, from_file: Option<&std::path::Path>) -> String {
    match (from_file, naming) {
        (Some(path), _) => format!("{field} (in {})", path.display()),
        (None, Naming::Flags) => format!("--{}", field.replace('_', "-")),
        (None, Naming::Keywords) => field.to_owned(),
    }
}

/// The YAML file's shape: the same settings as the flags.
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct FileSettings {
    listen: Option<SocketAddr>,
    upstream: Option<String>,
    grpc_upstream: Option<String>,
    upstream_protocol: Option<String>,
    max_in_flight: Option<i64>,
    queue_depth: Option<i64>,
    overflow_policy: Option<String>,
    queue_timeout: Option<f64>,
    max_in_flight_per_tenant: Option<i64>,
    tenant_from: Option<String>,
    rate_limit: Option<String>,
    rate_key: Option<String>,
    gate_methods: Option<String>,
    path_prefix: Option<String>,
    jsonrpc_path: Option<String>,
    max_peek_bytes: Option<usize>,
    fleet: Option<String>,
    fleet_key: Option<String>,
    fleet_on_error: Option<String>,
    fleet_tls_ca_file: Option<PathBuf>,
    fleet_tls_cert_file: Option<PathBuf>,
    fleet_tls_key_file: Option<PathBuf>,
    fleet_durability: Option<String>,
    metrics_listen: Option<SocketAddr>,
    drain_timeout: Option<f64>,
    first_bytes_timeout: Option<f64>,
    upstream_idle_timeout: Option<f64>,
    upstream_max_idle: Option<usize>,
    memory_soft_ratio: Option<f64>,
    memory_hard_ratio: Option<f64>,
    memory_cgroup: Option<PathBuf>,
    request_body_timeout: Option<f64>,
    max_buffered_body: Option<usize>,
    abandoned_response_timeout: Option<f64>,
    send_timeout: Option<f64>,
    threads: Option<usize>,
    readiness_path: Option<String>,
    /// `--priority`, one entry per class (`crate::priority::FileClass`).
    priorities: Option<Vec<crate::priority::FileClass>>,
    default_priority: Option<String>,
    priority_from: Option<String>,
    fairness: Option<String>,
}

/// Where a request's tenant comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TenantFrom {
    /// No tenant: the global cap only.
    None,
    /// An HTTP header (or gRPC metadata key), lowercase.
    Header(http::HeaderName),
    /// The tenant the A2A SDK's router takes from a REST path (`admitgate_classify`).
    Path,
}

/// How non-gRPC requests reach the upstream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpstreamProtocol {
    /// HTTP/1.1 for every request.
    Http1,
    /// Cleartext HTTP/2 (prior knowledge) for every request.
    H2,
    /// As the client spoke.
    Auto,
}

/// An upstream address.
#[derive(Clone, Debug)]
pub struct Upstream {
    /// `http`.
    pub scheme: http::uri::Scheme,
    /// `host:port`.
    pub authority: http::uri::Authority,
}

/// The validated settings.
#[derive(Clone, Debug)]
pub struct Config {
    pub listen: SocketAddr,
    pub upstream: Upstream,
    pub grpc_upstream: Upstream,
    pub upstream_protocol: UpstreamProtocol,
    pub max_in_flight: i64,
    pub queue_depth: i64,
    pub overflow_policy: String,
    pub queue_timeout: Option<Duration>,
    pub max_in_flight_per_tenant: i64,
    pub tenant_from: TenantFrom,
    /// `--rate-limit`, if any.
    pub rate_limit: Option<RateLimitSpec>,
    /// `--rate-key` (none: one budget for every request).
    pub rate_key: RateKey,
    pub gate_all: bool,
    pub path_prefix: String,
    pub jsonrpc_path: Option<String>,
    pub max_peek_bytes: usize,
    pub fleet: Option<String>,
    pub fleet_key: String,
    pub fleet_on_error: String,
    pub fleet_tls_ca_file: Option<PathBuf>,
    pub fleet_tls_cert_file: Option<PathBuf>,
    pub fleet_tls_key_file: Option<PathBuf>,
    pub fleet_durability: String,
    pub metrics_listen: Option<SocketAddr>,
    pub drain_timeout: Duration,
    pub first_bytes_timeout: Duration,
    pub upstream_idle_timeout: Duration,
    pub upstream_max_idle: usize,
    pub memory_soft_ratio: f64,
    pub memory_hard_ratio: f64,
    pub memory_cgroup: PathBuf,
    pub request_body_timeout: Duration,
    pub max_buffered_body: usize,
    pub abandoned_response_timeout: Duration,
    pub send_timeout: Duration,
    pub threads: usize,
    pub readiness_path: String,
    /// Priority classes and where a request's class comes from.
    pub priority: crate::priority::PrioritySettings,
}

/// A setting that cannot be used, named with its bad value (never a password: URLs are shown
/// redacted).
#[derive(Debug)]
pub struct ConfigError(pub String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

fn err<T>(message: String) -> Result<T, ConfigError> {
    Err(ConfigError(message))
}

/// An unknown flag gets the closest real one as a tip (`--max-inflight`: `--max-in-flight`).
/// clap's own suggestions need a crate this build does without; this is the same rule on the
/// broker's few flags: the fewest single-character edits, at most a third of the name's length.
fn suggest_a_flag(mut error: clap::Error) -> clap::Error {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    use clap::CommandFactory;
    if error.kind() != ErrorKind::UnknownArgument {
        return error;
    }
    let Some(ContextValue::String(typed)) = error.get(ContextKind::InvalidArg) else {
        return error;
    };
    let Some(typed) = typed.split('=').next().and_then(|t| t.strip_prefix("--")) else {
        return error;
    };
    let command = Flags::command();
    let best = command
        .get_arguments()
        .filter_map(|arg| arg.get_long())
        .map(|long| (edit_distance(typed, long), long))
        .min();
    if let Some((distance, long)) = best {
        if distance.saturating_mul(3) <= long.len() {
            error.insert(
                ContextKind::SuggestedArg,
                ContextValue::String(format!("--{long}")),
            );
        }
    }
    error
}

/// The Levenshtein distance between two short strings.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut current = vec![i.saturating_add(1)];
        for (j, cb) in b.iter().enumerate() {
            let substitute = previous.get(j).copied().unwrap_or(usize::MAX);
            let substitute = substitute.saturating_add(usize::from(ca != *cb));
            let delete = previous
                .get(j.saturating_add(1))
                .copied()
                .unwrap_or(usize::MAX);
            let insert = current.last().copied().unwrap_or(usize::MAX);
            current.push(
                substitute
                    .min(delete.saturating_add(1))
                    .min(insert.saturating_add(1)),
            );
        }
        previous = current;
    }
    previous.last().copied().unwrap_or(0)
}

/// The most `--threads` takes.
pub const MAX_THREADS: usize = 1024;

fn seconds(name: &str, value: f64, allow_zero: bool) -> Result<Duration, ConfigError> {
    if !value.is_finite() || value < 0.0 || (!allow_zero && value == 0.0) || value > 86_400.0 {
        let range = if allow_zero { ">= 0" } else { "> 0" };
        return err(format!(
            "{name} must be a number of seconds {range} and at most 86400, got {value}"
        ));
    }
    Ok(Duration::from_secs_f64(value))
}

fn ratio(name: &str, value: f64) -> Result<f64, ConfigError> {
    if !value.is_finite() || !(0.0..=1.0).contains(&value) {
        return err(format!(
            "{name} must be a fraction between 0 and 1, got {value}"
        ));
    }
    Ok(value)
}

fn upstream(name: &str, value: &str) -> Result<Upstream, ConfigError> {
    let bad = |why: &str| {
        err(format!(
            "{name} must be an http://host:port URL ({why}), got {value:?}"
        ))
    };
    let Ok(uri) = value.parse::<http::Uri>() else {
        return bad("it does not parse");
    };
    let (Some(scheme), Some(authority)) = (uri.scheme().cloned(), uri.authority().cloned()) else {
        return bad("it needs a scheme and a host");
    };
    if scheme != http::uri::Scheme::HTTP {
        return bad("only cleartext http is proxied");
    }
    if authority.as_str().contains('@') {
        return bad("no user info");
    }
    if uri.path() != "/" && !uri.path().is_empty() {
        return bad("no path");
    }
    Ok(Upstream { scheme, authority })
}

fn tenant_from(name: &str, value: Option<&str>) -> Result<TenantFrom, ConfigError> {
    match value {
        None | Some("") => Ok(TenantFrom::None),
        Some("path") => Ok(TenantFrom::Path),
        Some(other) => match other.strip_prefix("header:") {
            Some(header) => match http::HeaderName::from_bytes(header.as_bytes()) {
                Ok(parsed) if !header.is_empty() => Ok(TenantFrom::Header(parsed)),
                _ => err(format!(
                    "{name} header:NAME must be an HTTP header name, got {header:?}"
                )),
            },
            None => err(format!("{name} must be header:NAME or path, got {other:?}")),
        },
    }
}

impl Config {
    /// Parses `args` (the program name first), reads `--config`, and validates.
    pub fn from_args<I, T>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let flags = Flags::try_parse_from(args).map_err(suggest_a_flag)?;
        Self::resolve(flags).map_err(|e| {
            clap::Error::raw(clap::error::ErrorKind::ValueValidation, format!("{e}\n"))
        })
    }

    /// Merges the flags with the YAML file they name, then the defaults.
    pub fn resolve(flags: Flags) -> Result<Self, ConfigError> {
        let file = match &flags.config {
            None => FileSettings::default(),
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| ConfigError(format!("config {}: {e}", path.display())))?;
                if text.trim().is_empty() {
                    FileSettings::default()
                } else {
                    serde_yaml::from_str(&text)
                        .map_err(|e| ConfigError(format!("config {}: {e}", path.display())))?
                }
            }
        };
        macro_rules! pick {
            ($field:ident) => {
                flags.$field.clone().or(file.$field.clone())
            };
        }
        // The setting as the user gave it: its flag (or keyword), or its key in the file.
        macro_rules! name {
            ($field:ident) => {
                setting_name(
                    stringify!($field),
                    flags.naming,
                    flags
                        .config
                        .as_deref()
                        .filter(|_| flags.$field.is_none() && file.$field.is_some()),
                )
            };
        }
        let upstream_text = pick!(upstream).ok_or_else(|| {
            ConfigError(format!(
                "{} is required (the agent's address, e.g. http://127.0.0.1:9000)",
                name!(upstream)
            ))
        })?;
        let main = upstream(&name!(upstream), &upstream_text)?;
        let grpc = match pick!(grpc_upstream) {
            Some(text) => upstream(&name!(grpc_upstream), &text)?,
            None => main.clone(),
        };
        let upstream_protocol = match pick!(upstream_protocol).as_deref() {
            None | Some("http1") => UpstreamProtocol::Http1,
            Some("h2") => UpstreamProtocol::H2,
            Some("auto") => UpstreamProtocol::Auto,
            Some(other) => {
                return err(format!(
                    "{} must be http1, h2 or auto, got {other:?}",
                    name!(upstream_protocol)
                ))
            }
        };
        let max_in_flight = pick!(max_in_flight).unwrap_or(0);
        let queue_depth = pick!(queue_depth).unwrap_or(0);
        let overflow_policy = pick!(overflow_policy).unwrap_or_else(|| "reject".into());
        let per_tenant = pick!(max_in_flight_per_tenant).unwrap_or(0);
        // The core validates the numbers and the policy name, with its own messages.
        if let Err(e) = admitgate_passage::core_api::ConcurrencyLimit::new(
            max_in_flight,
            queue_depth,
            &overflow_policy,
            per_tenant,
        ) {
            let setting = match e.arg() {
                "max_concurrent_runs" => name!(max_in_flight),
                "max_concurrent_runs_per_scope" => name!(max_in_flight_per_tenant),
                "queue_depth" => name!(queue_depth),
                "overflow_policy" => name!(overflow_policy),
                other => other.to_owned(),
            };
            return err(e.to_string().replacen(e.arg(), &setting, 1));
        }
        let tenant = tenant_from(&name!(tenant_from), pick!(tenant_from).as_deref())?;
        if per_tenant > 0 && tenant == TenantFrom::None {
            return err(format!(
                "{} needs {} (header:NAME or path)",
                name!(max_in_flight_per_tenant),
                name!(tenant_from)
            ));
        }
        let (rate_limit, rate_key) = rate_settings(
            &name!(rate_limit),
            pick!(rate_limit).as_deref(),
            &name!(rate_key),
            pick!(rate_key).as_deref(),
            (tenant != TenantFrom::None, &name!(tenant_from)),
        )?;
        let gate_all = match pick!(gate_methods).as_deref() {
            None | Some("work") => false,
            Some("all") => true,
            Some(other) => {
                return err(format!(
                    "{} must be work or all, got {other:?}",
                    name!(gate_methods)
                ))
            }
        };
        let path_prefix = pick!(path_prefix).unwrap_or_default();
        if !path_prefix.is_empty() && !path_prefix.starts_with('/') {
            return err(format!(
                "{} must be \"\" or start with /, got {path_prefix:?}",
                name!(path_prefix)
            ));
        }
        let jsonrpc_path = match pick!(jsonrpc_path) {
            None => Some("/".to_owned()),
            Some(none) if none == "none" => None,
            Some(path) if path.starts_with('/') => Some(path),
            Some(path) => {
                return err(format!(
                    "{} must start with / (or be none), got {path:?}",
                    name!(jsonrpc_path)
                ))
            }
        };
        let max_peek_bytes = pick!(max_peek_bytes).unwrap_or(65536);
        if !(1..=(1 << 31)).contains(&max_peek_bytes) {
            return err(format!(
                "{} must be in 1..2147483648, got {max_peek_bytes}",
                name!(max_peek_bytes)
            ));
        }
        let fleet_on_error = pick!(fleet_on_error).unwrap_or_else(|| "local".into());
        if fleet_on_error != "local" && fleet_on_error != "reject" {
            return err(format!(
                "{} must be local or reject, got {fleet_on_error:?}",
                name!(fleet_on_error)
            ));
        }
        let fleet_durability = pick!(fleet_durability).unwrap_or_else(|| "primary".into());
        if fleet_durability != "primary" && fleet_durability != "replicated" {
            return err(format!(
                "fleet_durability must be primary or replicated, got {fleet_durability:?}"
            ));
        }
        let queue_timeout = match pick!(queue_timeout) {
            Some(v) => Some(seconds(&name!(queue_timeout), v, false)?),
            None => None,
        };
        let soft = ratio(
            &name!(memory_soft_ratio),
            pick!(memory_soft_ratio).unwrap_or(0.0),
        )?;
        let hard = ratio(
            &name!(memory_hard_ratio),
            pick!(memory_hard_ratio).unwrap_or(0.0),
        )?;
        if soft > 0.0 && hard > 0.0 && soft > hard {
            return err(format!(
                "{} ({soft}) must not exceed {} ({hard})",
                name!(memory_soft_ratio),
                name!(memory_hard_ratio)
            ));
        }
        let max_buffered_body = pick!(max_buffered_body).unwrap_or(1 << 20);
        if !(1..=(1 << 30)).contains(&max_buffered_body) {
            return err(format!(
                "{} must be in 1..1073741824, got {max_buffered_body}",
                name!(max_buffered_body)
            ));
        }
        let threads = match pick!(threads) {
            // std reads the affinity mask and the cgroup's cpu.max quota.
            None => std::thread::available_parallelism().map_or(1, |n| n.get().clamp(1, 4)),
            Some(n) if (1..=MAX_THREADS).contains(&n) => n,
            Some(n) => {
                return err(format!(
                    "{} must be between 1 and {MAX_THREADS}, got {n}",
                    name!(threads)
                ))
            }
        };
        let readiness_path = match pick!(readiness_path) {
            None => format!(
                "{}/.well-known/agent-card.json",
                path_prefix.trim_end_matches('/')
            ),
            Some(path) if path.starts_with('/') && path.parse::<http::Uri>().is_ok() => path,
            Some(path) => {
                return err(format!(
                    "{} must be a request path starting with /, got {path:?}",
                    name!(readiness_path)
                ))
            }
        };
        let priority = crate::priority::resolve(
            &flags.priorities,
            crate::priority::FileSettings {
                priorities: file.priorities.clone(),
                default_priority: file.default_priority.clone(),
                priority_from: file.priority_from.clone(),
                fairness: file.fairness.clone(),
            },
            |field, from_file| {
                setting_name(
                    field,
                    flags.naming,
                    flags.config.as_deref().filter(|_| from_file),
                )
            },
            tenant != TenantFrom::None,
        )
        .map_err(ConfigError)?;
        Ok(Config {
            priority,
            listen: pick!(listen).unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 8080))),
            upstream: main,
            grpc_upstream: grpc,
            upstream_protocol,
            max_in_flight,
            queue_depth,
            overflow_policy,
            queue_timeout,
            max_in_flight_per_tenant: per_tenant,
            tenant_from: tenant,
            rate_limit,
            rate_key,
            gate_all,
            path_prefix,
            jsonrpc_path,
            max_peek_bytes,
            fleet: pick!(fleet),
            fleet_key: pick!(fleet_key).unwrap_or_else(|| "agent:default".into()),
            fleet_on_error,
            fleet_tls_ca_file: pick!(fleet_tls_ca_file),
            fleet_tls_cert_file: pick!(fleet_tls_cert_file),
            fleet_tls_key_file: pick!(fleet_tls_key_file),
            fleet_durability,
            metrics_listen: pick!(metrics_listen),
            drain_timeout: seconds(
                &name!(drain_timeout),
                pick!(drain_timeout).unwrap_or(15.0),
                true,
            )?,
            first_bytes_timeout: seconds(
                &name!(first_bytes_timeout),
                pick!(first_bytes_timeout).unwrap_or(10.0),
                false,
            )?,
            upstream_idle_timeout: seconds(
                &name!(upstream_idle_timeout),
                pick!(upstream_idle_timeout).unwrap_or(0.5),
                true,
            )?,
            upstream_max_idle: pick!(upstream_max_idle).unwrap_or(128),
            memory_soft_ratio: soft,
            memory_hard_ratio: hard,
            memory_cgroup: pick!(memory_cgroup).unwrap_or_else(|| PathBuf::from("/sys/fs/cgroup")),
            request_body_timeout: seconds(
                &name!(request_body_timeout),
                pick!(request_body_timeout).unwrap_or(30.0),
                false,
            )?,
            max_buffered_body,
            abandoned_response_timeout: seconds(
                &name!(abandoned_response_timeout),
                pick!(abandoned_response_timeout).unwrap_or(60.0),
                true,
            )?,
            send_timeout: seconds(
                &name!(send_timeout),
                pick!(send_timeout).unwrap_or(60.0),
                false,
            )?,
            threads,
            readiness_path,
        })
    }
}

/// `--rate-limit` and `--rate-key`, checked together: a key needs a limit, and a key read
/// from the tenant needs `--tenant-from` (`has_tenant`, named `tenant_name`).
fn rate_settings(
    limit_name: &str,
    limit: Option<&str>,
    key_name: &str,
    key_text: Option<&str>,
    (has_tenant, tenant_name): (bool, &str),
) -> Result<(Option<RateLimitSpec>, RateKey), ConfigError> {
    let spec = match limit {
        Some(text) => Some(RateLimitSpec::parse(limit_name, text).map_err(ConfigError)?),
        None => None,
    };
    let key = match key_text {
        Some(text) => RateKey::parse(key_name, text).map_err(ConfigError)?,
        None => RateKey::default(),
    };
    if spec.is_none() && key != RateKey::default() {
        return err(format!(
            "{key_name} needs {limit_name} (the budget it keys)"
        ));
    }
    if key.uses_tenant() && !has_tenant {
        return err(format!(
            "{key_name} {:?} reads the tenant: it needs {tenant_name} (header:NAME or path)",
            key_text.unwrap_or_default()
        ));
    }
    Ok((spec, key))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_then_yaml_then_defaults() {
        let dir =
            std::env::temp_dir().join(format!("admitgate-broker-{}.yaml", std::process::id()));
        std::fs::write(
            &dir,
            "upstream: http://127.0.0.1:9\nmax_in_flight: 7\nqueue_depth: 3\n",
        )
        .unwrap();
        let path = dir.to_str().unwrap();
        let c = Config::from_args(["b", "--config", path, "--max-in-flight", "4"]).unwrap();
        assert_eq!((c.max_in_flight, c.queue_depth), (4, 3));
        assert_eq!(c.drain_timeout, Duration::from_secs(15));
        std::fs::write(&dir, "upstream: http://127.0.0.1:9\nmax_inflight: 7\n").unwrap();
        let e = Config::from_args(["b", "--config", path])
            .unwrap_err()
            .to_string();
        assert!(e.contains("max_inflight"), "{e}");
        std::fs::remove_file(&dir).unwrap();
    }

    #[test]
    fn threads_default_to_the_usable_cpus_and_bad_counts_are_named() {
        let c = Config::from_args(["b", "--upstream", "http://x:1"]).unwrap();
        let usable = std::thread::available_parallelism().unwrap().get();
        assert_eq!(c.threads, usable.clamp(1, 4));
        let c = Config::from_args(["b", "--upstream", "http://x:1", "--threads", "3"]).unwrap();
        assert_eq!(c.threads, 3);
        for bad in ["0", "1025"] {
            let e = Config::from_args(["b", "--upstream", "http://x:1", "--threads", bad])
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("--threads must be between 1 and 1024, got {bad}")),
                "{e}"
            );
        }
        let e = Config::from_args(["b", "--upstream", "http://x:1", "--threads", "-1"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--threads"), "{e}");
    }

    #[test]
    fn bad_values_are_named() {
        let e = Config::from_args(["b", "--upstream", "https://x:1"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--upstream") && e.contains("https://x:1"), "{e}");
        let e = Config::from_args(["b", "--upstream", "http://x:1", "--overflow-policy", "drop"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--overflow-policy must") && e.contains("drop"),
            "{e}"
        );
        let e = Config::from_args(["b", "--upstream", "http://x:1", "--upstream-protocol", "h3"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--upstream-protocol must") && e.contains("h3"),
            "{e}"
        );
        let e = Config::from_args([
            "b",
            "--upstream",
            "http://x:1",
            "--max-in-flight-per-tenant",
            "2",
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("--tenant-from"), "{e}");
    }

    /// Issue 27: messages named settings in snake_case (`max_in_flight must be >= 0`), not
    /// as the user gave them, and `--max-inflight` got no suggestion.
    #[test]
    fn settings_are_named_as_given_flag_key_or_keyword() {
        let e = Config::from_args(["b", "--upstream", "http://x:1", "--max-in-flight", "-1"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--max-in-flight must be >= 0, got -1"), "{e}");
        let path =
            std::env::temp_dir().join(format!("admitgate-names-{}.yaml", std::process::id()));
        std::fs::write(&path, "upstream: http://127.0.0.1:9\nqueue_depth: -2\n").unwrap();
        let e = Config::from_args(["b", "--config", path.to_str().unwrap()])
            .unwrap_err()
            .to_string();
        let expected = format!("queue_depth (in {}) must be >= 0, got -2", path.display());
        assert!(e.contains(&expected), "{e}");
        std::fs::remove_file(&path).unwrap();
        let keywords = Flags {
            upstream: Some("http://x:1".into()),
            max_in_flight: Some(-1),
            naming: Naming::Keywords,
            ..Flags::default()
        };
        let e = Config::resolve(keywords).unwrap_err().to_string();
        assert!(e.starts_with("max_in_flight must be >= 0"), "{e}");
        let e = Config::from_args(["b", "--max-inflight", "3"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tip: a similar argument exists: '--max-in-flight'"),
            "{e}"
        );
        let e = Config::from_args(["b", "--frobnicate", "3"])
            .unwrap_err()
            .to_string();
        assert!(!e.contains("tip:"), "{e}");
        assert_eq!(edit_distance("max-inflight", "max-in-flight"), 1);
    }

    #[test]
    fn the_body_response_and_readiness_settings_have_defaults_and_name_bad_values() {
        let c =
            Config::from_args(["b", "--upstream", "http://x:1", "--path-prefix", "/a2a"]).unwrap();
        assert_eq!(c.request_body_timeout, Duration::from_secs(30));
        assert_eq!(c.max_buffered_body, 1 << 20);
        assert_eq!(c.abandoned_response_timeout, Duration::from_secs(60));
        assert_eq!(c.send_timeout, Duration::from_secs(60));
        assert_eq!(c.readiness_path, "/a2a/.well-known/agent-card.json");
        let c = Config::from_args([
            "b",
            "--upstream",
            "http://x:1",
            "--abandoned-response-timeout",
            "0",
            "--readiness-path",
            "/healthz",
        ])
        .unwrap();
        assert_eq!(c.abandoned_response_timeout, Duration::ZERO);
        assert_eq!(c.readiness_path, "/healthz");
        // Each bad value is named by the flag as typed (not the setting's snake_case name).
        for (flag, value) in [
            ("--request-body-timeout", "0"),
            ("--request-body-timeout", "NaN"),
            ("--abandoned-response-timeout", "-1"),
            ("--max-buffered-body", "0"),
            ("--send-timeout", "0"),
            ("--readiness-path", "healthz"),
        ] {
            let e = Config::from_args(["b", "--upstream", "http://x:1", flag, value])
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(flag) && e.contains(value) && !e.contains('_'),
                "{flag} {value}: {e}"
            );
        }
    }

    #[test]
    fn rate_limit_and_rate_key_are_checked_and_named() {
        let c = Config::from_args([
            "b",
            "--upstream",
            "http://x:1",
            "--rate-limit",
            "requests=60/min,tokens=100000/min",
            "--tenant-from",
            "header:x-tenant",
            "--rate-key",
            "header:x-api-key|tenant",
        ])
        .unwrap();
        assert_eq!(c.rate_limit.unwrap().limits.len(), 2);
        assert!(c.rate_key.uses_tenant());
        for (args, expected) in [
            (
                vec!["--rate-limit", "requests=60/fortnight"],
                "--rate-limit \"requests=60/fortnight\": ",
            ),
            (
                vec!["--rate-limit", "requests=1/s", "--rate-key", "cookie:x"],
                "--rate-key \"cookie:x\": ",
            ),
            (
                vec!["--rate-key", "header:x-api-key"],
                "--rate-key needs --rate-limit",
            ),
            (
                vec!["--rate-limit", "requests=1/s", "--rate-key", "tenant"],
                "--rate-key \"tenant\" reads the tenant: it needs --tenant-from",
            ),
        ] {
            let mut argv = vec!["b", "--upstream", "http://x:1"];
            argv.extend(args);
            let e = Config::from_args(argv).unwrap_err().to_string();
            assert!(e.contains(expected), "{e}");
            assert_eq!(e.trim_end().lines().count(), 1, "{e}");
        }
        let keywords = Flags {
            upstream: Some("http://x:1".into()),
            rate_limit: Some("tokens=5/s,cost=6".into()),
            naming: Naming::Keywords,
            ..Flags::default()
        };
        let e = Config::resolve(keywords).unwrap_err().to_string();
        assert!(e.starts_with("rate_limit \"tokens=5/s,cost=6\": "), "{e}");
        // And from the config file, named as its key there.
        let path = std::env::temp_dir().join(format!("admitgate-rate-{}.yaml", std::process::id()));
        std::fs::write(
            &path,
            "upstream: http://127.0.0.1:9\nrate_limit: requests=5/s,cost=1\nrate_key: header:x-k\n",
        )
        .unwrap();
        let e = Config::from_args(["b", "--config", path.to_str().unwrap()])
            .unwrap_err()
            .to_string();
        let expected = format!(
            "rate_limit (in {}) \"requests=5/s,cost=1\": cost= needs a tokens= rate",
            path.display()
        );
        assert!(e.contains(&expected), "{e}");
        std::fs::write(
            &path,
            "upstream: http://127.0.0.1:9\nrate_limit: requests=5/s\nrate_key: header:x-k\n",
        )
        .unwrap();
        let c = Config::from_args(["b", "--config", path.to_str().unwrap()]).unwrap();
        assert_eq!(c.rate_limit.unwrap().policies, ["requests-per-s"]);
        std::fs::remove_file(&path).unwrap();
    }
}
