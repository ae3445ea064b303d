//! What `__aenter__` returns for a turn of a gate built with `fleet=`: its local queue wait
//! (if it queued), then its wait for the fleet lease, in fleet-wide FIFO order.
//!
//! [`LeaseWait`] drives the local [`Wait`] first, then awaits the lease (an asyncio future
//! on admitgate's fleet runtime, `fleet::lease_future`). A cancelled or closed wait drops the
//! lease future, which withdraws the ticket (or gives back a lease granted at that moment); a
//! deadline (the queue timeout, refused with `timeout`, or the caller's `deadline_s`, refused
//! with `deadline` once less of it is left than a turn takes, whichever comes first) or the
//! gate closing cancels it the same way, through the
//! wait's [`Interrupt`]. The turn's counters and its slot are settled by its [`Admission`]
//! (`lease_granted`, `lease_refused`, `lease_cancelled`), over passage's `Turn`.

use std::sync::Arc;
use std::time::Duration;

use admitgate_passage::TurnLease;
use parking_lot::Mutex;
use pyo3::exceptions::{PyRuntimeError, PyStopIteration};
use pyo3::prelude::*;
use pyo3::{PyTraverseError, PyVisit};

use super::admission::Admission;
use super::awaitable::thrown;
use super::awaitables::Wait;
use super::errors::guard;
use super::fleet::{lease_future, FleetRuntime, Interrupt, LeaseTimer, PyFleetLease, PyFleetLimit};
use super::runtime::{now, running_loop};
use admitgate_core::Rejection;

struct WaitState {
    /// The local queue wait is over (the turn has its local slot).
    local_done: bool,
    /// The lease future, once asked for.
    fut: Option<Py<PyAny>>,
    /// The `call_later` handle of the deadline.
    timer: Option<Py<PyAny>>,
    done: bool,
}

/// What `__aenter__` returns for a turn of a gate with a fleet limit: the local queue wait
/// (if the turn queued), then the wait for the lease.
#[pyclass(frozen, module = "admitgate._admitgate")]
pub struct LeaseWait {
    admission: Py<Admission>,
    local: Option<Py<Wait>>,
    fleet: Py<PyFleetLimit>,
    scope: Arc<str>,
    /// When the queue timeout refuses the turn, on [`now`]'s clock (the caller's
    /// `deadline_s` may end the lease wait first: [`Admission::lease_deadline`]).
    timeout_at: Option<Duration>,
    interrupt: Arc<Interrupt>,
    state: Mutex<WaitState>,
}

fn is_true(value: PyResult<Bound<'_, PyAny>>) -> PyResult<bool> {
    value?.is_truthy()
}

impl LeaseWait {
    /// The wait of `admission`, which queued locally (`local`) or holds its slot already.
    pub fn new(
        admission: Py<Admission>,
        local: Option<Py<Wait>>,
        fleet: Py<PyFleetLimit>,
        scope: Arc<str>,
        timeout_at: Option<Duration>,
        interrupt: Arc<Interrupt>,
    ) -> Self {
        Self {
            admission,
            state: Mutex::new(WaitState {
                local_done: local.is_none(),
                fut: None,
                timer: None,
                done: false,
            }),
            local,
            fleet,
            scope,
            timeout_at,
            interrupt,
        }
    }

    /// Marks the wait over and cancels its timer; `false` if it already was.
    fn finish(&self, py: Python<'_>) -> bool {
        let timer = {
            let mut state = self.state.lock();
            if state.done {
                return false;
            }
            state.done = true;
            state.timer.take()
        };
        if let Some(timer) = timer {
            let _ = timer.bind(py).call_method0(pyo3::intern!(py, "cancel"));
        }
        // Nothing is left to cancel from outside (and the loop is not kept alive by it).
        let asked = self.interrupt.fut.lock().take();
        drop(asked);
        true
    }

    /// Asks for the lease: the future to yield, with the deadline's timer set.
    fn ask(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let event_loop = running_loop(py)?.ok_or_else(|| {
            PyRuntimeError::new_err("gate.admit() must be awaited inside a running event loop")
        })?;
        // The turn's class orders its ticket in the fleet's queue (ignored without classes).
        let class = self.admission.get().lease_class();
        let fut = lease_future(py, self.fleet.get(), self.scope.clone(), class)?;
        *self.interrupt.fut.lock() = Some((fut.clone().unbind(), event_loop.clone().unbind()));
        let ends = self.admission.get().lease_deadline(self.timeout_at);
        let timer = match ends {
            Some((deadline, reason)) => {
                let delay = deadline.saturating_sub(now()).as_secs_f64();
                let expire = Py::new(py, LeaseTimer::new(self.interrupt.clone(), reason))?;
                Some(
                    event_loop
                        .call_method1(pyo3::intern!(py, "call_later"), (delay, expire))?
                        .unbind(),
                )
            }
            None => None,
        };
        let mut state = self.state.lock();
        state.fut = Some(fut.clone().unbind());
        state.timer = timer;
        Ok(fut.unbind())
    }

    /// The lease future finished: the turn runs, or is refused.
    fn settle(&self, py: Python<'_>, fut: &Bound<'_, PyAny>) -> PyResult<Option<Py<PyAny>>> {
        let admission = self.admission.bind(py);
        self.finish(py);
        if is_true(fut.call_method0(pyo3::intern!(py, "cancelled")))? {
            return Err(self.gave_up(py, None));
        }
        let error = fut.call_method0(pyo3::intern!(py, "exception"))?;
        if !error.is_none() {
            // The limit refused (Redis down and `reject`, or shut down).
            Admission::lease_refused(admission, Rejection::FleetUnavailable);
            return Err(PyErr::from_value(error));
        }
        let result = fut.call_method0(pyo3::intern!(py, "result"))?;
        let lease = result
            .cast::<PyFleetLease>()
            .ok()
            .and_then(|lease| lease.get().take());
        match lease {
            Some(lease) => {
                let limit = self.fleet.get().limit()?;
                let held = TurnLease::new(limit, lease, Arc::new(FleetRuntime));
                Admission::lease_granted(admission, held)?;
                // `async with gate.admit() as turn` yields the turn on every gate.
                Err(PyStopIteration::new_err((admission.clone().unbind(),)))
            }
            None => {
                Admission::lease_cancelled(admission);
                Err(PyRuntimeError::new_err(
                    "the fleet lease was lost before the turn started",
                ))
            }
        }
    }

    /// The turn gives up waiting for its lease (cancelled, closed, dropped), or its deadline
    /// passed or its gate closed: the lease future is cancelled (a lease it already holds goes
    /// back) and the local slot is handed on. Returns the error to raise: `thrown`, or the
    /// refusal (`timeout`, `closing`) when the wait was ended from outside.
    fn gave_up(&self, py: Python<'_>, thrown: Option<PyErr>) -> PyErr {
        self.finish(py);
        let fut = self.state.lock().fut.as_ref().map(|f| f.clone_ref(py));
        if let Some(fut) = fut {
            let fut = fut.bind(py);
            if is_true(fut.call_method0(pyo3::intern!(py, "done"))).unwrap_or(true) {
                // A lease that came at this very moment goes back.
                if let Ok(result) = fut.call_method0(pyo3::intern!(py, "result")) {
                    if let Ok(lease) = result.cast::<PyFleetLease>() {
                        drop(lease.get().take());
                    }
                }
                // Retrieve a stored exception, so asyncio does not report it as never read.
                let _ = fut.call_method0(pyo3::intern!(py, "exception"));
            } else {
                let _ = fut.call_method0(pyo3::intern!(py, "cancel"));
            }
        }
        let admission = self.admission.bind(py);
        if let Some(reason) = self.interrupt.reason() {
            let retry = Admission::lease_refused(admission, reason);
            return admission.get().refusal(py, reason, retry);
        }
        Admission::lease_cancelled(admission);
        thrown.unwrap_or_else(|| {
            PyRuntimeError::new_err("the turn stopped waiting for its fleet lease")
        })
    }

    /// One step of the await (see the module documentation).
    fn step(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        let (local_done, fut) = {
            let state = self.state.lock();
            if state.done {
                return Err(PyRuntimeError::new_err(
                    "cannot reuse an already awaited admission",
                ));
            }
            (
                state.local_done,
                state.fut.as_ref().map(|f| f.clone_ref(py)),
            )
        };
        // A turn without a local wait (it held its slot already) starts with `local_done`.
        if let Some(local) = self.local.as_ref().filter(|_| !local_done) {
            match local.get().step(py) {
                Ok(Some(fut)) => return Ok(Some(fut)),
                Ok(None) => self.state.lock().local_done = true,
                Err(err) => {
                    self.finish(py);
                    return Err(err);
                }
            }
        }
        let fut = match fut {
            Some(fut) => fut,
            // The gate closed (or the deadline passed) before the lease was asked for.
            None if self.interrupt.reason().is_some() => return Err(self.gave_up(py, None)),
            None => self.ask(py)?,
        };
        let bound = fut.bind(py);
        if is_true(bound.call_method0(pyo3::intern!(py, "done")))? {
            return self.settle(py, bound);
        }
        bound.setattr(pyo3::intern!(py, "_asyncio_future_blocking"), true)?;
        Ok(Some(fut))
    }

    /// `throw` and `close`: the local wait handles its own phase; the lease phase gives up.
    fn interrupt(&self, py: Python<'_>, error: PyErr) -> PyErr {
        let (local_done, done) = {
            let state = self.state.lock();
            (state.local_done, state.done)
        };
        if done {
            return error;
        }
        if !local_done {
            self.finish(py);
            if let Some(local) = &self.local {
                local.get().withdraw(py);
            }
            return error;
        }
        // asyncio throws the lease future's own exception into the awaiting coroutine: that is
        // the limit's refusal.
        let fut = self.state.lock().fut.as_ref().map(|f| f.clone_ref(py));
        if let Some(fut) = fut {
            let fut = fut.bind(py);
            let refused = is_true(fut.call_method0(pyo3::intern!(py, "done"))).unwrap_or(false)
                && !is_true(fut.call_method0(pyo3::intern!(py, "cancelled"))).unwrap_or(true)
                && fut
                    .call_method0(pyo3::intern!(py, "exception"))
                    .is_ok_and(|exc| exc.is(error.value(py)));
            if refused {
                self.finish(py);
                Admission::lease_refused(self.admission.bind(py), Rejection::FleetUnavailable);
                return error;
            }
        }
        // Anything else gives up (a task cancelled, or its lease future cancelled by the
        // deadline, which becomes the timeout refusal).
        self.gave_up(py, Some(error))
    }
}

#[pymethods]
impl LeaseWait {
    fn __await__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        guard(|| self.step(py))
    }

    #[pyo3(signature = (_value))]
    fn send(&self, py: Python<'_>, _value: &Bound<'_, PyAny>) -> PyResult<Option<Py<PyAny>>> {
        guard(|| self.step(py))
    }

    #[pyo3(signature = (typ, val=None, tb=None))]
    fn throw(
        &self,
        typ: &Bound<'_, PyAny>,
        val: Option<&Bound<'_, PyAny>>,
        tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        guard(|| Err(self.interrupt(typ.py(), thrown(typ, val, tb))))
    }

    fn close(&self, py: Python<'_>) -> PyResult<()> {
        guard(|| {
            let closing = PyErr::new::<pyo3::exceptions::PyGeneratorExit, _>(());
            let _ = self.interrupt(py, closing);
            Ok(())
        })
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.admission)?;
        visit.call(&self.fleet)?;
        if let Some(local) = &self.local {
            visit.call(local)?;
        }
        if let Some(state) = self.state.try_lock() {
            if let Some(fut) = &state.fut {
                visit.call(fut)?;
            }
            if let Some(timer) = &state.timer {
                visit.call(timer)?;
            }
        }
        Ok(())
    }
}

impl Drop for LeaseWait {
    fn drop(&mut self) {
        // Dropped unfinished (its task was destroyed): the turn gives up, nothing leaks.
        if !self.state.get_mut().done {
            Python::attach(|py| {
                if let Err(err) = guard(|| {
                    let closing = PyErr::new::<pyo3::exceptions::PyGeneratorExit, _>(());
                    let _ = self.interrupt(py, closing);
                    Ok(())
                }) {
                    err.write_unraisable(py, None);
                }
            });
        }
    }
}
