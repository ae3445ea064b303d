//! `AdmissionGate`: the Python class around the core gate.
//!
//! It holds the core ([`Core`]), the limits it enforces, the concurrency policy (decided in
//! Rust when it is admitgate's own, by calling `decide` otherwise) and the memory-aware side
//! ([`ResourceGate`]). Turns go through [`Admission`]; counters are read from the core.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use pyo3::exceptions::{PyAttributeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};
use pyo3::{PyTraverseError, PyVisit};

use super::admission::Admission;
use super::args;
use super::errors::guard;
use super::fork::register_gate;
use super::human_wait::human_wait_scope;
use super::policy::{decision_from, not_a_decision, PyConcurrencyLimitPolicy};
use super::resources::ResourceGate;
use super::runtime::{log, now};
use super::wake::Core;
use crate::core::histogram::HistogramSnapshot;
use crate::core::transport::TransportId;
use crate::core::{ConcurrencyLimit, Decision, Overflow, Rejection};

/// Gateway-wide admission gate: a concurrency ceiling, a bounded FIFO wait queue with
/// per-scope lanes, overflow policies and memory-aware admission. Thread-safe; one gate
/// may serve several event loops at once.
#[pyclass(
    frozen,
    subclass,
    weakref,
    module = "admitgate",
    name = "AdmissionGate"
)]
pub struct PyAdmissionGate {
    pub core: Arc<Core>,
    pub limits: ConcurrencyLimit,
    /// The policy object (`None` for a resource-only gate). Behind a lock only so the
    /// garbage collector can clear it; the lock is held to clone it, never while Python runs.
    policy: Mutex<Option<Py<PyAny>>>,
    /// A policy is configured (it stays configured after the collector clears the object).
    has_policy: bool,
    /// The policy is admitgate's own: decide in Rust, from the live facts, under the lock.
    native_policy: bool,
    pub resources: ResourceGate,
    warned_policy: AtomicBool,
}

/// A limit a custom policy object declares: a missing attribute (or `None`, 0) means 0;
/// any other failure to read it is the policy's bug and is raised, naming the attribute.
fn read_limit(policy: &Bound<'_, PyAny>, attr: &'static str) -> PyResult<u32> {
    match declared(policy, attr)? {
        None => Ok(0),
        Some(value) if value.is_none() => Ok(0),
        Some(value) if value.is_instance_of::<pyo3::types::PyInt>() && !value.is_truthy()? => Ok(0),
        Some(value) => args::count(attr, &value),
    }
}

/// `policy.attr`, `None` when the policy does not have it. Any other exception from the
/// attribute (a broken property) is raised with the attribute's name, instead of silently
/// reading as "no limit".
fn declared<'py>(
    policy: &Bound<'py, PyAny>,
    attr: &'static str,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    match policy.getattr(attr) {
        Ok(value) => Ok(Some(value)),
        Err(err) if err.is_instance_of::<PyAttributeError>(policy.py()) => Ok(None),
        Err(err) => {
            let wrapped = PyValueError::new_err(format!(
                "policy.{attr} raised {}; a policy's limits must be readable",
                err.value(policy.py())
                    .repr()
                    .map(|r| r.to_string())
                    .unwrap_or_default()
            ));
            wrapped.set_cause(policy.py(), Some(err));
            Err(wrapped)
        }
    }
}

/// The limits a policy object declares (admitgate's own, or any object with the
/// reference's attributes), and whether it is exactly admitgate's own.
fn limits_of(
    py: Python<'_>,
    policy: Option<&Bound<'_, PyAny>>,
) -> PyResult<(ConcurrencyLimit, bool)> {
    let Some(p) = policy else {
        return Ok((
            ConcurrencyLimit {
                max_concurrent_runs: 0,
                queue_depth: 0,
                overflow: Overflow::Reject,
                max_per_scope: 0,
            },
            false,
        ));
    };
    if let Ok(ours) = p.cast::<PyConcurrencyLimitPolicy>() {
        // Exactly ours (not a subclass, which may override decide in Python).
        if p.get_type().is(py.get_type::<PyConcurrencyLimitPolicy>()) {
            return Ok((ours.get().limit, true));
        }
    }
    let overflow = match declared(p, "overflow_policy")? {
        Some(v) if v.is_truthy()? => args::overflow(&v)?,
        _ => Overflow::Reject,
    };
    let limits = ConcurrencyLimit {
        max_concurrent_runs: read_limit(p, "max_concurrent_runs")?,
        queue_depth: read_limit(p, "queue_depth")?,
        overflow,
        max_per_scope: read_limit(p, "max_concurrent_runs_per_scope")?,
    };
    Ok((limits, false))
}

/// A `session_id` as the reference accepts it: a str as is, `None` as `""`, anything else
/// by its `str()`.
fn session_key(session_id: Option<Bound<'_, PyAny>>, py: Python<'_>) -> PyResult<Py<PyString>> {
    match session_id {
        None => Ok(PyString::intern(py, "").unbind()),
        Some(s) if s.is_none() => Ok(PyString::intern(py, "").unbind()),
        Some(s) => match s.cast_into::<PyString>() {
            Ok(text) => Ok(text.unbind()),
            Err(err) => Ok(err.into_inner().str()?.unbind()),
        },
    }
}

fn histogram_dict<'py>(py: Python<'py>, h: &HistogramSnapshot) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("count", h.count)?;
    d.set_item("sum", h.sum)?;
    d.set_item("buckets", PyList::new(py, h.buckets.iter().copied())?)?;
    Ok(d)
}

impl PyAdmissionGate {
    /// Whether the policy is admitgate's own (decided in Rust by the core).
    pub fn native_policy(&self) -> bool {
        self.native_policy
    }

    /// Whether the gate is active: a ceiling is set, or memory-aware admission is on.
    pub fn is_enabled(&self, py: Python<'_>) -> bool {
        (self.has_policy && self.limits.max_concurrent_runs > 0) || self.resources.enabled(py)
    }

    /// A custom policy's decision from the current facts (`None` for admitgate's own policy,
    /// which the core decides). A policy that raises or answers garbage is logged once and
    /// treated as admit (the gate's mechanism still holds).
    pub fn foreign_decision(
        &self,
        py: Python<'_>,
        session_id: &Bound<'_, PyAny>,
        scope: Option<&str>,
    ) -> Option<Decision> {
        if self.native_policy {
            return None;
        }
        let policy = self.policy.lock().as_ref().map(|p| p.clone_ref(py))?;
        let outcome = (|| -> PyResult<Decision> {
            let facts = self.core.facts(scope);
            let kwargs = PyDict::new(py);
            kwargs.set_item("in_flight", facts.in_flight)?;
            kwargs.set_item("queued", facts.queued)?;
            kwargs.set_item("session_id", session_id)?;
            let scope_arg = if self.limits.max_per_scope > 0 {
                session_id.clone()
            } else {
                PyString::new(py, "").into_any()
            };
            kwargs.set_item("scope", scope_arg)?;
            kwargs.set_item("scope_in_flight", facts.scope_in_flight)?;
            kwargs.set_item("scope_queued", facts.scope_queued)?;
            let answer =
                policy
                    .bind(py)
                    .call_method(pyo3::intern!(py, "decide"), (), Some(&kwargs))?;
            decision_from(&answer).ok_or_else(|| not_a_decision("decide", &answer))
        })();
        Some(outcome.unwrap_or_else(|err| {
            if !self.warned_policy.swap(true, Ordering::Relaxed) {
                log(
                    py,
                    "warning",
                    format!("AdmissionGate: policy.decide failed ({err}); admitting"),
                );
            }
            Decision::Admit
        }))
    }

    /// The pressure when a turn ends, so a release under eased pressure refills the free
    /// slots. Read only when someone waits: only waiters are affected.
    pub fn release_pressure(&self, py: Python<'_>) -> Option<Decision> {
        (self.core.has_waiters() && self.resources.enabled(py)).then(|| self.resources.decision(py))
    }
}

#[pymethods]
impl PyAdmissionGate {
    #[new]
    #[pyo3(signature = (policy, *, resource_policy=None, resource_sampler=None))]
    fn new(
        py: Python<'_>,
        policy: Option<Bound<'_, PyAny>>,
        resource_policy: Option<Bound<'_, PyAny>>,
        resource_sampler: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        guard(|| {
            let (limits, native_policy) = limits_of(py, policy.as_ref())?;
            let resources = ResourceGate::new(py, resource_policy, resource_sampler)?;
            // Resolve praisonaiagents' human-wait variable now, not inside a running turn:
            // importing praisonaiagents reconfigures logging.
            let _ = human_wait_scope(py);
            let core = Arc::new(Core::new(limits));
            register_gate(&core);
            Ok(Self {
                core,
                limits,
                has_policy: policy.is_some(),
                policy: Mutex::new(policy.map(Bound::unbind)),
                native_policy,
                resources,
                warned_policy: AtomicBool::new(false),
            })
        })
    }

    /// Admits (or sheds) one turn: `async with gate.admit(session_id=..., transport=...)`.
    /// Raises `AdmissionRejected` on entry when the turn is rejected or evicted while waiting.
    #[pyo3(
        signature = (*, session_id=None, transport=None),
        text_signature = "($self, *, session_id='', transport='direct')"
    )]
    fn admit(
        slf: &Bound<'_, Self>,
        session_id: Option<Bound<'_, PyAny>>,
        transport: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Admission> {
        guard(|| {
            let py = slf.py();
            let transport = match transport {
                None => TransportId::DIRECT,
                Some(t) => {
                    let name = t.cast::<PyString>().map_err(|_| {
                        PyTypeError::new_err(format!(
                            "transport must be a str, got {}",
                            t.repr().map(|r| r.to_string()).unwrap_or_default()
                        ))
                    })?;
                    slf.get()
                        .core
                        .transports
                        .resolve(name.to_str()?)
                        .map_err(|err| PyValueError::new_err(err.to_string()))?
                }
            };
            Ok(Admission::new(
                slf.clone().unbind(),
                session_key(session_id, py)?,
                transport,
            ))
        })
    }

    /// Whether the gate is active: a ceiling is set, or a memory-pressure policy with a
    /// threshold is.
    #[getter]
    fn enabled(&self, py: Python<'_>) -> PyResult<bool> {
        guard(|| Ok(self.is_enabled(py)))
    }

    /// The ceiling on concurrent runs (0: none).
    #[getter]
    fn max_concurrent_runs(&self) -> PyResult<u32> {
        guard(|| Ok(self.limits.max_concurrent_runs))
    }

    /// Whether in flight is at the ceiling (never with no ceiling).
    #[getter]
    fn saturated(&self) -> PyResult<bool> {
        guard(|| {
            let max = self.limits.max_concurrent_runs;
            Ok(max > 0 && self.core.stats(now).in_flight >= u64::from(max))
        })
    }

    /// Turns holding a run slot (including turns granted one that have not started yet).
    #[getter]
    fn in_flight(&self) -> PyResult<u64> {
        guard(|| Ok(self.core.stats(now).in_flight))
    }

    /// Turns waiting for a slot.
    #[getter]
    fn queued(&self) -> PyResult<u64> {
        guard(|| Ok(self.core.stats(now).queued))
    }

    /// Turns that started running.
    #[getter]
    fn admitted(&self) -> PyResult<u64> {
        guard(|| Ok(self.core.stats(now).admitted))
    }

    /// Turns refused on arrival.
    #[getter]
    fn rejected(&self) -> PyResult<u64> {
        guard(|| Ok(self.core.stats(now).rejected))
    }

    /// Waiters evicted by `shed_oldest` that saw the eviction.
    #[getter]
    fn shed(&self) -> PyResult<u64> {
        guard(|| Ok(self.core.stats(now).shed))
    }

    /// Turns withdrawn while queued (cancelled, timed out, their loop closed), or cancelled
    /// between being granted a slot (or evicted) and seeing it.
    #[getter]
    fn cancelled(&self) -> PyResult<u64> {
        guard(|| Ok(self.core.stats(now).cancelled))
    }

    /// Admitted turns parked on a human approval, not holding a slot.
    #[getter]
    fn awaiting_human(&self) -> PyResult<u64> {
        guard(|| Ok(self.core.stats(now).awaiting_human))
    }

    /// A snapshot of the counters, with the reference's keys (plus `cancelled`).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guard(|| {
            let s = self.core.stats(now);
            let max_rss_mb = self.resources.max_rss_mb(py);
            let d = PyDict::new(py);
            d.set_item("max_concurrent_runs", self.limits.max_concurrent_runs)?;
            d.set_item("max_concurrent_runs_per_scope", self.limits.max_per_scope)?;
            d.set_item("queue_depth", self.limits.queue_depth)?;
            d.set_item("in_flight", s.in_flight)?;
            d.set_item("queued", s.queued)?;
            d.set_item("awaiting_human", s.awaiting_human)?;
            d.set_item("admitted", s.admitted)?;
            d.set_item("rejected", s.rejected)?;
            d.set_item("shed", s.shed)?;
            d.set_item("max_rss_mb", max_rss_mb)?;
            d.set_item("cancelled", s.cancelled)?;
            Ok(d)
        })
    }

    /// Per-transport counters: `{name: {"in_flight", "queued", "admitted", "rejected":
    /// {reason: count}}}` for every transport that reached `admit()` (`direct` always).
    fn transport_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guard(|| {
            let out = PyDict::new(py);
            for t in self.core.transports.stats() {
                let d = PyDict::new(py);
                d.set_item("in_flight", t.in_flight)?;
                d.set_item("queued", t.queued)?;
                d.set_item("admitted", t.admitted)?;
                let rejected = PyDict::new(py);
                for reason in Rejection::ALL {
                    rejected.set_item(reason.as_str(), t.rejected[reason.index()])?;
                }
                d.set_item("rejected", rejected)?;
                out.set_item(&*t.name, d)?;
            }
            Ok(out)
        })
    }

    /// Records one front-door request of `transport` (`"passthrough"` for ungated traffic)
    /// that took `seconds` from arrival to its last byte. Called once per request by the ASGI
    /// middleware and the gRPC interceptor; a plain `admit()` turn never calls it.
    fn record_request(
        &self,
        transport: &Bound<'_, PyAny>,
        seconds: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        guard(|| {
            let name = transport.cast::<PyString>().map_err(|_| {
                PyTypeError::new_err(format!(
                    "transport must be a str, got {}",
                    transport.repr().map(|r| r.to_string()).unwrap_or_default()
                ))
            })?;
            let label = self
                .core
                .transports
                .request_label(name.to_str()?)
                .map_err(|err| PyValueError::new_err(err.to_string()))?;
            let seconds = args::number("seconds", seconds)?;
            let duration = std::time::Duration::try_from_secs_f64(seconds).map_err(|_| {
                PyValueError::new_err(format!(
                    "seconds must be a finite number >= 0, got {seconds}"
                ))
            })?;
            self.core.transports.record_request(label, duration);
            Ok(())
        })
    }

    /// Request counts and duration histograms per transport label that has seen a request:
    /// `{name: {"count", "sum", "buckets": [(upper_bound, cumulative_count), ...]}}`.
    fn request_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guard(|| {
            let out = PyDict::new(py);
            for (name, h) in self.core.transports.request_stats() {
                out.set_item(&*name, histogram_dict(py, &h)?)?;
            }
            Ok(out)
        })
    }

    /// How long turns that queued waited before they were admitted:
    /// `{"count", "sum", "buckets": [(upper_bound, cumulative_count), ...]}`.
    fn queue_wait_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guard(|| histogram_dict(py, &self.core.queue_wait()))
    }

    /// The most turns that were ever in flight at once.
    #[getter]
    fn peak_in_flight(&self) -> PyResult<u64> {
        guard(|| Ok(self.core.stats(now).peak_in_flight))
    }

    /// Seconds the oldest waiter has waited, or `None` when nobody waits.
    #[getter]
    fn oldest_wait_seconds(&self) -> PyResult<Option<f64>> {
        guard(|| Ok(self.core.stats(now).oldest_wait.map(|d| d.as_secs_f64())))
    }

    /// The concurrency policy the gate was built with (`None` for a resource-only gate).
    #[getter]
    fn policy(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        guard(|| Ok(self.policy.lock().as_ref().map(|p| p.clone_ref(py))))
    }

    /// The memory-pressure policy, or `None`.
    #[getter]
    fn _resource_policy(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        guard(|| Ok(self.resources.policy_object(py)))
    }

    /// The sampler consulted on every decision (the built-in one unless replaced).
    #[getter]
    fn _resource_sampler(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        guard(|| Ok(self.resources.sampler_object(py)))
    }

    /// Replaces the sampler (as PraisonAI's own tests do); `None` removes it.
    #[setter(_resource_sampler)]
    fn set_resource_sampler(
        &self,
        py: Python<'_>,
        sampler: Option<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        guard(|| self.resources.set_sampler(py, sampler))
    }

    /// Evicts the oldest live waiter (it gets `AdmissionRejected` and counts as shed);
    /// `False` when nobody waits.
    fn _shed_oldest_waiter(&self) -> PyResult<bool> {
        guard(|| {
            let (evicted, wakes) = self.core.shed_oldest_waiter();
            wakes.run();
            Ok(evicted)
        })
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        guard(|| {
            let s = self.core.stats(now);
            Ok(format!(
                "<AdmissionGate enabled={} max_concurrent_runs={} queue_depth={} overflow_policy={:?} max_concurrent_runs_per_scope={} in_flight={} queued={}>",
                if self.is_enabled(py) { "True" } else { "False" },
                self.limits.max_concurrent_runs,
                self.limits.queue_depth,
                self.limits.overflow.as_str(),
                self.limits.max_per_scope,
                s.in_flight,
                s.queued
            ))
        })
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Some(policy) = self.policy.try_lock() {
            if let Some(p) = &*policy {
                visit.call(p)?;
            }
        }
        self.resources.traverse(&visit)
    }

    fn __clear__(&self) {
        let policy = self.policy.lock().take();
        drop(policy);
        self.resources.clear();
    }
}

/// Panics inside the gate's lock, to prove a Rust panic surfaces as `InternalError` and the
/// gate stays usable. For admitgate's own tests.
#[pyfunction]
pub fn _panic_inside_gate(gate: &Bound<'_, PyAdmissionGate>) -> PyResult<()> {
    guard(|| {
        let (_, wakes) = gate
            .get()
            .core
            .with(|_, _| -> () { panic!("deliberate panic for a test") });
        wakes.run();
        Ok(())
    })
}
