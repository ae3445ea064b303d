//! `ConcurrencyLimitPolicy` and `MemoryPressurePolicy`: the pure decisions, callable from
//! Python with the reference's signatures. The gate does not call these methods on its fast
//! path: it recognises its own policies and decides in Rust.

use std::time::Duration;

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyTuple;

use super::args::{self, Arg};
use super::errors::{config_error, guard};
use admitgate_core::policy::{ConcurrencyLimit, Decision, Facts, MemoryPressure};

static DECISIONS: PyOnceLock<[Py<PyAny>; 3]> = PyOnceLock::new();

/// The `AdmissionDecision` member for `decision`: praisonaiagents' own members when it is
/// installed, so code comparing with `is` against its enum sees the same objects.
pub fn decision_object(py: Python<'_>, decision: Decision) -> PyResult<Py<PyAny>> {
    let members = DECISIONS.get_or_try_init(py, || -> PyResult<_> {
        let members = py.import("admitgate._decision")?.call_method0("members")?;
        let members = members.cast::<PyTuple>()?;
        Ok([
            members.get_item(0)?.unbind(),
            members.get_item(1)?.unbind(),
            members.get_item(2)?.unbind(),
        ])
    })?;
    let [admit, queue, reject] = members;
    let member = match decision {
        Decision::Admit => admit,
        Decision::Queue => queue,
        Decision::Reject => reject,
    };
    Ok(member.clone_ref(py))
}

/// The error for a policy method that answered something other than a decision.
pub fn not_a_decision(method: &str, answer: &Bound<'_, PyAny>) -> PyErr {
    pyo3::exceptions::PyTypeError::new_err(format!(
        "{method}() returned {}, not an AdmissionDecision",
        answer.repr().map(|r| r.to_string()).unwrap_or_default()
    ))
}

/// `(type(obj), args, obj.__dict__ or None)`: what pickle and `copy` rebuild a policy from,
/// keeping a subclass's own attributes.
fn reduce<'py>(
    slf: &Bound<'py, PyAny>,
    args: Bound<'py, PyTuple>,
) -> PyResult<Bound<'py, PyTuple>> {
    let state = slf
        .getattr("__dict__")
        .ok()
        .unwrap_or_else(|| slf.py().None().into_bound(slf.py()));
    PyTuple::new(
        slf.py(),
        [slf.get_type().into_any(), args.into_any(), state],
    )
}

/// Reads any decision object by its value: an `AdmissionDecision` of either package, a
/// plain string, or an enum whose `.value` is one of them. `None` for anything else.
pub fn decision_from(value: &Bound<'_, PyAny>) -> Option<Decision> {
    if let Ok(text) = value.extract::<String>() {
        return Decision::from_value(&text);
    }
    let inner = value.getattr("value").ok()?;
    let text = inner.extract::<String>().ok()?;
    Decision::from_value(&text)
}

/// Config-driven concurrency policy: a ceiling, a bounded wait queue, an overflow rule and
/// an optional per-scope (per-tenant) sub-limit. Decides exactly as PraisonAI's
/// `ConcurrencyLimitPolicy` does.
#[pyclass(
    frozen,
    subclass,
    weakref,
    module = "admitgate",
    name = "ConcurrencyLimitPolicy"
)]
pub struct PyConcurrencyLimitPolicy {
    pub limit: ConcurrencyLimit,
    /// How long a turn may wait before it is refused with `timeout`; `None`: no bound.
    pub queue_timeout: Option<Duration>,
}

#[pymethods]
impl PyConcurrencyLimitPolicy {
    #[new]
    #[pyo3(
        signature = (max_concurrent_runs=Arg(None), queue_depth=Arg(None), overflow_policy=Arg(None), max_concurrent_runs_per_scope=Arg(None), queue_timeout_s=Arg(None)),
        text_signature = "(max_concurrent_runs=0, queue_depth=0, overflow_policy='reject', max_concurrent_runs_per_scope=0, queue_timeout_s=None)"
    )]
    fn new(
        py: Python<'_>,
        max_concurrent_runs: Arg,
        queue_depth: Arg,
        overflow_policy: Arg,
        max_concurrent_runs_per_scope: Arg,
        queue_timeout_s: Arg,
    ) -> PyResult<Self> {
        guard(|| {
            Ok(Self {
                limit: ConcurrencyLimit {
                    max_concurrent_runs: max_concurrent_runs.count(py, "max_concurrent_runs")?,
                    queue_depth: queue_depth.count(py, "queue_depth")?,
                    overflow: overflow_policy.overflow(py)?,
                    max_per_scope: max_concurrent_runs_per_scope
                        .count(py, "max_concurrent_runs_per_scope")?,
                },
                queue_timeout: queue_timeout_s.timeout(py, "queue_timeout_s")?,
            })
        })
    }

    /// Seconds a turn may wait before it is refused with `timeout`; `None`: no bound.
    #[getter]
    fn queue_timeout_s(&self) -> PyResult<Option<f64>> {
        guard(|| Ok(self.queue_timeout.map(|d| d.as_secs_f64())))
    }

    /// Ceiling on concurrent runs; 0 disables admission control.
    #[getter]
    fn max_concurrent_runs(&self) -> PyResult<u32> {
        guard(|| Ok(self.limit.max_concurrent_runs))
    }

    /// Turns that may wait before the overflow policy applies.
    #[getter]
    fn queue_depth(&self) -> PyResult<u32> {
        guard(|| Ok(self.limit.queue_depth))
    }

    /// `"reject"`, `"queue"` or `"shed_oldest"`.
    #[getter]
    fn overflow_policy(&self) -> PyResult<&'static str> {
        guard(|| Ok(self.limit.overflow.as_str()))
    }

    /// Per-scope sub-limit within the ceiling; 0 disables it.
    #[getter]
    fn max_concurrent_runs_per_scope(&self) -> PyResult<u32> {
        guard(|| Ok(self.limit.max_per_scope))
    }

    /// Whether a ceiling is set.
    #[getter]
    fn enabled(&self) -> PyResult<bool> {
        guard(|| Ok(self.limit.enabled()))
    }

    /// Decides for one turn from the live facts.
    #[pyo3(
        signature = (*, in_flight, queued, session_id=Arg(None), scope=Arg(None), scope_in_flight=Arg(None), scope_queued=Arg(None)),
        text_signature = "($self, *, in_flight, queued, session_id='', scope='', scope_in_flight=0, scope_queued=0)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn decide(
        &self,
        py: Python<'_>,
        in_flight: &Bound<'_, PyAny>,
        queued: &Bound<'_, PyAny>,
        session_id: Arg,
        scope: Arg,
        scope_in_flight: Arg,
        scope_queued: Arg,
    ) -> PyResult<Py<PyAny>> {
        guard(|| {
            let text = |arg, value: &Arg| -> PyResult<bool> {
                match &value.0 {
                    None => Ok(false),
                    Some(v) => match v.bind(py).cast::<pyo3::types::PyString>() {
                        Ok(s) => Ok(s.len()? > 0),
                        Err(_) => Err(pyo3::exceptions::PyTypeError::new_err(format!(
                            "{arg} must be a str, got {}",
                            v.bind(py).repr()?
                        ))),
                    },
                }
            };
            text("session_id", &session_id)?;
            let scoped = text("scope", &scope)?;
            let optional = |arg, value: &Arg| match &value.0 {
                None => Ok(0),
                Some(v) => args::fact(arg, v.bind(py)),
            };
            let facts = Facts {
                in_flight: args::fact("in_flight", in_flight)?,
                queued: args::fact("queued", queued)?,
                scope_in_flight: optional("scope_in_flight", &scope_in_flight)?,
                scope_queued: optional("scope_queued", &scope_queued)?,
            };
            decision_object(py, self.limit.decide(&facts, scoped))
        })
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let l = slf.get().limit;
        let args = (
            l.max_concurrent_runs,
            l.queue_depth,
            l.overflow.as_str(),
            l.max_per_scope,
            slf.get().queue_timeout.map(|d| d.as_secs_f64()),
        )
            .into_pyobject(slf.py())?;
        reduce(slf.as_any(), args)
    }

    fn __repr__(&self) -> String {
        let timeout = match self.queue_timeout {
            Some(t) => format!(", queue_timeout_s={:?}", t.as_secs_f64()),
            None => String::new(),
        };
        format!(
            "ConcurrencyLimitPolicy(max_concurrent_runs={}, queue_depth={}, overflow_policy={:?}, max_concurrent_runs_per_scope={}{timeout})",
            self.limit.max_concurrent_runs,
            self.limit.queue_depth,
            self.limit.overflow.as_str(),
            self.limit.max_per_scope
        )
    }
}

/// The soft/hard RSS ladder: below soft admit, soft..hard queue, at or over hard reject.
#[pyclass(
    frozen,
    subclass,
    weakref,
    module = "admitgate",
    name = "MemoryPressurePolicy"
)]
pub struct PyMemoryPressurePolicy {
    pub ladder: MemoryPressure,
}

#[pymethods]
impl PyMemoryPressurePolicy {
    #[new]
    #[pyo3(
        signature = (soft_rss_mb=Arg(None), hard_rss_mb=Arg(None)),
        text_signature = "(soft_rss_mb=0.0, hard_rss_mb=0.0)"
    )]
    fn new(py: Python<'_>, soft_rss_mb: Arg, hard_rss_mb: Arg) -> PyResult<Self> {
        guard(|| {
            let soft = soft_rss_mb.threshold(py, "soft_rss_mb")?;
            let hard = hard_rss_mb.threshold(py, "hard_rss_mb")?;
            Ok(Self {
                ladder: MemoryPressure::new(soft, hard).map_err(config_error)?,
            })
        })
    }

    /// The ladder for one hard ceiling `max_rss_mb` (MiB), with the soft threshold at
    /// `soft_ratio` (clamped to `[0, 1]`) of it; `None` when the ceiling is 0 or `None`.
    #[staticmethod]
    #[pyo3(signature = (max_rss_mb, soft_ratio))]
    fn from_max_rss_mb(
        py: Python<'_>,
        max_rss_mb: &Bound<'_, PyAny>,
        soft_ratio: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Py<Self>>> {
        guard(|| {
            let hard = args::threshold("max_rss_mb", max_rss_mb)?;
            let ratio = args::number("soft_ratio", soft_ratio)?;
            match MemoryPressure::from_ceiling(hard, ratio) {
                Ok(Some(ladder)) => Ok(Some(Py::new(py, Self { ladder })?)),
                Ok(None) => Ok(None),
                Err(err) => Err(pyo3::exceptions::PyValueError::new_err(
                    err.describe(&soft_ratio.repr()?.to_string()),
                )),
            }
        })
    }

    /// Soft (queue) threshold in MiB; 0.0 when unset.
    #[getter]
    fn soft_rss_mb(&self) -> PyResult<f64> {
        guard(|| Ok(self.ladder.soft_rss_mb))
    }

    /// Hard (reject) threshold in MiB; 0.0 when unset.
    #[getter]
    fn hard_rss_mb(&self) -> PyResult<f64> {
        guard(|| Ok(self.ladder.hard_rss_mb))
    }

    /// Whether any threshold is set.
    #[getter]
    fn enabled(&self) -> PyResult<bool> {
        guard(|| Ok(self.ladder.enabled()))
    }

    /// Decides for one sample (any object with an `rss_mb` attribute; `None` admits).
    fn evaluate(&self, py: Python<'_>, sample: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        guard(|| {
            let rss = rss_of(sample)?;
            decision_object(py, self.ladder.evaluate(rss))
        })
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let ladder = slf.get().ladder;
        let args = (ladder.soft_rss_mb, ladder.hard_rss_mb).into_pyobject(slf.py())?;
        reduce(slf.as_any(), args)
    }

    fn __repr__(&self) -> String {
        format!(
            "MemoryPressurePolicy(soft_rss_mb={:?}, hard_rss_mb={:?})",
            self.ladder.soft_rss_mb, self.ladder.hard_rss_mb
        )
    }
}

/// A sample's `rss_mb`: `None` (unknown, which admits) when missing or `None`; a
/// `TypeError` when it is not a number.
pub fn rss_of(sample: &Bound<'_, PyAny>) -> PyResult<Option<f64>> {
    let Ok(value) = sample.getattr("rss_mb") else {
        return Ok(None);
    };
    if value.is_none() {
        return Ok(None);
    }
    let number = if value.is_instance_of::<pyo3::types::PyBool>() {
        None
    } else {
        value.extract::<f64>().ok().filter(|v| !v.is_nan())
    };
    number.map(Some).ok_or_else(|| {
        pyo3::exceptions::PyTypeError::new_err(format!(
            "sample.rss_mb must be a number or None, got {}",
            value.repr().map(|r| r.to_string()).unwrap_or_default()
        ))
    })
}
