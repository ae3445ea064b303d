//! A gate's `estimator=`: what a turn given no `cost=` reserves in its budgets. Either
//! `admitgate.RecentUsage` (budget's [`RecentUsage`], estimated and taught in Rust with no
//! Python per turn) or any callable `estimator(session_id, identity) -> int`.
//!
//! The estimate is keyed on the identity the gate's first token-counting budget keys the turn
//! on (`identity=`, else that budget's `key(session_id)`, else the session id): the unit the
//! budget spends. A callable is called with no lock held, as a budget's `key` is; what it
//! answers is checked here, once, and a bad answer refuses the turn with an error naming the
//! estimator and the value (the turn reserves nothing). `RecentUsage`'s lock is held only for
//! its own lookup (no Python inside), so a thread holding the GIL never waits behind Python.

use std::sync::Arc;

use admitgate_budget::estimate::{
    DEFAULT_HALF_LIFE, DEFAULT_MAX_IDENTITIES, MAX_HALF_LIFE, MAX_IDENTITIES,
};
use admitgate_budget::rate::MAX_AMOUNT;
use admitgate_budget::{RecentUsage, UsageKey};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyInt};
use pyo3::{PyTraverseError, PyVisit};

use super::args;
use super::errors::guard;
use super::rate_limit::PyRateLimit;

/// A token estimate learned from what turns report: per identity, the larger of its last
/// report and a decayed average of its reports; see ``docs/budgets.md``.
#[pyclass(frozen, module = "admitgate", name = "RecentUsage")]
pub struct PyRecentUsage {
    inner: RecentUsage,
}

impl PyRecentUsage {
    /// The Rust estimator.
    pub fn usage(&self) -> &RecentUsage {
        &self.inner
    }
}

/// An int argument (not a bool) as a `u64`, or a message naming it and showing the value.
fn whole(arg: &'static str, value: &Bound<'_, PyAny>, range: &str) -> PyResult<u64> {
    args::fact(arg, value).map_err(|err| {
        if err.is_instance_of::<PyTypeError>(value.py()) {
            return err;
        }
        PyValueError::new_err(format!("{arg} must be {range}, got {}", args::repr(value)))
    })
}

#[pymethods]
impl PyRecentUsage {
    #[new]
    #[pyo3(
        signature = (initial, *, half_life=None, max_identities=None),
        text_signature = "(initial, *, half_life=8, max_identities=65536)"
    )]
    fn new(
        initial: Bound<'_, PyAny>,
        half_life: Option<Bound<'_, PyAny>>,
        max_identities: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        guard(|| {
            let initial = whole("initial", &initial, &format!("0 to {MAX_AMOUNT} (tokens)"))?;
            let half_life = match half_life.filter(|h| !h.is_none()) {
                None => DEFAULT_HALF_LIFE,
                Some(h) => whole("half_life", &h, &format!("1 to {MAX_HALF_LIFE} (reports)"))?,
            };
            let max_identities = match max_identities.filter(|m| !m.is_none()) {
                None => DEFAULT_MAX_IDENTITIES as u64,
                Some(m) => whole("max_identities", &m, &format!("2 to {MAX_IDENTITIES}"))?,
            };
            // The value an int argument shows is its decimal, as the crate's error has it.
            let inner = RecentUsage::new(initial, half_life, max_identities).map_err(|err| {
                PyValueError::new_err(format!(
                    "{} {}, got {}",
                    err.argument(),
                    err.reason(),
                    err.value()
                ))
            })?;
            Ok(PyRecentUsage { inner })
        })
    }

    /// The estimate before any report (tokens).
    #[getter]
    fn initial(&self) -> u64 {
        self.inner.initial()
    }

    /// How many reports halve the gap between the average and a smaller usage.
    #[getter]
    fn half_life(&self) -> u64 {
        self.inner.half_life()
    }

    /// The most identities held at once.
    #[getter]
    fn max_identities(&self) -> usize {
        self.inner.max_identities()
    }

    /// The estimate for a turn of `identity` (a str or bytes), as a gate asks it:
    /// `estimator(session_id, identity)`; the session id is not used.
    fn __call__(&self, session_id: Bound<'_, PyAny>, identity: Bound<'_, PyAny>) -> PyResult<u64> {
        let _ = session_id;
        guard(|| {
            let identity = args::identity_bytes("identity", &identity)?;
            Ok(self.inner.estimate(self.inner.key(&identity)))
        })
    }

    /// Learns that a turn of `identity` used `tokens` (what a gate does at
    /// `turn.report_usage(tokens=...)`; for turns that passed no gate using this estimator).
    #[pyo3(signature = (identity, *, tokens))]
    fn report(&self, identity: Bound<'_, PyAny>, tokens: Bound<'_, PyAny>) -> PyResult<()> {
        guard(|| {
            let identity = args::identity_bytes("identity", &identity)?;
            let tokens = args::fact("tokens", &tokens)?;
            self.inner.report(self.inner.key(&identity), tokens);
            Ok(())
        })
    }

    /// Its counters: `identities` (held now), `reports`, `forgotten` (to stay within
    /// `max_identities`), `bytes` (its tables). No per-identity numbers.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guard(|| {
            let s = self.inner.stats();
            let d = PyDict::new(py);
            d.set_item("identities", s.identities)?;
            d.set_item("reports", s.reports)?;
            d.set_item("forgotten", s.forgotten)?;
            d.set_item("bytes", s.bytes)?;
            Ok(d)
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "RecentUsage(initial={}, half_life={}, max_identities={})",
            self.inner.initial(),
            self.inner.half_life(),
            self.inner.max_identities()
        )
    }
}

/// How a gate estimates.
pub enum Estimate {
    /// admitgate's own: estimated and taught in Rust.
    Recent(Py<PyRecentUsage>),
    /// `estimator(session_id, identity) -> int`.
    Callable(Py<PyAny>),
}

/// A gate's `estimator=`, with what the gate's budgets allow of it.
pub struct GateEstimator {
    estimate: Estimate,
    /// Which of the gate's budgets keys the estimate (the first that counts tokens).
    budget: usize,
    /// The largest estimate that fits every token limit of the gate: a learned estimate is
    /// capped at it, so one huge report never makes an identity's next turn unfittable.
    max_tokens: u64,
}

/// What a turn reserves, and where its report teaches.
#[derive(Clone, Copy, Debug)]
pub struct Priced {
    /// The tokens reserved.
    pub cost: u64,
    /// The `RecentUsage` key its report teaches, on a gate estimating with one.
    pub learns: Option<UsageKey>,
}

impl GateEstimator {
    /// `estimator=`, for a gate with `rate_limits`: `None`, a `RecentUsage` or a callable; a
    /// gate with an estimator needs a budget that counts tokens.
    pub fn from_arg(
        value: Option<&Bound<'_, PyAny>>,
        rate_limits: &[Py<PyRateLimit>],
    ) -> PyResult<Option<Self>> {
        let Some(value) = value.filter(|v| !v.is_none()) else {
            return Ok(None);
        };
        let estimate = if let Ok(recent) = value.cast::<PyRecentUsage>() {
            Estimate::Recent(recent.clone().unbind())
        } else if value.is_callable() {
            Estimate::Callable(value.clone().unbind())
        } else {
            return Err(PyTypeError::new_err(format!(
                "estimator must be an admitgate.RecentUsage, a callable estimator(session_id, identity) -> int, or None, got {}",
                args::repr(value)
            )));
        };
        let mut budget = None;
        let mut max_tokens = MAX_AMOUNT;
        for (i, limit) in rate_limits.iter().enumerate() {
            for max in limit.get().limits()?.iter().filter_map(|l| l.max_tokens()) {
                budget.get_or_insert(i);
                max_tokens = max_tokens.min(max);
            }
        }
        let Some(budget) = budget else {
            return Err(PyValueError::new_err(format!(
                "estimator={} needs a rate_limit= with tokens= (the estimate is what a turn reserves there), got {}",
                args::repr(value),
                if rate_limits.is_empty() {
                    "no rate_limit"
                } else {
                    "no token limit"
                }
            )));
        };
        Ok(Some(GateEstimator {
            estimate,
            budget,
            max_tokens,
        }))
    }

    /// The object given as `estimator=`.
    pub fn object(&self, py: Python<'_>) -> Py<PyAny> {
        match &self.estimate {
            Estimate::Recent(recent) => recent.clone_ref(py).into_any(),
            Estimate::Callable(callable) => callable.clone_ref(py),
        }
    }

    /// Which of the gate's budgets keys the estimate.
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Whether the estimate is a Python callable (which needs the identity as Python sees it).
    pub fn is_callable(&self) -> bool {
        matches!(self.estimate, Estimate::Callable(_))
    }

    /// What a turn reserves: `cost` when given, else the estimate for `identity` (its key in
    /// budget [`GateEstimator::budget`]; `shown`, that identity as Python passed it, for a
    /// callable). Called with no lock held: a callable runs Python.
    pub fn price(
        &self,
        py: Python<'_>,
        cost: Option<u64>,
        session_id: &Bound<'_, PyAny>,
        identity: &Arc<[u8]>,
        shown: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Priced> {
        match &self.estimate {
            Estimate::Recent(recent) => {
                let usage = recent.get().usage();
                let key = usage.key(identity);
                let cost = cost.unwrap_or_else(|| usage.estimate(key).min(self.max_tokens));
                Ok(Priced {
                    cost,
                    learns: Some(key),
                })
            }
            Estimate::Callable(callable) => {
                if let Some(cost) = cost {
                    return Ok(Priced { cost, learns: None });
                }
                let identity = match shown {
                    Some(shown) => shown.clone(),
                    None => session_id.clone(),
                };
                let answer = callable.bind(py).call1((session_id, identity))?;
                Ok(Priced {
                    cost: checked_estimate(callable.bind(py), &answer)?,
                    learns: None,
                })
            }
        }
    }

    /// A turn taught by `priced` used `tokens`.
    pub fn learn(&self, priced: &Priced, tokens: u64) {
        if let (Estimate::Recent(recent), Some(key)) = (&self.estimate, priced.learns) {
            recent.get().usage().report(key, tokens);
        }
    }

    /// For the gate's garbage-collection traversal.
    pub fn traverse(&self, visit: &PyVisit<'_>) -> Result<(), PyTraverseError> {
        match &self.estimate {
            Estimate::Recent(recent) => visit.call(recent),
            Estimate::Callable(callable) => visit.call(callable),
        }
    }
}

/// A callable estimator's answer: an int from 0 to `MAX_AMOUNT`, or an error naming the
/// estimator and the value (never the identity, which may be a secret).
fn checked_estimate(estimator: &Bound<'_, PyAny>, answer: &Bound<'_, PyAny>) -> PyResult<u64> {
    let bad = |what: &str| {
        format!(
            "estimator {} returned {}: an estimate must be {what}",
            args::repr(estimator),
            args::repr(answer)
        )
    };
    if answer.is_instance_of::<PyBool>() || !answer.is_instance_of::<PyInt>() {
        return Err(PyTypeError::new_err(bad("an int (tokens)")));
    }
    match answer.extract::<u64>() {
        Ok(tokens) if tokens <= MAX_AMOUNT => Ok(tokens),
        _ => Err(PyValueError::new_err(bad(&format!(
            "0 to {MAX_AMOUNT} (tokens)"
        )))),
    }
}
