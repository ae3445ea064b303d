//! Overload control in Python: `admitgate.AdaptiveLimit` (the adaptive ceiling's
//! settings), the `queue_discipline` and `deadline_s` arguments, the awaitable that hands an
//! adaptive gate's turn to `async with ... as turn`, and the simulator
//! (`admitgate._admitgate._simulate`, which `python -m admitgate simulate` drives).

use std::sync::Arc;
use std::time::Duration;

use pyo3::exceptions::{PyStopIteration, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple, PyType};

use super::args;
use super::awaitable::thrown;
use super::fleet::PyFleetLimit;
use super::runtime::now;
use admitgate_core::overload::sim::{
    self, Algorithm, Candidate, Ceiling, Clients, Provider, Scenario, Traffic,
};
use admitgate_core::overload::{CapacitySearch, CapacitySearchConfig, Discipline, LimitController};
use admitgate_core::{Order, Overflow, Priorities, PriorityClass};
use admitgate_fleet::{FleetLearner, LimitSource};

/// Learn the provider's real ceiling below `max_concurrent_runs` (see the README's
/// "Overload control"): `AdaptiveLimit(min_limit=1, initial_limit=None, throttle_on=())`.
#[pyclass(frozen, module = "admitgate", name = "AdaptiveLimit")]
pub struct PyAdaptiveLimit {
    min_limit: u32,
    initial_limit: Option<u32>,
    throttle_on: Py<PyTuple>,
}

#[pymethods]
impl PyAdaptiveLimit {
    #[new]
    #[pyo3(signature = (*, min_limit=None, initial_limit=None, throttle_on=None))]
    fn new(
        py: Python<'_>,
        min_limit: Option<Bound<'_, PyAny>>,
        initial_limit: Option<Bound<'_, PyAny>>,
        throttle_on: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let positive = |arg: &'static str, value: &Bound<'_, PyAny>| -> PyResult<u32> {
            // 1 is the least either takes: said so for a negative int too, not the
            // generic count's ">= 0".
            let below_one = value.is_instance_of::<pyo3::types::PyInt>()
                && !value.is_instance_of::<pyo3::types::PyBool>()
                && value.lt(1i64)?;
            if below_one {
                return Err(PyValueError::new_err(format!(
                    "{arg} must be >= 1, got {}",
                    args::repr(value)
                )));
            }
            let n = args::count(arg, value)?;
            if n == 0 {
                return Err(PyValueError::new_err(format!(
                    "{arg} must be >= 1, got {}",
                    args::repr(value)
                )));
            }
            Ok(n)
        };
        let min_limit = match &min_limit {
            Some(v) if !v.is_none() => positive("min_limit", v)?,
            _ => 1,
        };
        let initial_limit = match &initial_limit {
            Some(v) if !v.is_none() => Some(positive("initial_limit", v)?),
            _ => None,
        };
        if let Some(initial) = initial_limit {
            if initial < min_limit {
                return Err(PyValueError::new_err(format!(
                    "initial_limit ({initial}) must be >= min_limit ({min_limit})"
                )));
            }
        }
        Ok(Self {
            min_limit,
            initial_limit,
            throttle_on: exception_types(py, throttle_on)?,
        })
    }

    /// The lowest ceiling it sets.
    #[getter]
    fn min_limit(&self) -> u32 {
        self.min_limit
    }

    /// The ceiling before anything is learned (`None`: 4, or `max_concurrent_runs` if lower).
    #[getter]
    fn initial_limit(&self) -> Option<u32> {
        self.initial_limit
    }

    /// The exception types that, leaving a turn's block, report a provider throttle.
    #[getter]
    fn throttle_on(&self, py: Python<'_>) -> Py<PyTuple> {
        self.throttle_on.clone_ref(py)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let names: Vec<String> = self
            .throttle_on
            .bind(py)
            .iter()
            .map(|t| {
                t.getattr("__qualname__")
                    .map(|n| n.to_string())
                    .unwrap_or_else(|_| args::repr(&t))
            })
            .collect();
        let initial = self
            .initial_limit
            .map_or("None".to_owned(), |n| n.to_string());
        let trailing = if names.len() == 1 { "," } else { "" };
        format!(
            "AdaptiveLimit(min_limit={}, initial_limit={initial}, throttle_on=({}{trailing}))",
            self.min_limit,
            names.join(", ")
        )
    }
}

/// `throttle_on`: an exception type or a tuple / list of them.
fn exception_types(py: Python<'_>, value: Option<Bound<'_, PyAny>>) -> PyResult<Py<PyTuple>> {
    let Some(value) = value.filter(|v| !v.is_none()) else {
        return Ok(PyTuple::empty(py).unbind());
    };
    let base = py.get_type::<pyo3::exceptions::PyBaseException>();
    let bad = |v: &Bound<'_, PyAny>| {
        PyTypeError::new_err(format!(
            "throttle_on must be an exception type or a tuple of them, got {}",
            args::repr(v)
        ))
    };
    let items: Vec<Bound<'_, PyAny>> = if value.is_instance_of::<PyType>() {
        vec![value.clone()]
    } else if value.is_instance_of::<PyTuple>() || value.is_instance_of::<PyList>() {
        value.try_iter()?.collect::<PyResult<_>>()?
    } else {
        return Err(bad(&value));
    };
    for item in &items {
        let is_exception = item
            .cast::<PyType>()
            .map(|t| t.is_subclass(&base).unwrap_or(false))
            .unwrap_or(false);
        if !is_exception {
            return Err(bad(item));
        }
    }
    Ok(PyTuple::new(py, items)?.unbind())
}

impl PyAdaptiveLimit {
    /// The controller for a gate whose `max_concurrent_runs` is `max` (at least 1).
    pub fn controller(&self, max: u32) -> PyResult<Box<dyn LimitController>> {
        if max == 0 {
            return Err(PyValueError::new_err(
                "adaptive= needs max_concurrent_runs >= 1 (the most the gate will ever allow), got 0",
            ));
        }
        if self.min_limit > max {
            return Err(PyValueError::new_err(format!(
                "AdaptiveLimit(min_limit={}) exceeds max_concurrent_runs={max}",
                self.min_limit
            )));
        }
        let mut config = CapacitySearchConfig::new(u64::from(max));
        config.min_limit = u64::from(self.min_limit);
        if let Some(initial) = self.initial_limit {
            config.initial_limit = u64::from(initial);
        }
        config.initial_limit = config.initial_limit.max(config.min_limit);
        Ok(Box::new(CapacitySearch::new(config)))
    }

    /// The controller of a gate with `fleet=` too: one learned limit for the whole fleet,
    /// between `min_limit` and the fleet's `max_in_flight`, kept in Redis beside the fleet's
    /// leases (see `admitgate_fleet::FleetLearner`). `max` is the gate's
    /// `max_concurrent_runs`, which still bounds this replica's own ceiling.
    pub fn fleet_controller(
        &self,
        max: u32,
        fleet: &Bound<'_, PyFleetLimit>,
    ) -> PyResult<Box<dyn LimitController>> {
        // The same checks as without a fleet: the gate's own ceiling must exist.
        self.controller(max)?;
        let cap = fleet.get().config().max_in_flight;
        if self.min_limit > cap {
            return Err(PyValueError::new_err(format!(
                "AdaptiveLimit(min_limit={}) exceeds the fleet's max_in_flight={cap}",
                self.min_limit
            )));
        }
        let mut config = CapacitySearchConfig::new(u64::from(cap));
        config.min_limit = u64::from(self.min_limit);
        if let Some(initial) = self.initial_limit {
            config.initial_limit = u64::from(initial);
        }
        config.initial_limit = config.initial_limit.max(config.min_limit);
        let fleet: Py<PyFleetLimit> = fleet.clone().unbind();
        let source: LimitSource = Arc::new(move || fleet.get().current_limit());
        Ok(Box::new(FleetLearner::new(config, source)))
    }

    /// The exception types that report a throttle.
    pub fn throttle_types(&self, py: Python<'_>) -> Py<PyTuple> {
        self.throttle_on.clone_ref(py)
    }
}

/// `queue_discipline`: `"fifo"` (or `None`) or `"adaptive"`.
pub fn discipline(value: Option<&Bound<'_, PyAny>>) -> PyResult<Discipline> {
    let Some(value) = value.filter(|v| !v.is_none()) else {
        return Ok(Discipline::Fifo);
    };
    let parsed = value
        .cast::<PyString>()
        .ok()
        .and_then(|text| text.to_str().ok().map(|t| t.trim().to_ascii_lowercase()))
        .and_then(|text| Discipline::parse(&text));
    parsed.ok_or_else(|| {
        PyValueError::new_err(format!(
            "queue_discipline must be one of ('fifo', 'adaptive'), got {}",
            args::repr(value)
        ))
    })
}

/// `deadline_s`: the seconds the caller will wait for the whole turn, as a deadline on
/// [`now`]'s clock; `None` for none.
pub fn deadline(value: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Duration>> {
    let Some(value) = value.filter(|v| !v.is_none()) else {
        return Ok(None);
    };
    let seconds = args::number("deadline_s", value)?;
    if !(seconds.is_finite() && seconds >= 0.0) {
        return Err(PyValueError::new_err(format!(
            "deadline_s must be a finite number of seconds >= 0 or None, got {}",
            args::repr(value)
        )));
    }
    let left = Duration::try_from_secs_f64(seconds).map_err(|_| {
        PyValueError::new_err(format!(
            "deadline_s is too large, got {}",
            args::repr(value)
        ))
    })?;
    Ok(Some(now().saturating_add(left)))
}

/// The awaitable `__aenter__` returns for a turn of an adaptive gate that runs at once: it
/// finishes at once with the admission, so `async with gate.admit() as turn` can report a
/// throttle (`turn.report_throttled()`).
#[pyclass(frozen, module = "admitgate._admitgate")]
pub struct Entered {
    /// The turn's `Admission`.
    admission: Py<PyAny>,
}

impl Entered {
    /// The awaitable of `admission` (an `Admission`), which runs now.
    pub fn new(admission: Py<PyAny>) -> Self {
        Self { admission }
    }
}

#[pymethods]
impl Entered {
    fn __await__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Finished at once, the admission being the awaited value: `StopIteration(admission)`
    /// is set through the C API and no item is returned (`tp_iternext`'s NULL). PyO3's error
    /// path would build and normalise the exception object on every turn (about 800
    /// instructions of a 10,000-instruction turn, issue 26's profile); CPython reads the
    /// value without it (3.11), or builds it once (3.12+). The admission is never a tuple,
    /// which `PyErr_SetObject` would unpack as the exception's arguments.
    fn __next__(&self) -> Option<Py<PyAny>> {
        // Safety: called attached to the interpreter (a pymethod); the type is a live
        // exception class and the admission a live object, and the call takes its own
        // references to both.
        unsafe {
            pyo3::ffi::PyErr_SetObject(pyo3::ffi::PyExc_StopIteration, self.admission.as_ptr())
        };
        None
    }

    // A method, not the slot: returning `None` here would return `None` to the caller, so the
    // exception goes through PyO3.
    #[pyo3(signature = (_value))]
    fn send(&self, py: Python<'_>, _value: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        Err(PyStopIteration::new_err(self.admission.clone_ref(py)))
    }

    #[pyo3(signature = (typ, val=None, tb=None))]
    fn throw(
        &self,
        typ: &Bound<'_, PyAny>,
        val: Option<&Bound<'_, PyAny>>,
        tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        Err(thrown(typ, val, tb))
    }

    fn close(&self) {}

    fn __traverse__(&self, visit: pyo3::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        visit.call(&self.admission)
    }
}

fn item<'py, T>(d: &Bound<'py, PyDict>, key: &str, default: T) -> PyResult<T>
where
    T: pyo3::conversion::FromPyObjectOwned<'py>,
{
    match d.get_item(key)? {
        Some(v) if !v.is_none() => v.extract::<T>().map_err(|err| {
            let err: PyErr = err.into();
            PyValueError::new_err(format!("{key}: {err}"))
        }),
        _ => Ok(default),
    }
}

fn seconds(value: f64, what: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value).map_err(|_| {
        PyValueError::new_err(format!(
            "{what} must be a number of seconds >= 0, got {value}"
        ))
    })
}

fn scenario_of(d: &Bound<'_, PyDict>) -> PyResult<Scenario> {
    let phases: Vec<(f64, u64)> = item(d, "capacity", vec![(0.0, 8)])?;
    let mut capacity = Vec::new();
    for (at, c) in phases {
        capacity.push((seconds(at, "a capacity change's time")?, c));
    }
    Ok(Scenario {
        name: item(d, "name", "scenario".to_owned())?,
        provider: Provider {
            capacity,
            service_mean: seconds(item(d, "service_s", 0.05)?, "service_s")?,
            service_sigma: item(d, "service_sigma", 0.25)?,
            refusal_latency: seconds(item(d, "refusal_s", 0.001)?, "refusal_s")?,
        },
        clients: Clients {
            patience: seconds(item(d, "patience_s", 0.5)?, "patience_s")?,
            load: item(d, "load", 10.0)?,
            send_deadline: item(d, "send_deadline", false)?,
        },
        duration: seconds(item(d, "duration_s", 30.0)?, "duration_s")?,
        seed: item(d, "seed", 17)?,
        traffic: item::<Vec<(String, f64, Option<f64>)>>(d, "traffic", Vec::new())?
            .into_iter()
            .map(|(class, share, patience)| {
                Ok(Traffic {
                    class,
                    share,
                    patience: patience
                        .map(|p| seconds(p, "a class's patience"))
                        .transpose()?,
                })
            })
            .collect::<PyResult<_>>()?,
        tenants: item(d, "tenants", 0)?,
    })
}

/// One kind of traffic in a report: name, offered, served, goodput, p99 queue wait (s), and
/// `(goodput, mean wait s)` per timeline point.
type ClassRow = (String, u64, u64, f64, f64, Vec<(f64, f64)>);

/// A candidate's `priorities` (`[(name, min_share, max_share)]`), `default_priority` and
/// `fair` as the queue's order; `None` without classes and without fairness.
fn order_of(d: &Bound<'_, PyDict>) -> PyResult<Option<Order>> {
    let classes: Vec<(String, f64, f64)> = item(d, "priorities", Vec::new())?;
    let fair: bool = item(d, "fair", !classes.is_empty())?;
    if classes.is_empty() && !fair {
        return Ok(None);
    }
    let priorities = if classes.is_empty() {
        Priorities::default()
    } else {
        let default: Option<String> = item(d, "default_priority", None)?;
        let classes = classes
            .iter()
            .map(|(name, min, max)| PriorityClass::shared(name, *min, *max))
            .collect();
        Priorities::new(classes, default.as_deref())
            .map_err(|e| PyValueError::new_err(e.to_string()))?
    };
    Ok(Some(Order {
        priorities,
        fair,
        weights: Default::default(),
    }))
}

fn candidate_of(d: &Bound<'_, PyDict>) -> PyResult<Candidate> {
    let max: u32 = item(d, "max_concurrent_runs", 64)?;
    let kind: String = item(d, "ceiling", "fixed".to_owned())?;
    let ceiling = match kind.as_str() {
        "none" => Ceiling::NoGate,
        "fixed" => Ceiling::Fixed(max),
        "adaptive" => Ceiling::Adaptive(Algorithm::Admitgate, max),
        "aimd" => Ceiling::Adaptive(Algorithm::Aimd, max),
        "gradient2" => Ceiling::Adaptive(Algorithm::Gradient2, max),
        other => {
            return Err(PyValueError::new_err(format!(
                "ceiling must be one of ('none', 'fixed', 'adaptive', 'aimd', 'gradient2'), got {other:?}"
            )))
        }
    };
    let discipline_name: String = item(d, "queue_discipline", "fifo".to_owned())?;
    let discipline = match discipline_name.as_str() {
        "codel" => Discipline::Codel,
        other => Discipline::parse(other).ok_or_else(|| {
            PyValueError::new_err(format!(
                "queue_discipline must be one of ('fifo', 'adaptive', 'codel'), got {other:?}"
            ))
        })?,
    };
    let overflow: String = item(d, "overflow_policy", "reject".to_owned())?;
    let timeout: Option<f64> = item(d, "queue_timeout_s", None)?;
    Ok(Candidate {
        name: item(d, "name", kind.clone())?,
        ceiling,
        queue_depth: item(d, "queue_depth", 32)?,
        overflow: Overflow::parse(&overflow)
            .map_err(|err| PyValueError::new_err(err.to_string()))?,
        queue_timeout: timeout.map(|t| seconds(t, "queue_timeout_s")).transpose()?,
        discipline,
        order: order_of(d)?,
    })
}

/// The scenarios (see [`sim::standard`]) as the dicts [`_simulate`] takes, each
/// capacity phase (and each fixed-capacity run's third) `phase_s` seconds long.
#[pyfunction]
pub fn _standard_scenarios(py: Python<'_>, phase_s: f64, seed: u64) -> PyResult<Bound<'_, PyList>> {
    let out = PyList::empty(py);
    for scenario in sim::standard(seconds(phase_s, "phase_s")?, seed) {
        let d = PyDict::new(py);
        d.set_item("name", &scenario.name)?;
        let capacity: Vec<(f64, u64)> = scenario
            .provider
            .capacity
            .iter()
            .map(|&(at, c)| (at.as_secs_f64(), c))
            .collect();
        d.set_item("capacity", capacity)?;
        d.set_item("service_s", scenario.provider.service_mean.as_secs_f64())?;
        d.set_item("service_sigma", scenario.provider.service_sigma)?;
        d.set_item("refusal_s", scenario.provider.refusal_latency.as_secs_f64())?;
        d.set_item("patience_s", scenario.clients.patience.as_secs_f64())?;
        d.set_item("load", scenario.clients.load)?;
        d.set_item("send_deadline", scenario.clients.send_deadline)?;
        d.set_item("duration_s", scenario.duration.as_secs_f64())?;
        d.set_item("seed", scenario.seed)?;
        out.append(d)?;
    }
    Ok(out)
}

/// Runs each candidate gate (a dict) in the scenario (a dict) in the simulator; returns one
/// report dict per candidate. The keys are those of `python -m admitgate simulate`.
#[pyfunction]
pub fn _simulate<'py>(
    py: Python<'py>,
    scenario: &Bound<'py, PyDict>,
    candidates: &Bound<'py, PyList>,
) -> PyResult<Bound<'py, PyList>> {
    let scenario = scenario_of(scenario)?;
    let candidates: Vec<Candidate> = candidates
        .iter()
        .map(|c| candidate_of(c.cast::<PyDict>()?))
        .collect::<PyResult<_>>()?;
    let reports: Vec<sim::Report> =
        py.detach(|| candidates.iter().map(|c| sim::run(&scenario, c)).collect());
    let out = PyList::empty(py);
    for report in reports {
        let d = PyDict::new(py);
        d.set_item("gate", &report.candidate)?;
        d.set_item("scenario", &report.scenario)?;
        d.set_item("offered", report.offered)?;
        d.set_item("served", report.served)?;
        d.set_item("goodput", report.goodput)?;
        d.set_item("p99_s", report.p99.as_secs_f64())?;
        d.set_item("provider_calls", report.provider_calls)?;
        d.set_item("provider_429s", report.throttled)?;
        d.set_item("busy", report.refused)?;
        d.set_item("left_queued", report.left_queued)?;
        d.set_item("left_running", report.left_running)?;
        d.set_item("phase_limits", report.phase_limits.clone())?;
        let timeline: Vec<(f64, f64, u64, u64, f64)> = report
            .timeline
            .iter()
            .map(|p| (p.at_s, p.goodput, p.limit, p.capacity, p.throttled_share))
            .collect();
        d.set_item("timeline", timeline)?;
        let classes: Vec<ClassRow> = report
            .classes
            .iter()
            .map(|c| {
                let timeline = c.timeline.iter().map(|p| (p.goodput, p.mean_wait_s));
                (
                    c.name.clone(),
                    c.offered,
                    c.served,
                    c.goodput,
                    c.p99_wait.as_secs_f64(),
                    timeline.collect(),
                )
            })
            .collect();
        d.set_item("classes", classes)?;
        out.append(d)?;
    }
    Ok(out)
}
