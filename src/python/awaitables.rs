//! The awaitable `__aenter__` returns for a queued turn.
//!
//! The fast path (a free slot) returns the shared, already-finished
//! [`Ready`](super::awaitable::Ready), so no event-loop callback is scheduled and no thread
//! is crossed. A turn that must wait gets a [`Wait`]: it yields an asyncio future created on
//! the caller's own loop until the gate settles the turn (see [`super::wake`]). It follows
//! the generator protocol exactly (`send`, `throw`, `close`); the turn's transitions are its
//! [`Admission`]'s, each made once, so whatever is called, in whatever order, the turn's slot
//! is returned exactly once.

use std::sync::Arc;

use admitgate_passage::turn::{Claimed, WaitEnd};
use parking_lot::Mutex;
use pyo3::exceptions::{PyRuntimeError, PyStopIteration};
use pyo3::prelude::*;
use pyo3::{PyTraverseError, PyVisit};

use super::admission::Admission;
use super::awaitable::thrown;
use super::errors::guard;
use super::pressure_check;
use super::runtime::{now, running_loop};
use super::wake::{mailbox_for, resolve_waiter, Core, LoopWaker, PyWaker};
use admitgate_core::{Registered, WaiterKey};

struct WaitState {
    fut: Option<Py<PyAny>>,
    /// The `call_later` handle of the queue timeout, cancelled when the wait ends.
    timer: Option<Py<PyAny>>,
    done: bool,
}

/// A queued turn's awaitable: yields a future on the caller's loop until a slot is granted
/// (or the turn is shed); withdraws from the queue if cancelled, closed or dropped.
#[pyclass(frozen, module = "admitgate._admitgate")]
pub struct Wait {
    admission: Py<Admission>,
    core: Arc<Core>,
    key: WaiterKey,
    /// The first look at the wait (its deadline, the adaptive queue's cap, its queue
    /// timeout), on [`now`]'s clock.
    deadline: Option<WaitEnd>,
    /// A fleet lease follows the slot (`LeaseWait` drives this wait and starts the turn).
    lease_follows: bool,
    state: Mutex<WaitState>,
}

/// Refuses one waiting turn whose queue timeout ran out (scheduled with `call_later` on the
/// turn's loop). A turn granted a slot first is left alone: exactly one of the two wins.
#[pyclass(frozen, module = "admitgate._admitgate")]
pub struct QueueTimer {
    admission: Py<Admission>,
    end: WaitEnd,
}

impl QueueTimer {
    /// Schedules the look at `end` on `event_loop`; its handle.
    fn arm(
        py: Python<'_>,
        event_loop: &Bound<'_, PyAny>,
        admission: Py<Admission>,
        end: WaitEnd,
    ) -> PyResult<Py<PyAny>> {
        let delay = end.at.saturating_sub(now()).as_secs_f64();
        let timer = Py::new(py, QueueTimer { admission, end })?;
        Ok(event_loop
            .call_method1(pyo3::intern!(py, "call_later"), (delay, timer))?
            .unbind())
    }
}

#[pymethods]
impl QueueTimer {
    fn __call__(&self, py: Python<'_>) -> PyResult<()> {
        guard(|| {
            // A look that refused nothing (the estimate moved since it was set) sets the next
            // one; the chain ends when the turn stops waiting, at its queue timeout at the
            // latest. A later handle is not cancelled with the wait: it finds nothing to do.
            if let Some(next) = self.admission.get().expire(&self.end) {
                if let Some(event_loop) = running_loop(py)? {
                    QueueTimer::arm(py, &event_loop, self.admission.clone_ref(py), next)?;
                }
            }
            Ok(())
        })
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.admission)
    }
}

impl Wait {
    /// The awaitable of a turn the gate queued under `key`, refused at `deadline` (for its
    /// reason: `timeout`, or `deadline`) if still waiting then.
    pub fn new(
        admission: Py<Admission>,
        core: Arc<Core>,
        key: WaiterKey,
        deadline: Option<WaitEnd>,
        lease_follows: bool,
    ) -> Self {
        Self {
            admission,
            core,
            key,
            deadline,
            lease_follows,
            state: Mutex::new(WaitState {
                fut: None,
                timer: None,
                done: false,
            }),
        }
    }

    /// Marks the wait over, exactly once: `false` if it already was. A pending queue
    /// timeout is cancelled.
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
        true
    }

    /// One step of the await: claim the outcome if a future was already yielded, else (or
    /// if still waiting) yield a future that the gate resolves when it settles the turn.
    pub fn step(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        let yielded = {
            let state = self.state.lock();
            if state.done {
                return Err(PyRuntimeError::new_err(
                    "cannot reuse an already awaited admission",
                ));
            }
            state.fut.as_ref().map(|f| f.clone_ref(py))
        };
        let admission = self.admission.bind(py);
        if let Some(fut) = yielded {
            let claimed = admission.get().claim();
            if claimed != Claimed::Waiting {
                self.core.delivered(self.key);
            }
            match claimed {
                Claimed::Granted => {
                    self.finish(py);
                    Admission::enter(admission)?;
                    if !self.lease_follows {
                        // `async with gate.admit() as turn` yields the turn on every gate.
                        return Err(PyStopIteration::new_err((admission.clone().unbind(),)));
                    }
                    return Ok(None);
                }
                Claimed::Refused(refused) => {
                    self.finish(py);
                    return Err(admission
                        .get()
                        .refusal(py, refused.reason, refused.retry_after));
                }
                Claimed::Withdrawn => {
                    self.finish(py);
                    return Err(PyRuntimeError::new_err(
                        "this turn's wait was withdrawn because its event loop closed",
                    ));
                }
                Claimed::Waiting => {
                    let fut = fut.bind(py);
                    if !fut.call_method0(pyo3::intern!(py, "done"))?.is_truthy()? {
                        fut.setattr(pyo3::intern!(py, "_asyncio_future_blocking"), true)?;
                        return Ok(Some(fut.clone().unbind()));
                    }
                }
            }
        }
        let Some(event_loop) = running_loop(py)? else {
            self.withdraw(py);
            return Err(PyRuntimeError::new_err(
                "gate.admit() must be awaited inside a running event loop",
            ));
        };
        let fut = event_loop.call_method0(pyo3::intern!(py, "create_future"))?;
        let timer = match self.deadline {
            Some(end) => Some(QueueTimer::arm(
                py,
                &event_loop,
                self.admission.clone_ref(py),
                end,
            )?),
            None => None,
        };
        let waker = PyWaker::Loop(LoopWaker {
            fut: fut.clone().unbind(),
            mailbox: mailbox_for(&event_loop),
            event_loop: event_loop.unbind(),
            loop_thread: std::thread::current().id(),
            key: self.key,
            core: self.core.clone(),
        });
        if admission.get().register(waker) == Registered::Waiting {
            self.state.lock().timer = timer;
            // Held back by memory pressure with slots free: re-sampled until it eases.
            pressure_check::ensure(py, admission.get().gate().bind(py));
        } else {
            if let Some(timer) = timer {
                timer.bind(py).call_method0(pyo3::intern!(py, "cancel"))?;
            }
            // Settled before we could wait (granted by a release, or shed). Still yield
            // once, with the future already resolved: the turn then starts after the
            // waiters woken before it, in the order the loop runs their callbacks.
            resolve_waiter(&fut)?;
        }
        fut.setattr(pyo3::intern!(py, "_asyncio_future_blocking"), true)?;
        self.state.lock().fut = Some(fut.clone().unbind());
        Ok(Some(fut.unbind()))
    }

    /// Leaves the queue (or hands on a slot granted in the meantime). Idempotent: a wait
    /// already over (admitted, shed or withdrawn) leaves the turn alone, and a turn that
    /// holds a slot is returned only by `__aexit__` (or the admission's drop).
    pub fn withdraw(&self, py: Python<'_>) {
        if self.finish(py) {
            self.admission.get().withdraw(py);
            self.core.delivered(self.key);
        }
    }
}

#[pymethods]
impl Wait {
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
        guard(|| {
            self.withdraw(typ.py());
            Err(thrown(typ, val, tb))
        })
    }

    fn close(&self, py: Python<'_>) -> PyResult<()> {
        guard(|| {
            self.withdraw(py);
            Ok(())
        })
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.admission)?;
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

impl Drop for Wait {
    fn drop(&mut self) {
        // A wait dropped unfinished (its task was destroyed) leaves the queue, handing on
        // any slot it had been granted.
        if !self.state.get_mut().done {
            Python::attach(|py| {
                if let Err(err) = guard(|| {
                    self.withdraw(py);
                    Ok(())
                }) {
                    err.write_unraisable(py, None);
                }
            });
        }
    }
}
