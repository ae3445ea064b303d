//! `AdmissionGate`'s Python methods: construction and `reconfigure`, `admit()` and
//! `admit_sync()` (which make an `Admission`), the drain, and the counters read from the core.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use pyo3::exceptions::{PyAttributeError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyString};
use pyo3::{PyTraverseError, PyVisit};

use super::adaptive::{self, PyAdaptiveLimit};
use super::admission::{Admission, AdmitArgs, Identity};
use super::args::{self, Arg};
use super::errors::guard;
use super::estimator::GateEstimator;
use super::fleet::{set_gate_fleet_keys, LeaseWaits, PyFleetLimit};
use super::fork::register_gate;
use super::gate::PyAdmissionGate;
use super::human_wait::human_wait_scope;
use super::policy::PyConcurrencyLimitPolicy;
use super::pressure_check;
use super::priorities::{self, ClassNames};
use super::rate_limit::{stats_dict, PyRateLimit};
use super::resources::ResourceGate;
use super::runtime::{deadline_after, now, running_loop};
use super::wake::{Core, DrainWaiter, ThreadSignal};
use admitgate_core::histogram::HistogramSnapshot;
use admitgate_core::overload::Discipline;
use admitgate_core::transport::TransportId;
use admitgate_core::{ConcurrencyLimit, Overflow, Rejection};

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

/// What a policy object declares.
struct Declared {
    limits: ConcurrencyLimit,
    queue_timeout: Option<Duration>,
    /// Exactly admitgate's own policy (decided in Rust).
    native: bool,
}

/// The limits a policy object declares (admitgate's own, or any object with the
/// reference's attributes, plus an optional `queue_timeout_s`).
fn limits_of(py: Python<'_>, policy: Option<&Bound<'_, PyAny>>) -> PyResult<Declared> {
    let Some(p) = policy else {
        return Ok(Declared {
            limits: ConcurrencyLimit {
                max_concurrent_runs: 0,
                queue_depth: 0,
                overflow: Overflow::Reject,
                max_per_scope: 0,
            },
            queue_timeout: None,
            native: false,
        });
    };
    if let Ok(ours) = p.cast::<PyConcurrencyLimitPolicy>() {
        let ours = ours.get();
        // Exactly ours (not a subclass, which may override decide in Python).
        let native = p.get_type().is(py.get_type::<PyConcurrencyLimitPolicy>());
        return Ok(Declared {
            limits: ours.limit,
            queue_timeout: ours.queue_timeout,
            native,
        });
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
    let queue_timeout = match declared(p, "queue_timeout_s")? {
        Some(value) => args::timeout("queue_timeout_s", &value)?,
        None => None,
    };
    Ok(Declared {
        limits,
        queue_timeout,
        native: false,
    })
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

fn repr(value: &Bound<'_, PyAny>) -> String {
    value.repr().map(|r| r.to_string()).unwrap_or_default()
}

static DRAIN: PyOnceLock<Py<pyo3::types::PyModule>> = PyOnceLock::new();

/// `admitgate._drain.<name>`: the drain's Python half (it awaits; the primitives are here).
fn drain_helper<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    DRAIN
        .get_or_try_init(py, || {
            Ok::<_, PyErr>(py.import("admitgate._drain")?.unbind())
        })?
        .bind(py)
        .getattr(name)
}

fn histogram_dict<'py>(py: Python<'py>, h: &HistogramSnapshot) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("count", h.count)?;
    d.set_item("sum", h.sum)?;
    d.set_item("buckets", PyList::new(py, h.buckets.iter().copied())?)?;
    Ok(d)
}

/// What `admit()` / `admit_sync()` were asked for, validated.
/// `rate_limit=`: a `RateLimit`, a list (or tuple) of them, or `None`; names unique (they
/// label the stats and metrics).
fn rate_limits_arg(value: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<Py<PyRateLimit>>> {
    let Some(value) = value.filter(|v| !v.is_none()) else {
        return Ok(Vec::new());
    };
    let must = |v: &Bound<'_, PyAny>| {
        PyTypeError::new_err(format!(
            "rate_limit must be an admitgate.RateLimit, a list of them or None, got {}",
            repr(v)
        ))
    };
    let items: Vec<Bound<'_, PyAny>> = if let Ok(one) = value.cast::<PyRateLimit>() {
        vec![one.clone().into_any()]
    } else if value.is_instance_of::<pyo3::types::PyList>()
        || value.is_instance_of::<pyo3::types::PyTuple>()
    {
        value.try_iter()?.collect::<PyResult<_>>()?
    } else {
        return Err(must(value));
    };
    let mut limits: Vec<Py<PyRateLimit>> = Vec::with_capacity(items.len());
    for item in items {
        let limit = item.cast::<PyRateLimit>().map_err(|_| must(&item))?;
        let name = limit.get().limit_name();
        if limits.iter().any(|l| l.get().limit_name() == name) {
            return Err(PyValueError::new_err(format!(
                "rate_limit: two limits are named {name:?}; give each its own name= (it labels stats and metrics)"
            )));
        }
        limits.push(limit.clone().unbind());
    }
    Ok(limits)
}

/// `cost=` (the turn's token estimate, an int >= 0; `None`: the gate's `estimator=`'s, else
/// 0) and `identity=` (a str or bytes that keys the turn in every budget, instead of
/// `key(session_id)` or the session id).
fn budget_args(
    cost: Option<&Bound<'_, PyAny>>,
    identity: Option<&Bound<'_, PyAny>>,
) -> PyResult<(Option<u64>, Option<Identity>)> {
    let cost = match cost.filter(|c| !c.is_none()) {
        None => None,
        Some(c) => {
            let cost = args::fact("cost", c)?;
            if cost > admitgate_budget::rate::MAX_AMOUNT {
                return Err(PyValueError::new_err(format!(
                    "cost must be 0 to {}, got {cost}",
                    admitgate_budget::rate::MAX_AMOUNT
                )));
            }
            Some(cost)
        }
    };
    let identity = match identity.filter(|i| !i.is_none()) {
        None => None,
        Some(i) => Some(Identity {
            bytes: args::identity_bytes("identity", i)?,
            given: i.clone().unbind(),
        }),
    };
    Ok((cost, identity))
}

fn admit_args(
    gate: &PyAdmissionGate,
    py: Python<'_>,
    session_id: Option<Bound<'_, PyAny>>,
    transport: Option<Bound<'_, PyAny>>,
    on_queued: Option<Bound<'_, PyAny>>,
    timeout: Option<Duration>,
    priority: Option<Bound<'_, PyAny>>,
) -> PyResult<AdmitArgs> {
    let class = gate.classes().resolve(priority.as_ref())?;
    let transport = match transport {
        None => TransportId::DIRECT,
        Some(t) => {
            let name = t.cast::<PyString>().map_err(|_| {
                PyTypeError::new_err(format!("transport must be a str, got {}", repr(&t)))
            })?;
            gate.core
                .transports
                .resolve(name.to_str()?)
                .map_err(|err| PyValueError::new_err(err.to_string()))?
        }
    };
    let on_queued = match on_queued {
        Some(cb) if cb.is_none() => None,
        Some(cb) if !cb.is_callable() => {
            return Err(PyTypeError::new_err(format!(
                "on_queued must be callable as on_queued(position, estimated_wait_s), got {}",
                repr(&cb)
            )))
        }
        cb => cb.map(Bound::unbind),
    };
    Ok(AdmitArgs {
        session_id: session_key(session_id, py)?,
        transport,
        on_queued,
        timeout,
        deadline: None,
        class,
        cost: None,
        identity: None,
    })
}

impl PyAdmissionGate {
    /// The order `reconfigure` asks for, validated against the classes in force (`None`
    /// when none of its arguments is given). Classes keep their names and order; an argument
    /// not given keeps its value.
    fn reordered(
        &self,
        py: Python<'_>,
        priorities: Option<&Bound<'_, PyAny>>,
        default_priority: Option<&Bound<'_, PyAny>>,
        fairness: Option<&Bound<'_, PyAny>>,
        tenant_weights: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<admitgate_core::Order>> {
        fn given<'a, 'py>(arg: Option<&'a Bound<'py, PyAny>>) -> Option<&'a Bound<'py, PyAny>> {
            arg.filter(|a| !a.is_none())
        }
        if [priorities, default_priority, fairness, tenant_weights]
            .into_iter()
            .all(|arg| given(arg).is_none())
        {
            return Ok(None);
        }
        let current = self.core.order();
        if given(priorities).is_none()
            && !self.classes.classed()
            && given(default_priority).is_some()
        {
            return Err(PyValueError::new_err(
                "default_priority needs a gate with priorities=[...]",
            ));
        }
        let (mut order, classed) = if given(priorities).is_some() {
            let (order, classed) =
                priorities::order_from(py, priorities, default_priority, fairness, tenant_weights)?;
            if !self.classes.classed() || !order.priorities.same_names(&current.priorities) {
                return Err(PyValueError::new_err(
                    "reconfigure may change the priority classes' shares, not their names or \
                     order (nor add classes to a gate built without them)",
                ));
            }
            let mut order = order;
            if given(default_priority).is_none() {
                let default = current.priorities.default_class();
                let name = current
                    .priorities
                    .names()
                    .get(usize::from(default.0))
                    .cloned();
                order.priorities = admitgate_core::Priorities::new(
                    order.priorities.classes().to_vec(),
                    name.as_deref(),
                )
                .map_err(|err| PyValueError::new_err(err.to_string()))?;
            }
            (order, classed)
        } else {
            let (mut order, classed) =
                priorities::order_from(py, None, None, fairness, tenant_weights)?;
            order.priorities = current.priorities.clone();
            if let Some(name) = given(default_priority) {
                let class = self.classes.resolve(Some(name)).map_err(|_| {
                    PyValueError::new_err(format!(
                        "default_priority {} is not a priority class; known: {}",
                        name.repr().map(|r| r.to_string()).unwrap_or_default(),
                        admitgate_core::queue::classes::names(&current.priorities.names())
                    ))
                })?;
                let default = current
                    .priorities
                    .names()
                    .get(usize::from(class.0))
                    .map(|n| n.to_string());
                order.priorities = admitgate_core::Priorities::new(
                    current.priorities.classes().to_vec(),
                    default.as_deref(),
                )
                .map_err(|err| PyValueError::new_err(err.to_string()))?;
            }
            (order, self.classes.classed() || classed)
        };
        if given(fairness).is_none() {
            order.fair = current.fair;
        }
        if given(tenant_weights).is_none() {
            order.weights = current.weights.clone();
        }
        if !order.weights.is_empty() && !order.fair {
            return Err(PyValueError::new_err(
                "tenant_weights needs fair queuing (fairness='tenant', or priorities=[...])",
            ));
        }
        let _ = classed;
        Ok(Some(order))
    }

    /// The fleet's learned limit, when this gate learns one with its fleet (`adaptive=` and
    /// `fleet=`) and has read it: what `limit` shows then.
    fn fleet_learned(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        match (&self.fleet, &self.adaptive) {
            (Some(fleet), Some(_)) => {
                let learned = fleet.get().fleet_stats(py)?.learned_limit;
                Ok((learned > 0).then_some(learned))
            }
            _ => Ok(None),
        }
    }
}

#[pymethods]
impl PyAdmissionGate {
    #[new]
    #[pyo3(
        signature = (
            *args, policy=None, resource_policy=None, resource_sampler=None, fleet=None,
            adaptive=None, queue_discipline=None, priorities=None, default_priority=None,
            fairness=None, tenant_weights=None, rate_limit=None, estimator=None
        ),
        text_signature = "(policy=None, *, resource_policy=None, resource_sampler=None, fleet=None, adaptive=None, queue_discipline=None, priorities=None, default_priority=None, fairness=None, tenant_weights=None, rate_limit=None, estimator=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        args: &Bound<'_, pyo3::types::PyTuple>,
        policy: Option<Bound<'_, PyAny>>,
        resource_policy: Option<Bound<'_, PyAny>>,
        resource_sampler: Option<Bound<'_, PyAny>>,
        fleet: Option<Bound<'_, PyAny>>,
        adaptive: Option<Bound<'_, PyAny>>,
        queue_discipline: Option<Bound<'_, PyAny>>,
        priorities: Option<Bound<'_, PyAny>>,
        default_priority: Option<Bound<'_, PyAny>>,
        fairness: Option<Bound<'_, PyAny>>,
        tenant_weights: Option<Bound<'_, PyAny>>,
        rate_limit: Option<Bound<'_, PyAny>>,
        estimator: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        guard(|| {
            // `policy` is required (None for a gate without a ceiling), as the reference's
            // is, except for a gate that enforces only its budget: `AdmissionGate(rate_limit=...)`.
            let policy = match (args.len(), policy) {
                (0, None) if rate_limit.as_ref().is_none_or(|r| r.is_none()) => {
                    return Err(PyTypeError::new_err(
                        "AdmissionGate() missing 1 required positional argument: 'policy' (None for a gate without a ceiling; or give rate_limit=)",
                    ))
                }
                (0, policy) => policy,
                (1, None) => Some(args.get_item(0)?).filter(|p| !p.is_none()),
                (1, Some(_)) => {
                    return Err(PyTypeError::new_err(
                        "AdmissionGate() got multiple values for argument 'policy'",
                    ))
                }
                (n, _) => {
                    return Err(PyTypeError::new_err(format!(
                        "AdmissionGate() takes 1 positional argument (policy) but {n} were given; the other options are keyword-only"
                    )))
                }
            };
            let rate_limits = rate_limits_arg(rate_limit.as_ref())?;
            let estimator = GateEstimator::from_arg(estimator.as_ref(), &rate_limits)?;
            let (order, classed) = priorities::order_from(
                py,
                priorities.as_ref(),
                default_priority.as_ref(),
                fairness.as_ref(),
                tenant_weights.as_ref(),
            )?;
            let discipline = adaptive::discipline(queue_discipline.as_ref())?;
            let adaptive = match adaptive {
                Some(a) if a.is_none() => None,
                Some(a) => Some(a.cast_into::<PyAdaptiveLimit>().map_err(|err| {
                    PyTypeError::new_err(format!(
                        "adaptive must be an admitgate.AdaptiveLimit or None, got {}",
                        repr(&err.into_inner())
                    ))
                })?),
                None => None,
            };
            let fleet = match fleet {
                Some(f) if f.is_none() => None,
                Some(f) => Some(f.cast_into::<PyFleetLimit>().map_err(|err| {
                    PyValueError::new_err(format!(
                        "fleet must be an admitgate.FleetLimit or None, got {}",
                        repr(&err.into_inner())
                    ))
                })?),
                None => None,
            };
            let declared = limits_of(py, policy.as_ref())?;
            let resources = ResourceGate::new(py, resource_policy, resource_sampler)?;
            // Resolve praisonaiagents' human-wait variable now, not inside a running turn:
            // importing praisonaiagents reconfigures logging.
            let _ = human_wait_scope(py);
            let limits = declared.limits;
            let controller = adaptive
                .as_ref()
                .map(|a| match &fleet {
                    // With a fleet, one learned limit for all of its replicas.
                    Some(fleet) => a.get().fleet_controller(limits.max_concurrent_runs, fleet),
                    None => a.get().controller(limits.max_concurrent_runs),
                })
                .transpose()?;
            if discipline != Discipline::Fifo && limits.max_concurrent_runs == 0 {
                return Err(PyValueError::new_err(
                    "queue_discipline='adaptive' needs max_concurrent_runs >= 1 (no ceiling, no queue), got 0",
                ));
            }
            if let Some(fleet) = &fleet {
                // The fleet's lease queue orders tickets by the same classes, fleet-wide.
                let fleet_classes = admitgate_fleet::FleetClasses::new(
                    order.priorities.clone(),
                    order.fair,
                    order.weights.clone(),
                );
                fleet
                    .get()
                    .limit()?
                    .set_classes(fleet_classes)
                    .map_err(|err| PyValueError::new_err(format!("fleet: {}", err.reason)))?;
            }
            let core = Arc::new(Core::new(limits));
            let classes = ClassNames::new(&order, classed);
            // A fresh gate takes any order: nothing to wake.
            core.set_order(order)
                .map_err(|err| PyValueError::new_err(err.to_string()))?
                .run();
            if controller.is_some() || discipline != Discipline::Fifo {
                core.enable_overload(controller, discipline);
            }
            if fleet.is_some() {
                // A turn counts as admitted once it also has its lease.
                core.defer_admission();
            }
            register_gate(&core);
            let gate = Self {
                core,
                max_runs: AtomicU32::new(limits.max_concurrent_runs),
                per_scope: AtomicU32::new(limits.max_per_scope),
                queue_timeout_nanos: AtomicU64::new(0),
                policy: Mutex::new(policy.map(Bound::unbind)),
                native_policy: declared.native,
                resources,
                warned_policy: AtomicBool::new(false),
                fleet: fleet.map(Bound::unbind),
                lease_waits: LeaseWaits::default(),
                throttle_on: adaptive.as_ref().map(|a| a.get().throttle_types(py)),
                adaptive: adaptive.map(Bound::unbind),
                discipline,
                classes,
                rate_limits,
                estimator,
            };
            gate.set_queue_timeout(declared.queue_timeout);
            Ok(gate)
        })
    }

    /// Admits (or sheds) one turn: `async with gate.admit(session_id=..., transport=...)`.
    /// Raises `AdmissionRejected` on entry when the turn is rejected or evicted while waiting.
    #[pyo3(
        signature = (*, session_id=None, transport=None, on_queued=None, deadline_s=None, priority=None, cost=None, identity=None),
        text_signature = "($self, *, session_id='', transport='direct', on_queued=None, deadline_s=None, priority=None, cost=None, identity=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn admit(
        slf: &Bound<'_, Self>,
        session_id: Option<Bound<'_, PyAny>>,
        transport: Option<Bound<'_, PyAny>>,
        on_queued: Option<Bound<'_, PyAny>>,
        deadline_s: Option<Bound<'_, PyAny>>,
        priority: Option<Bound<'_, PyAny>>,
        cost: Option<Bound<'_, PyAny>>,
        identity: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Admission> {
        guard(|| {
            let mut args = admit_args(
                slf.get(),
                slf.py(),
                session_id,
                transport,
                on_queued,
                None,
                priority,
            )?;
            args.deadline = slf.get().caller_deadline(deadline_s.as_ref())?;
            (args.cost, args.identity) = budget_args(cost.as_ref(), identity.as_ref())?;
            Ok(Admission::new(slf.clone().unbind(), args))
        })
    }

    /// Admits one turn from a worker thread: `with gate.admit_sync(session_id=...)`. Blocks
    /// without the GIL while the turn waits, at most `timeout` seconds (and at most the
    /// gate's `queue_timeout_s`); raises `RuntimeError` at once on a thread running an event
    /// loop.
    #[pyo3(
        signature = (*, session_id=None, transport=None, timeout=None, on_queued=None, deadline_s=None, priority=None, cost=None, identity=None),
        text_signature = "($self, *, session_id='', transport='direct', timeout=None, on_queued=None, deadline_s=None, priority=None, cost=None, identity=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn admit_sync(
        slf: &Bound<'_, Self>,
        session_id: Option<Bound<'_, PyAny>>,
        transport: Option<Bound<'_, PyAny>>,
        timeout: Option<Bound<'_, PyAny>>,
        on_queued: Option<Bound<'_, PyAny>>,
        deadline_s: Option<Bound<'_, PyAny>>,
        priority: Option<Bound<'_, PyAny>>,
        cost: Option<Bound<'_, PyAny>>,
        identity: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Admission> {
        guard(|| {
            let timeout = match &timeout {
                Some(t) => args::timeout("timeout", t)?,
                None => None,
            };
            let mut args = admit_args(
                slf.get(),
                slf.py(),
                session_id,
                transport,
                on_queued,
                timeout,
                priority,
            )?;
            args.deadline = slf.get().caller_deadline(deadline_s.as_ref())?;
            (args.cost, args.identity) = budget_args(cost.as_ref(), identity.as_ref())?;
            Ok(Admission::new(slf.clone().unbind(), args))
        })
    }

    /// Changes limits while the gate runs: any subset of the arguments, the rest unchanged,
    /// each validated as at construction (a bad value changes nothing). Lowering the ceiling
    /// never cancels a running turn; raising it starts waiting turns at once. Shrinking the
    /// queue refuses the newest waiters of each lane past the new depth (`queue_full`),
    /// except under the `queue` overflow policy. Turns let through while the gate enforced
    /// nothing count against a ceiling set now. Memory pressure is sampled afresh: eased
    /// pressure (or `max_rss_mb=0`) starts the waiters it held back at once. Returns how many
    /// waiters were refused.
    #[pyo3(signature = (
        *,
        max_concurrent_runs=Arg(None),
        queue_depth=Arg(None),
        overflow_policy=Arg(None),
        max_concurrent_runs_per_scope=Arg(None),
        max_rss_mb=Arg(None),
        queue_timeout_s=Arg(None),
        priorities=None,
        default_priority=None,
        fairness=None,
        tenant_weights=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn reconfigure(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        max_concurrent_runs: Arg,
        queue_depth: Arg,
        overflow_policy: Arg,
        max_concurrent_runs_per_scope: Arg,
        max_rss_mb: Arg,
        queue_timeout_s: Arg,
        priorities: Option<Bound<'_, PyAny>>,
        default_priority: Option<Bound<'_, PyAny>>,
        fairness: Option<Bound<'_, PyAny>>,
        tenant_weights: Option<Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let this = slf.get();
        guard(|| {
            let order = this.reordered(
                py,
                priorities.as_ref(),
                default_priority.as_ref(),
                fairness.as_ref(),
                tenant_weights.as_ref(),
            )?;
            // Validate everything first: a bad value changes nothing.
            let current = this.core.limits();
            let count = |arg: &Arg, name: &'static str, old: u32| -> PyResult<u32> {
                if arg.given() {
                    arg.count(py, name)
                } else {
                    Ok(old)
                }
            };
            let limits = ConcurrencyLimit {
                max_concurrent_runs: count(
                    &max_concurrent_runs,
                    "max_concurrent_runs",
                    current.max_concurrent_runs,
                )?,
                queue_depth: count(&queue_depth, "queue_depth", current.queue_depth)?,
                overflow: if overflow_policy.given() {
                    overflow_policy.overflow(py)?
                } else {
                    current.overflow
                },
                max_per_scope: count(
                    &max_concurrent_runs_per_scope,
                    "max_concurrent_runs_per_scope",
                    current.max_per_scope,
                )?,
            };
            let timeout = if queue_timeout_s.given() {
                queue_timeout_s.timeout(py, "queue_timeout_s")?
            } else {
                this.queue_timeout()
            };
            let max_rss = if max_rss_mb.given() {
                this.resources.check_reconfigurable()?;
                Some(max_rss_mb.threshold(py, "max_rss_mb")?)
            } else {
                None
            };
            if this.native_policy || this.policy.lock().is_none() {
                let replacement = Py::new(
                    py,
                    PyConcurrencyLimitPolicy {
                        limit: limits,
                        queue_timeout: timeout,
                    },
                )?;
                if this.native_policy {
                    let old = this.policy.lock().replace(replacement.into_any());
                    drop(old);
                }
            }
            if let Some(max_rss) = max_rss {
                this.resources.set_max_rss_mb(py, max_rss)?;
            }
            if let Some(order) = order {
                this.classes.update(&order);
                this.core
                    .set_order(order)
                    .map_err(|err| PyValueError::new_err(err.to_string()))?
                    .run();
            }
            this.set_queue_timeout(timeout);
            this.max_runs
                .store(limits.max_concurrent_runs, Ordering::Relaxed);
            this.per_scope
                .store(limits.max_per_scope, Ordering::Relaxed);
            // The pressure under the new configuration: eased, or memory-aware admission
            // turned off, starts the waiters it held back at once.
            let resource = this.resources.decision(py);
            let (refused, wakes) = this.core.reconfigure(limits, Some(resource));
            wakes.run();
            // A higher ceiling under pressure that persists holds waiters back: re-sampled.
            pressure_check::ensure(py, slf);
            Ok(refused)
        })
    }

    /// Per tenant with turns running or waiting: `{tenant: {"in_flight": n, "queued": n}}`.
    /// Empty when per-tenant limits are off; idle tenants are not kept.
    fn scope_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guard(|| {
            let out = PyDict::new(py);
            for (scope, in_flight, queued) in self.core.scope_stats() {
                let d = PyDict::new(py);
                d.set_item("in_flight", in_flight)?;
                d.set_item("queued", queued)?;
                out.set_item(&*scope, d)?;
            }
            Ok(out)
        })
    }

    /// Stops admitting and refuses every queued turn (`closing`); returns
    /// `(running turns, waiters refused)`. Used by `close()` / `close_sync()`.
    fn _begin_close(&self, py: Python<'_>) -> PyResult<(u64, u64)> {
        guard(|| {
            let refused = self.core.begin_close(py);
            // Turns holding a slot while they wait for a fleet lease are waiting too: they
            // are refused with `closing`, not waited for.
            self.lease_waits.refuse_all(py, Rejection::Closing);
            let (running, leasing) = self.core.running_and_unconfirmed();
            Ok((
                running.saturating_sub(leasing),
                refused.saturating_add(leasing),
            ))
        })
    }

    /// Turns still running (holding a slot, granted, or parked on a human).
    fn _running(&self) -> PyResult<u64> {
        guard(|| Ok(self.core.running().0))
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> PyResult<bool> {
        guard(|| Ok(self.core.is_closing()))
    }

    /// A future on the running loop, resolved once a closing gate has nothing running;
    /// `None` when nothing runs already.
    fn _drained_future(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        guard(|| {
            let event_loop = running_loop(py)?.ok_or_else(|| {
                PyRuntimeError::new_err("gate.close() must be awaited inside a running event loop")
            })?;
            let fut = event_loop.call_method0(pyo3::intern!(py, "create_future"))?;
            let waiter = DrainWaiter::Loop {
                fut: fut.clone().unbind(),
                event_loop: event_loop.unbind(),
            };
            Ok(self.core.add_drain_waiter(waiter).then(|| fut.unbind()))
        })
    }

    /// Blocks (without the GIL) until a closing gate has nothing running or `timeout`
    /// seconds pass (`None`: no bound); whether it drained.
    #[pyo3(signature = (timeout=None))]
    fn _wait_drained(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        guard(|| {
            // An infinite or unrepresentably long timeout is no bound at all; NaN and
            // negatives are no wait (the Python wrapper validates before calling).
            let deadline = timeout
                .and_then(|t| Duration::try_from_secs_f64(t.max(0.0)).ok())
                .and_then(deadline_after);
            let signal = Arc::new(ThreadSignal::default());
            if !self
                .core
                .add_drain_waiter(DrainWaiter::Thread(signal.clone()))
            {
                return Ok(true);
            }
            loop {
                let slice = match deadline {
                    Some(d) => d.saturating_sub(now()).min(Duration::from_millis(100)),
                    None => Duration::from_millis(100),
                };
                if slice.is_zero() {
                    return Ok(self.core.running().0 == 0);
                }
                let waiting = signal.clone();
                if super::exit::detach_counted(py, move || waiting.wait(slice)) {
                    return Ok(true);
                }
                py.check_signals()?;
            }
        })
    }

    /// Drains the gate: stops admitting (newcomers are refused with `closing`), refuses
    /// every queued turn at once, never cancels a running turn, and waits up to
    /// `drain_timeout` seconds (`None`: as long as it takes) for the running turns to end.
    /// Returns a `DrainReport(finished, still_running, queued_rejected)`. A closed gate stays
    /// closed.
    #[pyo3(signature = (drain_timeout=None))]
    fn close<'py>(
        slf: &Bound<'py, Self>,
        drain_timeout: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        guard(|| drain_helper(slf.py(), "close")?.call1((slf, drain_timeout)))
    }

    /// [`close`](Self::close) for threaded code: blocks (without the GIL) until drained or
    /// `drain_timeout` passes, and returns the `DrainReport`.
    #[pyo3(signature = (drain_timeout=None))]
    fn close_sync<'py>(
        slf: &Bound<'py, Self>,
        drain_timeout: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        guard(|| drain_helper(slf.py(), "close_sync")?.call1((slf, drain_timeout)))
    }

    /// Whether the gate is active: a ceiling is set, or a memory-pressure policy with a
    /// threshold is.
    #[getter]
    fn enabled(&self, py: Python<'_>) -> PyResult<bool> {
        guard(|| Ok(self.is_enabled(py)))
    }

    /// The adaptive ceiling's settings (`adaptive=`), or `None`.
    #[getter(adaptive)]
    fn get_adaptive(&self, py: Python<'_>) -> Option<Py<PyAdaptiveLimit>> {
        self.adaptive.as_ref().map(|a| a.clone_ref(py))
    }

    /// `"fifo"` or `"adaptive"`.
    #[getter(queue_discipline)]
    fn get_queue_discipline(&self) -> &'static str {
        self.discipline.as_str()
    }

    /// The effective ceiling now: `max_concurrent_runs`, or what `adaptive=` learned below it
    /// (with `fleet=`, the fleet's learned limit, once read).
    #[getter(limit)]
    fn get_limit(&self, py: Python<'_>) -> PyResult<u64> {
        guard(|| match self.fleet_learned(py)? {
            Some(learned) => Ok(learned),
            None => Ok(self.core.stats(now).limit),
        })
    }

    /// The ceiling on concurrent runs (0: none).
    #[getter(max_concurrent_runs)]
    fn get_max_concurrent_runs(&self) -> PyResult<u32> {
        guard(|| Ok(self.max_concurrent_runs()))
    }

    /// Seconds a turn may wait before it is refused with `timeout`; `None`: no bound.
    #[getter(queue_timeout_s)]
    fn get_queue_timeout_s(&self) -> PyResult<Option<f64>> {
        guard(|| Ok(self.queue_timeout().map(|d| d.as_secs_f64())))
    }

    /// Whether in flight is at the cap that bounds the agent: the fleet cap (leases held
    /// across the fleet, last known) with a fleet limit, else the ceiling (never without one).
    #[getter]
    fn saturated(&self, py: Python<'_>) -> PyResult<bool> {
        guard(|| {
            if let Some(fleet) = &self.fleet {
                let s = fleet.get().fleet_stats(py)?;
                // The learned limit, when the fleet has one below its cap.
                let mut cap = u64::from(s.max_in_flight);
                if s.learned_limit > 0 {
                    cap = cap.min(s.learned_limit);
                }
                return Ok(s.fleet_in_flight >= cap);
            }
            // The effective ceiling: what an adaptive limit learned, else the configured one.
            let s = self.core.stats(now);
            Ok(s.limit > 0 && s.in_flight >= s.limit)
        })
    }

    /// The fleet-wide limit (`None` without one).
    #[getter(fleet)]
    fn get_fleet(&self, py: Python<'_>) -> Option<Py<PyFleetLimit>> {
        self.fleet.as_ref().map(|f| f.clone_ref(py))
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

    /// `rate_limit=`, in the order turns pass them (empty: none).
    #[getter(rate_limits)]
    fn rate_limits_getter(&self, py: Python<'_>) -> Vec<Py<PyRateLimit>> {
        self.rate_limits.iter().map(|l| l.clone_ref(py)).collect()
    }

    /// `estimator=`: a `RecentUsage`, the callable given, or `None`.
    #[getter(estimator)]
    fn estimator_getter(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.estimator.as_ref().map(|e| e.object(py))
    }

    /// Admitted turns parked on a human approval, not holding a slot.
    #[getter]
    fn awaiting_human(&self) -> PyResult<u64> {
        guard(|| Ok(self.core.stats(now).awaiting_human))
    }

    /// A snapshot of the counters, with the reference's keys (plus `cancelled`).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guard(|| {
            let (s, classes) = self.core.stats_and_classes(now);
            let limits = self.core.limits();
            let max_rss_mb = self.resources.max_rss_mb(py);
            let d = PyDict::new(py);
            d.set_item("max_concurrent_runs", limits.max_concurrent_runs)?;
            d.set_item("max_concurrent_runs_per_scope", limits.max_per_scope)?;
            d.set_item("queue_depth", limits.queue_depth)?;
            d.set_item("in_flight", s.in_flight)?;
            d.set_item("queued", s.queued)?;
            d.set_item("awaiting_human", s.awaiting_human)?;
            d.set_item("admitted", s.admitted)?;
            d.set_item("rejected", s.rejected)?;
            d.set_item("shed", s.shed)?;
            d.set_item("max_rss_mb", max_rss_mb)?;
            d.set_item("cancelled", s.cancelled)?;
            d.set_item("limit", s.limit)?;
            if self.classes.classed() {
                d.set_item("classes", priorities::classes_dict(py, &classes)?)?;
            }
            if !self.rate_limits.is_empty() {
                let per_limit = PyDict::new(py);
                for limit in &self.rate_limits {
                    let limit = limit.get();
                    let stats = limit.current().map(|l| l.stats()).unwrap_or_default();
                    per_limit.set_item(limit.limit_name(), stats_dict(py, &stats)?)?;
                }
                d.set_item("rate_limits", per_limit)?;
            }
            if let Some(fleet) = &self.fleet {
                let fleet_stats = fleet.get().fleet_stats(py)?;
                set_gate_fleet_keys(&d, &fleet_stats)?;
                if self.adaptive.is_some() {
                    // One learned limit for the fleet: `limit` is the fleet's, once read.
                    d.set_item("fleet_limit", fleet_stats.learned_limit)?;
                    if fleet_stats.learned_limit > 0 {
                        d.set_item("limit", fleet_stats.learned_limit)?;
                    }
                }
            }
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
                for (reason, count) in Rejection::ALL.iter().zip(t.rejected) {
                    rejected.set_item(reason.as_str(), count)?;
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
                PyTypeError::new_err(format!("transport must be a str, got {}", repr(transport)))
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
            let limits = self.core.limits();
            Ok(format!(
                "<AdmissionGate enabled={} max_concurrent_runs={} queue_depth={} overflow_policy={:?} max_concurrent_runs_per_scope={} in_flight={} queued={}>",
                if self.is_enabled(py) { "True" } else { "False" },
                limits.max_concurrent_runs,
                limits.queue_depth,
                limits.overflow.as_str(),
                limits.max_per_scope,
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
        if let Some(fleet) = &self.fleet {
            visit.call(fleet)?;
        }
        if let Some(adaptive) = &self.adaptive {
            visit.call(adaptive)?;
        }
        if let Some(types) = &self.throttle_on {
            visit.call(types)?;
        }
        for limit in &self.rate_limits {
            visit.call(limit)?;
        }
        if let Some(estimator) = &self.estimator {
            estimator.traverse(&visit)?;
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
#[allow(clippy::panic, reason = "the test hook panics on purpose")]
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
