//! A gate turn's fleet lease: waiting for it once the local slot is granted, holding it beside
//! the slot, lending it during a human wait, giving it back with the slot.
//!
//! A turn of a gate built with `fleet=` takes its local slot first (local queue and overflow
//! policy as without a fleet), then its lease, in fleet-wide FIFO order:
//!
//! * [`LeaseWait`] is the awaitable `__aenter__` returns: it drives the local queue wait (if
//!   the turn queued), then awaits the lease (an asyncio future from [`super::runtime`]). A
//!   cancelled or closed wait drops the lease future, which withdraws the ticket (or gives back
//!   a lease granted at that moment); a deadline (the queue timeout) cancels it the same way.
//! * [`acquire_blocking`] is the same wait for `admit_sync`, on a worker thread.
//! * [`TurnLease`] holds the lease while the turn runs: lent back during a human wait and
//!   reclaimed (or borrowed) on resume without blocking, given back when the turn ends.
//!
//! The admission's counters are settled by [`Admission`]'s `lease_granted` / `lease_refused`:
//! with a fleet, the gate's core defers admission until the lease comes (see the core's
//! "deferred admission").

use std::sync::Arc;
use std::time::Duration;

use admitgate_fleet::{FleetError, FleetLimit, Lease};
use parking_lot::Mutex;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::{PyTraverseError, PyVisit};

use super::lease::{Outcome, PyFleetLease};
use super::limit::PyFleetLimit;
use super::runtime;
use crate::python::admission::Admission;
use crate::python::awaitables::{thrown, Wait};
use crate::python::errors::guard;
use crate::python::rejection::rejection;
use crate::python::runtime::{now, running_loop};
use admitgate_core::Rejection;

/// How long a blocked thread waits before it looks at signals again.
const SLICE: Duration = Duration::from_millis(100);

/// The scope a turn's lease counts against: its tenant when the limit has per-tenant slices,
/// else none (no per-tenant bookkeeping in Redis).
pub fn lease_scope(fleet: &PyFleetLimit, session: &str) -> Arc<str> {
    if fleet.config().max_in_flight_per_scope > 0 {
        Arc::from(session)
    } else {
        Arc::from("")
    }
}

// -- holding the lease -------------------------------------------------------------------

enum Held {
    /// The turn holds its lease.
    Lease(Lease),
    /// Given back while the turn waits for a person.
    Lent,
    /// Taken back after the wait, not yet answered; `lend_on_arrival`: the turn parked again
    /// meanwhile, so the lease goes straight back when it comes.
    Reclaiming { lend_on_arrival: bool },
    /// The turn ended.
    Closed,
}

struct HeldState {
    held: Held,
    /// Human waits entered and not yet left (the local slot's rule: the first lends, the
    /// first exit takes back).
    waits: u32,
}

/// A running turn's fleet lease. Never blocks: lending, reclaiming and giving back run on
/// admitgate's runtime. Lock order: never held while calling Python or the protocol.
pub struct TurnLease {
    limit: FleetLimit,
    scope: Arc<str>,
    /// The runtime epoch the lease was taken in: after a fork it is the parent's.
    epoch: u64,
    state: Mutex<HeldState>,
}

impl TurnLease {
    /// The lease of a turn that just got it.
    pub fn new(limit: FleetLimit, lease: Lease, epoch: u64) -> Arc<Self> {
        Arc::new(Self {
            scope: Arc::from(lease.scope()),
            limit,
            epoch,
            state: Mutex::new(HeldState {
                held: Held::Lease(lease),
                waits: 0,
            }),
        })
    }

    fn current(&self) -> bool {
        self.epoch == runtime::epoch()
    }

    fn lend(&self, lease: Lease) {
        let limit = self.limit.clone();
        if let Ok(handle) = runtime::start() {
            handle.spawn(async move { limit.lend(lease).await });
        }
    }

    /// Enters a human wait: the first of nested waits lends the lease to the fleet.
    pub fn suspend(&self) {
        if !self.current() {
            return;
        }
        let lent = {
            let mut state = self.state.lock();
            // Nested waits of one turn: 2^32 of them cannot happen, so this never saturates.
            state.waits = state.waits.saturating_add(1);
            if state.waits != 1 {
                None
            } else {
                match std::mem::replace(&mut state.held, Held::Lent) {
                    Held::Lease(lease) => Some(lease),
                    Held::Reclaiming { .. } => {
                        state.held = Held::Reclaiming {
                            lend_on_arrival: true,
                        };
                        None
                    }
                    other => {
                        state.held = other;
                        None
                    }
                }
            }
        };
        if let Some(lease) = lent {
            self.lend(lease);
        }
    }

    /// Leaves a human wait: a lent lease is taken back, or borrowed over the cap when there
    /// is no room (counted in `fleet_borrowed`); the turn does not wait for the answer.
    pub fn resume(self: &Arc<Self>) {
        if !self.current() {
            return;
        }
        {
            let mut state = self.state.lock();
            state.waits = state.waits.saturating_sub(1);
            match &mut state.held {
                Held::Lent => {
                    state.held = Held::Reclaiming {
                        lend_on_arrival: false,
                    }
                }
                Held::Reclaiming { lend_on_arrival } => {
                    *lend_on_arrival = false;
                    return;
                }
                _ => return,
            }
        }
        let this = self.clone();
        let Ok(handle) = runtime::start() else { return };
        handle.spawn(async move {
            let Ok((lease, _)) = this.limit.reclaim(&this.scope).await else {
                return; // the limit was shut down
            };
            let lend = {
                let mut state = this.state.lock();
                match std::mem::replace(&mut state.held, Held::Closed) {
                    Held::Reclaiming {
                        lend_on_arrival: false,
                    } => {
                        state.held = Held::Lease(lease);
                        None
                    }
                    Held::Reclaiming {
                        lend_on_arrival: true,
                    } => {
                        state.held = Held::Lent;
                        Some(lease)
                    }
                    // Ended meanwhile: the lease goes back as it is dropped below.
                    other => {
                        state.held = other;
                        drop(state);
                        drop(lease);
                        return;
                    }
                }
            };
            if let Some(lease) = lend {
                this.limit.lend(lease).await;
            }
        });
    }

    /// The turn ended: the lease goes back (a reclaim still under way gives it back when it
    /// lands). Idempotent. A lease of the parent of a fork is left alone (see `Drop`).
    pub fn close(&self) {
        if !self.current() {
            return;
        }
        let held = std::mem::replace(&mut self.state.lock().held, Held::Closed);
        drop(held); // a lease is given back on the runtime
    }
}

impl Drop for TurnLease {
    fn drop(&mut self) {
        if self.current() {
            self.close();
            return;
        }
        // The parent's, before a fork: never given back by the child. Its lock may have been
        // held by one of the parent's runtime threads when the process forked, so it is not
        // taken: `get_mut` needs no lock.
        if let Held::Lease(lease) = std::mem::replace(&mut self.state.get_mut().held, Held::Closed)
        {
            std::mem::forget(lease);
        }
    }
}

// -- waiting for it, async ---------------------------------------------------------------

/// What ends a turn's wait for its lease from outside, and why: its deadline (`timeout`) or
/// its gate closing (`closing`). Firing it records the reason and cancels the lease future on
/// its own loop (a blocked thread sees the reason within a slice).
#[derive(Default)]
pub struct Interrupt {
    reason: Mutex<Option<Rejection>>,
    /// The lease future and its loop, once asked for.
    fut: Mutex<Option<(Py<PyAny>, Py<PyAny>)>>,
}

impl Interrupt {
    /// Why the wait was ended from outside, if it was.
    pub fn reason(&self) -> Option<Rejection> {
        *self.reason.lock()
    }

    /// Ends the wait for `reason` (the first reason wins).
    fn fire(&self, py: Python<'_>, reason: Rejection) {
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
}

#[pymethods]
impl LeaseTimer {
    fn __call__(&self, py: Python<'_>) -> PyResult<()> {
        guard(|| {
            self.interrupt.fire(py, Rejection::Timeout);
            Ok(())
        })
    }
}

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
    /// When the queue timeout refuses the turn, on [`now`]'s clock.
    deadline: Option<Duration>,
    interrupt: Arc<Interrupt>,
    state: Mutex<WaitState>,
}

/// The lease future for a turn: resolves to a `FleetLease`, or raises
/// `AdmissionRejected(reason="fleet_unavailable")` for any failure of the limit.
fn lease_future<'py>(
    py: Python<'py>,
    fleet: &PyFleetLimit,
    scope: Arc<str>,
) -> PyResult<Bound<'py, PyAny>> {
    let limit = fleet.limit()?;
    let epoch = runtime::epoch();
    let retry = fleet.config().probe_interval;
    runtime::future_into_py(py, async move {
        Ok(match limit.acquire(&scope).await {
            Ok(lease) => Outcome::Lease(PyFleetLease::new(lease, epoch, None)),
            Err(_) => Outcome::Failed(FleetError::Unavailable, retry),
        })
    })
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
        deadline: Option<Duration>,
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
            deadline,
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
        let fut = lease_future(py, self.fleet.get(), self.scope.clone())?;
        *self.interrupt.fut.lock() = Some((fut.clone().unbind(), event_loop.clone().unbind()));
        let timer = match self.deadline {
            Some(deadline) => {
                let delay = deadline.saturating_sub(now()).as_secs_f64();
                let expire = Py::new(
                    py,
                    LeaseTimer {
                        interrupt: self.interrupt.clone(),
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
                let held = TurnLease::new(limit, lease, runtime::epoch());
                Admission::lease_granted(admission, held)?;
                Ok(None)
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
            return rejection(py, reason, retry);
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
                local.get().withdraw_and_abandon(py);
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

// -- waiting for it, blocking ------------------------------------------------------------

/// How a blocking wait for a lease ended without one.
pub enum Blocked {
    /// The limit refused (Redis down and `reject`, or shut down).
    Refused(Duration),
    /// The deadline passed.
    TimedOut,
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
    deadline: Option<Duration>,
    interrupt: &Interrupt,
) -> PyResult<Result<Lease, Blocked>> {
    let limit = fleet.limit()?;
    let retry = fleet.config().probe_interval;
    let handle = runtime::start()?;
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let task = handle.spawn(async move {
        // A receiver gone (the wait gave up) drops the result here: a lease goes back.
        let _ = tx.send(limit.acquire(&scope).await);
    });
    let mut rx = rx;
    loop {
        let slice = match deadline {
            Some(deadline) => deadline.saturating_sub(now()).min(SLICE),
            None => SLICE,
        };
        if slice.is_zero() {
            task.abort();
            return Ok(Err(Blocked::TimedOut));
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
