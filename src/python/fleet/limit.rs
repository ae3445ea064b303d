//! `admitgate.FleetLimit`: the Python face of a fleet-wide limit ([`admitgate_fleet::FleetLimit`]).
//!
//! Arguments are converted and validated here, with messages in the binding's style (the
//! argument, what it must be, the value given; a URL always with its password redacted). The
//! protocol object is built on admitgate's runtime ([`super::runtime`]) in the constructor,
//! which starts no thread, and rebuilt from the same settings in a forked child.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use admitgate_fleet::{
    ConfigError, Durability, FleetConfig, FleetLimit, FleetStats, OnBackendError,
};
use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

use super::events::EventSink;
use super::lease::{Outcome, PyFleetLease};
use super::runtime;
use crate::python::args;
use crate::python::errors::guard;

/// The protocol object of the current runtime epoch.
struct Built {
    limit: FleetLimit,
    epoch: u64,
}

/// A fleet-wide in-flight cap shared by every replica configured with the same `key` on the
/// same Redis. Thread-safe; the awaitables may be awaited on any event loop.
#[pyclass(frozen, weakref, module = "admitgate", name = "FleetLimit")]
pub struct PyFleetLimit {
    /// The validated settings (`replica_id` as given, or the building process's default).
    config: FleetConfig,
    /// `replica_id` was given; otherwise a forked child takes its own default (its pid).
    replica_id_given: bool,
    built: Mutex<Built>,
}

fn repr(value: &Bound<'_, PyAny>) -> String {
    value
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "<unrepresentable>".to_owned())
}

/// `repr(text)` as Python writes it.
fn py_repr(py: Python<'_>, text: &str) -> String {
    repr(PyString::new(py, text).as_any())
}

fn bad(arg: &str, what: &str, shown: &str) -> PyErr {
    PyValueError::new_err(format!("{arg} {what}, got {shown}"))
}

/// A text argument; `None` when `optional` and not given.
fn text(arg: &'static str, value: &Bound<'_, PyAny>) -> PyResult<String> {
    match value.cast::<PyString>() {
        Ok(s) => Ok(s.to_str()?.to_owned()),
        Err(_) => Err(bad(arg, "must be a str", &repr(value))),
    }
}

/// A duration in seconds: a finite number > 0 (the protocol checks the range).
fn seconds(
    arg: &'static str,
    value: Option<&Bound<'_, PyAny>>,
    default: f64,
) -> PyResult<Duration> {
    let Some(value) = value.filter(|v| !v.is_none()) else {
        // The defaults are constants, or half a TTL that passed this very check.
        return Duration::try_from_secs_f64(default).map_err(|_| {
            bad(
                arg,
                "must be a finite number of seconds > 0",
                &format!("a default of {default}"),
            )
        });
    };
    let secs = args::number(arg, value)?;
    if !secs.is_finite() || secs <= 0.0 {
        return Err(bad(
            arg,
            "must be a finite number of seconds > 0",
            &repr(value),
        ));
    }
    Duration::try_from_secs_f64(secs)
        .map_err(|_| bad(arg, "must be a finite number of seconds > 0", &repr(value)))
}

/// A scope argument as the gate keys a `session_id`: `None` is `""`, a str as is (a lone
/// surrogate escaped), anything else by its `str()`.
/// The seven fleet keys a gate's `stats()` adds (and `FleetLimit.stats()` starts with).
pub fn set_gate_fleet_keys(d: &Bound<'_, PyDict>, s: &FleetStats) -> PyResult<()> {
    d.set_item("fleet_in_flight", s.fleet_in_flight)?;
    d.set_item("fleet_max_in_flight", s.max_in_flight)?;
    d.set_item("fleet_backend_up", u8::from(s.backend_up))?;
    d.set_item("fleet_lease_lost", s.lease_lost)?;
    d.set_item("fleet_borrowed", s.borrowed)?;
    d.set_item("fleet_outages", s.outages)?;
    d.set_item("fleet_failovers", s.failovers)
}

pub fn scope_arg(scope: Option<&Bound<'_, PyAny>>) -> PyResult<Arc<str>> {
    let Some(scope) = scope.filter(|s| !s.is_none()) else {
        return Ok(Arc::from(""));
    };
    let text = match scope.cast::<PyString>() {
        Ok(s) => s.clone(),
        Err(_) => scope.str()?,
    };
    Ok(Arc::from(&*args::scope_key(&text)?))
}

/// The protocol's refusal of a setting, in the binding's words: the Python argument, the
/// reason, and the value as the caller gave it (`shown`).
fn config_error(err: ConfigError, shown: impl Fn(&str) -> String) -> PyErr {
    let arg = match err.field {
        "lease_ttl" => "lease_ttl_s",
        "connect_timeout" => "connect_timeout_s",
        "command_timeout" => "command_timeout_s",
        other => other,
    };
    let reason = err
        .reason
        .replace("lease_ttl", "lease_ttl_s")
        .replace("command_timeout", "command_timeout_s");
    bad(arg, &reason, &shown(arg))
}

/// `replica_id` for this process when none was given: `<hostname>-<pid>`.
fn default_replica_id() -> String {
    FleetConfig::new("", "", 0).replica_id
}

impl PyFleetLimit {
    /// A protocol object for `config` on the current runtime, its events routed to the
    /// `admitgate` logger.
    fn build(config: FleetConfig, refused: impl Fn(ConfigError) -> PyErr) -> PyResult<FleetLimit> {
        let limit = FleetLimit::new(config, runtime::handle()?).map_err(refused)?;
        limit.set_event_handler(Arc::new(EventSink::default()).handler());
        Ok(limit)
    }

    /// The protocol object of this process (rebuilt after a fork; the parent's is forgotten).
    pub fn limit(&self) -> PyResult<FleetLimit> {
        let epoch = runtime::epoch();
        let mut built = self.built.lock();
        if built.epoch != epoch {
            let mut config = self.config.clone();
            if !self.replica_id_given {
                config.replica_id = default_replica_id();
            }
            // Validated once already: only the CA file can have changed since.
            let fresh = Self::build(config, |err| config_error(err, |_| "the same".to_owned()))?;
            // The gate's classes, set on the parent's protocol object, hold for this one too.
            let _ = fresh.set_classes((*built.limit.classes()).clone());
            let inherited = std::mem::replace(
                &mut *built,
                Built {
                    limit: fresh,
                    epoch,
                },
            );
            // Never dropped: it belongs to the parent's runtime (see `runtime`).
            std::mem::forget(inherited);
        }
        Ok(built.limit.clone())
    }

    /// The protocol object of this process if it was built already, without building one: what
    /// the fleet's learned limit ([`admitgate_fleet::FleetLearner`]) sends its proposals on. A
    /// forked child gets `None` until its first fleet call rebuilt it, so it never sends on the
    /// parent's runtime; called under the gate's lock, so it must not build anything.
    pub fn current_limit(&self) -> Option<FleetLimit> {
        let built = self.built.lock();
        (built.epoch == runtime::epoch()).then(|| built.limit.clone())
    }

    /// The hint given with a `fleet_unavailable` refusal: when the recovery probe looks next.
    fn retry_after(&self) -> Duration {
        self.config.probe_interval
    }

    /// The validated settings.
    pub fn config(&self) -> &FleetConfig {
        &self.config
    }

    /// The protocol's counters (the protocol's lock is waited for detached).
    pub fn fleet_stats(&self, py: Python<'_>) -> PyResult<FleetStats> {
        let limit = self.limit()?;
        Ok(py.detach(|| limit.stats()))
    }
}

#[pymethods]
impl PyFleetLimit {
    #[new]
    #[pyo3(
        signature = (
            url, key, max_in_flight, *, max_in_flight_per_scope=None, lease_ttl_s=None,
            on_backend_error=None, connect_timeout_s=None, command_timeout_s=None,
            replica_id=None, tls_ca_file=None, durability=None, tls_cert_file=None,
            tls_key_file=None
        ),
        text_signature = "(url, key, max_in_flight, *, max_in_flight_per_scope=0, \
                          lease_ttl_s=10.0, on_backend_error='local', connect_timeout_s=2.0, \
                          command_timeout_s=1.0, replica_id=None, tls_ca_file=None, \
                          durability='primary', tls_cert_file=None, tls_key_file=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        url: &Bound<'_, PyAny>,
        key: &Bound<'_, PyAny>,
        max_in_flight: &Bound<'_, PyAny>,
        max_in_flight_per_scope: Option<&Bound<'_, PyAny>>,
        lease_ttl_s: Option<&Bound<'_, PyAny>>,
        on_backend_error: Option<&Bound<'_, PyAny>>,
        connect_timeout_s: Option<&Bound<'_, PyAny>>,
        command_timeout_s: Option<&Bound<'_, PyAny>>,
        replica_id: Option<&Bound<'_, PyAny>>,
        tls_ca_file: Option<&Bound<'_, PyAny>>,
        durability: Option<&Bound<'_, PyAny>>,
        tls_cert_file: Option<&Bound<'_, PyAny>>,
        tls_key_file: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        guard(|| {
            // Never the repr of a URL that is not a str: it may carry the password.
            let url = match url.cast::<PyString>() {
                Ok(s) => s.to_str()?.to_owned(),
                Err(_) => {
                    let kind = url.get_type().name()?;
                    return Err(bad("url", "must be a str", &format!("a {kind}")));
                }
            };
            let key_text = text("key", key)?;
            let cap = args::count("max_in_flight", max_in_flight)?;
            let slice = match max_in_flight_per_scope.filter(|v| !v.is_none()) {
                None => 0,
                Some(v) => args::count("max_in_flight_per_scope", v)?,
            };
            let mut config = FleetConfig::new(url, key_text, cap);
            config.max_in_flight_per_scope = slice;
            config.lease_ttl = seconds("lease_ttl_s", lease_ttl_s, 10.0)?;
            config.connect_timeout = seconds("connect_timeout_s", connect_timeout_s, 2.0)?;
            // The default fits any TTL: 1 s, or half the TTL when that is shorter.
            let default_command = (config.lease_ttl.as_secs_f64() / 2.0).min(1.0);
            config.command_timeout =
                seconds("command_timeout_s", command_timeout_s, default_command)?;
            if let Some(mode) = on_backend_error.filter(|v| !v.is_none()) {
                let name = text("on_backend_error", mode)?;
                config.on_backend_error = name.parse::<OnBackendError>().map_err(|_| {
                    bad(
                        "on_backend_error",
                        "must be 'local' or 'reject'",
                        &repr(mode),
                    )
                })?;
            }
            if let Some(mode) = durability.filter(|v| !v.is_none()) {
                let name = text("durability", mode)?;
                config.durability = name.parse::<Durability>().map_err(|_| {
                    bad(
                        "durability",
                        "must be 'primary' or 'replicated'",
                        &repr(mode),
                    )
                })?;
            }
            let replica_id_given = match replica_id.filter(|v| !v.is_none()) {
                None => false,
                Some(id) => {
                    config.replica_id = text("replica_id", id)?;
                    true
                }
            };
            let path_arg = |name: &'static str, value: Option<&Bound<'_, PyAny>>| -> PyResult<_> {
                let Some(path) = value.filter(|v| !v.is_none()) else {
                    return Ok(None);
                };
                let fspath = py
                    .import("os")?
                    .call_method1("fspath", (path,))
                    .map_err(|_| bad(name, "must be a path", &repr(path)))?;
                Ok(Some(PathBuf::from(text(name, &fspath)?)))
            };
            config.tls_ca_file = path_arg("tls_ca_file", tls_ca_file)?;
            config.tls_cert_file = path_arg("tls_cert_file", tls_cert_file)?;
            config.tls_key_file = path_arg("tls_key_file", tls_key_file)?;
            let redacted = config.redacted_url();
            let given = |arg: &str| -> String {
                let value = match arg {
                    "url" => return py_repr(py, &redacted),
                    "key" => Some(key),
                    "max_in_flight" => Some(max_in_flight),
                    "max_in_flight_per_scope" => max_in_flight_per_scope,
                    "lease_ttl_s" => lease_ttl_s,
                    "connect_timeout_s" => connect_timeout_s,
                    "command_timeout_s" => command_timeout_s,
                    "replica_id" => replica_id,
                    "tls_ca_file" => tls_ca_file,
                    "tls_cert_file" => tls_cert_file,
                    "tls_key_file" => tls_key_file,
                    "durability" => durability,
                    _ => None,
                };
                match value.filter(|v| !v.is_none()) {
                    Some(v) => repr(v),
                    None => "the default".to_owned(),
                }
            };
            config.validate().map_err(|err| config_error(err, given))?;
            runtime::register_atexit(py)?;
            let limit = Self::build(config.clone(), |err| config_error(err, given))?;
            Ok(Self {
                config,
                replica_id_given,
                built: Mutex::new(Built {
                    limit,
                    epoch: runtime::epoch(),
                }),
            })
        })
    }

    /// The Redis URL with its password replaced by `***`.
    #[getter]
    fn url(&self) -> String {
        self.config.redacted_url()
    }

    /// The limit's name: every replica with the same key (on the same Redis) shares one cap.
    #[getter]
    fn key(&self) -> &str {
        &self.config.key
    }

    /// The cap for the whole fleet, as this replica enforces it.
    #[getter]
    fn max_in_flight(&self) -> u32 {
        self.config.max_in_flight
    }

    /// A tenant's (scope's) slice of the fleet cap; 0: off.
    #[getter]
    fn max_in_flight_per_scope(&self) -> u32 {
        self.config.max_in_flight_per_scope
    }

    /// How long a lease outlives its last renewal, in seconds.
    #[getter]
    fn lease_ttl_s(&self) -> f64 {
        self.config.lease_ttl.as_secs_f64()
    }

    /// What admissions do while Redis cannot be reached: `"local"` or `"reject"`.
    #[getter]
    fn on_backend_error(&self) -> &'static str {
        self.config.on_backend_error.as_str()
    }

    /// The bound on establishing a connection, in seconds.
    #[getter]
    fn connect_timeout_s(&self) -> f64 {
        self.config.connect_timeout.as_secs_f64()
    }

    /// How long one command's reply is awaited (with the connect timeout) before a PING asks
    /// whether Redis is alive, in seconds; also the claim window of a grant to this replica.
    #[getter]
    fn command_timeout_s(&self) -> f64 {
        self.config.command_timeout.as_secs_f64()
    }

    /// This replica's name in lease ids (`<hostname>-<pid>` unless given).
    #[getter]
    fn replica_id(&self) -> PyResult<String> {
        guard(|| Ok(self.limit()?.config().replica_id.clone()))
    }

    /// When a grant counts: `"primary"` (once the primary holds it) or `"replicated"` (once
    /// `WAIT 1` confirms a replica holds it too).
    #[getter]
    fn durability(&self) -> &'static str {
        self.config.durability.as_str()
    }

    /// The client certificate presented to servers that require one, or `None`.
    #[getter]
    fn tls_cert_file(&self) -> Option<String> {
        self.config
            .tls_cert_file
            .as_ref()
            .map(|p| p.display().to_string())
    }

    /// The client certificate's private key file, or `None`.
    #[getter]
    fn tls_key_file(&self) -> Option<String> {
        self.config
            .tls_key_file
            .as_ref()
            .map(|p| p.display().to_string())
    }

    /// The CA file for a `rediss://` server with a private CA, or `None`.
    #[getter]
    fn tls_ca_file(&self) -> Option<String> {
        self.config
            .tls_ca_file
            .as_ref()
            .map(|p| p.display().to_string())
    }

    /// Whether Redis answered the last call (`True` until a call fails).
    #[getter]
    fn backend_up(&self) -> PyResult<bool> {
        guard(|| Ok(self.limit()?.backend_up()))
    }

    /// Counters, without a round trip: `fleet_in_flight` (leases held across the fleet: the
    /// newest figure Redis reported, at most one heartbeat interval old), `fleet_max_in_flight`,
    /// `fleet_backend_up` (1/0), `fleet_lease_lost` (running turns whose lease expired with no
    /// room to take it again, and grants that expired before this replica claimed them),
    /// `fleet_borrowed` (leases borrowed over the cap, last known), `fleet_outages`, and
    /// `fleet_max_in_flight_per_scope`, `fleet_waiting` (turns waiting across the fleet, last
    /// known), `fleet_lease_retaken`, `fleet_replica_held` and `fleet_replica_waiting` (this
    /// replica's leases and waiting turns), `fleet_limit` (the fleet's learned limit, last
    /// known, set by gates with `adaptive=`; 0: none, the cap alone counts).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guard(|| {
            let s = self.fleet_stats(py)?;
            let d = PyDict::new(py);
            set_gate_fleet_keys(&d, &s)?;
            d.set_item("fleet_max_in_flight_per_scope", s.max_in_flight_per_scope)?;
            d.set_item("fleet_waiting", s.fleet_waiting)?;
            d.set_item("fleet_lease_retaken", s.lease_retaken)?;
            d.set_item("fleet_replica_held", s.held)?;
            d.set_item("fleet_replica_waiting", s.waiting)?;
            d.set_item("fleet_limit", s.learned_limit)?;
            d.set_item("fleet_unconfirmed", s.unconfirmed)?;
            Ok(d)
        })
    }

    /// Waits for a lease for a turn of `scope` (the tenant; `""`: the fleet cap only), in
    /// fleet-wide FIFO order, and returns a `FleetLease`. Cancelling the wait withdraws it
    /// (a lease granted at that moment goes back). While Redis is down: a local lease
    /// (`on_backend_error="local"`) or `AdmissionRejected(reason="fleet_unavailable")`.
    #[pyo3(signature = (scope=None), text_signature = "($self, scope='')")]
    fn acquire<'py>(
        &self,
        py: Python<'py>,
        scope: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        guard(|| {
            let scope = scope_arg(scope)?;
            let limit = self.limit()?;
            let (epoch, retry) = (runtime::epoch(), self.retry_after());
            runtime::future_into_py(py, async move {
                Ok(match limit.acquire(&scope).await {
                    Ok(lease) => Outcome::Lease(PyFleetLease::new(lease, epoch, None)),
                    Err(err) => Outcome::Failed(err, retry),
                })
            })
        })
    }

    /// A lease for `scope` if one is free now (one round trip), else `None`; never waits.
    #[pyo3(signature = (scope=None), text_signature = "($self, scope='')")]
    fn try_acquire<'py>(
        &self,
        py: Python<'py>,
        scope: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        guard(|| {
            let scope = scope_arg(scope)?;
            let limit = self.limit()?;
            let (epoch, retry) = (runtime::epoch(), self.retry_after());
            runtime::future_into_py(py, async move {
                Ok(match limit.try_acquire(&scope).await {
                    Ok(Some(lease)) => Outcome::Lease(PyFleetLease::new(lease, epoch, None)),
                    Ok(None) => Outcome::Nothing,
                    Err(err) => Outcome::Failed(err, retry),
                })
            })
        })
    }

    /// Gives `lease` back while its turn waits for a person (human approval); resume with
    /// `reclaim`. The room goes to the oldest waiting turn in the fleet that can run. A lease
    /// already released is left alone.
    fn lend<'py>(
        &self,
        py: Python<'py>,
        lease: &Bound<'py, PyFleetLease>,
    ) -> PyResult<Bound<'py, PyAny>> {
        guard(|| {
            let limit = self.limit()?;
            let taken = lease.get().take();
            runtime::future_into_py(py, async move {
                if let Some(lease) = taken {
                    limit.lend(lease).await;
                }
                Ok(Outcome::Nothing)
            })
        })
    }

    /// A lease for a turn of `scope` resuming after a person answered: taken if there is
    /// room, otherwise borrowed over the cap (counted in `fleet_borrowed`, repaid by the next
    /// release in the fleet). Never waits in line: at most one bounded round trip, and a local
    /// lease while Redis is down. `lease.reclaimed` says which.
    #[pyo3(signature = (scope=None), text_signature = "($self, scope='')")]
    fn reclaim<'py>(
        &self,
        py: Python<'py>,
        scope: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        guard(|| {
            let scope = scope_arg(scope)?;
            let limit = self.limit()?;
            let (epoch, retry) = (runtime::epoch(), self.retry_after());
            runtime::future_into_py(py, async move {
                Ok(match limit.reclaim(&scope).await {
                    Ok((lease, how)) => Outcome::Lease(PyFleetLease::new(lease, epoch, Some(how))),
                    Err(err) => Outcome::Failed(err, retry),
                })
            })
        })
    }

    /// Checks that Redis answers (one bounded round trip) and starts the background tasks;
    /// raises `ConnectionError` (without the password) when it does not. Optional: an
    /// unreachable Redis is otherwise just an outage.
    fn connect<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        guard(|| {
            let limit = self.limit()?;
            let retry = self.retry_after();
            runtime::future_into_py(py, async move {
                Ok(match limit.connect().await {
                    Ok(()) => Outcome::Nothing,
                    Err(err) => Outcome::Failed(err, retry),
                })
            })
        })
    }

    /// Gives back every lease and withdraws every waiting turn of this replica, then stops
    /// the background tasks. Waits in progress fail; the limit cannot be used afterwards.
    fn shutdown<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        guard(|| {
            let limit = self.limit()?;
            runtime::future_into_py(py, async move {
                limit.shutdown().await;
                Ok(Outcome::Nothing)
            })
        })
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        guard(|| {
            let c = &self.config;
            Ok(format!(
                "<FleetLimit key={} url={} max_in_flight={} max_in_flight_per_scope={} \
                 lease_ttl_s={:?} on_backend_error={} replica_id={}>",
                py_repr(py, &c.key),
                py_repr(py, &c.redacted_url()),
                c.max_in_flight,
                c.max_in_flight_per_scope,
                c.lease_ttl.as_secs_f64(),
                py_repr(py, c.on_backend_error.as_str()),
                py_repr(py, &self.limit()?.config().replica_id),
            ))
        })
    }
}
