//! `AdmissionGate` and the awaitables that make `async with gate.admit(...)` work.
//!
//! The fast path (a free slot) runs entirely inside `__aenter__`: one lock of the core, and
//! the shared, already-finished [`Ready`] awaitable is returned, so no event-loop callback is
//! scheduled and no thread is crossed. A turn that must wait gets a [`Wait`]: an awaitable
//! that yields an asyncio future created on the caller's own loop. Whoever frees a slot
//! resolves that future after the core's lock is released: directly on the loop's own
//! thread, and from any other thread through the loop's [`LoopMailbox`] (one
//! `call_soon_threadsafe` per burst). A wait that is cancelled, closed or dropped withdraws
//! from the core, which hands on any slot it had been granted in the meantime; turns woken
//! on a loop that then closes without running them are withdrawn by a periodic sweep.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use pyo3::exceptions::{PyRuntimeError, PyTypeError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyString, PyType};

use super::args;
use super::errors::guard;
use super::policy::{decision_from, rss_of, PyConcurrencyLimitPolicy, PyMemoryPressurePolicy};
use crate::core::rss::RssSampler;
use crate::core::{
    Arrival, Cancelled, Claim, ConcurrencyLimit, Decision, Gate, MemoryPressure, Overflow,
    Registered, TurnSlot, WaiterKey, Waker, Wakes,
};

/// The core plus what the binding must remember about waiters it has woken.
pub struct Core {
    gate: Gate<PyWaker>,
    /// Waiters whose wake-up has been handed to their event loop but who have not yet
    /// claimed their outcome, with that loop. A loop stopped and then closed discards the
    /// callbacks it had not run; the turns it woke would keep their slots forever, so
    /// arrivals that find no slot free sweep this map (at most every [`SWEEP_INTERVAL`])
    /// and withdraw the turns of closed loops.
    in_transit: Mutex<HashMap<WaiterKey, Py<PyAny>, foldhash::fast::RandomState>>,
    /// When the last sweep ran, in nanoseconds on [`now`].
    last_sweep: AtomicU64,
    /// Whether the closed-loop warning was logged (once per gate, not once per waiter).
    warned_closed_loop: AtomicBool,
    /// Bumped when a forked child empties the gate: slots of turns entered before (the
    /// parent's) must not be returned to the child's counts.
    epoch: AtomicU64,
}

/// How often arrivals that find no free slot look for turns stranded on closed loops.
const SWEEP_INTERVAL: Duration = Duration::from_millis(50);

impl std::ops::Deref for Core {
    type Target = Gate<PyWaker>;

    fn deref(&self) -> &Gate<PyWaker> {
        &self.gate
    }
}

impl Core {
    fn new(limits: ConcurrencyLimit) -> Self {
        Self {
            gate: Gate::new(limits),
            in_transit: Mutex::new(HashMap::default()),
            last_sweep: AtomicU64::new(0),
            warned_closed_loop: AtomicBool::new(false),
            epoch: AtomicU64::new(0),
        }
    }

    fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Relaxed)
    }

    fn delivered(&self, key: WaiterKey) {
        self.in_transit.lock().remove(&key);
    }

    /// Withdraws woken turns whose event loop has closed, handing their slots on. Runs at
    /// most once per [`SWEEP_INTERVAL`]; each distinct loop is asked once.
    fn sweep_closed_loops(&self, py: Python<'_>) {
        let now_ns = now().as_nanos() as u64;
        let last = self.last_sweep.load(Ordering::Relaxed);
        if now_ns.saturating_sub(last) < SWEEP_INTERVAL.as_nanos() as u64
            || self
                .last_sweep
                .compare_exchange(last, now_ns, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        let pending: Vec<(WaiterKey, Py<PyAny>)> = self
            .in_transit
            .lock()
            .iter()
            .map(|(key, event_loop)| (*key, event_loop.clone_ref(py)))
            .collect();
        // Each distinct loop is asked once; an error reads as open (withdraw nobody by mistake).
        let mut verdicts: Vec<(Py<PyAny>, bool)> = Vec::new();
        for (key, event_loop) in pending {
            let closed = match verdicts.iter().find(|(l, _)| l.is(&event_loop)) {
                Some((_, closed)) => *closed,
                None => {
                    let closed = loop_is_closed(event_loop.bind(py)).unwrap_or(false);
                    verdicts.push((event_loop, closed));
                    closed
                }
            };
            if closed {
                self.delivered(key);
                self.gate.cancel(key).1.run();
            }
        }
    }
}

fn loop_is_closed(event_loop: &Bound<'_, PyAny>) -> PyResult<bool> {
    event_loop
        .call_method0(pyo3::intern!(event_loop.py(), "is_closed"))?
        .is_truthy()
}

/// The monotonic clock given to the gate's core (which never reads one itself) and to the
/// RSS sampler.
fn now() -> Duration {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed()
}

/// Every live gate, so `fork()` can empty them in the child.
static GATES: Mutex<Vec<Weak<Core>>> = Mutex::new(Vec::new());

/// Empties every gate in a freshly forked child: the parent's turns are not the child's.
///
/// Safe to take the cores' locks here: every core operation runs while its thread is
/// attached to the interpreter, and `os.fork()` is called by an attached thread, so no other
/// thread was inside a core operation when the process forked.
#[pyfunction]
pub fn _reset_after_fork() {
    let gates: Vec<Arc<Core>> = GATES.lock().iter().filter_map(Weak::upgrade).collect();
    for gate in gates {
        // Dropped, not woken: the futures belong to the parent's event loops.
        drop(gate.reset());
        drop(std::mem::take(&mut *gate.in_transit.lock()));
        gate.last_sweep.store(0, Ordering::Relaxed);
        gate.epoch.fetch_add(1, Ordering::Relaxed);
    }
}

static REJECTION_CLASS: Mutex<Option<Py<PyType>>> = Mutex::new(None);
static DEFAULT_REJECTION: PyOnceLock<Py<PyType>> = PyOnceLock::new();

fn default_rejection_class(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    DEFAULT_REJECTION.import(py, "admitgate._errors", "AdmissionRejected")
}

/// The exception class the gate raises for a rejected or shed turn.
#[pyfunction]
pub fn _rejection_class(py: Python<'_>) -> PyResult<Py<PyType>> {
    if let Some(cls) = REJECTION_CLASS.lock().as_ref() {
        return Ok(cls.clone_ref(py));
    }
    Ok(default_rejection_class(py)?.clone().unbind())
}

/// Makes the gate raise `cls` (a subclass of `admitgate.AdmissionRejected`); `None`
/// restores the default. Used by `admitgate.praisonai.install()`.
#[pyfunction]
#[pyo3(signature = (cls))]
pub fn _set_rejection_class(py: Python<'_>, cls: Option<Bound<'_, PyType>>) -> PyResult<()> {
    if let Some(cls) = &cls {
        if !cls.is_subclass(default_rejection_class(py)?)? {
            return Err(PyTypeError::new_err(format!(
                "cls must be a subclass of admitgate.AdmissionRejected, got {}",
                cls.repr()?
            )));
        }
    }
    *REJECTION_CLASS.lock() = cls.map(Bound::unbind);
    Ok(())
}

fn rejection(py: Python<'_>, reason: &str) -> PyErr {
    let build = || -> PyResult<PyErr> {
        let cls = _rejection_class(py)?;
        let exc = cls.bind(py).call0()?;
        exc.setattr("reason", reason)?;
        Ok(PyErr::from_value(exc))
    };
    build().unwrap_or_else(|err| err)
}

static LOGGER: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

fn logger(py: Python<'_>) -> PyResult<&Bound<'_, PyAny>> {
    LOGGER
        .get_or_try_init(py, || {
            Ok::<_, PyErr>(
                py.import("logging")?
                    .call_method1("getLogger", ("admitgate",))?
                    .unbind(),
            )
        })
        .map(|l| l.bind(py))
}

fn log(py: Python<'_>, level: &str, message: String) {
    if let Ok(logger) = logger(py) {
        // Logging must never break admission; a broken handler is Python's to report.
        let _ = logger.call_method1(level, (message,));
    }
}

static GET_RUNNING_LOOP: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

fn running_loop(py: Python<'_>) -> PyResult<Option<Bound<'_, PyAny>>> {
    let get = GET_RUNNING_LOOP.import(py, "asyncio.events", "_get_running_loop")?;
    let current = get.call0()?;
    Ok((!current.is_none()).then_some(current))
}

static HUMAN_WAIT_SCOPE: PyOnceLock<Option<Py<PyAny>>> = PyOnceLock::new();

/// praisonaiagents' `HUMAN_WAIT_SCOPE` context variable, when it can be imported.
fn human_wait_scope(py: Python<'_>) -> Option<&Bound<'_, PyAny>> {
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
fn call_method_one<'py>(
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

/// Resolves a waiter's future on its own loop (scheduled with `call_soon_threadsafe`).
#[pyfunction]
pub fn _resolve_waiter(fut: &Bound<'_, PyAny>) -> PyResult<()> {
    let py = fut.py();
    // A cancelled future is left alone: its owner's cancellation hands the slot on.
    if !fut.call_method0(pyo3::intern!(py, "done"))?.is_truthy()? {
        fut.call_method1(pyo3::intern!(py, "set_result"), (true,))?;
    }
    Ok(())
}

/// Wake-ups posted to one event loop from other threads. The first post of a batch
/// schedules one `call_soon_threadsafe` of the mailbox; later posts ride along until it
/// runs, so a burst of releases on other threads costs the loop one self-pipe write, not
/// one per waiter. Invariant: while the list is non-empty a delivery is scheduled.
#[pyclass(frozen, module = "admitgate._admitgate")]
pub struct LoopMailbox {
    futs: Mutex<Vec<Py<PyAny>>>,
}

#[pymethods]
impl LoopMailbox {
    /// Resolves every future posted since the last delivery (runs on the loop, in order).
    fn __call__(&self, py: Python<'_>) {
        let futs = std::mem::take(&mut *self.futs.lock());
        for fut in futs {
            // A future already cancelled is skipped: its owner's cancellation hands on.
            let _ = _resolve_waiter(fut.bind(py));
        }
    }
}

/// The mailbox of `event_loop`, kept on the loop itself; `None` for a loop that takes no
/// attributes (then each wake-up is its own `call_soon_threadsafe`). Called on the loop's
/// own thread, so two mailboxes are never made for one loop.
fn mailbox_for(event_loop: &Bound<'_, PyAny>) -> Option<Py<LoopMailbox>> {
    let py = event_loop.py();
    let name = pyo3::intern!(py, "_admitgate_mailbox");
    if let Ok(existing) = event_loop.getattr(name) {
        if let Ok(mailbox) = existing.cast_into::<LoopMailbox>() {
            return Some(mailbox.unbind());
        }
    }
    let mailbox = Py::new(
        py,
        LoopMailbox {
            futs: Mutex::new(Vec::new()),
        },
    )
    .ok()?;
    event_loop.setattr(name, &mailbox).ok()?;
    Some(mailbox)
}

/// Wakes one waiting turn by resolving its future on its own event loop.
pub struct PyWaker {
    fut: Py<PyAny>,
    event_loop: Py<PyAny>,
    mailbox: Option<Py<LoopMailbox>>,
    /// The thread that runs the loop (the one that created the future).
    loop_thread: std::thread::ThreadId,
    key: WaiterKey,
    core: Arc<Core>,
}

impl PyWaker {
    fn wake_on_loop(&self, py: Python<'_>) -> PyResult<bool> {
        let fut = self.fut.bind(py);
        let event_loop = self.event_loop.bind(py);
        if std::thread::current().id() == self.loop_thread {
            // The loop's own thread: resolve directly (it schedules the task's wake-up on
            // the loop; a closed loop refuses, which is reported as failure).
            return Ok(_resolve_waiter(fut).is_ok());
        }
        if let Some(mailbox) = &self.mailbox {
            let first = {
                let mut futs = mailbox.get().futs.lock();
                futs.push(self.fut.clone_ref(py));
                futs.len() == 1
            };
            if !first {
                return Ok(true); // a delivery is already scheduled
            }
            if self.schedule(py, mailbox.bind(py).as_any()) {
                return Ok(true);
            }
            // The loop is gone. Turns whose wake-ups rode on this delivery are recovered by
            // the closed-loop sweep; this one is withdrawn by our caller.
            mailbox.get().futs.lock().clear();
            return Ok(false);
        }
        let resolve = pyo3::wrap_pyfunction!(_resolve_waiter, py)?;
        Ok(self.loop_open(py)
            && event_loop
                .call_method1(pyo3::intern!(py, "call_soon_threadsafe"), (resolve, fut))
                .is_ok())
    }

    fn loop_open(&self, py: Python<'_>) -> bool {
        !loop_is_closed(self.event_loop.bind(py)).unwrap_or(true)
    }

    /// `loop.call_soon_threadsafe(callback)`; false if the loop is closed. The loop can
    /// close between the check and the call: both are handled.
    fn schedule(&self, py: Python<'_>, callback: &Bound<'_, PyAny>) -> bool {
        self.loop_open(py)
            && self
                .event_loop
                .bind(py)
                .call_method1(pyo3::intern!(py, "call_soon_threadsafe"), (callback,))
                .is_ok()
    }
}

impl Waker for PyWaker {
    fn wake(self) -> Wakes<Self> {
        Python::attach(|py| {
            // Recorded before the wake-up can run, so the turn's claim always finds (and
            // removes) the record.
            self.core
                .in_transit
                .lock()
                .insert(self.key, self.event_loop.clone_ref(py));
            if self.wake_on_loop(py).unwrap_or(false) {
                return Wakes::default();
            }
            // Nobody can run this turn any more (its loop is gone): withdraw it, which
            // hands the slot it was just given to the next waiter.
            self.core.delivered(self.key);
            if !self.core.warned_closed_loop.swap(true, Ordering::Relaxed) {
                log(
                    py,
                    "warning",
                    "AdmissionGate: turns were waiting on an event loop that closed; their slots go to the next waiters".into(),
                );
            }
            self.core.cancel(self.key).1
        })
    }
}

/// An awaitable that is already finished: what `__aenter__`/`__aexit__` return on the fast
/// path. Stateless, so one instance serves every caller.
#[pyclass(frozen, module = "admitgate._admitgate")]
pub struct Ready;

static READY: PyOnceLock<Py<Ready>> = PyOnceLock::new();

fn ready(py: Python<'_>) -> PyResult<Py<PyAny>> {
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

    #[pyo3(signature = (typ, val=None, _tb=None))]
    fn throw(
        &self,
        typ: &Bound<'_, PyAny>,
        val: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        Err(thrown(typ, val))
    }

    fn close(&self) {}
}

/// The exception `throw(typ, val)` asks to raise.
fn thrown(typ: &Bound<'_, PyAny>, val: Option<&Bound<'_, PyAny>>) -> PyErr {
    if let Ok(cls) = typ.cast::<PyType>() {
        let args = val
            .map(|v| v.clone().unbind())
            .unwrap_or_else(|| typ.py().None());
        match cls.call1((args,)) {
            Ok(instance) => PyErr::from_value(instance),
            Err(err) => err,
        }
    } else {
        PyErr::from_value(typ.clone())
    }
}

/// Which resource policy the gate consults.
enum ResourcePolicy {
    None,
    /// admitgate's own `MemoryPressurePolicy`: evaluated in Rust.
    Native(MemoryPressure),
    /// Any object with `evaluate(sample)` (and optionally `enabled`).
    Foreign(Py<PyAny>),
}

/// Where samples come from.
enum Sampler {
    None,
    Builtin(Py<PyRssSampler>),
    /// Any object with `read()` returning something with `rss_mb`.
    Foreign(Py<PyAny>),
}

/// No memory-aware admission.
const RESOURCE_OFF: u8 = 0;
/// admitgate's `MemoryPressurePolicy` read through the built-in sampler: all in Rust.
const RESOURCE_NATIVE: u8 = 1;
/// Anything else: consult `resources` (and Python) on every decision.
const RESOURCE_DYNAMIC: u8 = 2;

struct Resources {
    policy: ResourcePolicy,
    policy_object: Option<Py<PyAny>>,
    sampler: Sampler,
}

/// Gateway-wide admission gate: a concurrency ceiling, a bounded FIFO wait queue with
/// per-scope lanes, overflow policies and memory-aware admission. Thread-safe; one gate
/// may serve several event loops at once.
#[pyclass(frozen, subclass, module = "admitgate", name = "AdmissionGate")]
pub struct PyAdmissionGate {
    core: Arc<Core>,
    limits: ConcurrencyLimit,
    /// Which resource path applies, readable without taking `resources`' lock: the common
    /// configurations (none, or admitgate's own policy with the built-in sampler) never
    /// take it on the hot path.
    resource_mode: AtomicU8,
    /// admitgate's own ladder and the built-in sampler, for [`RESOURCE_NATIVE`].
    native_resources: Option<(MemoryPressure, Arc<RssSampler>)>,
    policy: Option<Py<PyAny>>,
    /// The policy is admitgate's own: decide in Rust, from the live facts, under the lock.
    native_policy: bool,
    resources: RwLock<Resources>,
    warned_policy: AtomicBool,
    warned_resource: AtomicBool,
}

fn read_limit(policy: &Bound<'_, PyAny>, attr: &'static str) -> PyResult<u32> {
    match policy.getattr(attr) {
        Ok(value) if value.is_none() => Ok(0),
        Ok(value) if value.is_instance_of::<pyo3::types::PyInt>() && !value.is_truthy()? => Ok(0),
        Ok(value) => args::count(attr, &value),
        Err(_) => Ok(0),
    }
}

impl PyAdmissionGate {
    fn resource_enabled(&self, py: Python<'_>) -> bool {
        match self.resource_mode.load(Ordering::Relaxed) {
            RESOURCE_OFF => false,
            RESOURCE_NATIVE => true,
            _ => self.dynamic_resource_enabled(py),
        }
    }

    fn dynamic_resource_enabled(&self, py: Python<'_>) -> bool {
        let resources = self.resources.read();
        if matches!(resources.sampler, Sampler::None) {
            return false;
        }
        match &resources.policy {
            ResourcePolicy::None => false,
            ResourcePolicy::Native(ladder) => ladder.enabled(),
            ResourcePolicy::Foreign(policy) => {
                match policy.bind(py).getattr(pyo3::intern!(py, "enabled")) {
                    Ok(enabled) => enabled.is_truthy().unwrap_or(true),
                    Err(_) => true,
                }
            }
        }
    }

    /// The mode for a configuration (see [`RESOURCE_NATIVE`]).
    fn mode_of(resources: &Resources, native: &Option<(MemoryPressure, Arc<RssSampler>)>) -> u8 {
        match (&resources.policy, &resources.sampler) {
            (ResourcePolicy::None, _) | (_, Sampler::None) => RESOURCE_OFF,
            (ResourcePolicy::Native(ladder), _) if !ladder.enabled() => RESOURCE_OFF,
            (ResourcePolicy::Native(_), Sampler::Builtin(sampler)) => match native {
                Some((_, ours)) if Arc::ptr_eq(ours, &sampler.get().sampler) => RESOURCE_NATIVE,
                _ => RESOURCE_DYNAMIC,
            },
            _ => RESOURCE_DYNAMIC,
        }
    }

    fn is_enabled(&self, py: Python<'_>) -> bool {
        (self.policy.is_some() && self.limits.max_concurrent_runs > 0) || self.resource_enabled(py)
    }

    fn warn_once(&self, py: Python<'_>, flag: &AtomicBool, message: String) {
        if !flag.swap(true, Ordering::Relaxed) {
            log(py, "warning", message);
        }
    }

    /// The memory-pressure decision for one turn. Never fails: a broken sampler or policy
    /// is logged once and admits, as the reference does (the concurrency ceiling still holds).
    fn resource_decision(&self, py: Python<'_>) -> Decision {
        match self.resource_mode.load(Ordering::Relaxed) {
            RESOURCE_OFF => return Decision::Admit,
            RESOURCE_NATIVE => {
                if let Some((ladder, sampler)) = &self.native_resources {
                    return ladder.evaluate(read_builtin(py, sampler));
                }
            }
            _ => {
                if !self.dynamic_resource_enabled(py) {
                    return Decision::Admit;
                }
            }
        }
        // A configuration that calls into Python: take what is needed, release the lock,
        // then call.
        let (policy, sampler) = {
            let resources = self.resources.read();
            let policy = match &resources.policy {
                ResourcePolicy::Native(ladder) => Ok(*ladder),
                ResourcePolicy::Foreign(policy) => Err(policy.clone_ref(py)),
                ResourcePolicy::None => return Decision::Admit,
            };
            let sampler = match &resources.sampler {
                Sampler::Builtin(builtin) => Ok(builtin.get().sampler.clone()),
                Sampler::Foreign(foreign) => Err(foreign.clone_ref(py)),
                Sampler::None => return Decision::Admit,
            };
            (policy, sampler)
        };
        let read = |sampler: Result<Arc<RssSampler>, Py<PyAny>>| -> PyResult<Bound<'_, PyAny>> {
            match sampler {
                Ok(builtin) => resource_sample(py, read_builtin(py, &builtin)),
                Err(foreign) => foreign.bind(py).call_method0(pyo3::intern!(py, "read")),
            }
        };
        let outcome = (|| -> PyResult<Decision> {
            match (policy, sampler) {
                (Ok(ladder), Ok(builtin)) => Ok(ladder.evaluate(read_builtin(py, &builtin))),
                (Ok(ladder), foreign) => Ok(ladder.evaluate(rss_of(&read(foreign)?)?)),
                (Err(policy), sampler) => {
                    let answer = policy
                        .bind(py)
                        .call_method1(pyo3::intern!(py, "evaluate"), (read(sampler)?,))?;
                    decision_from(&answer).ok_or_else(|| {
                        PyTypeError::new_err(format!(
                            "evaluate() returned {}, not an AdmissionDecision",
                            answer.repr().map(|r| r.to_string()).unwrap_or_default()
                        ))
                    })
                }
            }
        })();
        outcome.unwrap_or_else(|err| {
            self.warn_once(
                py,
                &self.warned_resource,
                format!("AdmissionGate: resource policy failed ({err}); admitting"),
            );
            Decision::Admit
        })
    }

    /// A foreign policy's decision from the current facts; a policy that raises or answers
    /// garbage is logged once and treated as admit (the gate's mechanism still holds).
    fn foreign_decision(
        &self,
        py: Python<'_>,
        policy: &Bound<'_, PyAny>,
        session_id: &Bound<'_, PyAny>,
        scope: Option<&str>,
    ) -> Decision {
        let outcome = (|| -> PyResult<Decision> {
            let facts = self.core.facts(scope);
            let kwargs = PyDict::new(py);
            kwargs.set_item("in_flight", facts.in_flight)?;
            kwargs.set_item("queued", facts.queued)?;
            kwargs.set_item("session_id", session_id)?;
            let scope_arg = if self.limits.max_per_scope > 0 {
                session_id.clone()
            } else {
                PyString::new(py, "").into_any()
            };
            kwargs.set_item("scope", scope_arg)?;
            kwargs.set_item("scope_in_flight", facts.scope_in_flight)?;
            kwargs.set_item("scope_queued", facts.scope_queued)?;
            let answer = policy.call_method(pyo3::intern!(py, "decide"), (), Some(&kwargs))?;
            decision_from(&answer).ok_or_else(|| {
                PyTypeError::new_err(format!(
                    "decide() returned {}, not an AdmissionDecision",
                    answer.repr().map(|r| r.to_string()).unwrap_or_default()
                ))
            })
        })();
        outcome.unwrap_or_else(|err| {
            self.warn_once(
                py,
                &self.warned_policy,
                format!("AdmissionGate: policy.decide failed ({err}); admitting"),
            );
            Decision::Admit
        })
    }

    /// The pressure when a turn ends, so a release under eased pressure refills the free
    /// slots. Read only when someone waits: only waiters are affected.
    fn release_pressure(&self, py: Python<'_>) -> Option<Decision> {
        // Only waiters care; with nobody waiting, the next arrival reads it anyway.
        (self.core.has_waiters() && self.resource_enabled(py)).then(|| self.resource_decision(py))
    }
}

#[pymethods]
impl PyAdmissionGate {
    #[new]
    #[pyo3(signature = (policy, *, resource_policy=None, resource_sampler=None))]
    fn new(
        py: Python<'_>,
        policy: Option<Bound<'_, PyAny>>,
        resource_policy: Option<Bound<'_, PyAny>>,
        resource_sampler: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        guard(|| {
            let (limits, native_policy) = match &policy {
                None => (
                    ConcurrencyLimit {
                        max_concurrent_runs: 0,
                        queue_depth: 0,
                        overflow: Overflow::Reject,
                        max_per_scope: 0,
                    },
                    false,
                ),
                Some(p) => match p.cast::<PyConcurrencyLimitPolicy>() {
                    // Exactly ours (not a subclass, which may override decide in Python).
                    Ok(ours) if p.get_type().is(py.get_type::<PyConcurrencyLimitPolicy>()) => {
                        (ours.get().limit, true)
                    }
                    _ => {
                        let overflow = match p.getattr("overflow_policy") {
                            Ok(v) if !v.is_truthy()? => Overflow::Reject,
                            Ok(v) => args::overflow(&v)?,
                            Err(_) => Overflow::Reject,
                        };
                        (
                            ConcurrencyLimit {
                                max_concurrent_runs: read_limit(p, "max_concurrent_runs")?,
                                queue_depth: read_limit(p, "queue_depth")?,
                                overflow,
                                max_per_scope: read_limit(p, "max_concurrent_runs_per_scope")?,
                            },
                            false,
                        )
                    }
                },
            };
            let resource = match &resource_policy {
                None => ResourcePolicy::None,
                Some(rp) => match rp.cast::<PyMemoryPressurePolicy>() {
                    Ok(ours) if rp.get_type().is(py.get_type::<PyMemoryPressurePolicy>()) => {
                        ResourcePolicy::Native(ours.get().ladder)
                    }
                    _ => {
                        if !rp.hasattr("evaluate")? {
                            return Err(PyTypeError::new_err(format!(
                                "resource_policy must have an evaluate(sample) method, got {}",
                                rp.repr()?
                            )));
                        }
                        ResourcePolicy::Foreign(rp.clone().unbind())
                    }
                },
            };
            let sampler = match (&resource_sampler, &resource_policy) {
                (Some(s), _) => {
                    if !s.hasattr("read")? {
                        return Err(PyTypeError::new_err(format!(
                            "resource_sampler must have a read() method, got {}",
                            s.repr()?
                        )));
                    }
                    Sampler::Foreign(s.clone().unbind())
                }
                (None, Some(_)) => Sampler::Builtin(Py::new(py, PyRssSampler::new())?),
                (None, None) => Sampler::None,
            };
            let native_resources = match (&resource, &sampler) {
                (ResourcePolicy::Native(ladder), Sampler::Builtin(builtin)) => {
                    Some((*ladder, builtin.get().sampler.clone()))
                }
                _ => None,
            };
            let resources = Resources {
                policy: resource,
                policy_object: resource_policy.map(Bound::unbind),
                sampler,
            };
            let resource_mode = AtomicU8::new(Self::mode_of(&resources, &native_resources));
            let core = Arc::new(Core::new(limits));
            {
                let mut gates = GATES.lock();
                gates.retain(|g| g.strong_count() > 0);
                gates.push(Arc::downgrade(&core));
            }
            Ok(Self {
                core,
                limits,
                policy: policy.map(Bound::unbind),
                native_policy,
                resource_mode,
                native_resources,
                resources: RwLock::new(resources),
                warned_policy: AtomicBool::new(false),
                warned_resource: AtomicBool::new(false),
            })
        })
    }

    /// Admits (or sheds) one turn: `async with gate.admit(session_id=...)`. Raises
    /// `AdmissionRejected` on entry when the turn is rejected or evicted while waiting.
    #[pyo3(signature = (*, session_id=None))]
    fn admit(slf: &Bound<'_, Self>, session_id: Option<Bound<'_, PyAny>>) -> PyResult<Admission> {
        let py = slf.py();
        let session_id = match session_id {
            None => PyString::intern(py, "").into_any().unbind(),
            Some(s) if s.is_instance_of::<PyString>() => s.unbind(),
            Some(s) if s.is_none() => PyString::intern(py, "").into_any().unbind(),
            Some(s) => {
                return Err(PyTypeError::new_err(format!(
                    "session_id must be a str, got {}",
                    s.repr()?
                )))
            }
        };
        Ok(Admission {
            gate: slf.clone().unbind(),
            session_id,
            state: Mutex::new(AdmissionState::Fresh),
            waited: AtomicBool::new(false),
        })
    }

    /// Whether the gate is active: a ceiling is set, or a memory-pressure policy with a
    /// threshold is.
    #[getter]
    fn enabled(&self, py: Python<'_>) -> bool {
        self.is_enabled(py)
    }

    /// Turns holding a run slot (including turns granted one that have not started yet).
    #[getter]
    fn in_flight(&self) -> u64 {
        self.core.stats(now).in_flight
    }

    /// Turns waiting for a slot.
    #[getter]
    fn queued(&self) -> u64 {
        self.core.stats(now).queued
    }

    /// Turns that started running.
    #[getter]
    fn admitted(&self) -> u64 {
        self.core.stats(now).admitted
    }

    /// Turns refused on arrival.
    #[getter]
    fn rejected(&self) -> u64 {
        self.core.stats(now).rejected
    }

    /// Waiters evicted by `shed_oldest`.
    #[getter]
    fn shed(&self) -> u64 {
        self.core.stats(now).shed
    }

    /// Turns withdrawn while queued (cancelled, timed out, their loop closed), or cancelled
    /// between being granted a slot and starting.
    #[getter]
    fn cancelled(&self) -> u64 {
        self.core.stats(now).cancelled
    }

    /// Admitted turns parked on a human approval, not holding a slot.
    #[getter]
    fn awaiting_human(&self) -> u64 {
        self.core.stats(now).awaiting_human
    }

    /// A snapshot of the counters, with the reference's keys (plus `cancelled`).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guard(|| {
            let s = self.core.stats(now);
            let max_rss_mb = match &self.resources.read().policy_object {
                Some(p) => p
                    .bind(py)
                    .getattr("hard_rss_mb")
                    .ok()
                    .filter(|v| v.is_truthy().unwrap_or(false))
                    .and_then(|v| v.extract::<f64>().ok())
                    .unwrap_or(0.0),
                None => 0.0,
            };
            let d = PyDict::new(py);
            d.set_item("max_concurrent_runs", self.limits.max_concurrent_runs)?;
            d.set_item("max_concurrent_runs_per_scope", self.limits.max_per_scope)?;
            d.set_item("queue_depth", self.limits.queue_depth)?;
            d.set_item("in_flight", s.in_flight)?;
            d.set_item("queued", s.queued)?;
            d.set_item("awaiting_human", s.awaiting_human)?;
            d.set_item("admitted", s.admitted)?;
            d.set_item("rejected", s.rejected)?;
            d.set_item("shed", s.shed)?;
            d.set_item("max_rss_mb", max_rss_mb)?;
            d.set_item("cancelled", s.cancelled)?;
            Ok(d)
        })
    }

    /// The most turns that were ever in flight at once.
    #[getter]
    fn peak_in_flight(&self) -> u64 {
        self.core.stats(now).peak_in_flight
    }

    /// Seconds the oldest waiter has waited, or `None` when nobody waits.
    #[getter]
    fn oldest_wait_seconds(&self) -> Option<f64> {
        self.core.stats(now).oldest_wait.map(|d| d.as_secs_f64())
    }

    /// The concurrency policy the gate was built with (`None` for a resource-only gate).
    #[getter]
    fn policy(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.policy.as_ref().map(|p| p.clone_ref(py))
    }

    /// The memory-pressure policy, or `None`.
    #[getter]
    fn _resource_policy(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.resources
            .read()
            .policy_object
            .as_ref()
            .map(|p| p.clone_ref(py))
    }

    /// The sampler consulted on every decision (the built-in one unless replaced).
    #[getter]
    fn _resource_sampler(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        match &self.resources.read().sampler {
            Sampler::None => None,
            Sampler::Builtin(s) => Some(s.clone_ref(py).into_any()),
            Sampler::Foreign(s) => Some(s.clone_ref(py)),
        }
    }

    /// Replaces the sampler (as PraisonAI's own tests do); `None` removes it.
    #[setter(_resource_sampler)]
    fn set_resource_sampler(&self, sampler: Option<Bound<'_, PyAny>>) -> PyResult<()> {
        let new = match sampler {
            None => Sampler::None,
            Some(s) => match s.cast::<PyRssSampler>() {
                Ok(builtin) => Sampler::Builtin(builtin.clone().unbind()),
                Err(_) => {
                    if !s.hasattr("read")? {
                        return Err(PyTypeError::new_err(format!(
                            "resource_sampler must have a read() method, got {}",
                            s.repr()?
                        )));
                    }
                    Sampler::Foreign(s.unbind())
                }
            },
        };
        let mut resources = self.resources.write();
        resources.sampler = new;
        self.resource_mode.store(
            Self::mode_of(&resources, &self.native_resources),
            Ordering::Relaxed,
        );
        Ok(())
    }

    /// Evicts the oldest live waiter (it gets `AdmissionRejected` and counts as shed);
    /// `False` when nobody waits.
    fn _shed_oldest_waiter(&self) -> PyResult<bool> {
        guard(|| {
            let (evicted, wakes) = self.core.shed_oldest_waiter();
            wakes.run();
            Ok(evicted)
        })
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let s = self.core.stats(now);
        format!(
            "<AdmissionGate enabled={} max_concurrent_runs={} queue_depth={} overflow_policy={:?} max_concurrent_runs_per_scope={} in_flight={} queued={}>",
            if self.is_enabled(py) { "True" } else { "False" },
            self.limits.max_concurrent_runs,
            self.limits.queue_depth,
            self.limits.overflow.as_str(),
            self.limits.max_per_scope,
            s.in_flight,
            s.queued
        )
    }
}

/// Panics inside the gate's lock, to prove a Rust panic surfaces as `InternalError` and the
/// gate stays usable. For admitgate's own tests.
#[pyfunction]
pub fn _panic_inside_gate(gate: &Bound<'_, PyAdmissionGate>) -> PyResult<()> {
    guard(|| {
        let (_, wakes) = gate
            .get()
            .core
            .with(|_, _| -> () { panic!("deliberate panic for a test") });
        wakes.run();
        Ok(())
    })
}

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
    /// The gate is disabled: nothing to release.
    PassThrough,
    Waiting,
    Entered {
        slot: SlotRef,
        token: Option<Py<PyAny>>,
        /// The gate's epoch when the turn entered (see [`Core::epoch`]).
        epoch: u64,
    },
    Done,
}

impl AdmissionState {
    fn is_entered(&self) -> bool {
        matches!(self, AdmissionState::Entered { .. })
    }
}

/// One turn's passage through the gate: the async context manager `gate.admit()` returns.
#[pyclass(frozen, module = "admitgate._admitgate")]
pub struct Admission {
    gate: Py<PyAdmissionGate>,
    session_id: Py<PyAny>,
    state: Mutex<AdmissionState>,
    /// Whether the turn had to wait in the queue (set once it is admitted after waiting).
    waited: AtomicBool,
}

impl Admission {
    /// The turn holds a slot: bind the human-wait hook and remember what to release.
    fn enter(admission: &Bound<'_, Self>, scope: Option<Arc<str>>) -> PyResult<()> {
        let py = admission.py();
        let this = admission.get();
        let core = &this.gate.get().core;
        let epoch = core.epoch();
        let (slot, token) = match human_wait_scope(py) {
            Some(var) => {
                let slot = Arc::new(TurnSlot::new(scope));
                let bound = Py::new(
                    py,
                    HumanWaitFactory {
                        slot: slot.clone(),
                        core: core.clone(),
                        epoch,
                    },
                )
                .and_then(|factory| {
                    call_method_one(var, pyo3::intern!(py, "set"), factory.bind(py))
                });
                match bound {
                    Ok(token) => (SlotRef::Shared(slot), Some(token.unbind())),
                    Err(err) => {
                        // The turn will not run: its slot goes straight back.
                        slot.close(core, None).run();
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
        if !gate.is_enabled(py) {
            *this.state.lock() = AdmissionState::PassThrough;
            return ready(py);
        }
        let session_id = this.session_id.bind(py);
        let session_key = args::scope_key(session_id.cast::<PyString>()?)?;
        let session: &str = &session_key;
        let scope = (gate.limits.max_per_scope > 0 && !session.is_empty()).then_some(session);
        let resource = gate.resource_decision(py);
        let decided = match (&gate.policy, gate.native_policy) {
            (Some(policy), false) => {
                Some(gate.foreign_decision(py, policy.bind(py), session_id, scope))
            }
            _ => None,
        };
        let (arrival, wakes) = gate.core.arrive(scope, decided, resource, now);
        wakes.run();
        if !matches!(arrival, Arrival::Admitted(_)) {
            gate.core.sweep_closed_loops(py);
        }
        match arrival {
            Arrival::Admitted(scope) => {
                Self::enter(slf, scope)?;
                ready(py)
            }
            Arrival::Rejected(reason) => {
                *this.state.lock() = AdmissionState::Done;
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
                Err(rejection(py, reason.as_str()))
            }
            Arrival::Queued(key) => Py::new(
                py,
                Wait {
                    admission: slf.clone().unbind(),
                    core: gate.core.clone(),
                    key,
                    state: Mutex::new(WaitState {
                        fut: None,
                        done: false,
                        parked: false,
                    }),
                },
            )
            .map(Py::into_any)
            .inspect_err(|_| {
                // Nobody will wait for this turn: withdraw it.
                gate.core.cancel(key).1.run();
            }),
        }
    }

    fn leave(&self, py: Python<'_>) -> PyResult<()> {
        let previous = std::mem::replace(&mut *self.state.lock(), AdmissionState::Done);
        if let AdmissionState::Entered { slot, token, epoch } = previous {
            let gate = self.gate.get();
            if let (Some(token), Some(var)) = (token, human_wait_scope(py)) {
                // Exited in another context (the body handed the turn to another task):
                // the variable cannot be reset there, and nothing depends on it after exit.
                let _ = call_method_one(var, pyo3::intern!(py, "reset"), token.bind(py));
            }
            if epoch == gate.core.epoch() {
                slot.close(&gate.core, gate.release_pressure(py)).run();
            }
        }
        Ok(())
    }
}

#[pymethods]
impl Admission {
    /// Whether the turn had to wait for a slot (it was not granted one on arrival).
    #[getter]
    fn waited(&self) -> bool {
        self.waited.load(Ordering::Relaxed)
    }

    /// Whether the turn currently holds (or has lent to a human wait) its run slot.
    #[getter]
    fn active(&self) -> bool {
        self.state.lock().is_entered()
    }

    fn __aenter__(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        guard(|| Self::arrive(slf))
    }

    #[pyo3(signature = (*_exc))]
    fn __aexit__(
        &self,
        py: Python<'_>,
        _exc: &Bound<'_, pyo3::types::PyTuple>,
    ) -> PyResult<Py<PyAny>> {
        guard(|| {
            self.leave(py)?;
            ready(py)
        })
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        // A turn abandoned without __aexit__ (its coroutine was never finished) still
        // returns its slot exactly once. A panic must not unwind out of a destructor the
        // interpreter calls, so it is contained and reported as unraisable.
        if let AdmissionState::Entered { slot, epoch, .. } =
            std::mem::replace(self.state.get_mut(), AdmissionState::Done)
        {
            let core = self.gate.get().core.clone();
            if epoch != core.epoch() {
                return; // a turn of the parent process, forgotten by the forked child
            }
            Python::attach(|py| {
                if let Err(err) = guard(|| {
                    slot.close(&core, None).run();
                    Ok(())
                }) {
                    err.write_unraisable(py, None);
                }
            });
        }
    }
}

struct WaitState {
    fut: Option<Py<PyAny>>,
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
    state: Mutex<WaitState>,
}

impl Wait {
    fn finish(&self) {
        self.state.lock().done = true;
        *self.admission.get().state.lock() = AdmissionState::Done;
    }

    /// One step of the await: claim the outcome if a future was already yielded, else (or
    /// if still waiting) yield a future that the gate resolves when it settles the turn.
    fn step(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
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
            let (claim, wakes) = self.core.claim(self.key);
            wakes.run();
            if claim != Claim::Waiting {
                self.core.delivered(self.key);
            }
            match claim {
                Claim::Admitted(scope) => {
                    self.state.lock().done = true;
                    let parked = self.state.lock().parked;
                    self.admission.get().waited.store(parked, Ordering::Relaxed);
                    Admission::enter(self.admission.bind(py), scope)?;
                    return Ok(None);
                }
                Claim::Shed => {
                    self.finish();
                    return Err(rejection(py, "shed"));
                }
                Claim::Unknown => {
                    self.finish();
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
            self.withdraw();
            self.finish();
            return Err(PyRuntimeError::new_err(
                "gate.admit() must be awaited inside a running event loop",
            ));
        };
        let fut = event_loop.call_method0(pyo3::intern!(py, "create_future"))?;
        let waker = PyWaker {
            fut: fut.clone().unbind(),
            mailbox: mailbox_for(&event_loop),
            event_loop: event_loop.unbind(),
            loop_thread: std::thread::current().id(),
            key: self.key,
            core: self.core.clone(),
        };
        let (registered, _) = self.core.register(self.key, waker);
        if registered == Registered::Waiting {
            self.state.lock().parked = true;
        } else {
            // Settled before we could wait (granted by a release, or shed). Still yield
            // once, with the future already resolved: the turn then starts after the
            // waiters woken before it, in the order the loop runs their callbacks.
            _resolve_waiter(&fut)?;
        }
        fut.setattr(pyo3::intern!(py, "_asyncio_future_blocking"), true)?;
        self.state.lock().fut = Some(fut.clone().unbind());
        Ok(Some(fut.unbind()))
    }

    /// Leaves the queue (or hands on a slot granted in the meantime). Idempotent.
    fn withdraw(&self) -> Option<Cancelled> {
        {
            let mut state = self.state.lock();
            if state.done {
                return None;
            }
            state.done = true;
        }
        let (cancelled, wakes) = self.core.cancel(self.key);
        wakes.run();
        self.core.delivered(self.key);
        Some(cancelled)
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

    #[pyo3(signature = (typ, val=None, _tb=None))]
    fn throw(
        &self,
        typ: &Bound<'_, PyAny>,
        val: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        guard(|| {
            self.withdraw();
            *self.admission.get().state.lock() = AdmissionState::Done;
            Err(thrown(typ, val))
        })
    }

    fn close(&self) -> PyResult<()> {
        guard(|| {
            self.withdraw();
            *self.admission.get().state.lock() = AdmissionState::Done;
            Ok(())
        })
    }
}

impl Drop for Wait {
    fn drop(&mut self) {
        // A wait dropped unfinished (its task was destroyed) leaves the queue, handing on
        // any slot it had been granted.
        if !self.state.get_mut().done {
            Python::attach(|py| {
                if let Err(err) = guard(|| {
                    self.withdraw();
                    Ok(())
                }) {
                    err.write_unraisable(py, None);
                }
            });
        }
    }
}

/// What praisonaiagents' approval registry calls around a human wait: makes a
/// [`HumanWait`] for the turn that is running.
#[pyclass(frozen, module = "admitgate._admitgate")]
pub struct HumanWaitFactory {
    slot: Arc<TurnSlot>,
    core: Arc<Core>,
    epoch: u64,
}

#[pymethods]
impl HumanWaitFactory {
    #[pyo3(signature = (*_args, **_kwargs))]
    fn __call__(
        &self,
        _args: &Bound<'_, pyo3::types::PyTuple>,
        _kwargs: Option<&Bound<'_, PyDict>>,
    ) -> HumanWait {
        HumanWait {
            slot: self.slot.clone(),
            core: self.core.clone(),
            epoch: self.epoch,
            entered: AtomicBool::new(false),
        }
    }
}

/// A sync and async context manager around one human-approval wait: the turn's run slot is
/// lent to the queue inside it and taken back (borrowed if none is free) on exit, without
/// ever blocking. Safe from the turn's loop and from worker threads. After the turn has
/// ended it does nothing.
#[pyclass(frozen, module = "admitgate._admitgate")]
pub struct HumanWait {
    slot: Arc<TurnSlot>,
    core: Arc<Core>,
    epoch: u64,
    entered: AtomicBool,
}

impl HumanWait {
    /// Whether the turn belongs to this process's gate (not a parent's, before a fork).
    fn current(&self) -> bool {
        self.epoch == self.core.epoch()
    }

    fn suspend(&self) {
        if !self.entered.swap(true, Ordering::AcqRel) && self.current() {
            self.slot.suspend(&self.core).run();
        }
    }

    fn resume(&self) {
        if self.entered.swap(false, Ordering::AcqRel) && self.current() {
            self.slot.resume(&self.core);
        }
    }
}

#[pymethods]
impl HumanWait {
    fn __enter__(slf: Py<Self>, py: Python<'_>) -> PyResult<Py<Self>> {
        guard(|| {
            slf.get().suspend();
            Ok(slf.clone_ref(py))
        })
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, _exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
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
    fn __aexit__(
        &self,
        py: Python<'_>,
        _exc: &Bound<'_, pyo3::types::PyTuple>,
    ) -> PyResult<Py<PyAny>> {
        guard(|| {
            self.resume();
            ready(py)
        })
    }
}

static RESOURCE_SAMPLE: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// RSS in MiB (or `None`) from the built-in sampler, warning once when sampling turns out to
/// be unavailable.
fn read_builtin(py: Python<'_>, sampler: &RssSampler) -> Option<f64> {
    let reading = sampler.read(now());
    if reading.just_disabled {
        log(
            py,
            "warning",
            "AdmissionGate: resource sampling unavailable on this platform; memory-pressure admission disabled.".into(),
        );
    }
    reading.rss_mb
}

/// The built-in RSS sampler: live RSS, falling back to peak RSS, cached for 5 ms.
#[pyclass(frozen, module = "admitgate", name = "RssSampler")]
pub struct PyRssSampler {
    sampler: Arc<RssSampler>,
}

static SAMPLERS: Mutex<Vec<Weak<RssSampler>>> = Mutex::new(Vec::new());

/// Forgets cached readings in a forked child.
#[pyfunction]
pub fn _invalidate_samplers() {
    for sampler in SAMPLERS.lock().iter().filter_map(Weak::upgrade) {
        sampler.invalidate();
    }
}

impl PyRssSampler {
    fn new() -> Self {
        let sampler = Arc::new(RssSampler::default());
        let mut all = SAMPLERS.lock();
        all.retain(|s| s.strong_count() > 0);
        all.push(Arc::downgrade(&sampler));
        Self { sampler }
    }
}

/// A `ResourceSample(rss_mb=...)`.
fn resource_sample(py: Python<'_>, rss_mb: Option<f64>) -> PyResult<Bound<'_, PyAny>> {
    let cls = RESOURCE_SAMPLE.import(py, "admitgate._types", "ResourceSample")?;
    let kwargs = PyDict::new(py);
    kwargs.set_item("rss_mb", rss_mb)?;
    cls.call((), Some(&kwargs))
}

#[pymethods]
impl PyRssSampler {
    #[new]
    fn py_new() -> Self {
        Self::new()
    }

    /// A `ResourceSample` of the process's RSS (`rss_mb=None` when unavailable).
    fn read<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        guard(|| resource_sample(py, read_builtin(py, &self.sampler)))
    }

    /// How stale a reading may be, in seconds.
    #[getter]
    fn interval_seconds(&self) -> f64 {
        self.sampler.interval().as_secs_f64()
    }

    /// `"live"`, `"peak"` or `"unavailable"`.
    #[getter]
    fn source(&self) -> &'static str {
        match self.sampler.source() {
            crate::core::rss::RssSource::Live => "live",
            crate::core::rss::RssSource::Peak => "peak",
            crate::core::rss::RssSource::Unavailable => "unavailable",
        }
    }
}
