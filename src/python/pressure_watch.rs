//! Re-sampling memory pressure while it holds waiters back.
//!
//! Under memory pressure the gate leaves free slots idle, and only a fresh sample that finds
//! the pressure eased lets the waiters it held back take them. Arrivals and releases sample,
//! but when neither comes (a long turn runs, nobody arrives) the waiters were stranded until
//! their queue timeout, with slots free. So while the core reports waiters held back
//! ([`admitgate_core::Gate::held_back`]), someone re-samples every [`WATCH_INTERVAL`]:
//!
//! * on an event loop, one [`PressureCheck`] per gate, a `call_later` callback that samples,
//!   lets eased pressure start the waiters, and schedules itself again while waiters are still
//!   held back. It runs on the loop of the waiter that found the gate holding it back (or, for
//!   a `reconfigure` on a thread with no loop, of the oldest waiter);
//! * a thread blocked in `admit_sync` re-samples itself, waiting in slices of the interval.
//!
//! Only one check is armed per gate ([`PressureWatch`]); one whose loop stopped running it
//! (closed, or blocked for [`STALE_AFTER`]) is replaced by the next waiter that finds the gate
//! holding it back.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use pyo3::prelude::*;

use super::errors::guard;
use super::gate::PyAdmissionGate;
use super::runtime::{now, running_loop};
use super::wake::PyWaker;

/// How often held-back waiters are re-checked: a fifth of a typical turn's latency budget
/// and twice the built-in sampler's cache interval, so each check reads a fresh sample.
pub const WATCH_INTERVAL: Duration = Duration::from_millis(10);

/// An armed check that has not run for this long is presumed lost (its loop closed or is
/// blocked), and the next waiter held back arms another.
const STALE_AFTER: Duration = Duration::from_millis(200);

fn nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

/// Whether a gate's pressure check is armed: when it is next due, in nanoseconds on
/// [`now`]'s clock; 0 when unarmed.
#[derive(Debug, Default)]
pub struct PressureWatch {
    due: AtomicU64,
}

impl PressureWatch {
    /// Claims the right to schedule the check: `true` if none was armed, or the armed one is
    /// presumed lost; the caller must then schedule it (or [`disarm`](Self::disarm)).
    fn arm(&self) -> bool {
        let now = nanos(now());
        let due = now.saturating_add(nanos(WATCH_INTERVAL));
        self.due
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |current| {
                let live = current != 0 && now < current.saturating_add(nanos(STALE_AFTER));
                (!live).then_some(due)
            })
            .is_ok()
    }

    /// The armed check runs again in [`WATCH_INTERVAL`].
    fn rearm(&self) {
        let due = nanos(now()).saturating_add(nanos(WATCH_INTERVAL));
        self.due.store(due.max(1), Ordering::Release);
    }

    /// No check is armed.
    fn disarm(&self) {
        self.due.store(0, Ordering::Release);
    }

    /// Forgets the armed check (a forked child: the parent's loops do not run here).
    pub fn reset(&self) {
        self.disarm();
    }
}

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
