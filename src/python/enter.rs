//! `Admission`'s Python methods: entering a turn (`__aenter__` picks its awaitable,
//! `__enter__` blocks for `admit_sync`), reporting on its provider call, leaving it.
//!
//! The turn's transitions are [`Admission`]'s (over passage's `Turn`); this module only
//! chooses who waits: nothing for a turn that runs now, a [`Wait`] for one that queues, a
//! [`LeaseWait`] around either with a fleet limit, or this thread ([`BlockingWait`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::{PyTraverseError, PyVisit};

use super::adaptive::Entered;
use super::admission::{Admission, Entry};
use super::args;
use super::awaitable::ready;
use super::awaitables::Wait;
use super::blocking::BlockingWait;
use super::budget_step::BudgetAnswer;
use super::errors::guard;
use super::fleet::{acquire_blocking, lease_scope, Blocked, FleetRuntime, PyFleetLimit};
use super::lease_wait::LeaseWait;
use super::runtime::{now, running_loop};
use admitgate_core::Rejection;
use admitgate_passage::TurnLease;

impl Admission {
    /// The scope of this turn's lease.
    fn lease_scope(&self, py: Python<'_>, fleet: &Py<PyFleetLimit>) -> PyResult<Arc<str>> {
        Ok(lease_scope(
            fleet.get(),
            &args::scope_key(self.session_id.bind(py))?,
        ))
    }

    /// `__aenter__`: the shared finished awaitable for a turn that runs now, a [`Wait`] for
    /// one that queues, a [`LeaseWait`] with a fleet limit.
    fn enter_async(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        // The budgets first: a turn they refuse never takes a slot or a lease.
        if let Some(waits) = Self::budget_enter_async(slf)? {
            return Ok(waits);
        }
        Self::enter_gate(slf)
    }

    /// The gate's part of `__aenter__`, after the budgets: what is awaited for the slot (and
    /// the lease). Refused, or failing, the turn's budget holds go back.
    fn enter_gate(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        let entered = Self::enter_slot(slf);
        if entered.is_err() {
            slf.get().give_back_budget();
        }
        entered
    }

    fn enter_slot(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let this = slf.get();
        let gate = this.gate().get();
        let fleet = gate.fleet();
        match Self::arrive(slf)? {
            Entry::Running => match fleet {
                // `async with gate.admit() as turn` yields the turn on every gate.
                None => Ok(Py::new(py, Entered::new(slf.clone().into_any().unbind()))?.into_any()),
                Some(fleet) => {
                    let wait = LeaseWait::new(
                        slf.clone().unbind(),
                        None,
                        fleet.clone_ref(py),
                        this.lease_scope(py, fleet)?,
                        this.deadline(),
                        gate.lease_waits.register(),
                    );
                    // If the awaitable cannot be made, dropping the admission hands the slot on.
                    Ok(Py::new(py, wait)?.into_any())
                }
            },
            Entry::Queued(key, until) => {
                let wait = Wait::new(
                    slf.clone().unbind(),
                    gate.core.clone(),
                    key,
                    until,
                    fleet.is_some(),
                );
                // If the awaitable cannot be made, or on_queued raises, dropping the wait
                // withdraws the turn.
                let wait = Py::new(py, wait)?;
                Self::announce_queued(slf, key)?;
                match fleet {
                    None => Ok(wait.into_any()),
                    Some(fleet) => {
                        let wait = LeaseWait::new(
                            slf.clone().unbind(),
                            Some(wait),
                            fleet.clone_ref(py),
                            this.lease_scope(py, fleet)?,
                            until.and_then(|end| end.timeout_at()),
                            gate.lease_waits.register(),
                        );
                        Ok(Py::new(py, wait)?.into_any())
                    }
                }
            }
        }
    }

    /// `__enter__` (`admit_sync`): blocks, without the GIL, until the turn runs or is
    /// refused.
    fn enter_blocking(slf: &Bound<'_, Self>) -> PyResult<()> {
        let py = slf.py();
        if running_loop(py)?.is_some() {
            return Err(PyRuntimeError::new_err(
                "admit_sync() called on a thread that is running an event loop: waiting here would block that loop; use `async with gate.admit()` on it",
            ));
        }
        let this = slf.get();
        // The budgets first, on this thread: a turn they refuse never takes a slot or a lease.
        this.budget_enter_blocking(py)?;
        let entered = Self::enter_blocking_slot(slf);
        if entered.is_err() {
            this.give_back_budget();
        }
        entered
    }

    fn enter_blocking_slot(slf: &Bound<'_, Self>) -> PyResult<()> {
        let py = slf.py();
        let this = slf.get();
        let fleet = this.gate().get().fleet();
        let timeout_at = match Self::arrive(slf)? {
            Entry::Running => this.deadline(),
            Entry::Queued(key, until) => {
                let mut wait = BlockingWait::new(this);
                if let Err(err) = Self::announce_queued(slf, key) {
                    wait.withdraw(py);
                    return Err(err);
                }
                wait.wait(py, until)?;
                this.waited.store(true, Ordering::Relaxed);
                Self::enter(slf)?;
                until.and_then(|end| end.timeout_at())
            }
        };
        let Some(fleet) = fleet else {
            return Ok(());
        };
        // The local slot is held: now the lease, on this thread too.
        let interrupt = this.gate().get().lease_waits.register();
        let deadline = this.lease_deadline(timeout_at);
        match acquire_blocking(
            py,
            fleet.get(),
            this.lease_scope(py, fleet)?,
            this.lease_class(),
            deadline,
            &interrupt,
        ) {
            Err(err) => {
                Self::lease_cancelled(slf);
                Err(err)
            }
            Ok(Ok(lease)) => {
                let limit = fleet.get().limit()?;
                Self::lease_granted(slf, TurnLease::new(limit, lease, Arc::new(FleetRuntime)))
            }
            Ok(Err(Blocked::Refused(retry))) => {
                Self::lease_refused(slf, Rejection::FleetUnavailable);
                Err(this.refusal(py, Rejection::FleetUnavailable, Some(retry)))
            }
            Ok(Err(Blocked::TimedOut(reason))) => {
                let retry = Self::lease_refused(slf, reason);
                Err(this.refusal(py, reason, retry))
            }
            Ok(Err(Blocked::Ended(reason))) => {
                let retry = Self::lease_refused(slf, reason);
                Err(this.refusal(py, reason, retry))
            }
            Ok(Err(Blocked::Interrupted(err))) => {
                Self::lease_cancelled(slf);
                Err(err)
            }
        }
    }
}

#[pymethods]
impl Admission {
    /// Whether the turn had to wait for a slot (it was not granted one on arrival).
    #[getter]
    fn waited(&self) -> PyResult<bool> {
        guard(|| Ok(self.waited.load(Ordering::Relaxed)))
    }

    /// Whether the turn currently holds (or has lent to a human wait) its run slot.
    #[getter]
    fn active(&self) -> PyResult<bool> {
        guard(|| Ok(self.is_running()))
    }

    /// While the turn waits: how many turns would start before it; `None` otherwise.
    #[getter]
    fn position(&self) -> PyResult<Option<u64>> {
        guard(|| {
            let Some(key) = self.queued_key() else {
                return Ok(None);
            };
            Ok(self
                .gate()
                .get()
                .core
                .place_in_line(key, now)
                .map(|(p, _)| p))
        })
    }

    /// While the turn waits: seconds until it may start at the recent release rate
    /// (unclamped); `None` otherwise, or until some turn of the gate has ended.
    #[getter]
    fn estimated_wait_s(&self) -> PyResult<Option<f64>> {
        guard(|| {
            let Some(key) = self.queued_key() else {
                return Ok(None);
            };
            let place = self.gate().get().core.place_in_line(key, now);
            Ok(place.and_then(|(_, estimate)| estimate.map(|d| d.as_secs_f64())))
        })
    }

    fn __aenter__(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        guard(|| Self::enter_async(slf))
    }

    /// The budget coroutine's next step (`admitgate._budget`): `None` once the budgets allow
    /// the turn, seconds to sleep, or an awaitable of the fleet's answer; raises the refusal.
    #[pyo3(signature = (answer=None))]
    fn _budget_step(
        &self,
        py: Python<'_>,
        answer: Option<Bound<'_, BudgetAnswer>>,
    ) -> PyResult<Py<PyAny>> {
        guard(|| self.budget_step_py(py, answer.as_ref()))
    }

    /// When Redis recorded this turn in its first fleet-wide budget (seconds since the epoch,
    /// Redis's clock), or `None`: for tests that check a fleet's exactness on one clock.
    #[getter]
    fn _budget_server_time(&self) -> PyResult<Option<f64>> {
        guard(|| Ok(self.budget_server_time()))
    }

    /// The tokens this turn reserves in its budgets: `cost=`, or without it the gate's
    /// `estimator=`'s estimate (0 without one), known once the turn has passed its budgets;
    /// `None` before that when no `cost=` was given.
    #[getter]
    fn cost(&self) -> Option<u64> {
        self.priced.get().map(|p| p.cost).or(self.cost)
    }

    /// The budget coroutine was cancelled (or failed): what the turn reserved goes back,
    /// including a fleet answer that had landed in `step` (its future) but was never read.
    #[pyo3(signature = (step=None))]
    fn _budget_abandon(&self, step: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        guard(|| {
            if let Some(step) = step {
                BudgetAnswer::discard_unread(step);
            }
            self.give_back_budget();
            Ok(())
        })
    }

    /// The gate's part of `__aenter__`, once the budgets allowed the turn.
    fn _enter_gate(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        guard(|| Self::enter_gate(slf))
    }

    /// Reports the tokens this turn really used: each budget (`rate_limit=`) refunds what its
    /// estimate (`cost=`) held beyond that, or records the excess as a debt that delays the
    /// identity's next turns. Only the first report counts; without a budget it is ignored.
    #[pyo3(signature = (*, tokens))]
    fn report_usage(&self, tokens: Bound<'_, PyAny>) -> PyResult<()> {
        guard(|| {
            let tokens = args::fact("tokens", &tokens)?;
            self.budget_settle(tokens);
            Ok(())
        })
    }

    fn __enter__(slf: &Bound<'_, Self>) -> PyResult<Py<Self>> {
        guard(|| {
            Self::enter_blocking(slf)?;
            Ok(slf.clone().unbind())
        })
    }

    /// Reports that the provider throttled this turn's call (HTTP 429, gRPC
    /// RESOURCE_EXHAUSTED), with its `Retry-After` in seconds if it sent one (0 included: no
    /// hold). On a gate with `adaptive=`, the ceiling moves when the turn ends; elsewhere it
    /// is ignored.
    #[pyo3(signature = (retry_after_s=None))]
    fn report_throttled(&self, retry_after_s: Option<Bound<'_, PyAny>>) -> PyResult<()> {
        guard(|| {
            let retry_after = match &retry_after_s {
                Some(v) => args::hold("retry_after_s", v)?,
                None => None,
            };
            self.report.lock().throttled = Some(retry_after);
            Ok(())
        })
    }

    /// Reports the provider's `x-ratelimit-remaining-requests` for this turn's call: at 0
    /// the adaptive ceiling does not grow.
    fn report_remaining(&self, requests: Bound<'_, PyAny>) -> PyResult<()> {
        guard(|| {
            let remaining = args::fact("requests", &requests)?;
            self.report.lock().remaining = Some(remaining);
            Ok(())
        })
    }

    // The exit's three arguments are named, not `*exc`: a varargs signature builds a tuple on
    // every turn (issue 26's profile).
    #[pyo3(signature = (_exc_type=None, exc=None, _tb=None))]
    fn __exit__(
        &self,
        py: Python<'_>,
        _exc_type: Option<&Bound<'_, PyAny>>,
        exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        guard(|| {
            self.leave(py, exc.filter(|v| !v.is_none()));
            Ok(false)
        })
    }

    #[pyo3(signature = (_exc_type=None, exc=None, _tb=None))]
    fn __aexit__(
        &self,
        py: Python<'_>,
        _exc_type: Option<&Bound<'_, PyAny>>,
        exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        guard(|| {
            self.leave(py, exc.filter(|v| !v.is_none()));
            ready(py)
        })
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(self.gate())?;
        visit.call(&self.session_id)?;
        if let Some(callback) = &self.on_queued {
            visit.call(callback)?;
        }
        if let Some(token) = self.token.try_lock() {
            if let Some(token) = &*token {
                visit.call(token)?;
            }
        }
        Ok(())
    }
}
