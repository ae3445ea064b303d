//! What a gate turn's wait for its fleet lease needs from the fleet runtime, Python-side:
//!
//! * [`lease_future`]: the lease as an asyncio future (the awaitable that drives it is
//!   `lease_wait::LeaseWait`, beside the admission it settles);
//! * [`acquire_blocking`]: the same wait for `admit_sync`, on a worker thread;
//! * [`Interrupt`] / [`LeaseWaits`]: what ends such a wait from outside (its deadline, its
//!   gate closing);
//! * [`FleetRuntime`]: where a running turn's lease (passage's `TurnLease`, lent during a
//!   human wait and reclaimed after it) runs its protocol work.
//!
//! The turn's counters are settled by passage's `Turn` (through the admission): with a
//! fleet, the gate's core defers admission until the lease comes (see the core's "deferred
//! admission").

use std::sync::Arc;
use std::time::Duration;

use std::future::Future;
use std::pin::Pin;

use admitgate_fleet::{FleetError, Lease};
use admitgate_passage::LeaseRuntime;
use parking_lot::Mutex;
use pyo3::prelude::*;

use super::lease::{Outcome, PyFleetLease};
use super::limit::PyFleetLimit;
use super::runtime;
use crate::python::errors::guard;
use crate::python::runtime::now;
use admitgate_core::Rejection;

/// How long a blocked thread waits before it looks at signals again.
const SLICE: Duration = Duration::from_millis(100);

/// The scope a turn's lease counts against: its tenant when the limit has per-tenant slices
/// or shares its classes fairly among tenants, else none (no per-tenant bookkeeping in Redis).
pub fn lease_scope(fleet: &PyFleetLimit, session: &str) -> Arc<str> {
    // The protocol object holds the gate's classes (rebuilt with them after a fork).
    let fair = fleet.limit().is_ok_and(|l| l.classes().is_fair());
    if fleet.config().max_in_flight_per_scope > 0 || fair {
        Arc::from(session)
    } else {
        Arc::from("")
    }
}

/// admitgate's fleet runtime (started on first use, rebuilt after a fork), where a running
/// turn's lease lends and reclaims itself.
pub struct FleetRuntime;

impl LeaseRuntime for FleetRuntime {
    fn spawn(&self, task: Pin<Box<dyn Future<Output = ()> + Send>>) {
        // A runtime that cannot start drops the task, which gives back the lease it owns.
        if let Ok(handle) = runtime::start() {
            drop(handle.spawn(task));
        }
    }

    fn epoch(&self) -> u64 {
        runtime::epoch()
    }
}

// -- ending a wait from outside -------------------------------------------------------

// -- waiting for it, async ---------------------------------------------------------------

/// What ends a turn's wait for its lease from outside, and why: its deadline (`timeout`) or
/// its gate closing (`closing`). Firing it records the reason and cancels the lease future on
/// its own loop (a blocked thread sees the reason within a slice).
#[derive(Default)]
pub struct Interrupt {
    reason: Mutex<Option<Rejection>>,
    /// The lease future and its loop, once asked for.
    pub fut: Mutex<Option<(Py<PyAny>, Py<PyAny>)>>,
}

impl Interrupt {
    /// Why the wait was ended from outside, if it was.
    pub fn reason(&self) -> Option<Rejection> {
        *self.reason.lock()
    }

    /// Ends the wait for `reason` (the first reason wins).
    pub fn fire(&self, py: Python<'_>, reason: Rejection) {
        {
            let mut current = self.reason.lock();
            if current.is_some() {
                return;
            }
            *current = Some(reason);
        }
        let fut = self
            .fut
            .lock()
            .as_ref()
            .map(|(fut, event_loop)| (fut.clone_ref(py), event_loop.clone_ref(py)));
        if let Some((fut, event_loop)) = fut {
            // Any thread may close a gate: the future is cancelled on its own loop.
            if let Ok(cancel) = fut.bind(py).getattr(pyo3::intern!(py, "cancel")) {
                let _ = event_loop
                    .bind(py)
                    .call_method1(pyo3::intern!(py, "call_soon_threadsafe"), (cancel,));
            }
        }
    }
}

/// A gate's turns waiting for their leases, so that closing the gate refuses them as it
/// refuses its queued turns.
#[derive(Default)]
pub struct LeaseWaits(Mutex<Vec<std::sync::Weak<Interrupt>>>);

impl LeaseWaits {
    /// Registers a new wait.
    pub fn register(&self) -> Arc<Interrupt> {
        let interrupt = Arc::new(Interrupt::default());
        let mut all = self.0.lock();
        all.retain(|w| w.strong_count() > 0);
        all.push(Arc::downgrade(&interrupt));
        interrupt
    }

    /// Ends every registered wait for `reason`; their turns are refused with it.
    pub fn refuse_all(&self, py: Python<'_>, reason: Rejection) {
        // Collected under the lock, fired after it: firing calls Python.
        let live: Vec<Arc<Interrupt>> = self.0.lock().iter().filter_map(|w| w.upgrade()).collect();
        for interrupt in live {
            interrupt.fire(py, reason);
        }
    }
}

/// Refuses a turn whose lease did not come within its queue timeout (scheduled with
/// `call_later` on the turn's loop).
#[pyclass(frozen, module = "admitgate._admitgate")]
pub struct LeaseTimer {
    interrupt: Arc<Interrupt>,
    reason: Rejection,
}

impl LeaseTimer {
    /// The timer that ends the wait `interrupt` stands for with `reason` (`timeout`: the
    /// queue timeout; `deadline`: the caller's deadline).
    pub fn new(interrupt: Arc<Interrupt>, reason: Rejection) -> Self {
        Self { interrupt, reason }
    }
}

#[pymethods]
impl LeaseTimer {
    fn __call__(&self, py: Python<'_>) -> PyResult<()> {
        guard(|| {
            self.interrupt.fire(py, self.reason);
            Ok(())
        })
    }
}

// -- the lease, as an asyncio future ---------------------------------------------------

/// The lease future for a turn: resolves to a `FleetLease`, or raises
/// `AdmissionRejected(reason="fleet_unavailable")` for any failure of the limit.
pub fn lease_future<'py>(
    py: Python<'py>,
    fleet: &PyFleetLimit,
    scope: Arc<str>,
    class: Option<usize>,
) -> PyResult<Bound<'py, PyAny>> {
    let limit = fleet.limit()?;
    let epoch = runtime::epoch();
    let retry = fleet.config().probe_interval;
    runtime::future_into_py(py, async move {
        Ok(match limit.acquire_in(&scope, class).await {
            Ok(lease) => Outcome::Lease(PyFleetLease::new(lease, epoch, None)),
            Err(_) => Outcome::Failed(FleetError::Unavailable, retry),
        })
    })
}

// -- waiting for it, blocking ------------------------------------------------------------

/// How a blocking wait for a lease ended without one.
pub enum Blocked {
    /// The limit refused (Redis down and `reject`, or shut down).
    Refused(Duration),
    /// The deadline passed: refused for this reason (`timeout`, `deadline`).
    TimedOut(Rejection),
    /// Ended from outside: the gate closed.
    Ended(Rejection),
    /// A signal handler raised (`KeyboardInterrupt`...).
    Interrupted(PyErr),
}

/// Waits on this (worker) thread, with the GIL released in slices so signals are seen, for a
/// lease for a turn of `scope`, until `deadline` at the latest. Giving up drops the protocol's
/// future on the runtime, which withdraws the ticket; a lease that comes at that moment goes
/// back.
pub fn acquire_blocking(
    py: Python<'_>,
    fleet: &PyFleetLimit,
    scope: Arc<str>,
    class: Option<usize>,
    deadline: Option<(Duration, Rejection)>,
    interrupt: &Interrupt,
) -> PyResult<Result<Lease, Blocked>> {
    let limit = fleet.limit()?;
    let retry = fleet.config().probe_interval;
    let handle = runtime::start()?;
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let task = handle.spawn(async move {
        // A receiver gone (the wait gave up) drops the result here: a lease goes back.
        let _ = tx.send(limit.acquire_in(&scope, class).await);
    });
    let mut rx = rx;
    loop {
        let slice = match deadline {
            Some((deadline, _)) => deadline.saturating_sub(now()).min(SLICE),
            None => SLICE,
        };
        if let (true, Some((_, reason))) = (slice.is_zero(), deadline) {
            task.abort();
            return Ok(Err(Blocked::TimedOut(reason)));
        }
        let (got, back) =
            crate::python::exit::detach_counted(py, move || (rx.recv_timeout(slice), rx));
        rx = back;
        match got {
            Ok(Ok(lease)) => return Ok(Ok(lease)),
            Ok(Err(_)) => return Ok(Err(Blocked::Refused(retry))),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Ok(Err(Blocked::Refused(retry)))
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
        }
        if let Err(err) = py.check_signals() {
            task.abort();
            return Ok(Err(Blocked::Interrupted(err)));
        }
        if let Some(reason) = interrupt.reason() {
            task.abort();
            return Ok(Err(Blocked::Ended(reason)));
        }
    }
}
