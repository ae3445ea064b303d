//! The awaitables `async with gate.admit()` returns from `__aenter__` and `__aexit__`.
//!
//! The fast path (a free slot) returns the shared, already-finished [`Ready`], so no
//! event-loop callback is scheduled and no thread is crossed. A turn that must wait gets a
//! [`Wait`]: it yields an asyncio future created on the caller's own loop until the gate
//! settles the turn (see [`super::wake`]). Both follow the generator protocol exactly
//! (`send`, `throw`, `close`), and every transition of a [`Wait`] is idempotent: whatever is
//! called, in whatever order, the turn's slot is returned exactly once.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use pyo3::exceptions::{PyRuntimeError, PyStopIteration, PyTypeError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyTuple, PyType};
use pyo3::{PyTraverseError, PyVisit};

use super::admission::Admission;
use super::errors::guard;
use super::pressure_watch;
use super::rejection::rejection;
use super::runtime::{now, running_loop};
use super::wake::{mailbox_for, resolve_waiter, Core, LoopWaker, PyWaker};
use admitgate_core::transport::TransportId;
use admitgate_core::{Claim, Registered, Rejection, WaiterKey};

/// An awaitable that is already finished: what `__aenter__`/`__aexit__` return on the fast
/// path. Stateless, so one instance serves every caller.
#[pyclass(frozen, module = "admitgate._admitgate")]
pub struct Ready;

static READY: PyOnceLock<Py<Ready>> = PyOnceLock::new();

/// The shared [`Ready`] instance.
pub fn ready(py: Python<'_>) -> PyResult<Py<PyAny>> {
    Ok(READY
        .get_or_try_init(py, || Py::new(py, Ready))?
        .clone_ref(py)
        .into_any())
}

#[pymethods]
impl Ready {
    fn __await__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__(&self) -> Option<Py<PyAny>> {
        None
    }

    #[pyo3(signature = (_value))]
    fn send(&self, _value: &Bound<'_, PyAny>) -> Option<Py<PyAny>> {
        None
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
}

/// The exception `throw(typ, val, tb)` raises, normalised as a generator's `throw` does: a
/// class is instantiated (with no argument, `val`, or `*val` for a tuple) unless `val` is
/// already an instance of it; an instance is raised as is; `tb` becomes its traceback.
pub fn thrown(
    typ: &Bound<'_, PyAny>,
    val: Option<&Bound<'_, PyAny>>,
    tb: Option<&Bound<'_, PyAny>>,
) -> PyErr {
    let build = || -> PyResult<Bound<'_, PyAny>> {
        let val = val.filter(|v| !v.is_none());
        let exc = if let Ok(cls) = typ.cast::<PyType>() {
            match val {
                None => cls.call0()?,
                Some(v) if v.is_instance(cls)? => v.clone(),
                Some(v) => match v.cast::<PyTuple>() {
                    Ok(args) => cls.call1(args)?,
                    Err(_) => cls.call1((v,))?,
                },
            }
        } else if val.is_some() {
            return Err(PyTypeError::new_err(
                "instance exception may not have a separate value",
            ));
        } else {
            typ.clone()
        };
        match tb.filter(|t| !t.is_none()) {
            Some(tb) => exc.call_method1(pyo3::intern!(typ.py(), "with_traceback"), (tb,)),
            None => Ok(exc),
        }
    };
    match build() {
        // Not an exception: PyO3 raises the TypeError Python would.
        Ok(exc) => PyErr::from_value(exc),
        Err(err) => err,
    }
}

struct WaitState {
    fut: Option<Py<PyAny>>,
    /// The `call_later` handle of the queue timeout, cancelled when the wait ends.
    timer: Option<Py<PyAny>>,
    done: bool,
    /// Whether the turn had to wait to be woken (not granted a slot on arrival).
    parked: bool,
}

/// A queued turn's awaitable: yields a future on the caller's loop until a slot is granted
/// (or the turn is shed); withdraws from the queue if cancelled, closed or dropped.
#[pyclass(frozen, module = "admitgate._admitgate")]
pub struct Wait {
    admission: Py<Admission>,
    core: Arc<Core>,
    key: WaiterKey,
    transport: TransportId,
    /// When the queue timeout (or the caller's deadline) refuses the turn, on [`now`]'s
    /// clock, and with which reason.
    deadline: Option<(Duration, Rejection)>,
    /// A fleet lease follows the slot (`LeaseWait` drives this wait): the turn stays queued
    /// for its transport until the lease settles it.
    lease_follows: bool,
    /// The gate's epoch when the turn queued (see [`Core::epoch`]): a wait of the parent of
    /// a fork that ends in the child leaves the child's counters alone.
    epoch: u64,
    state: Mutex<WaitState>,
}

/// Refuses one waiting turn whose queue timeout ran out (scheduled with `call_later` on the
/// turn's loop). A turn granted a slot first is left alone: exactly one of the two wins.
#[pyclass(frozen, module = "admitgate._admitgate")]
pub struct QueueTimer {
    core: Arc<Core>,
    key: WaiterKey,
    reason: Rejection,
}

#[pymethods]
impl QueueTimer {
    fn __call__(&self) -> PyResult<()> {
        guard(|| {
            let (_, wakes) = self.core.expire_for(self.key, self.reason);
            wakes.run();
            Ok(())
        })
    }
}

impl Wait {
    /// The awaitable of a turn the gate queued under `key`, refused at `deadline` (for its
    /// reason: `timeout`, or `deadline`) if still waiting then.
    pub fn new(
        admission: Py<Admission>,
        core: Arc<Core>,
        key: WaiterKey,
        transport: TransportId,
        deadline: Option<(Duration, Rejection)>,
        lease_follows: bool,
    ) -> Self {
        Self {
            admission,
            epoch: core.epoch(),
            core,
            key,
            transport,
            deadline,
            lease_follows,
            state: Mutex::new(WaitState {
                fut: None,
                timer: None,
                done: false,
                parked: false,
            }),
        }
    }

    /// Marks the wait over, exactly once: `false` if it already was. The transport stops
    /// counting the turn as queued (and counts it running if `admitted`); a pending queue
    /// timeout is cancelled.
    fn finish(&self, py: Python<'_>, admitted: bool) -> bool {
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
        if !(admitted && self.lease_follows) && self.epoch == self.core.epoch() {
            self.core.transports.dequeued(self.transport, admitted);
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
        if let Some(fut) = yielded {
            let (claim, wakes) = self.core.claim(self.key, now);
            wakes.run();
            if claim != Claim::Waiting {
                self.core.delivered(self.key);
            }
            match claim {
                Claim::Admitted(scope) => {
                    self.finish(py, true);
                    let parked = self.state.lock().parked;
                    let admission = self.admission.bind(py);
                    admission.get().waited.store(parked, Ordering::Relaxed);
                    Admission::enter(admission, scope)?;
                    if self.core.times_turns() && !self.lease_follows {
                        // An adaptive gate's turn is handed to `as turn`.
                        return Err(PyStopIteration::new_err((admission.clone().unbind(),)));
                    }
                    return Ok(None);
                }
                Claim::Refused(reason, retry_after) => {
                    self.finish(py, false);
                    self.core.transports.rejected(self.transport, reason);
                    self.admission.get().abandon();
                    return Err(rejection(py, reason, retry_after));
                }
                Claim::Unknown => {
                    self.finish(py, false);
                    self.admission.get().abandon();
                    return Err(PyRuntimeError::new_err(
                        "this turn's wait was withdrawn because its event loop closed",
                    ));
                }
                Claim::Waiting => {
                    let fut = fut.bind(py);
                    if !fut.call_method0(pyo3::intern!(py, "done"))?.is_truthy()? {
                        fut.setattr(pyo3::intern!(py, "_asyncio_future_blocking"), true)?;
                        return Ok(Some(fut.clone().unbind()));
                    }
                }
            }
        }
        let Some(event_loop) = running_loop(py)? else {
            self.withdraw_and_abandon(py);
            return Err(PyRuntimeError::new_err(
                "gate.admit() must be awaited inside a running event loop",
            ));
        };
        let fut = event_loop.call_method0(pyo3::intern!(py, "create_future"))?;
        let timer = match self.deadline {
            Some((deadline, reason)) => {
                let delay = deadline.saturating_sub(now()).as_secs_f64();
                let expire = Py::new(
                    py,
                    QueueTimer {
                        core: self.core.clone(),
                        key: self.key,
                        reason,
                    },
                )?;
                Some(
                    event_loop
                        .call_method1(pyo3::intern!(py, "call_later"), (delay, expire))?
                        .unbind(),
                )
            }
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
        let (registered, _) = self.core.register(self.key, waker);
        if registered == Registered::Waiting {
            {
                let mut state = self.state.lock();
                state.parked = true;
                state.timer = timer;
            }
            // Held back by memory pressure with slots free: re-sampled until it eases.
            pressure_watch::ensure(py, self.admission.get().gate().bind(py));
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

    /// Leaves the queue (or hands on a slot granted in the meantime). Idempotent: `false`
    /// when the wait was already over (admitted, shed or withdrawn).
    fn withdraw(&self, py: Python<'_>) -> bool {
        if !self.finish(py, false) {
            return false;
        }
        let (_, wakes) = self.core.cancel(self.key);
        wakes.run();
        self.core.delivered(self.key);
        self.core.after_release(py);
        true
    }

    /// Withdraws, and if this call is what ended the wait, the admission is over too. A
    /// wait that already admitted its turn leaves the admission alone: the turn holds a slot
    /// that only `__aexit__` (or the admission's drop) returns.
    pub fn withdraw_and_abandon(&self, py: Python<'_>) {
        if self.withdraw(py) {
            self.admission.get().abandon();
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
            self.withdraw_and_abandon(typ.py());
            Err(thrown(typ, val, tb))
        })
    }

    fn close(&self, py: Python<'_>) -> PyResult<()> {
        guard(|| {
            self.withdraw_and_abandon(py);
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
