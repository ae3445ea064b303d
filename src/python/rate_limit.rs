//! `admitgate.RateLimit`: a budget as Python configures it (requests and tokens per identity
//! per window, local or fleet-wide), over passage's [`RateLimiter`].
//!
//! Every argument is validated here, with a message that names it and shows the bad value (a
//! Redis URL always with its password redacted). The limiter is built in the constructor and
//! rebuilt, empty, in a forked child (the parent's locks and runtime are not the child's).

use std::sync::Arc;
use std::time::Duration;

use admitgate_budget::{Budget, Limit, Meter, Rate, DEFAULT_MAX_KEYS};
use admitgate_fleet::{BudgetFallback, FleetBudget, FleetConfig};
use admitgate_passage::budget::{BudgetBackend, OnLimit, RateLimitStats, RateLimiter};
use parking_lot::Mutex;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use pyo3::{PyTraverseError, PyVisit};

use super::errors::guard;
use super::fleet::{runtime_epoch, runtime_handle, PyFleetLimit};

fn repr(value: &Bound<'_, PyAny>) -> String {
    value
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "<unrepresentable>".to_owned())
}

/// Where a rate limit decides: here, on a `FleetLimit`'s connection, or on its own URL.
enum Fleet {
    Local,
    Shared(Py<PyFleetLimit>),
    /// The URL as given (never shown) and as shown (password redacted).
    Url {
        url: String,
        shown: String,
    },
}

/// The limiter of the current runtime epoch.
struct Built {
    limiter: Arc<RateLimiter>,
    epoch: u64,
}

/// A budget: at most `requests` turns and `tokens` tokens per identity per window, exact in
/// any window (or GCRA with `burst=`), decided before a turn's slot. See ``docs/budgets.md``.
#[pyclass(frozen, module = "admitgate", name = "RateLimit")]
pub struct PyRateLimit {
    requests: Vec<(String, Rate)>,
    tokens: Vec<(String, Rate)>,
    key: Option<Py<PyAny>>,
    fleet: Fleet,
    on_limit: OnLimit,
    name: String,
    on_backend_error: BudgetFallback,
    burst: Option<u64>,
    built: Mutex<Option<Built>>,
}

/// One limit: `"N/s"`, `"N/min"`, `"N/h"`, `"N/day"`, or `(N, seconds)`.
fn rate(arg: &'static str, value: &Bound<'_, PyAny>) -> PyResult<(String, Rate)> {
    let invalid = |err: admitgate_budget::BudgetError| {
        PyValueError::new_err(format!("{arg}={}: {}", repr(value), err.reason()))
    };
    if let Ok(text) = value.cast::<PyString>() {
        let text = text.to_str()?;
        let parsed = Rate::parse(arg, text).map_err(invalid)?;
        return Ok((text.to_owned(), parsed));
    }
    if let Ok(pair) = value.cast::<PyTuple>() {
        if pair.len() == 2 {
            let amount = pair.get_item(0)?;
            let seconds = pair.get_item(1)?;
            let amount_ok = amount.is_instance_of::<PyInt>() && !amount.is_instance_of::<PyBool>();
            let seconds_ok = (seconds.is_instance_of::<PyInt>()
                || seconds.is_instance_of::<PyFloat>())
                && !seconds.is_instance_of::<PyBool>();
            if amount_ok && seconds_ok {
                let amount: u64 = amount.extract().map_err(|_| {
                    PyValueError::new_err(format!(
                        "{arg}={}: the amount must be 1 to {}",
                        repr(value),
                        admitgate_budget::rate::MAX_AMOUNT
                    ))
                })?;
                let seconds: f64 = seconds.extract()?;
                let window = Duration::try_from_secs_f64(seconds).map_err(|_| {
                    PyValueError::new_err(format!(
                        "{arg}={}: the window must be 1 ms to 366 days",
                        repr(value)
                    ))
                })?;
                let parsed = Rate::new(arg, amount, window).map_err(invalid)?;
                return Ok((format!("({amount}, {seconds})"), parsed));
            }
        }
    }
    Err(PyTypeError::new_err(format!(
        "{arg} must be \"N/s\", \"N/min\", \"N/h\", \"N/day\", a tuple (N, seconds) or a list of them, got {}",
        repr(value)
    )))
}

/// `requests=` / `tokens=`: one limit or a list of them.
fn rates(arg: &'static str, value: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<(String, Rate)>> {
    let Some(value) = value.filter(|v| !v.is_none()) else {
        return Ok(Vec::new());
    };
    if let Ok(list) = value.cast::<PyList>() {
        if list.is_empty() {
            return Err(PyValueError::new_err(format!(
                "{arg} must name at least one limit, got []"
            )));
        }
        return list.iter().map(|item| rate(arg, &item)).collect();
    }
    Ok(vec![rate(arg, value)?])
}

fn text<'py>(arg: &str, value: &Bound<'py, PyAny>, must: &str) -> PyResult<String> {
    value
        .cast::<PyString>()
        .map_err(|_| PyTypeError::new_err(format!("{arg} must be {must}, got {}", repr(value))))?
        .to_str()
        .map(str::to_owned)
}

fn check_name(value: &Bound<'_, PyAny>) -> PyResult<String> {
    let name = text("name", value, "a str")?;
    if name.is_empty()
        || name.chars().count() > 100
        || name
            .chars()
            .any(|c| c == '{' || c == '}' || c.is_whitespace() || c.is_control())
    {
        return Err(PyValueError::new_err(format!(
            "name must be 1 to 100 characters with no braces, spaces or control characters, got {}",
            repr(value)
        )));
    }
    Ok(name)
}

impl PyRateLimit {
    /// Its limits, in order (requests first).
    pub(super) fn limits(&self) -> PyResult<Vec<Limit>> {
        let meters = self
            .requests
            .iter()
            .map(|(_, r)| (Meter::Requests, *r))
            .chain(self.tokens.iter().map(|(_, r)| (Meter::Tokens, *r)));
        meters
            .map(|(meter, rate)| match self.burst {
                None => Ok(Limit::sliding(meter, rate)),
                Some(burst) => Limit::gcra(meter, rate, burst).map_err(|err| {
                    PyValueError::new_err(format!("burst={burst}: {}", err.reason()))
                }),
            })
            .collect()
    }

    fn build(&self) -> PyResult<Arc<RateLimiter>> {
        let local = Budget::new(self.limits()?, DEFAULT_MAX_KEYS)
            .map_err(|err| PyValueError::new_err(err.to_string()))?;
        let config_error =
            |err: admitgate_fleet::ConfigError| PyValueError::new_err(err.to_string());
        let backend = match &self.fleet {
            Fleet::Local => BudgetBackend::Local(Box::new(local)),
            Fleet::Shared(limit) => {
                let limit = limit.get().limit()?;
                BudgetBackend::Fleet(
                    FleetBudget::new(&limit, &self.name, local, self.on_backend_error)
                        .map_err(config_error)?,
                )
            }
            Fleet::Url { url, .. } => {
                let handle = runtime_handle()?;
                BudgetBackend::Fleet(
                    FleetBudget::with_url(url, &self.name, local, self.on_backend_error, handle)
                        .map_err(config_error)?,
                )
            }
        };
        Ok(Arc::new(RateLimiter::new(
            &self.name,
            backend,
            self.on_limit,
        )))
    }

    /// The limiter of this process (rebuilt, empty, in a forked child).
    pub fn limiter(&self) -> PyResult<Arc<RateLimiter>> {
        let epoch = runtime_epoch();
        if let Some(built) = &*self.built.lock() {
            if built.epoch == epoch {
                return Ok(built.limiter.clone());
            }
        }
        // Built without the lock: building a fleet budget may call into Python.
        let fresh = self.build()?;
        let mut built = self.built.lock();
        match &*built {
            Some(b) if b.epoch == epoch => Ok(b.limiter.clone()),
            _ => {
                *built = Some(Built {
                    limiter: fresh.clone(),
                    epoch,
                });
                Ok(fresh)
            }
        }
    }

    /// The limiter already built (for stats: never builds).
    pub fn current(&self) -> Option<Arc<RateLimiter>> {
        self.built.lock().as_ref().map(|b| b.limiter.clone())
    }

    /// The key callable, if any.
    pub fn key(&self) -> Option<&Py<PyAny>> {
        self.key.as_ref()
    }

    /// The limit's name.
    pub fn limit_name(&self) -> &str {
        &self.name
    }
}

/// The stats of one limiter as a dict (no per-identity numbers).
pub fn stats_dict<'py>(py: Python<'py>, s: &RateLimitStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("allowed", s.allowed)?;
    d.set_item("limited", s.limited)?;
    d.set_item("waited", s.waited)?;
    d.set_item("unavailable", s.unavailable)?;
    d.set_item("tokens_reserved", s.tokens_reserved)?;
    d.set_item("settled", s.settled)?;
    d.set_item("tokens_settled", s.tokens_settled)?;
    d.set_item("returned", s.returned)?;
    d.set_item("tokens_returned", s.tokens_returned)?;
    d.set_item("keys", s.keys)?;
    if let Some(f) = &s.fleet {
        d.set_item("fleet_decisions", f.fleet_decisions)?;
        d.set_item("known_refusals", f.known_refusals)?;
        d.set_item("offline_decisions", f.offline_decisions)?;
        d.set_item("settles_lost", f.settles_lost)?;
    }
    Ok(d)
}

fn shown_rates(rates: &[(String, Rate)]) -> Vec<String> {
    rates.iter().map(|(shown, _)| shown.clone()).collect()
}

#[pymethods]
impl PyRateLimit {
    #[new]
    #[pyo3(
        signature = (
            requests=None, tokens=None, key=None, fleet=None, on_limit=None, name=None,
            on_backend_error=None, burst=None
        ),
        text_signature = "(requests=None, tokens=None, key=None, fleet=None, on_limit='reject', name='default', on_backend_error='local', burst=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        requests: Option<Bound<'_, PyAny>>,
        tokens: Option<Bound<'_, PyAny>>,
        key: Option<Bound<'_, PyAny>>,
        fleet: Option<Bound<'_, PyAny>>,
        on_limit: Option<Bound<'_, PyAny>>,
        name: Option<Bound<'_, PyAny>>,
        on_backend_error: Option<Bound<'_, PyAny>>,
        burst: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        guard(|| {
            let requests = rates("requests", requests.as_ref())?;
            let tokens = rates("tokens", tokens.as_ref())?;
            if requests.is_empty() && tokens.is_empty() {
                return Err(PyValueError::new_err(
                    "RateLimit needs requests= or tokens= (e.g. requests=\"60/min\"), got neither",
                ));
            }
            let key = match key.filter(|k| !k.is_none()) {
                Some(k) if k.is_callable() => Some(k.unbind()),
                Some(k) => {
                    return Err(PyTypeError::new_err(format!(
                        "key must be a callable of the session id (returning str or bytes) or None, got {}",
                        repr(&k)
                    )))
                }
                None => None,
            };
            let on_limit = match on_limit.filter(|v| !v.is_none()) {
                None => OnLimit::Reject,
                Some(v) => {
                    let given = text("on_limit", &v, "\"reject\" or \"wait\"")?;
                    given.parse().map_err(|_| {
                        PyValueError::new_err(format!(
                            "on_limit must be \"reject\" or \"wait\", got {}",
                            repr(&v)
                        ))
                    })?
                }
            };
            let name = match name.filter(|v| !v.is_none()) {
                None => "default".to_owned(),
                Some(v) => check_name(&v)?,
            };
            let on_backend_error = match on_backend_error.filter(|v| !v.is_none()) {
                None => BudgetFallback::Local,
                Some(v) => {
                    let given = text("on_backend_error", &v, "\"local\", \"reject\" or \"allow\"")?;
                    given.parse().map_err(|_| {
                        PyValueError::new_err(format!(
                            "on_backend_error must be \"local\", \"reject\" or \"allow\", got {}",
                            repr(&v)
                        ))
                    })?
                }
            };
            let burst = match burst.filter(|v| !v.is_none()) {
                None => None,
                Some(v) => {
                    if v.is_instance_of::<PyBool>() || !v.is_instance_of::<PyInt>() {
                        return Err(PyTypeError::new_err(format!(
                            "burst must be an int >= 1 or None, got {}",
                            repr(&v)
                        )));
                    }
                    match v.extract::<u64>() {
                        Ok(b) if (1..=admitgate_budget::rate::MAX_AMOUNT).contains(&b) => Some(b),
                        _ => {
                            return Err(PyValueError::new_err(format!(
                                "burst must be 1 to {}, got {}",
                                admitgate_budget::rate::MAX_AMOUNT,
                                repr(&v)
                            )))
                        }
                    }
                }
            };
            let fleet = match fleet.filter(|v| !v.is_none()) {
                None => Fleet::Local,
                Some(f) => {
                    if let Ok(limit) = f.cast::<PyFleetLimit>() {
                        Fleet::Shared(limit.clone().unbind())
                    } else if let Ok(url) = f.cast::<PyString>() {
                        let url = url.to_str()?.to_owned();
                        let shown =
                            FleetConfig::new(url.clone(), "admitgate:budget", 1).redacted_url();
                        Fleet::Url { url, shown }
                    } else {
                        // Never the repr of the value: it may carry a password.
                        return Err(PyTypeError::new_err(format!(
                            "fleet must be a Redis URL (str), an admitgate.FleetLimit or None, got a {}",
                            f.get_type().name().map(|n| n.to_string()).unwrap_or_default()
                        )));
                    }
                }
            };
            if burst.is_some() && !matches!(fleet, Fleet::Local) {
                return Err(PyValueError::new_err(format!(
                    "burst={}: a fleet-wide RateLimit decides exact sliding windows only; burst= (GCRA) is for a local one (fleet=None)",
                    burst.unwrap_or_default()
                )));
            }
            let this = PyRateLimit {
                requests,
                tokens,
                key,
                fleet,
                on_limit,
                name,
                on_backend_error,
                burst,
                built: Mutex::new(None),
            };
            let limiter = this.build()?;
            *this.built.lock() = Some(Built {
                limiter,
                epoch: runtime_epoch(),
            });
            Ok(this)
        })
    }

    /// The request limits, as given.
    #[getter]
    fn requests(&self) -> Vec<String> {
        shown_rates(&self.requests)
    }

    /// The token limits, as given.
    #[getter]
    fn tokens(&self) -> Vec<String> {
        shown_rates(&self.tokens)
    }

    /// The name: its keys' namespace in Redis, its label in stats and metrics.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// `"reject"` or `"wait"`.
    #[getter]
    fn on_limit(&self) -> &'static str {
        self.on_limit.as_str()
    }

    /// `"local"`, `"reject"` or `"allow"`: what a fleet-wide limit does while Redis is down.
    #[getter]
    fn on_backend_error(&self) -> &'static str {
        self.on_backend_error.as_str()
    }

    /// The GCRA burst, or `None` (exact sliding windows).
    #[getter]
    fn burst(&self) -> Option<u64> {
        self.burst
    }

    /// The key callable, or `None` (the session id).
    #[getter(key)]
    fn key_getter(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.key.as_ref().map(|k| k.clone_ref(py))
    }

    /// `None` (local), the `FleetLimit` whose connection it shares, or its Redis URL with the
    /// password redacted.
    #[getter]
    fn fleet(&self, py: Python<'_>) -> Py<PyAny> {
        match &self.fleet {
            Fleet::Local => py.None(),
            Fleet::Shared(limit) => limit.clone_ref(py).into_any(),
            Fleet::Url { shown, .. } => PyString::new(py, shown).into_any().unbind(),
        }
    }

    /// This process's counters: `allowed`, `limited`, `waited`, `unavailable`,
    /// `tokens_reserved`, `settled`, `tokens_settled`, `returned`, `tokens_returned`, `keys`
    /// (plus the fleet's decision counters for a fleet-wide limit). No per-identity numbers.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guard(|| {
            let stats = self.current().map(|l| l.stats()).unwrap_or_default();
            stats_dict(py, &stats)
        })
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let list = |rates: &[(String, Rate)]| -> PyResult<String> {
            Ok(match rates {
                [] => "None".to_owned(),
                [(shown, _)] => repr(PyString::new(py, shown).as_any()),
                many => {
                    repr(PyList::new(py, many.iter().map(|(shown, _)| shown.as_str()))?.as_any())
                }
            })
        };
        let fleet = match &self.fleet {
            Fleet::Local => "None".to_owned(),
            Fleet::Shared(limit) => repr(limit.bind(py).as_any()),
            Fleet::Url { shown, .. } => repr(PyString::new(py, shown).as_any()),
        };
        let key = match &self.key {
            None => "None".to_owned(),
            Some(k) => repr(k.bind(py)),
        };
        Ok(format!(
            "RateLimit(requests={}, tokens={}, key={key}, fleet={fleet}, on_limit='{}', name={}, on_backend_error='{}', burst={})",
            list(&self.requests)?,
            list(&self.tokens)?,
            self.on_limit.as_str(),
            repr(PyString::new(py, &self.name).as_any()),
            self.on_backend_error.as_str(),
            self.burst.map_or("None".to_owned(), |b| b.to_string()),
        ))
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Some(key) = &self.key {
            visit.call(key)?;
        }
        if let Fleet::Shared(limit) = &self.fleet {
            visit.call(limit)?;
        }
        Ok(())
    }
}
