//! One turn's passage through the gate: the async context manager `gate.admit()` returns.
//!
//! `__aenter__` arrives at the core: a turn that runs at once gets the shared finished
//! awaitable, a refused one raises `AdmissionRejected` (with its reason and retry hint), and
//! a queued one gets a [`Wait`]. `__aexit__` returns the slot; so does dropping an admission
//! abandoned without `__aexit__`. Each transition happens exactly once.
//!
//! With a fleet-wide limit (`AdmissionGate(..., fleet=...)`), a turn granted its local slot
//! then waits for its fleet lease ([`LeaseWait`], or [`acquire_blocking`] for `admit_sync`);
//! the core counts it as admitted only once the lease comes, and as rejected
//! (`fleet_unavailable`, `timeout`) or cancelled, with its slot handed on, if it does not.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple};
use pyo3::{PyTraverseError, PyVisit};

use super::adaptive::Entered;
use super::args;
use super::awaitables::{ready, Wait};
use super::blocking::BlockingWait;
use super::errors::guard;
use super::fleet::{
    acquire_blocking, fleet_epoch, lease_scope, Blocked, LeaseWait, PyFleetLimit, TurnLease,
};
use super::gate::PyAdmissionGate;
use super::human_wait::{call_method_one, human_wait_scope, HumanWaitFactory};
use super::rejection::rejection;
use super::runtime::{deadline_after, log, now, running_loop};
use admitgate_core::gate::TurnEnd;
use admitgate_core::overload::Outcome;
use admitgate_core::passthrough::PassTicket;
use admitgate_core::transport::TransportId;
use admitgate_core::{Arrival, Rejection, TurnSlot, WaiterKey};

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
    /// Let through by a gate with nothing to enforce: counted without its lock, and adopted
    /// by the gate if it enforces something before the turn ends (see
    /// [`admitgate_core::passthrough`]).
    PassThrough {
        ticket: PassTicket,
        /// The gate's epoch when the turn passed (see [`super::wake::Core::epoch`]).
        epoch: u64,
    },
    /// Arriving (deciding), before the gate has settled the turn.
    Arriving,
    /// Queued under this key.
    Queued(WaiterKey),
    /// Holds its local slot and waits for its fleet lease (a gate with a fleet limit).
    Leasing {
        scope: Option<Arc<str>>,
        epoch: u64,
    },
    Entered {
        slot: SlotRef,
        /// When it started and how many turns ran then, for a gate that times turns.
        started: Option<(Duration, u64)>,
        token: Option<Py<PyAny>>,
        /// The gate's epoch when the turn entered (see [`super::wake::Core::epoch`]).
        epoch: u64,
        /// The fleet lease, with a fleet limit.
        lease: Option<Arc<TurnLease>>,
    },
    Done,
}

/// One turn's passage through the gate: the async context manager `gate.admit()` returns.
#[pyclass(frozen, weakref, module = "admitgate._admitgate")]
pub struct Admission {
    gate: Py<PyAdmissionGate>,
    session_id: Py<PyString>,
    transport: TransportId,
    /// Called once with `(position, estimated_wait_s)` when the turn starts waiting.
    on_queued: Option<Py<PyAny>>,
    /// For `admit_sync`: the caller's own bound on the wait.
    timeout: Option<Duration>,
    state: Mutex<AdmissionState>,
    /// Whether the turn had to wait in the queue (set once it is admitted after waiting).
    pub waited: AtomicBool,
    /// `deadline_s`, as a deadline on the binding's clock.
    deadline_at: Option<Duration>,
    /// What `report_throttled` / `report_remaining` told about the provider call.
    report: Mutex<ProviderReport>,
}

/// What a turn reported about its provider call.
#[derive(Clone, Copy, Debug, Default)]
struct ProviderReport {
    /// `Some(retry_after)`: the provider throttled the call.
    throttled: Option<Option<Duration>>,
    /// `x-ratelimit-remaining-requests`.
    remaining: Option<u64>,
}

/// What `gate.admit()` / `gate.admit_sync()` were asked for.
pub struct AdmitArgs {
    pub session_id: Py<PyString>,
    pub transport: TransportId,
    pub on_queued: Option<Py<PyAny>>,
    pub timeout: Option<Duration>,
    /// `deadline_s`, as a deadline on the binding's clock.
    pub deadline: Option<Duration>,
}

/// How an arrival turned out, for the async and the blocking entry alike.
enum Arrived {
    /// Runs now (or the gate is disabled).
    Running,
    /// Waits under `key`, until `deadline` at the latest (refused then for the reason).
    Queued(WaiterKey, Option<Duration>, Rejection),
}

impl Admission {
    /// An admission of one turn, not yet entered.
    pub fn new(gate: Py<PyAdmissionGate>, args: AdmitArgs) -> Self {
        Self {
            gate,
            session_id: args.session_id,
            transport: args.transport,
            on_queued: args.on_queued,
            timeout: args.timeout,
            state: Mutex::new(AdmissionState::Fresh),
            waited: AtomicBool::new(false),
            deadline_at: args.deadline,
            report: Mutex::new(ProviderReport::default()),
        }
    }

    /// The turn will not run (refused, shed, withdrawn): nothing is left to return.
    pub fn abandon(&self) {
        let mut state = self.state.lock();
        if !matches!(*state, AdmissionState::Entered { .. }) {
            *state = AdmissionState::Done;
        }
    }

    /// The gate the turn passes.
    pub fn gate(&self) -> &Py<PyAdmissionGate> {
        &self.gate
    }

    /// The waiting turn's key, while it waits.
    fn queued_key(&self) -> Option<WaiterKey> {
        match *self.state.lock() {
            AdmissionState::Queued(key) => Some(key),
            _ => None,
        }
    }

    /// The turn holds a slot: bind the human-wait hook and remember what to release. With a
    /// fleet limit the turn first waits for its lease ([`Admission::lease_granted`] enters).
    pub fn enter(admission: &Bound<'_, Self>, scope: Option<Arc<str>>) -> PyResult<()> {
        let this = admission.get();
        let gate = this.gate.get();
        if gate.fleet().is_some() {
            *this.state.lock() = AdmissionState::Leasing {
                scope,
                epoch: gate.core.epoch(),
            };
            return Ok(());
        }
        Self::bind(admission, scope, None)
    }

    fn bind(
        admission: &Bound<'_, Self>,
        scope: Option<Arc<str>>,
        lease: Option<Arc<TurnLease>>,
    ) -> PyResult<()> {
        let py = admission.py();
        let this = admission.get();
        let core = &this.gate.get().core;
        let epoch = core.epoch();
        let started = core.times_turns().then(|| {
            let at = now();
            let (in_flight, wakes) = core.turn_started(at);
            wakes.run();
            (at, in_flight)
        });
        let (slot, token) = match human_wait_scope(py) {
            Some(var) => {
                let slot = Arc::new(TurnSlot::new(scope));
                let factory =
                    HumanWaitFactory::new(slot.clone(), core.clone(), epoch, lease.clone());
                let bound = Py::new(py, factory).and_then(|factory| {
                    call_method_one(var, pyo3::intern!(py, "set"), factory.bind(py))
                });
                match bound {
                    Ok(token) => (SlotRef::Shared(slot), Some(token.unbind())),
                    Err(err) => {
                        // The turn will not run: its slot (and lease) go straight back.
                        slot.close(core, None).run();
                        if let Some(lease) = &lease {
                            lease.close();
                        }
                        core.transports.finished(this.transport);
                        *this.state.lock() = AdmissionState::Done;
                        return Err(err);
                    }
                }
            }
            None => (SlotRef::Own(TurnSlot::new(scope)), None),
        };
        *this.state.lock() = AdmissionState::Entered {
            slot,
            started,
            token,
            epoch,
            lease,
        };
        Ok(())
    }

    /// The turn waiting for its lease got it: it counts as admitted and runs.
    pub fn lease_granted(admission: &Bound<'_, Self>, lease: Arc<TurnLease>) -> PyResult<()> {
        let this = admission.get();
        let core = &this.gate.get().core;
        let previous = std::mem::replace(&mut *this.state.lock(), AdmissionState::Done);
        let AdmissionState::Leasing { scope, epoch } = previous else {
            lease.close();
            return Err(PyRuntimeError::new_err(
                "this turn was not waiting for a lease",
            ));
        };
        if epoch != core.epoch() {
            lease.close();
            return Err(PyRuntimeError::new_err(
                "this turn belongs to the parent of a fork",
            ));
        }
        core.confirm();
        core.transports.dequeued(this.transport, true);
        Self::bind(admission, scope, Some(lease))
    }

    /// Ends a turn waiting for its lease: its local slot is handed on and it counts as
    /// rejected for `reason`, or as cancelled (`None`). Returns the retry hint.
    fn lease_ended(admission: &Bound<'_, Self>, reason: Option<Rejection>) -> Option<Duration> {
        let py = admission.py();
        let this = admission.get();
        let gate = this.gate.get();
        let previous = std::mem::replace(&mut *this.state.lock(), AdmissionState::Done);
        let AdmissionState::Leasing { scope, epoch } = previous else {
            return None;
        };
        if epoch != gate.core.epoch() {
            return None; // a turn of the parent process
        }
        let (retry, wakes) = gate.core.revoke(scope.as_deref(), reason, now);
        wakes.run();
        gate.core.after_release(py);
        gate.core.transports.dequeued(this.transport, false);
        if let Some(reason) = reason {
            gate.core.transports.rejected(this.transport, reason);
            let session = this.session_id.bind(py).to_string();
            log(
                py,
                "info",
                format!(
                    "AdmissionGate: rejecting turn ({}; waiting for its fleet lease) session={}",
                    reason.as_str(),
                    if session.is_empty() { "-" } else { &session }
                ),
            );
        }
        retry
    }

    /// The turn waiting for its lease is refused for `reason` (`fleet_unavailable`,
    /// `timeout`): counted in `rejected`, its slot handed on. Returns the retry hint.
    pub fn lease_refused(admission: &Bound<'_, Self>, reason: Rejection) -> Option<Duration> {
        Self::lease_ended(admission, Some(reason))
    }

    /// The turn stopped waiting for its lease (cancelled): counted in `cancelled`, its slot
    /// handed on.
    pub fn lease_cancelled(admission: &Bound<'_, Self>) {
        Self::lease_ended(admission, None);
    }

    /// The fleet limit's deadline for the lease wait: the queue timeout (and `admit_sync`'s
    /// own), counted from the arrival, like the local wait's.
    fn deadline(&self) -> Option<Duration> {
        let timeout = match (self.gate.get().queue_timeout(), self.timeout) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        timeout.and_then(deadline_after)
    }

    /// The scope of this turn's lease.
    fn lease_scope(&self, py: Python<'_>, fleet: &Py<PyFleetLimit>) -> PyResult<Arc<str>> {
        Ok(lease_scope(
            fleet.get(),
            &args::scope_key(self.session_id.bind(py))?,
        ))
    }

    /// Arrives at the gate: runs now, waits (the key is remembered), or is refused.
    fn arrive(slf: &Bound<'_, Self>) -> PyResult<Arrived> {
        let py = slf.py();
        let this = slf.get();
        {
            let mut state = this.state.lock();
            if !matches!(*state, AdmissionState::Fresh) {
                return Err(PyRuntimeError::new_err(
                    "this admission was already entered; call gate.admit() for each turn",
                ));
            }
            *state = AdmissionState::Arriving;
        }
        let gate = this.gate.get();
        let transports = &gate.core.transports;
        // A disabled gate lets turns through without its lock; once closing, the core
        // refuses them.
        if !gate.is_enabled(py) && !gate.core.is_closing() {
            let ticket = gate.core.pass_through();
            // A reconfigure that enabled the gate before the ticket was taken did not adopt
            // this turn: it must arrive like any other. (One after it adopts the turn.)
            if !gate.is_enabled(py) {
                *this.state.lock() = AdmissionState::PassThrough {
                    ticket,
                    epoch: gate.core.epoch(),
                };
                transports.admitted(this.transport);
                return Ok(Arrived::Running);
            }
            gate.core.end_pass_through(ticket, None).run();
        }
        let session_id = this.session_id.bind(py);
        let session_key = args::scope_key(session_id)?;
        let session: &str = &session_key;
        let scope = (gate.max_per_scope() > 0 && !session.is_empty()).then_some(session);
        let resource = gate.resources.decision(py);
        if !gate.native_policy() && gate.core.has_waiters() {
            // A custom policy decides from the facts the arrival will see: let eased
            // pressure hand out the free slots first.
            gate.core.note_pressure(resource).run();
        }
        let decided = gate.foreign_decision(py, session_id.as_any(), scope);
        let (arrival, wakes) = gate
            .core
            .arrive_by(scope, decided, resource, this.deadline_at, now);
        wakes.run();
        if !matches!(arrival, Arrival::Admitted(_)) {
            gate.core.sweep_closed_loops(py);
        }
        match arrival {
            Arrival::Admitted(scope) => {
                if gate.fleet().is_some() {
                    // Waits for its lease: queued for its transport until it comes.
                    transports.queued(this.transport);
                } else {
                    transports.admitted(this.transport);
                }
                Self::enter(slf, scope)?;
                Ok(Arrived::Running)
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
                        gate.max_concurrent_runs(),
                        if session.is_empty() { "-" } else { session }
                    ),
                );
                Err(rejection(py, reason, retry_after))
            }
            Arrival::Queued(key) => {
                transports.queued(this.transport);
                *this.state.lock() = AdmissionState::Queued(key);
                let timeout = match (gate.queue_timeout(), this.timeout) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                let timed_out = timeout.and_then(deadline_after);
                // The caller's deadline: refused once less of it is left than a turn takes.
                let too_late = this.deadline_at.map(|d| gate.core.deadline_timer(d));
                Ok(match (timed_out, too_late) {
                    (Some(t), Some(d)) if d < t => {
                        Arrived::Queued(key, Some(d), Rejection::Deadline)
                    }
                    (None, Some(d)) => Arrived::Queued(key, Some(d), Rejection::Deadline),
                    (t, _) => Arrived::Queued(key, t, Rejection::Timeout),
                })
            }
        }
    }

    /// Tells `on_queued` where the turn stands. If it raises, the turn withdraws (nothing is
    /// lost) and the error propagates.
    fn announce_queued(slf: &Bound<'_, Self>, key: WaiterKey) -> PyResult<()> {
        let this = slf.get();
        let Some(callback) = &this.on_queued else {
            return Ok(());
        };
        let py = slf.py();
        let core = &this.gate.get().core;
        let Some((position, estimate)) = core.place_in_line(key, now) else {
            return Ok(()); // already settled
        };
        callback
            .bind(py)
            .call1((position, estimate.map(|d| d.as_secs_f64())))
            .map(drop)
    }

    /// `__aenter__`: the shared finished awaitable for a turn that runs now, a [`Wait`] for
    /// one that queues.
    fn enter_async(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let this = slf.get();
        let fleet = this.gate.get().fleet();
        match Self::arrive(slf)? {
            Arrived::Running => match fleet {
                // An adaptive gate's turn is handed to `as turn`, to report throttles.
                None if this.gate.get().core.times_turns() => {
                    Ok(Py::new(py, Entered::new(slf.clone().unbind()))?.into_any())
                }
                None => ready(py),
                Some(fleet) => {
                    let wait = LeaseWait::new(
                        slf.clone().unbind(),
                        None,
                        fleet.clone_ref(py),
                        this.lease_scope(py, fleet)?,
                        this.deadline(),
                        this.gate.get().lease_waits.register(),
                    );
                    // If the awaitable cannot be made, dropping it hands the slot on.
                    Ok(Py::new(py, wait)?.into_any())
                }
            },
            Arrived::Queued(key, deadline, reason) => {
                let core = this.gate.get().core.clone();
                let wait = Wait::new(
                    slf.clone().unbind(),
                    core,
                    key,
                    this.transport,
                    deadline.map(|at| (at, reason)),
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
                            deadline,
                            this.gate.get().lease_waits.register(),
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
        let fleet = this.gate.get().fleet();
        let deadline = match Self::arrive(slf)? {
            Arrived::Running => this.deadline(),
            Arrived::Queued(key, deadline, reason) => {
                let core = this.gate.get().core.clone();
                let mut wait = BlockingWait::new(
                    core,
                    this.gate.clone_ref(py),
                    key,
                    this.transport,
                    fleet.is_some(),
                );
                if let Err(err) = Self::announce_queued(slf, key) {
                    wait.withdraw(py);
                    this.abandon();
                    return Err(err);
                }
                match wait.wait(py, deadline, reason) {
                    Ok(scope) => {
                        this.waited.store(true, Ordering::Relaxed);
                        Self::enter(slf, scope)?;
                        deadline
                    }
                    Err(err) => {
                        this.abandon();
                        return Err(err);
                    }
                }
            }
        };
        let Some(fleet) = fleet else {
            return Ok(());
        };
        // The local slot is held: now the lease, on this thread too.
        let interrupt = this.gate.get().lease_waits.register();
        match acquire_blocking(
            py,
            fleet.get(),
            this.lease_scope(py, fleet)?,
            deadline,
            &interrupt,
        ) {
            Err(err) => {
                Self::lease_cancelled(slf);
                Err(err)
            }
            Ok(Ok(lease)) => {
                let limit = fleet.get().limit()?;
                Self::lease_granted(slf, TurnLease::new(limit, lease, fleet_epoch()))
            }
            Ok(Err(Blocked::Refused(retry))) => {
                Self::lease_refused(slf, Rejection::FleetUnavailable);
                Err(rejection(py, Rejection::FleetUnavailable, Some(retry)))
            }
            Ok(Err(Blocked::TimedOut)) => {
                let retry = Self::lease_refused(slf, Rejection::Timeout);
                Err(rejection(py, Rejection::Timeout, retry))
            }
            Ok(Err(Blocked::Ended(reason))) => {
                let retry = Self::lease_refused(slf, reason);
                Err(rejection(py, reason, retry))
            }
            Ok(Err(Blocked::Interrupted(err))) => {
                Self::lease_cancelled(slf);
                Err(err)
            }
        }
    }

    /// How the turn's provider call went, for the adaptive ceiling: what it reported, else
    /// a `throttle_on` exception leaving the block, else served if it ended cleanly.
    fn outcome(&self, py: Python<'_>, exc: Option<&Bound<'_, PyAny>>) -> (Outcome, Option<u64>) {
        let report = *self.report.lock();
        let outcome = match (report.throttled, exc) {
            (Some(retry_after), _) => Outcome::Throttled { retry_after },
            (None, Some(exc)) if self.gate.get().is_throttle(py, exc) => {
                Outcome::Throttled { retry_after: None }
            }
            // An unrelated error says nothing of the provider's capacity.
            (None, Some(_)) => Outcome::Ignored,
            (None, None) => Outcome::Success,
        };
        (outcome, report.remaining)
    }

    fn leave(&self, py: Python<'_>, exc: Option<&Bound<'_, PyAny>>) {
        let previous = std::mem::replace(&mut *self.state.lock(), AdmissionState::Done);
        let gate = self.gate.get();
        match previous {
            AdmissionState::Entered {
                slot,
                started,
                token,
                epoch,
                lease,
            } => {
                if let Some(lease) = lease {
                    lease.close();
                }
                if let (Some(token), Some(var)) = (token, human_wait_scope(py)) {
                    // Exited in another context (the body handed the turn to another task):
                    // the variable cannot be reset there, and nothing depends on it after exit.
                    let _ = call_method_one(var, pyo3::intern!(py, "reset"), token.bind(py));
                }
                if epoch == gate.core.epoch() {
                    gate.core.transports.finished(self.transport);
                    let pressure = gate.release_pressure(py);
                    let wakes = match started {
                        Some((started_at, in_flight)) => {
                            let (outcome, remaining) = self.outcome(py, exc);
                            let end = TurnEnd {
                                started_at,
                                ended_at: now(),
                                in_flight,
                                outcome,
                                remaining,
                            };
                            slot.finish(&gate.core, pressure, end)
                        }
                        None => slot.close(&gate.core, pressure),
                    };
                    wakes.run();
                    gate.core.after_release(py);
                }
            }
            // A turn of the parent of a fork is forgotten by the child.
            AdmissionState::PassThrough { ticket, epoch } if epoch == gate.core.epoch() => {
                gate.core.transports.finished(self.transport);
                let resource = gate.release_pressure(py);
                gate.core.end_pass_through(ticket, resource).run();
                gate.core.after_release(py);
            }
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

    /// While the turn waits: how many turns would start before it; `None` otherwise.
    #[getter]
    fn position(&self) -> PyResult<Option<u64>> {
        guard(|| {
            let Some(key) = self.queued_key() else {
                return Ok(None);
            };
            Ok(self.gate.get().core.place_in_line(key, now).map(|(p, _)| p))
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
            let place = self.gate.get().core.place_in_line(key, now);
            Ok(place.and_then(|(_, estimate)| estimate.map(|d| d.as_secs_f64())))
        })
    }

    fn __aenter__(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        guard(|| Self::enter_async(slf))
    }

    fn __enter__(slf: &Bound<'_, Self>) -> PyResult<Py<Self>> {
        guard(|| {
            Self::enter_blocking(slf)?;
            Ok(slf.clone().unbind())
        })
    }

    /// Reports that the provider throttled this turn's call (HTTP 429, gRPC
    /// RESOURCE_EXHAUSTED), with its `Retry-After` in seconds if it sent one. On a gate with
    /// `adaptive=`, the ceiling moves when the turn ends; elsewhere it is ignored.
    #[pyo3(signature = (retry_after_s=None))]
    fn report_throttled(&self, retry_after_s: Option<Bound<'_, PyAny>>) -> PyResult<()> {
        guard(|| {
            let retry_after = match &retry_after_s {
                Some(v) => args::timeout("retry_after_s", v)?,
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

    #[pyo3(signature = (*exc))]
    fn __exit__(&self, py: Python<'_>, exc: &Bound<'_, PyTuple>) -> PyResult<bool> {
        guard(|| {
            let value = exc.get_item(1).ok().filter(|v| !v.is_none());
            self.leave(py, value.as_ref());
            Ok(false)
        })
    }

    #[pyo3(signature = (*exc))]
    fn __aexit__(&self, py: Python<'_>, exc: &Bound<'_, PyTuple>) -> PyResult<Py<PyAny>> {
        guard(|| {
            let value = exc.get_item(1).ok().filter(|v| !v.is_none());
            self.leave(py, value.as_ref());
            ready(py)
        })
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.gate)?;
        visit.call(&self.session_id)?;
        if let Some(callback) = &self.on_queued {
            visit.call(callback)?;
        }
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
            AdmissionState::Entered {
                slot, epoch, lease, ..
            } => {
                if let Some(lease) = lease {
                    lease.close(); // a no-op for a lease of the parent of a fork
                }
                if epoch != core.epoch() {
                    return; // a turn of the parent process, forgotten by the forked child
                }
                Python::attach(|py| {
                    if let Err(err) = guard(|| {
                        core.transports.finished(self.transport);
                        slot.close(&core, None).run();
                        core.after_release(py);
                        Ok(())
                    }) {
                        err.write_unraisable(py, None);
                    }
                });
            }
            AdmissionState::Leasing { scope, epoch } if epoch == core.epoch() => {
                // Abandoned while waiting for its lease (the wait could not be made): the
                // slot is handed on, and the turn counts as cancelled.
                Python::attach(|py| {
                    if let Err(err) = guard(|| {
                        let (_, wakes) = core.revoke(scope.as_deref(), None, now);
                        wakes.run();
                        core.after_release(py);
                        core.transports.dequeued(self.transport, false);
                        Ok(())
                    }) {
                        err.write_unraisable(py, None);
                    }
                });
            }
            AdmissionState::PassThrough { ticket, epoch } if epoch == core.epoch() => {
                Python::attach(|py| {
                    if let Err(err) = guard(|| {
                        core.transports.finished(self.transport);
                        core.end_pass_through(ticket, None).run();
                        core.after_release(py);
                        Ok(())
                    }) {
                        err.write_unraisable(py, None);
                    }
                });
            }
            _ => {}
        }
    }
}
