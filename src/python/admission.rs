//! One turn's passage through the gate, for Python: the `Admission` object `gate.admit()`
//! returns, over passage's [`Turn`] state machine.
//!
//! The turn's phases, its counters and its one close path are the [`Turn`]'s (shared with the
//! broker); what lives here is what only Python has: the session id and `on_queued`
//! callback, the foreign policy asked before the turn arrives (its answer passed in as data),
//! memory pressure read from the sampler, the `HUMAN_WAIT_SCOPE` context variable bound
//! while the turn runs, the log lines and the exceptions. The turn is kept behind a lock that
//! is never held while Python runs: what may call Python (the pressure, the throttle check)
//! is done after the turn is taken out ([`Turn::take`]).
//!
//! How a queued turn waits is its driver's: an asyncio awaitable (`awaitables::Wait`, then
//! with a fleet limit `lease_wait::LeaseWait`) or a blocked thread (`blocking`). Each settles
//! the turn through the methods here, so every transition happens exactly once.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use admitgate_passage::turn::{Arrived, Claimed, NotLeasing, Report, WaitEnd};
use admitgate_passage::{Turn, TurnLease};
use parking_lot::Mutex;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyString;

use super::args;
use super::estimator::Priced;
use super::gate::PyAdmissionGate;
use super::human_wait::{call_method_one, human_wait_scope, HumanWaitFactory};
use super::rejection::rejection_in;
use super::runtime::{deadline_after, log, now};
use super::wake::{Core, PyWaker};
use admitgate_core::overload::Outcome;
use admitgate_core::transport::TransportId;
use admitgate_core::{ClassId, Registered, Rejection, WaiterKey};
use admitgate_passage::budget::{BudgetHolds, BudgetTurn};

/// One turn's passage through the gate: the context manager `gate.admit()` returns (its
/// Python methods are in `enter`).
#[pyclass(frozen, weakref, module = "admitgate._admitgate")]
pub struct Admission {
    pub(super) gate: Py<PyAdmissionGate>,
    pub(super) session_id: Py<PyString>,
    /// Called once with `(position, estimated_wait_s)` when the turn starts waiting.
    pub(super) on_queued: Option<Py<PyAny>>,
    /// For `admit_sync`: the caller's own bound on the wait.
    timeout: Option<Duration>,
    turn: Mutex<Turn>,
    /// The `HUMAN_WAIT_SCOPE` token while the turn runs, to reset on exit.
    pub(super) token: Mutex<Option<Py<PyAny>>>,
    /// Whether the turn had to wait in the queue (set once it is admitted after waiting).
    pub waited: AtomicBool,
    /// `deadline_s`, as a deadline on the binding's clock.
    pub(super) deadline_at: Option<Duration>,
    /// What `report_throttled` / `report_remaining` told about the provider call.
    pub(super) report: Mutex<ProviderReport>,
    /// `cost=`: the token estimate the turn reserves in its budgets (`None`: the gate's
    /// `estimator=` estimates it, else 0).
    pub(super) cost: Option<u64>,
    /// `identity=`: the turn's key in every budget, instead of `key(session_id)`.
    pub(super) identity: Option<Identity>,
    /// What the turn reserved, set once as it begins its budgets.
    pub(super) priced: OnceLock<Priced>,
    /// Where the turn is with its budgets (`rate_limit=`).
    pub(super) budget: Mutex<BudgetState>,
    /// When the turn began (its budget step, then its arrival), on the binding's clock: the
    /// queue timeout bounds the budget's wait and the queue's together.
    pub(super) began_at: Mutex<Option<Duration>>,
}

/// What a turn reported about its provider call.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct ProviderReport {
    /// `Some(retry_after)`: the provider throttled the call.
    pub(super) throttled: Option<Option<Duration>>,
    /// `x-ratelimit-remaining-requests`.
    pub(super) remaining: Option<u64>,
}

/// Where a turn is with its budgets.
#[derive(Default)]
pub enum BudgetState {
    /// No budget (or not yet asked).
    #[default]
    None,
    /// Deciding: waiting for a retry time or for Redis.
    Stepping(BudgetTurn),
    /// Admitted by its budgets; not yet running (given back if it is refused or cancelled).
    Held(BudgetHolds),
    /// It ran: the estimates stay spent unless it reports its usage.
    Running(BudgetHolds),
    /// Settled, given back, or refused.
    Done,
}

/// What `gate.admit()` / `gate.admit_sync()` were asked for.
pub struct AdmitArgs {
    pub session_id: Py<PyString>,
    pub transport: TransportId,
    pub on_queued: Option<Py<PyAny>>,
    pub timeout: Option<Duration>,
    /// `deadline_s`, as a deadline on the binding's clock.
    pub deadline: Option<Duration>,
    /// `priority=`, resolved to its class.
    pub class: ClassId,
    /// `cost=`.
    pub cost: Option<u64>,
    /// `identity=`.
    pub identity: Option<Identity>,
}

/// `identity=`: as the budgets hash it, and as given (for a callable `estimator=`).
pub struct Identity {
    pub bytes: Arc<[u8]>,
    pub given: Py<PyAny>,
}

/// How an arrival turned out, for the async and the blocking entry alike.
pub(super) enum Entry {
    /// Runs now (or the gate is disabled), or with a fleet limit waits for its lease.
    Running,
    /// Waits under `key`, looked at (refused then if due, for its reason) at each end.
    Queued(WaiterKey, Option<WaitEnd>),
}

impl Admission {
    /// An admission of one turn, not yet entered.
    pub fn new(gate: Py<PyAdmissionGate>, args: AdmitArgs) -> Self {
        let lease_follows = gate.get().fleet().is_some();
        let mut turn = Turn::new(args.transport, lease_follows);
        turn.set_class(args.class);
        Self {
            gate,
            session_id: args.session_id,
            on_queued: args.on_queued,
            timeout: args.timeout,
            turn: Mutex::new(turn),
            token: Mutex::new(None),
            waited: AtomicBool::new(false),
            deadline_at: args.deadline,
            report: Mutex::new(ProviderReport::default()),
            cost: args.cost,
            identity: args.identity,
            priced: OnceLock::new(),
            budget: Mutex::new(BudgetState::None),
            began_at: Mutex::new(None),
        }
    }

    /// The gate the turn passes.
    pub fn gate(&self) -> &Py<PyAdmissionGate> {
        &self.gate
    }

    /// The front door the turn came through.
    pub(super) fn transport(&self) -> TransportId {
        self.turn.lock().transport()
    }

    /// The turn ran: its budgets keep its estimates unless it reports its usage.
    pub(super) fn budget_ran(&self) {
        if self.gate.get().rate_limits().is_empty() {
            return; // every turn's path: no lock without a budget
        }
        let mut state = self.budget.lock();
        if let BudgetState::Held(_) = &*state {
            if let BudgetState::Held(holds) = std::mem::take(&mut *state) {
                *state = BudgetState::Running(holds);
            }
        }
    }

    /// The turn will not run (refused, cancelled, abandoned): its budgets get back whatever
    /// it reserved.
    pub(super) fn give_back_budget(&self) {
        if self.gate.get().rate_limits().is_empty() {
            return;
        }
        let state = {
            let mut state = self.budget.lock();
            match &*state {
                BudgetState::Held(_) | BudgetState::Stepping(_) => {
                    std::mem::replace(&mut *state, BudgetState::Done)
                }
                _ => return,
            }
        };
        match state {
            BudgetState::Held(holds) => holds.cancel(),
            // Dropping the step gives back what it holds.
            other => drop(other),
        }
    }

    /// The exception this turn raises when refused for `reason`: it names the turn's
    /// priority class on a gate that has classes.
    pub fn refusal(&self, py: Python<'_>, reason: Rejection, retry: Option<Duration>) -> PyErr {
        // Refused before it ran: its budgets get back what it reserved.
        self.give_back_budget();
        let class = self.turn.lock().class();
        let name = self.gate.get().classes().name(class);
        rejection_in(py, reason, retry, name.as_deref())
    }

    fn core(&self) -> &Arc<Core> {
        &self.gate.get().core
    }

    /// The turn's class as the fleet's lease queue takes it (ignored by a fleet without
    /// classes).
    pub(super) fn lease_class(&self) -> Option<usize> {
        Some(usize::from(self.turn.lock().class().0))
    }

    /// The waiting turn's key, while it waits.
    pub(super) fn queued_key(&self) -> Option<WaiterKey> {
        self.turn.lock().queued_key()
    }

    /// Whether the turn runs (holding, or having lent to a human wait, its slot).
    pub(super) fn is_running(&self) -> bool {
        self.turn.lock().is_running()
    }

    /// Registers the queued turn's waker.
    pub fn register(&self, waker: PyWaker) -> Registered {
        let core = self.core();
        self.turn.lock().register(&**core, waker)
    }

    /// The queued turn's wait reached `end`: refused if due (unless a slot was granted
    /// first). Returns the next end to wait for, if the turn still waits and has one.
    pub fn expire(&self, end: &WaitEnd) -> Option<WaitEnd> {
        let core = self.core();
        let (wakes, next) = {
            let turn = self.turn.lock();
            let wakes = turn.expire(&**core, end, now());
            (wakes, turn.next_end(&**core, end))
        };
        wakes.run();
        next
    }

    /// What became of the queued turn; a turn granted its slot is entered
    /// ([`Admission::enter`]) by the caller.
    pub fn claim(&self) -> Claimed {
        let core = self.core();
        let (claimed, wakes, waited) = {
            let mut turn = self.turn.lock();
            let (claimed, wakes) = turn.claim(&**core, now);
            (claimed, wakes, turn.waited())
        };
        wakes.run();
        if claimed == Claimed::Granted {
            self.waited
                .store(waited, std::sync::atomic::Ordering::Relaxed);
        }
        claimed
    }

    /// Leaves the queue (a slot granted meanwhile goes to the next waiter); `false` if the
    /// turn was not queued.
    pub fn withdraw(&self, py: Python<'_>) -> bool {
        let core = self.core();
        let withdrawn = self.turn.lock().withdraw(&**core);
        let Some(wakes) = withdrawn else {
            return false;
        };
        wakes.run();
        core.after_release(py);
        self.give_back_budget();
        true
    }

    /// The turn holds its slot: it starts, with the human-wait hook bound. With a fleet
    /// limit it first waits for its lease ([`Admission::lease_granted`] starts it).
    pub fn enter(admission: &Bound<'_, Self>) -> PyResult<()> {
        let this = admission.get();
        // Only a gate with a fleet limit has leases to wait for (its lock is not taken
        // otherwise: this is every admitted turn's path).
        if this.gate.get().fleet().is_some() && this.turn.lock().is_leasing() {
            return Ok(());
        }
        Self::start(admission)
    }

    fn start(admission: &Bound<'_, Self>) -> PyResult<()> {
        let py = admission.py();
        let this = admission.get();
        let core = this.core();
        let var = human_wait_scope(py);
        this.budget_ran();
        let (held, wakes) = this.turn.lock().start(&**core, var.is_some(), now);
        if !wakes.is_empty() {
            wakes.run(); // only a timed turn's start can wake anyone
        }
        let (Some(var), Some(held)) = (var, held) else {
            return Ok(());
        };
        let factory = HumanWaitFactory::new(held, core.clone());
        let bound = Py::new(py, factory)
            .and_then(|factory| call_method_one(var, pyo3::intern!(py, "set"), factory.bind(py)));
        match bound {
            Ok(token) => {
                *this.token.lock() = Some(token.unbind());
                Ok(())
            }
            Err(err) => {
                // The turn will not run: its slot (and lease) go straight back.
                let mut turn = this.turn.lock().take();
                if let Some(wakes) = turn.end(&**core, || None, || None) {
                    wakes.run();
                    core.after_release(py);
                }
                Err(err)
            }
        }
    }

    /// The turn waiting for its lease got it: it counts as admitted and runs.
    pub fn lease_granted(admission: &Bound<'_, Self>, lease: Arc<TurnLease>) -> PyResult<()> {
        let this = admission.get();
        let granted = this.turn.lock().lease_granted(&**this.core(), lease);
        match granted {
            Ok(()) => Self::start(admission),
            Err(NotLeasing::NotWaiting) => Err(PyRuntimeError::new_err(
                "this turn was not waiting for a lease",
            )),
            Err(NotLeasing::Forked) => Err(PyRuntimeError::new_err(
                "this turn belongs to the parent of a fork",
            )),
        }
    }

    /// Ends a turn waiting for its lease: its local slot is handed on and it counts as
    /// rejected for `reason`, or as cancelled (`None`). Returns the retry hint.
    fn lease_ended(admission: &Bound<'_, Self>, reason: Option<Rejection>) -> Option<Duration> {
        let py = admission.py();
        let this = admission.get();
        let core = this.core();
        let ended = this.turn.lock().lease_ended(&**core, reason, now);
        this.give_back_budget();
        let (retry, wakes) = ended?;
        wakes.run();
        core.after_release(py);
        if let Some(reason) = reason {
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
    /// `timeout`, `closing`): counted in `rejected`, its slot handed on. Returns the retry
    /// hint.
    pub fn lease_refused(admission: &Bound<'_, Self>, reason: Rejection) -> Option<Duration> {
        Self::lease_ended(admission, Some(reason))
    }

    /// The turn stopped waiting for its lease (cancelled): counted in `cancelled`, its slot
    /// handed on.
    pub fn lease_cancelled(admission: &Bound<'_, Self>) {
        Self::lease_ended(admission, None);
    }

    /// When the wait for the fleet lease ends, and with which refusal: at `timeout_at` (the
    /// queue timeout, counted from the arrival) with `timeout`, or, when it comes first, once
    /// less of `deadline_s` is left than a turn takes (at the estimate when the lease is asked
    /// for) with `deadline`, as the local wait does: the caller's deadline bounds the whole
    /// wait, slot and lease.
    pub(super) fn lease_deadline(
        &self,
        timeout_at: Option<Duration>,
    ) -> Option<(Duration, Rejection)> {
        let core = self.core();
        let turn = self.turn.lock();
        turn.wait_deadline(&**core, timeout_at, self.deadline_at)
            .map(|end| (end.at, end.reason))
    }

    /// The queue timeout (and `admit_sync`'s own) as a deadline, counted from now (the
    /// arrival, for a turn that did not queue).
    pub(super) fn deadline(&self) -> Option<Duration> {
        let timeout = match (self.gate.get().queue_timeout(), self.timeout) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        timeout.and_then(|t| self.timeout_at(t))
    }

    /// The end of a wait of `timeout`, counted from when the turn began (its budget step).
    pub(super) fn timeout_at(&self, timeout: Duration) -> Option<Duration> {
        match *self.began_at.lock() {
            Some(began) => began.checked_add(timeout),
            None => deadline_after(timeout),
        }
    }

    /// Arrives at the gate: runs now (or waits for its lease), waits in the queue, or is
    /// refused (raised).
    pub(super) fn arrive(slf: &Bound<'_, Self>) -> PyResult<Entry> {
        let py = slf.py();
        let this = slf.get();
        let gate = this.gate.get();
        let core = &gate.core;
        if this.turn.lock().begin(&**core).is_err() {
            return Err(PyRuntimeError::new_err(
                "this admission was already entered; call gate.admit() for each turn",
            ));
        }
        // A disabled gate lets turns through without its lock; once closing, the core
        // refuses them.
        if !gate.is_enabled(py) && !core.is_closing() {
            let ticket = core.pass_through();
            // A reconfigure that enabled the gate before the ticket was taken did not adopt
            // this turn: it must arrive like any other. (One after it adopts the turn.)
            if !gate.is_enabled(py) {
                this.turn.lock().pass_through(&**core, ticket);
                this.budget_ran();
                return Ok(Entry::Running);
            }
            core.end_pass_through(ticket, None).run();
        }
        let session_id = this.session_id.bind(py);
        let session_key = args::scope_key(session_id)?;
        let session: &str = &session_key;
        let scope = (gate.tracks_tenants() && !session.is_empty()).then_some(session);
        let resource = gate.resources.decision(py);
        if !gate.native_policy() && core.has_waiters() {
            // A custom policy decides from the facts the arrival will see: let eased
            // pressure hand out the free slots first.
            core.note_pressure(resource).run();
        }
        // Asked before the turn's lock is taken: the policy is Python; its answer is data.
        let decided = gate.foreign_decision(py, session_id.as_any(), scope);
        let (arrived, wakes) =
            this.turn
                .lock()
                .arrive(&**core, scope, decided, resource, this.deadline_at, now);
        wakes.run();
        if arrived != Arrived::Granted {
            core.sweep_closed_loops(py);
        }
        match arrived {
            Arrived::Granted => {
                Self::enter(slf)?;
                Ok(Entry::Running)
            }
            Arrived::Refused(refused) => {
                let s = core.stats(now);
                log(
                    py,
                    "info",
                    format!(
                        "AdmissionGate: rejecting turn ({}; in_flight={} queued={} max={}) session={}",
                        refused.reason.as_str(),
                        s.in_flight,
                        s.queued,
                        gate.max_concurrent_runs(),
                        if session.is_empty() { "-" } else { session }
                    ),
                );
                Err(this.refusal(py, refused.reason, refused.retry_after))
            }
            Arrived::Queued(key) => {
                let timeout = match (gate.queue_timeout(), this.timeout) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                let timed_out = timeout.and_then(|t| this.timeout_at(t));
                let until = this
                    .turn
                    .lock()
                    .wait_deadline(&**core, timed_out, this.deadline_at);
                Ok(Entry::Queued(key, until))
            }
        }
    }

    /// Tells `on_queued` where the turn stands. If it raises, the turn withdraws (nothing is
    /// lost) and the error propagates.
    pub(super) fn announce_queued(slf: &Bound<'_, Self>, key: WaiterKey) -> PyResult<()> {
        let this = slf.get();
        let Some(callback) = &this.on_queued else {
            return Ok(());
        };
        let py = slf.py();
        let Some((position, estimate)) = this.core().place_in_line(key, now) else {
            return Ok(()); // already settled
        };
        callback
            .bind(py)
            .call1((position, estimate.map(|d| d.as_secs_f64())))
            .map(drop)
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

    /// `__exit__` / `__aexit__`: the turn ends, its slot (and lease) returned exactly once.
    pub(super) fn leave(&self, py: Python<'_>, exc: Option<&Bound<'_, PyAny>>) {
        // Taken out first: the pressure and the throttle check may run Python. A turn still
        // waiting is left to its wait, which withdraws it.
        let mut turn = {
            let mut turn = self.turn.lock();
            if turn.queued_key().is_some() || turn.is_leasing() {
                return;
            }
            turn.take()
        };
        // Without praisonaiagents no token was ever bound: its lock is not taken.
        let var = human_wait_scope(py);
        let token = var.and_then(|_| self.token.lock().take());
        if let (Some(token), Some(var)) = (token, var) {
            // Exited in another context (the body handed the turn to another task): the
            // variable cannot be reset there, and nothing depends on it after exit.
            let _ = call_method_one(var, pyo3::intern!(py, "reset"), token.bind(py));
        }
        let gate = self.gate.get();
        let report = || {
            let (outcome, remaining) = self.outcome(py, exc);
            Some(Report {
                outcome,
                remaining,
                ended_at: now(),
            })
        };
        if let Some(wakes) = turn.end(&*gate.core, || gate.release_pressure(py), report) {
            wakes.run();
            gate.core.after_release(py);
        }
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        // A turn abandoned without __aexit__ (its coroutine was never finished) still
        // returns its slot exactly once. A panic must not unwind out of a destructor the
        // interpreter calls, so it is contained and reported as unraisable.
        // Never ran: what it reserved in its budgets goes back (a turn that ran keeps its
        // estimate unless it reported its usage).
        self.give_back_budget();
        let mut turn = self.turn.get_mut().take();
        if !turn.holds_anything() {
            return;
        }
        let core = self.core().clone();
        Python::attach(|py| {
            if let Err(err) = super::errors::guard(|| {
                if let Some(wakes) = turn.abandon(&*core, now) {
                    wakes.run();
                    core.after_release(py);
                }
                Ok(())
            }) {
                err.write_unraisable(py, None);
            }
        });
    }
}
