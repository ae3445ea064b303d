//! One turn's passage through the gate: the async context manager `gate.admit()` returns.
//!
//! `__aenter__` arrives at the core: a turn that runs at once gets the shared finished
//! awaitable, a refused one raises `AdmissionRejected` (with its reason and retry hint), and
//! a queued one gets a [`Wait`]. `__aexit__` returns the slot; so does dropping an admission
//! abandoned without `__aexit__`. Each transition happens exactly once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple};
use pyo3::{PyTraverseError, PyVisit};

use super::args;
use super::awaitables::{ready, Wait};
use super::errors::guard;
use super::gate::PyAdmissionGate;
use super::human_wait::{call_method_one, human_wait_scope, HumanWaitFactory};
use super::rejection::rejection;
use super::runtime::{log, now};
use crate::core::transport::TransportId;
use crate::core::{Arrival, TurnSlot};

/// The turn's slot: owned by the admission, or shared with the human-wait hook. The hook
/// never holds the admission itself, so an admission abandoned without `__aexit__` is still
/// dropped, and its drop returns the slot.
enum SlotRef {
    Own(TurnSlot),
    Shared(Arc<TurnSlot>),
}

impl std::ops::Deref for SlotRef {
    type Target = TurnSlot;

    fn deref(&self) -> &TurnSlot {
        match self {
            SlotRef::Own(slot) => slot,
            SlotRef::Shared(slot) => slot,
        }
    }
}

enum AdmissionState {
    Fresh,
    /// The gate is disabled: no slot to return.
    PassThrough,
    Waiting,
    Entered {
        slot: SlotRef,
        token: Option<Py<PyAny>>,
        /// The gate's epoch when the turn entered (see [`super::wake::Core::epoch`]).
        epoch: u64,
    },
    Done,
}

/// One turn's passage through the gate: the async context manager `gate.admit()` returns.
#[pyclass(frozen, weakref, module = "admitgate._admitgate")]
pub struct Admission {
    gate: Py<PyAdmissionGate>,
    session_id: Py<PyString>,
    transport: TransportId,
    state: Mutex<AdmissionState>,
    /// Whether the turn had to wait in the queue (set once it is admitted after waiting).
    pub waited: AtomicBool,
}

impl Admission {
    /// An admission of one turn of `session_id` through `transport`, not yet entered.
    pub fn new(
        gate: Py<PyAdmissionGate>,
        session_id: Py<PyString>,
        transport: TransportId,
    ) -> Self {
        Self {
            gate,
            session_id,
            transport,
            state: Mutex::new(AdmissionState::Fresh),
            waited: AtomicBool::new(false),
        }
    }

    /// The turn will not run (refused, shed, withdrawn): nothing is left to return.
    pub fn abandon(&self) {
        let mut state = self.state.lock();
        if !matches!(*state, AdmissionState::Entered { .. }) {
            *state = AdmissionState::Done;
        }
    }

    /// The turn holds a slot: bind the human-wait hook and remember what to release.
    pub fn enter(admission: &Bound<'_, Self>, scope: Option<Arc<str>>) -> PyResult<()> {
        let py = admission.py();
        let this = admission.get();
        let core = &this.gate.get().core;
        let epoch = core.epoch();
        let (slot, token) = match human_wait_scope(py) {
            Some(var) => {
                let slot = Arc::new(TurnSlot::new(scope));
                let bound = Py::new(py, HumanWaitFactory::new(slot.clone(), core.clone(), epoch))
                    .and_then(|factory| {
                        call_method_one(var, pyo3::intern!(py, "set"), factory.bind(py))
                    });
                match bound {
                    Ok(token) => (SlotRef::Shared(slot), Some(token.unbind())),
                    Err(err) => {
                        // The turn will not run: its slot goes straight back.
                        slot.close(core, None).run();
                        core.transports.finished(this.transport);
                        *this.state.lock() = AdmissionState::Done;
                        return Err(err);
                    }
                }
            }
            None => (SlotRef::Own(TurnSlot::new(scope)), None),
        };
        *this.state.lock() = AdmissionState::Entered { slot, token, epoch };
        Ok(())
    }

    fn arrive(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let this = slf.get();
        {
            let mut state = this.state.lock();
            if !matches!(*state, AdmissionState::Fresh) {
                return Err(PyRuntimeError::new_err(
                    "this admission was already entered; call gate.admit() for each turn",
                ));
            }
            *state = AdmissionState::Waiting;
        }
        let gate = this.gate.get();
        let transports = &gate.core.transports;
        if !gate.is_enabled(py) {
            *this.state.lock() = AdmissionState::PassThrough;
            transports.admitted(this.transport);
            return ready(py);
        }
        let session_id = this.session_id.bind(py);
        let session_key = args::scope_key(session_id)?;
        let session: &str = &session_key;
        let scope = (gate.limits.max_per_scope > 0 && !session.is_empty()).then_some(session);
        let resource = gate.resources.decision(py);
        if !gate.native_policy() && gate.core.has_waiters() {
            // A custom policy decides from the facts the arrival will see: let eased
            // pressure hand out the free slots first.
            gate.core.note_pressure(resource).run();
        }
        let decided = gate.foreign_decision(py, session_id.as_any(), scope);
        let (arrival, wakes) = gate.core.arrive(scope, decided, resource, now);
        wakes.run();
        if !matches!(arrival, Arrival::Admitted(_)) {
            gate.core.sweep_closed_loops(py);
        }
        match arrival {
            Arrival::Admitted(scope) => {
                transports.admitted(this.transport);
                Self::enter(slf, scope)?;
                ready(py)
            }
            Arrival::Rejected(reason, retry_after) => {
                *this.state.lock() = AdmissionState::Done;
                transports.rejected(this.transport, reason);
                let s = gate.core.stats(now);
                log(
                    py,
                    "info",
                    format!(
                        "AdmissionGate: rejecting turn ({}; in_flight={} queued={} max={}) session={}",
                        reason.as_str(),
                        s.in_flight,
                        s.queued,
                        gate.limits.max_concurrent_runs,
                        if session.is_empty() { "-" } else { session }
                    ),
                );
                Err(rejection(py, reason, retry_after))
            }
            Arrival::Queued(key) => {
                transports.queued(this.transport);
                let wait = Wait::new(slf.clone().unbind(), gate.core.clone(), key, this.transport);
                // If the awaitable cannot be made, dropping it withdraws the turn.
                Py::new(py, wait).map(Py::into_any)
            }
        }
    }

    fn leave(&self, py: Python<'_>) {
        let previous = std::mem::replace(&mut *self.state.lock(), AdmissionState::Done);
        let gate = self.gate.get();
        match previous {
            AdmissionState::Entered { slot, token, epoch } => {
                if let (Some(token), Some(var)) = (token, human_wait_scope(py)) {
                    // Exited in another context (the body handed the turn to another task):
                    // the variable cannot be reset there, and nothing depends on it after exit.
                    let _ = call_method_one(var, pyo3::intern!(py, "reset"), token.bind(py));
                }
                if epoch == gate.core.epoch() {
                    gate.core.transports.finished(self.transport);
                    slot.close(&gate.core, gate.release_pressure(py)).run();
                }
            }
            AdmissionState::PassThrough => gate.core.transports.finished(self.transport),
            _ => {}
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
        guard(|| Ok(matches!(*self.state.lock(), AdmissionState::Entered { .. })))
    }

    fn __aenter__(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        guard(|| Self::arrive(slf))
    }

    #[pyo3(signature = (*_exc))]
    fn __aexit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> PyResult<Py<PyAny>> {
        guard(|| {
            self.leave(py);
            ready(py)
        })
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.gate)?;
        visit.call(&self.session_id)?;
        if let Some(state) = self.state.try_lock() {
            if let AdmissionState::Entered {
                token: Some(token), ..
            } = &*state
            {
                visit.call(token)?;
            }
        }
        Ok(())
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        // A turn abandoned without __aexit__ (its coroutine was never finished) still
        // returns its slot exactly once. A panic must not unwind out of a destructor the
        // interpreter calls, so it is contained and reported as unraisable.
        let previous = std::mem::replace(self.state.get_mut(), AdmissionState::Done);
        let core = self.gate.get().core.clone();
        match previous {
            AdmissionState::Entered { slot, epoch, .. } => {
                if epoch != core.epoch() {
                    return; // a turn of the parent process, forgotten by the forked child
                }
                Python::attach(|py| {
                    if let Err(err) = guard(|| {
                        core.transports.finished(self.transport);
                        slot.close(&core, None).run();
                        Ok(())
                    }) {
                        err.write_unraisable(py, None);
                    }
                });
            }
            AdmissionState::PassThrough => core.transports.finished(self.transport),
            _ => {}
        }
    }
}
