//! A turn's budget step for Python (`rate_limit=`): the turn's identity (from `identity=`,
//! `key(session_id)` or the session id), and the drivers of passage's [`BudgetTurn`]: on an
//! event loop (a coroutine, `admitgate._budget.enter`, that sleeps and awaits the fleet's
//! answers), and on a blocked thread (`admit_sync`).
//!
//! The rules (order, give-back, `on_limit`, the wait bound) are passage's; this module only
//! waits. A turn whose budgets allow it at once (every local decision, the common case) never
//! leaves `__aenter__`: the coroutine is used only to wait or to ask Redis.

use std::sync::Arc;
use std::time::{Duration, Instant};

use admitgate_passage::budget::{BudgetNext, BudgetTurn, FleetAnswer};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use super::admission::{Admission, BudgetState};
use super::args;
use super::estimator::Priced;
use super::fleet::{run_for_loop, runtime_start, Deliver};
use super::runtime::now;

/// A fleet budget's answer, as the asyncio future's result (opaque to Python).
#[pyclass(frozen, module = "admitgate._admitgate")]
pub struct BudgetAnswer(Mutex<Option<FleetAnswer>>);

impl BudgetAnswer {
    /// Gives back at once the admission in `step`'s answer, if `step` is a fleet answer's
    /// future that was resolved but never read (its turn was cancelled as the answer landed).
    /// Left to the garbage collector, the admission would count against the identity for as
    /// long as anything (a traceback's frame, a finished task) kept the future alive.
    pub(super) fn discard_unread(step: &Bound<'_, PyAny>) {
        let py = step.py();
        let resolved = step
            .call_method0(pyo3::intern!(py, "done"))
            .and_then(|d| d.is_truthy())
            .unwrap_or(false)
            && !step
                .call_method0(pyo3::intern!(py, "cancelled"))
                .and_then(|c| c.is_truthy())
                .unwrap_or(true);
        if !resolved {
            return;
        }
        if let Ok(result) = step.call_method0(pyo3::intern!(py, "result")) {
            if let Ok(answer) = result.cast::<BudgetAnswer>() {
                // Dropped here: its own drop gives the admission back.
                drop(answer.get().0.lock().take());
            }
        }
    }
}

/// A turn's identity in each of its gate's budgets.
struct Identities<'py> {
    each: Vec<Arc<[u8]>>,
    /// For a callable `estimator=`: the identity it is given, as Python has it (`None`: the
    /// session id).
    shown: Option<Bound<'py, PyAny>>,
}

/// What the step asks of its driver next, as Python sees it: `None` (admitted), seconds to
/// sleep, or an awaitable of the fleet's answer.
enum Pending {
    Admitted,
    Sleep(Duration),
    Ask(admitgate_passage::budget::FleetAsk),
}

impl Admission {
    /// The turn's identity in each of its gate's budgets, and for a callable `estimator=`
    /// the identity it is given as Python has it.
    fn identities<'py>(&self, py: Python<'py>) -> PyResult<Identities<'py>> {
        let gate = self.gate().get();
        let shown_for = gate
            .estimator()
            .filter(|e| e.is_callable())
            .map(|e| e.budget());
        if let Some(identity) = &self.identity {
            return Ok(Identities {
                each: vec![identity.bytes.clone()],
                shown: shown_for.map(|_| identity.given.bind(py).clone()),
            });
        }
        let session = self.session_id.bind(py);
        let plain: Arc<[u8]> = Arc::from(args::scope_key(session)?.as_bytes());
        let mut shown = None;
        let mut identities = Vec::with_capacity(gate.rate_limits().len());
        for (i, limit) in gate.rate_limits().iter().enumerate() {
            match limit.get().key() {
                Some(key) => {
                    // The key is Python: called with no lock held.
                    let answer = key.bind(py).call1((session,))?;
                    identities.push(args::identity_bytes("key(session_id)", &answer)?);
                    if shown_for == Some(i) {
                        shown = Some(answer);
                    }
                }
                None => identities.push(plain.clone()),
            }
        }
        Ok(Identities {
            each: identities,
            shown,
        })
    }

    /// What the turn reserves: its `cost=`, else the gate's `estimator=`'s estimate, else 0.
    /// The estimator is asked with no lock held (a callable runs Python).
    fn price(
        &self,
        py: Python<'_>,
        identities: &[Arc<[u8]>],
        shown: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Priced> {
        let Some(estimator) = self.gate().get().estimator() else {
            return Ok(Priced {
                cost: self.cost.unwrap_or(0),
                learns: None,
            });
        };
        // One identity serves every budget when `identity=` was given.
        let identity = identities
            .get(estimator.budget())
            .or_else(|| identities.last())
            .cloned()
            .unwrap_or_else(|| Arc::from(&b""[..]));
        let session = self.session_id.bind(py);
        estimator.price(py, self.cost, session.as_any(), &identity, shown)
    }

    /// When the turn's budget wait must end: its queue timeout (and `admit_sync`'s own)
    /// counted from now, or its deadline, whichever is first.
    fn budget_wait_until(&self) -> Option<Instant> {
        let at = match (self.deadline(), self.deadline_at) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }?;
        Instant::now().checked_add(at.saturating_sub(now()))
    }

    /// Begins the budget step (nothing without `rate_limit=`): `Admitted` when every budget
    /// allowed the turn at once; raises the refusal.
    fn budget_begin(&self, py: Python<'_>) -> PyResult<Pending> {
        let gate = self.gate().get();
        if gate.rate_limits().is_empty() {
            return Ok(Pending::Admitted);
        }
        *self.began_at.lock() = Some(now());
        let Identities { each, shown } = self.identities(py)?;
        let priced = self.price(py, &each, shown.as_ref())?;
        // A turn begins its budgets once (entering twice is refused before this).
        let _ = self.priced.set(priced);
        let mut turn =
            BudgetTurn::new(gate.budgets()?, each, priced.cost, self.budget_wait_until());
        let next = turn.step(Instant::now());
        self.budget_next(py, turn, next)
    }

    /// Keeps `turn` for what comes `next`.
    fn budget_next(&self, py: Python<'_>, turn: BudgetTurn, next: BudgetNext) -> PyResult<Pending> {
        match next {
            BudgetNext::Admitted => {
                *self.budget.lock() = BudgetState::Held(turn.admitted());
                Ok(Pending::Admitted)
            }
            BudgetNext::Refused(refused) => {
                drop(turn);
                *self.budget.lock() = BudgetState::Done;
                // Counted per front door as every refusal is (`transport_stats()`, metrics).
                let transport = self.transport();
                self.gate()
                    .get()
                    .core
                    .transports
                    .rejected(transport, refused.reason);
                let error = self.refusal(py, refused.reason, refused.retry_after);
                if let Some(by) = refused.by {
                    // Which limit refused, for a front door's RateLimit fields.
                    if let Some(limit) = self.gate().get().rate_limits().get(by.limiter) {
                        let exc = error.value(py);
                        exc.setattr("rate_limit", limit.clone_ref(py))?;
                        exc.setattr("rate_limit_index", by.limit)?;
                    }
                }
                Err(error)
            }
            BudgetNext::WaitUntil(at) => {
                *self.budget.lock() = BudgetState::Stepping(turn);
                Ok(Pending::Sleep(at.saturating_duration_since(Instant::now())))
            }
            BudgetNext::Ask(ask) => {
                *self.budget.lock() = BudgetState::Stepping(turn);
                Ok(Pending::Ask(ask))
            }
        }
    }

    /// Goes on with the step after a sleep (`answer` `None`) or the fleet's answer.
    fn budget_resume(&self, py: Python<'_>, answer: Option<FleetAnswer>) -> PyResult<Pending> {
        let state = std::mem::take(&mut *self.budget.lock());
        let BudgetState::Stepping(mut turn) = state else {
            *self.budget.lock() = state;
            return Ok(Pending::Admitted);
        };
        let next = match answer {
            Some(answer) => turn.answered(answer, Instant::now()),
            None => turn.step(Instant::now()),
        };
        self.budget_next(py, turn, next)
    }

    /// When Redis recorded the turn (seconds since the epoch, its clock), if a fleet-wide
    /// budget decided it there.
    pub(super) fn budget_server_time(&self) -> Option<f64> {
        match &*self.budget.lock() {
            BudgetState::Held(holds) | BudgetState::Running(holds) => {
                holds.server_time().map(|t| t.as_secs_f64())
            }
            _ => None,
        }
    }

    /// `turn.report_usage(tokens=...)`: settles every budget's reservation (once), and
    /// teaches the gate's `RecentUsage`, if it estimates with one.
    pub(super) fn budget_settle(&self, tokens: u64) {
        let holds = {
            let mut state = self.budget.lock();
            match std::mem::take(&mut *state) {
                BudgetState::Running(holds) | BudgetState::Held(holds) => {
                    *state = BudgetState::Done;
                    holds
                }
                // Nothing reserved (no budget), or already settled: the report is ignored.
                other => {
                    *state = other;
                    return;
                }
            }
        };
        holds.settle(tokens);
        if let (Some(estimator), Some(priced)) = (self.gate().get().estimator(), self.priced.get())
        {
            estimator.learn(priced, tokens);
        }
    }

    /// For `__aenter__`: `None` when the turn passed its budgets at once (go on to the gate),
    /// else the coroutine that waits for them and then enters the gate.
    pub(super) fn budget_enter_async(slf: &Bound<'_, Self>) -> PyResult<Option<Py<PyAny>>> {
        let py = slf.py();
        let first = match slf.get().budget_begin(py)? {
            Pending::Admitted => return Ok(None),
            pending => to_python(py, pending)?,
        };
        static ENTER: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
        let enter = ENTER.import(py, "admitgate._budget", "enter")?;
        Ok(Some(enter.call1((slf, first))?.unbind()))
    }

    /// `_budget_step(answer)`: the coroutine's next step.
    pub(super) fn budget_step_py(
        &self,
        py: Python<'_>,
        answer: Option<&Bound<'_, BudgetAnswer>>,
    ) -> PyResult<Py<PyAny>> {
        let answer = answer.and_then(|a| a.get().0.lock().take());
        let pending = self.budget_resume(py, answer)?;
        to_python(py, pending)
    }

    /// For `admit_sync`: passes the budgets on this thread (sleeping, and asking Redis, with
    /// the GIL released; Ctrl-C interrupts the wait and gives back what the turn held).
    pub(super) fn budget_enter_blocking(&self, py: Python<'_>) -> PyResult<()> {
        let mut pending = self.budget_begin(py)?;
        loop {
            let answer = match pending {
                Pending::Admitted => return Ok(()),
                Pending::Sleep(wait) => {
                    if let Err(err) = sleep_interruptibly(py, wait) {
                        self.give_back_budget();
                        return Err(err);
                    }
                    None
                }
                Pending::Ask(ask) => match ask_blocking(py, ask) {
                    Ok(answer) => Some(answer),
                    Err(err) => {
                        self.give_back_budget();
                        return Err(err);
                    }
                },
            };
            pending = self.budget_resume(py, answer)?;
        }
    }
}

/// `None`, seconds (a float), or an asyncio future of the fleet's answer.
fn to_python(py: Python<'_>, pending: Pending) -> PyResult<Py<PyAny>> {
    match pending {
        Pending::Admitted => Ok(py.None()),
        Pending::Sleep(wait) => Ok(wait.as_secs_f64().into_pyobject(py)?.into_any().unbind()),
        Pending::Ask(ask) => {
            let fut = run_for_loop(py, async move {
                let answer = ask.run().await;
                Box::new(move |py: Python<'_>| {
                    Ok(Py::new(py, BudgetAnswer(Mutex::new(Some(answer))))?.into_any())
                }) as Deliver
            })?;
            Ok(fut.unbind())
        }
    }
}

/// How often a blocked wait looks for signals (Ctrl-C).
const SIGNAL_CHECK: Duration = Duration::from_millis(50);

fn sleep_interruptibly(py: Python<'_>, wait: Duration) -> PyResult<()> {
    let started = Instant::now();
    loop {
        let left = wait.saturating_sub(started.elapsed());
        if left.is_zero() {
            return Ok(());
        }
        py.detach(|| std::thread::sleep(left.min(SIGNAL_CHECK)));
        py.check_signals()?;
    }
}

fn ask_blocking(py: Python<'_>, ask: admitgate_passage::budget::FleetAsk) -> PyResult<FleetAnswer> {
    let handle = runtime_start()?;
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    // Dropped unanswered (the runtime shut down, Ctrl-C): the answer's own drop gives back
    // an admission in it.
    drop(handle.spawn(async move {
        let _ = tx.send(ask.run().await);
    }));
    let mut rx = rx;
    loop {
        // The receiver is moved in and back: it may not be shared with the detached thread.
        let (received, back) = py.detach(move || (rx.recv_timeout(SIGNAL_CHECK), rx));
        rx = back;
        match received {
            Ok(answer) => return Ok(answer),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => py.check_signals()?,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err(pyo3::exceptions::PyRuntimeError::new_err(
                    "admitgate's fleet runtime dropped a budget decision",
                ))
            }
        }
    }
}
