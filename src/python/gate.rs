//! `AdmissionGate`'s state: the core ([`Core`]), the limits it enforces, the concurrency
//! policy (decided in Rust when it is admitgate's own, by calling `decide` otherwise), the
//! memory-aware side ([`ResourceGate`]) and the fleet limit, with what a turn asks of them.
//! Its Python methods are in `gate_methods`; turns go through `Admission`.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyTuple};

use super::adaptive::{self, PyAdaptiveLimit};
use super::estimator::GateEstimator;
use super::fleet::{LeaseWaits, PyFleetLimit};
use super::policy::{decision_from, not_a_decision};
use super::priorities::ClassNames;
use super::rate_limit::PyRateLimit;
use super::resources::ResourceGate;
use super::runtime::log;
use super::wake::Core;
use admitgate_core::overload::Discipline;
use admitgate_core::Decision;

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
    /// The ceiling and the per-scope limit, readable without the core's lock (the core
    /// holds the authoritative limits; `reconfigure` changes both).
    pub(super) max_runs: AtomicU32,
    pub(super) per_scope: AtomicU32,
    /// The queue timeout in nanoseconds; 0: none.
    pub(super) queue_timeout_nanos: AtomicU64,
    /// The policy object (`None` for a resource-only gate). Behind a lock so the garbage
    /// collector can clear it and `reconfigure` can replace it; the lock is held to clone or
    /// swap it, never while Python runs.
    pub(super) policy: Mutex<Option<Py<PyAny>>>,
    /// The policy is admitgate's own: decide in Rust, from the live facts, under the lock.
    pub(super) native_policy: bool,
    pub resources: ResourceGate,
    pub(super) warned_policy: AtomicBool,
    /// The fleet-wide limit: a turn runs once it has its local slot and a lease.
    pub(super) fleet: Option<Py<PyFleetLimit>>,
    /// Turns waiting for their leases, refused (`closing`) when the gate closes.
    pub lease_waits: LeaseWaits,
    /// `adaptive=`: the settings of the adaptive ceiling, if any.
    pub(super) adaptive: Option<Py<PyAdaptiveLimit>>,
    /// The exception types that report a provider throttle (`adaptive.throttle_on`).
    pub(super) throttle_on: Option<Py<PyTuple>>,
    /// `queue_discipline=`.
    pub(super) discipline: Discipline,
    /// `priorities=` and `fairness=`: the classes turns name.
    pub(super) classes: ClassNames,
    /// `rate_limit=`: the budgets every turn passes, in order, before its slot.
    pub(super) rate_limits: Vec<Py<PyRateLimit>>,
    /// `estimator=`: what a turn given no `cost=` reserves in the budgets.
    pub(super) estimator: Option<GateEstimator>,
}

impl PyAdmissionGate {
    /// Whether the policy is admitgate's own (decided in Rust by the core).
    pub fn native_policy(&self) -> bool {
        self.native_policy
    }

    /// The ceiling in force (0: none).
    pub fn max_concurrent_runs(&self) -> u32 {
        self.max_runs.load(Ordering::Relaxed)
    }

    /// The per-scope limit in force (0: off).
    pub fn max_per_scope(&self) -> u32 {
        self.per_scope.load(Ordering::Relaxed)
    }

    /// Whether turns are tracked per tenant: a per-tenant limit, or fair queuing.
    pub fn tracks_tenants(&self) -> bool {
        self.max_per_scope() > 0 || self.classes.fair()
    }

    /// The priority classes turns name.
    pub fn classes(&self) -> &ClassNames {
        &self.classes
    }

    /// The queue timeout in force.
    pub fn queue_timeout(&self) -> Option<Duration> {
        match self.queue_timeout_nanos.load(Ordering::Relaxed) {
            0 => None,
            nanos => Some(Duration::from_nanos(nanos)),
        }
    }

    pub(super) fn set_queue_timeout(&self, timeout: Option<Duration>) {
        let nanos = timeout.map_or(0, |t| {
            u64::try_from(t.as_nanos()).unwrap_or(u64::MAX).max(1)
        });
        self.queue_timeout_nanos.store(nanos, Ordering::Relaxed);
    }

    /// Whether the gate is active: a ceiling is set, memory-aware admission is on, or a fleet
    /// limit is configured.
    pub fn is_enabled(&self, py: Python<'_>) -> bool {
        self.max_concurrent_runs() > 0
            || self.resources.enabled(py)
            || self.fleet.is_some()
            || self.classes.classed()
    }

    /// The fleet-wide limit, if one is configured.
    pub fn fleet(&self) -> Option<&Py<PyFleetLimit>> {
        self.fleet.as_ref()
    }

    /// `rate_limit=`, in the order turns pass them.
    pub fn rate_limits(&self) -> &[Py<PyRateLimit>] {
        &self.rate_limits
    }

    /// `estimator=`, if any.
    pub fn estimator(&self) -> Option<&GateEstimator> {
        self.estimator.as_ref()
    }

    /// The budgets of this process, for one turn (see `budget_step`).
    pub fn budgets(&self) -> PyResult<admitgate_passage::budget::RateLimits> {
        let limiters = self
            .rate_limits
            .iter()
            .map(|limit| limit.get().limiter())
            .collect::<PyResult<Vec<_>>>()?;
        Ok(admitgate_passage::budget::RateLimits::new(limiters))
    }

    /// `deadline_s` as a deadline on the binding's clock. The first turn with a deadline
    /// starts timing turns, so the gate learns the service time deadlines are checked
    /// against (until then only a deadline already passed refuses a turn that would wait).
    pub(super) fn caller_deadline(
        &self,
        deadline_s: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<Duration>> {
        let deadline = adaptive::deadline(deadline_s)?;
        if deadline.is_some() && !self.core.times_turns() {
            self.core.enable_overload(None, Discipline::Fifo);
        }
        Ok(deadline)
    }

    /// Whether `exc` (an exception leaving a turn's block) reports a provider throttle.
    pub fn is_throttle(&self, py: Python<'_>, exc: &Bound<'_, PyAny>) -> bool {
        match &self.throttle_on {
            Some(types) if !types.bind(py).is_empty() => {
                exc.is_instance(types.bind(py).as_any()).unwrap_or(false)
            }
            _ => false,
        }
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
        let per_scope = self.max_per_scope();
        let outcome = (|| -> PyResult<Decision> {
            let facts = self.core.facts(scope);
            let kwargs = PyDict::new(py);
            kwargs.set_item("in_flight", facts.in_flight)?;
            kwargs.set_item("queued", facts.queued)?;
            kwargs.set_item("session_id", session_id)?;
            let scope_arg = if per_scope > 0 {
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
