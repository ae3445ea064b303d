//! Human-approval slot lending: a running turn parked on a person gives its slot back.
//!
//! praisonai-bot binds praisonaiagents' `HUMAN_WAIT_SCOPE` context variable to a factory for
//! each admitted turn, and praisonaiagents' approval registry enters what the factory makes
//! around every wait for a person. admitgate binds its own [`HumanWaitFactory`] the same way
//! (the admission does it when a turn starts). Inside a [`HumanWait`] the turn's slot is lent
//! to the queue; on exit it is taken back, borrowed if none is free (the next release repays
//! it), never waiting. The lending is passage's ([`Held`]); this is its Python face.
//!
//! A slot is lent only where someone can use it: from an async wait, or from a sync wait on
//! a thread that runs no event loop (a worker thread). A sync wait on a thread that is
//! running an event loop blocks that loop, so a waiter on it could not run; lending there
//! would only let the turn borrow on resume and take the gate past its ceiling.
//!
//! With a fleet-wide limit the turn's lease follows its slot: lent to the fleet where the slot
//! is lent, reclaimed (or borrowed over the fleet cap) where the slot is taken back, without
//! ever waiting on Redis (passage's `TurnLease`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyString, PyTuple};

use super::awaitable::ready;
use super::errors::guard;
use super::runtime::{now, running_loop};
use super::wake::Core;
use admitgate_passage::Held;

static HUMAN_WAIT_SCOPE: PyOnceLock<Option<Py<PyAny>>> = PyOnceLock::new();

/// praisonaiagents' `HUMAN_WAIT_SCOPE` context variable, when it can be imported. The first
/// call imports praisonaiagents, so it is made when a gate is built, never inside a turn
/// (importing praisonaiagents reconfigures logging).
pub fn human_wait_scope(py: Python<'_>) -> Option<&Bound<'_, PyAny>> {
    HUMAN_WAIT_SCOPE
        .get_or_init(py, || {
            py.import("praisonaiagents.approval.registry")
                .and_then(|m| m.getattr("HUMAN_WAIT_SCOPE"))
                .map(Bound::unbind)
                .ok()
        })
        .as_ref()
        .map(|v| v.bind(py))
}

/// `obj.name(arg)` through `PyObject_CallMethodObjArgs`: no bound method object and no
/// argument tuple are built, which halves the cost of the context-variable calls made on
/// every admitted turn.
pub fn call_method_one<'py>(
    obj: &Bound<'py, PyAny>,
    name: &Bound<'py, PyString>,
    arg: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    // Safety: the three pointers are live references held for the duration of the call, the
    // variadic list ends with NULL, and the result is a new reference or NULL with an
    // exception set, which `from_owned_ptr_or_err` turns into the error.
    unsafe {
        let result = pyo3::ffi::PyObject_CallMethodObjArgs(
            obj.as_ptr(),
            name.as_ptr(),
            arg.as_ptr(),
            std::ptr::null_mut::<pyo3::ffi::PyObject>(),
        );
        Bound::from_owned_ptr_or_err(obj.py(), result)
    }
}

/// What praisonaiagents' approval registry calls around a human wait: makes a
/// [`HumanWait`] for the turn that is running.
#[pyclass(frozen, module = "admitgate._admitgate")]
pub struct HumanWaitFactory {
    held: Arc<Held>,
    core: Arc<Core>,
    /// The gate's epoch when the turn started (see [`Core::epoch`]).
    epoch: u64,
}

impl HumanWaitFactory {
    /// The factory for one running turn's slot (and fleet lease, with a fleet limit).
    pub fn new(held: Arc<Held>, core: Arc<Core>) -> Self {
        Self {
            epoch: core.epoch(),
            held,
            core,
        }
    }
}

#[pymethods]
impl HumanWaitFactory {
    #[pyo3(signature = (*_args, **_kwargs))]
    fn __call__(
        &self,
        _args: &Bound<'_, PyTuple>,
        _kwargs: Option<&Bound<'_, PyDict>>,
    ) -> HumanWait {
        HumanWait {
            held: self.held.clone(),
            core: self.core.clone(),
            epoch: self.epoch,
            lent: AtomicBool::new(false),
        }
    }
}

/// A sync and async context manager around one human-approval wait: the turn's run slot is
/// lent to the queue inside it and taken back (borrowed if none is free) on exit, without
/// ever blocking. After the turn has ended it does nothing.
#[pyclass(frozen, module = "admitgate._admitgate")]
pub struct HumanWait {
    /// The turn's slot and fleet lease, lent and taken back together.
    held: Arc<Held>,
    core: Arc<Core>,
    epoch: u64,
    /// Whether this wait lent the slot (and so must take it back).
    lent: AtomicBool,
}

impl HumanWait {
    /// Whether the turn belongs to this process's gate (not a parent's, before a fork).
    fn current(&self) -> bool {
        self.epoch == self.core.epoch()
    }

    fn suspend(&self) {
        if self.current() && !self.lent.swap(true, Ordering::AcqRel) {
            self.held.lend(&self.core, now()).run();
        }
    }

    fn resume(&self) {
        if self.lent.swap(false, Ordering::AcqRel) && self.current() {
            self.held.take_back(&self.core, now());
        }
    }
}

#[pymethods]
impl HumanWait {
    fn __enter__(slf: Py<Self>, py: Python<'_>) -> PyResult<Py<Self>> {
        guard(|| {
            // A sync wait on a thread running an event loop blocks that loop: nobody could
            // use a lent slot there (see the module documentation).
            if running_loop(py)?.is_none() {
                slf.get().suspend();
            }
            Ok(slf.clone_ref(py))
        })
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, _exc: &Bound<'_, PyTuple>) -> PyResult<bool> {
        guard(|| {
            self.resume();
            Ok(false)
        })
    }

    fn __aenter__(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        guard(|| {
            self.suspend();
            ready(py)
        })
    }

    #[pyo3(signature = (*_exc))]
    fn __aexit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> PyResult<Py<PyAny>> {
        guard(|| {
            self.resume();
            ready(py)
        })
    }
}
