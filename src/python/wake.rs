//! Waking a queued turn: every waiter is an asyncio future on its own event loop.
//!
//! Whoever frees a slot resolves the waiter's future after the core's lock is released:
//! directly on the loop's own thread, and from any other thread through the loop's
//! [`LoopMailbox`] (one `call_soon_threadsafe` per burst). A loop can close between a check
//! and a call: both are handled, and a turn whose loop is gone is withdrawn so its slot goes
//! to the next waiter. Turns woken on a loop that then closes without running them are
//! withdrawn by a periodic sweep ([`Core::sweep_closed_loops`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};
use pyo3::prelude::*;
use pyo3::{PyTraverseError, PyVisit};

use super::errors::{catch_panic, guard};
use super::pressure_watch::PressureWatch;
use super::runtime::{log, now};
use admitgate_core::transport::Transports;
use admitgate_core::{ConcurrencyLimit, Gate, WaiterKey, Waker, Wakes};
use admitgate_passage::turn::Lane;

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
    /// Per-transport counters (what callers of each front door experienced).
    pub transports: Transports,
    /// Set once the gate is closing, so releases check for a finished drain without taking
    /// the gate's lock otherwise.
    closing: AtomicBool,
    /// Who waits for the last running turn of a closing gate to end.
    drain_waiters: Mutex<Vec<DrainWaiter>>,
    /// Whether a re-check of memory pressure is armed (see [`super::pressure_watch`]).
    pub pressure_watch: PressureWatch,
}

/// A caller of `close()` or `close_sync()` waiting for the running turns to end.
pub enum DrainWaiter {
    /// An asyncio future, resolved on its loop.
    Loop {
        fut: Py<PyAny>,
        event_loop: Py<PyAny>,
    },
    /// A thread blocked in `close_sync`.
    Thread(Arc<ThreadSignal>),
}

/// How often arrivals that find no free slot look for turns stranded on closed loops.
const SWEEP_INTERVAL: Duration = Duration::from_millis(50);

impl std::ops::Deref for Core {
    type Target = Gate<PyWaker>;

    fn deref(&self) -> &Gate<PyWaker> {
        &self.gate
    }
}

/// What a turn of this gate passes (passage's `Turn` drives it): the gate, its transports,
/// and the fork epoch.
impl Lane for Core {
    type Waker = PyWaker;

    fn gate(&self) -> &Gate<PyWaker> {
        &self.gate
    }

    fn transports(&self) -> &Transports {
        &self.transports
    }

    fn epoch(&self) -> u64 {
        Core::epoch(self)
    }
}

impl Core {
    /// A core enforcing `limits`.
    pub fn new(limits: ConcurrencyLimit) -> Self {
        Self {
            gate: Gate::new(limits),
            in_transit: Mutex::new(HashMap::default()),
            last_sweep: AtomicU64::new(0),
            warned_closed_loop: AtomicBool::new(false),
            epoch: AtomicU64::new(0),
            transports: Transports::default(),
            closing: AtomicBool::new(false),
            drain_waiters: Mutex::new(Vec::new()),
            pressure_watch: PressureWatch::default(),
        }
    }

    /// Closes the gate (see [`admitgate_core::GateState::close`]): returns how many waiters were
    /// refused, and notifies drain waiters if nothing runs.
    pub fn begin_close(&self, py: Python<'_>) -> u64 {
        self.closing.store(true, Ordering::Release);
        let (refused, wakes) = self.gate.close();
        wakes.run();
        self.after_release(py);
        refused
    }

    /// Whether `close()` was called.
    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// Registers a drain waiter; `false` (not registered) when nothing runs any more.
    pub fn add_drain_waiter(&self, waiter: DrainWaiter) -> bool {
        let mut waiters = self.drain_waiters.lock();
        // Checked under the waiters' lock: a release that empties the gate after this check
        // takes the same lock to notify, so it sees this waiter.
        if self.gate.running().0 == 0 {
            return false;
        }
        waiters.push(waiter);
        true
    }

    /// Called after a slot is returned: once a closing gate has nothing running, every
    /// drain waiter is notified (outside the waiters' lock).
    pub fn after_release(&self, py: Python<'_>) {
        if !self.is_closing() {
            return;
        }
        let waiters = {
            let mut waiters = self.drain_waiters.lock();
            if waiters.is_empty() || self.gate.running().0 > 0 {
                return;
            }
            std::mem::take(&mut *waiters)
        };
        for waiter in waiters {
            match waiter {
                DrainWaiter::Thread(signal) => signal.notify(),
                DrainWaiter::Loop { fut, event_loop } => {
                    let Ok(resolve) = pyo3::wrap_pyfunction!(_resolve_waiter, py) else {
                        continue;
                    };
                    // A closed loop has nobody left to tell.
                    let _ = event_loop
                        .bind(py)
                        .call_method1(pyo3::intern!(py, "call_soon_threadsafe"), (resolve, fut));
                }
            }
        }
    }

    /// The gate's epoch (see the field).
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Relaxed)
    }

    /// Empties the gate in a freshly forked child: the parent's turns are not the child's.
    pub fn reset_after_fork(&self) {
        // Dropped, not woken: the futures belong to the parent's event loops.
        drop(self.gate.reset());
        drop(std::mem::take(&mut *self.in_transit.lock()));
        self.transports.reset();
        self.last_sweep.store(0, Ordering::Relaxed);
        self.pressure_watch.reset();
        self.epoch.fetch_add(1, Ordering::Relaxed);
    }

    /// The turn's wake-up reached it (or it withdrew): the sweep need not watch it.
    pub fn delivered(&self, key: WaiterKey) {
        self.in_transit.lock().remove(&key);
    }

    /// Withdraws woken turns whose event loop has closed, handing their slots on. Runs at
    /// most once per [`SWEEP_INTERVAL`]; each distinct loop is asked once.
    pub fn sweep_closed_loops(&self, py: Python<'_>) {
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
                self.after_release(py);
            }
        }
    }
}

pub fn loop_is_closed(event_loop: &Bound<'_, PyAny>) -> PyResult<bool> {
    event_loop
        .call_method0(pyo3::intern!(event_loop.py(), "is_closed"))?
        .is_truthy()
}

/// Resolves a waiter's future on its own loop (scheduled with `call_soon_threadsafe`).
#[pyfunction]
pub fn _resolve_waiter(fut: &Bound<'_, PyAny>) -> PyResult<()> {
    guard(|| resolve_waiter(fut))
}

pub fn resolve_waiter(fut: &Bound<'_, PyAny>) -> PyResult<()> {
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
    fn __call__(&self, py: Python<'_>) -> PyResult<()> {
        guard(|| {
            let futs = std::mem::take(&mut *self.futs.lock());
            for fut in futs {
                // A future already cancelled is skipped: its owner's cancellation hands on.
                let _ = _resolve_waiter(fut.bind(py));
            }
            Ok(())
        })
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        // Never block inside the collector: a mailbox being filled is skipped this time.
        if let Some(futs) = self.futs.try_lock() {
            for fut in futs.iter() {
                visit.call(fut)?;
            }
        }
        Ok(())
    }
}

/// The mailbox of `event_loop`, kept on the loop itself; `None` for a loop that takes no
/// attributes (then each wake-up is its own `call_soon_threadsafe`). Called on the loop's
/// own thread, so two mailboxes are never made for one loop.
pub fn mailbox_for(event_loop: &Bound<'_, PyAny>) -> Option<Py<LoopMailbox>> {
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

/// Wakes one waiting turn: an async turn by resolving its future on its own event loop, a
/// turn blocked in `admit_sync` by signalling its thread.
pub enum PyWaker {
    Loop(LoopWaker),
    Thread(Arc<ThreadSignal>),
}

/// A flag a blocked thread waits on, set by whoever settles its turn. Waiting releases the
/// GIL; setting it never needs the GIL.
#[derive(Default)]
pub struct ThreadSignal {
    set: Mutex<bool>,
    cond: Condvar,
}

impl ThreadSignal {
    /// Sets the flag and wakes the thread.
    pub fn notify(&self) {
        *self.set.lock() = true;
        self.cond.notify_all();
    }

    /// Waits until the flag is set or `timeout` passes; whether it is set. The caller has
    /// released the GIL, and nothing that sets the flag needs it, so this cannot deadlock.
    pub fn wait(&self, timeout: Duration) -> bool {
        let mut set = self.set.lock();
        if !*set {
            self.cond.wait_for(&mut set, timeout);
        }
        *set
    }

    /// Whether the flag is set.
    pub fn is_set(&self) -> bool {
        *self.set.lock()
    }
}

/// Wakes an async turn by resolving its future on its own event loop.
pub struct LoopWaker {
    pub fut: Py<PyAny>,
    pub event_loop: Py<PyAny>,
    pub mailbox: Option<Py<LoopMailbox>>,
    /// The thread that runs the loop (the one that created the future).
    pub loop_thread: std::thread::ThreadId,
    pub key: WaiterKey,
    pub core: Arc<Core>,
}

/// How many of the next wake-ups of queued turns panic on purpose (`_panic_in_next_wakes`).
static WAKE_PANICS_TO_INJECT: AtomicU32 = AtomicU32::new(0);

/// Panics if a test asked for it; one relaxed load otherwise, and only on the queued path.
#[allow(clippy::panic, reason = "the test hook panics on purpose")]
fn inject_wake_panic() {
    if WAKE_PANICS_TO_INJECT.load(Ordering::Relaxed) > 0
        && WAKE_PANICS_TO_INJECT
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok()
    {
        panic!("deliberate panic while waking a queued turn, for a test");
    }
}

/// Makes the next `count` wake-ups of queued turns panic midway (after the gate granted the
/// slot, before the turn hears of it), to prove such a panic strands nobody. For admitgate's
/// own tests.
#[pyfunction]
pub fn _panic_in_next_wakes(count: u32) {
    WAKE_PANICS_TO_INJECT.store(count, Ordering::Relaxed);
}

impl LoopWaker {
    fn wake_on_loop(&self, py: Python<'_>) -> PyResult<bool> {
        inject_wake_panic();
        let fut = self.fut.bind(py);
        let event_loop = self.event_loop.bind(py);
        if std::thread::current().id() == self.loop_thread {
            // The loop's own thread: resolve directly (it schedules the task's wake-up on
            // the loop; a closed loop refuses, which is reported as failure).
            return Ok(resolve_waiter(fut).is_ok());
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
        match self {
            PyWaker::Loop(waker) => waker.wake(),
            PyWaker::Thread(signal) => {
                signal.notify();
                Wakes::default()
            }
        }
    }
}

impl LoopWaker {
    fn wake(self) -> Wakes<PyWaker> {
        Python::attach(|py| {
            // A wake-up runs Python code (`call_soon_threadsafe`), from whichever thread frees
            // the slot: it must not run while the interpreter finalizes (see `exit`).
            let _inside = super::exit::Inside::enter();
            // Recorded before the wake-up can run, so the turn's claim always finds (and
            // removes) the record.
            self.core
                .in_transit
                .lock()
                .insert(self.key, self.event_loop.clone_ref(py));
            let delivered = catch_panic(|| self.wake_on_loop(py));
            match delivered {
                Ok(Ok(true)) => return Wakes::default(),
                Ok(_) => {}
                Err(_) => {
                    // A panic in PyO3 or the standard library while waking: the turn may never
                    // hear of its slot, so it is withdrawn like one whose loop is gone, and the
                    // slot goes to the next waiter instead of being held for nobody.
                    log(
                        py,
                        "error",
                        "AdmissionGate: internal error while waking a queued turn; it was withdrawn and its slot handed on".into(),
                    );
                }
            }
            // Nobody can run this turn any more (its loop is gone): withdraw it, which
            // hands the slot it was just given to the next waiter.
            self.core.delivered(self.key);
            if delivered.is_ok() && !self.core.warned_closed_loop.swap(true, Ordering::Relaxed) {
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
