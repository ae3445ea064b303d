//! The re-check of memory pressure that [`super::pressure_watch`] arms: scheduled on an event
//! loop while pressure holds a gate's waiters back, or run by a blocked thread itself.

use pyo3::prelude::*;

use super::errors::guard;
use super::gate::PyAdmissionGate;
pub use super::pressure_watch::WATCH_INTERVAL;
use super::runtime::running_loop;
use super::wake::PyWaker;

/// If memory pressure holds back waiters of `gate`, makes sure a check is armed: on this
/// thread's running loop, else on the oldest waiter's. Cheap when nothing is held back (one
/// relaxed load). Blocked threads need no check: they re-sample themselves.
pub fn ensure(py: Python<'_>, gate: &Bound<'_, PyAdmissionGate>) {
    let core = &gate.get().core;
    if !core.held_back() || !core.pressure_watch.arm() {
        return;
    }
    let host = match running_loop(py) {
        Ok(Some(event_loop)) => Some(event_loop.unbind()),
        _ => {
            // Only an incref under the gate's lock: no Python runs there.
            let (host, wakes) = core.with(|state, _| match state.oldest_waker() {
                Some(PyWaker::Loop(waker)) => Some(waker.event_loop.clone_ref(py)),
                _ => None,
            });
            drop(wakes);
            host
        }
    };
    let scheduled = host.is_some_and(|event_loop| {
        let check = PressureCheck {
            gate: gate.clone().unbind(),
            epoch: core.epoch(),
        };
        Py::new(py, check).is_ok_and(|check| {
            event_loop
                .bind(py)
                .call_method1(pyo3::intern!(py, "call_soon_threadsafe"), (check,))
                .is_ok()
        })
    });
    if !scheduled {
        // No loop to run it (only blocked threads wait, and they re-sample themselves), or
        // the loop is closed: the next waiter held back tries again.
        core.pressure_watch.disarm();
    }
}

/// Samples memory pressure for `gate` and lets eased pressure start the waiters it held back.
/// For blocked threads, which re-check themselves.
pub fn recheck(py: Python<'_>, gate: &PyAdmissionGate) {
    let resource = gate.resources.decision(py);
    gate.core.note_pressure(resource).run();
}

/// One gate's pressure check, run on an event loop every [`WATCH_INTERVAL`] while memory
/// pressure holds back its waiters.
#[pyclass(frozen, module = "admitgate._admitgate")]
pub struct PressureCheck {
    gate: Py<PyAdmissionGate>,
    /// The gate's epoch when armed: a forked child never runs its parent's checks.
    epoch: u64,
}

#[pymethods]
impl PressureCheck {
    fn __call__(slf: &Bound<'_, Self>) -> PyResult<()> {
        guard(|| {
            let py = slf.py();
            let this = slf.get();
            let gate = this.gate.bind(py);
            let core = &gate.get().core;
            if this.epoch != core.epoch() {
                return Ok(());
            }
            if !core.is_closing() {
                recheck(py, gate.get());
            }
            if core.held_back() && !core.is_closing() {
                core.pressure_watch.rearm();
                // A loop that is closing refuses: then the check is handed on below.
                let delay = WATCH_INTERVAL.as_secs_f64();
                let again = running_loop(py).ok().flatten().is_some_and(|event_loop| {
                    event_loop
                        .call_method1(pyo3::intern!(py, "call_later"), (delay, slf))
                        .is_ok()
                });
                if again {
                    return Ok(());
                }
            }
            core.pressure_watch.disarm();
            // A waiter held back between the check and the disarm found the check armed and
            // scheduled none: arm one for it.
            ensure(py, gate);
            Ok(())
        })
    }
}
