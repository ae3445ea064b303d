//! Interpreter exit: no thread is inside admitgate's Rust code when the interpreter finalizes.
//!
//! # Why
//!
//! CPython before 3.14 ends with `pthread_exit` any thread other than the finalizing one that
//! takes the GIL once finalization has begun: a daemon thread, typically. If that thread is
//! inside admitgate at that moment (a daemon `admit_sync` turn ending wakes a waiter on an
//! event loop with `call_soon_threadsafe`, which is Python code that can switch threads; a
//! log record runs a handler; a custom policy runs Python), the forced unwind climbs through
//! Rust frames: their destructors drop Python objects without the GIL (a segfault), and the
//! first `catch_unwind` catches it (an abort, "FATAL: exception not rethrown"). Measured
//! before this module: about 1 exit in 100 of a process whose daemon `admit_sync` threads
//! hand slots to async turns crashed (SIGABRT, SIGSEGV or SIGBUS).
//!
//! # How
//!
//! Every entry into admitgate's Rust code (the `errors::guard` around each
//! method, and every wake-up) holds an [`Inside`] for its duration: a per-thread depth, so
//! entering costs a thread-local increment and no shared cache line. An `atexit` hook
//! ([`_quiesce_at_exit`], registered when the package is imported, so it runs after the hooks
//! registered later) runs before finalization, while every thread still runs normally: it
//! raises [`EXITING`] and waits, with the GIL released, until no other thread is inside (at
//! most [`QUIESCE_TIMEOUT`]). From then on, a thread other than the exiting one that enters
//! admitgate parks for good with the GIL released, which is what CPython 3.14 does to such
//! threads itself: nothing that could still run waits for it (non-daemon threads were joined
//! before `atexit` hooks run). A thread blocked in a wait of its own (`admit_sync`,
//! `close_sync`) does not count as inside while it sleeps ([`detach_counted`]), so the hook
//! never waits for a turn that is waiting for a slot; it parks when it wakes.
//!
//! Entering and the hook pair a sequentially consistent store with a load of the other's
//! flag (the thread's depth, then `EXITING`; `EXITING`, then every depth), so either the
//! hook sees the thread inside and waits for it, or the thread sees `EXITING` and parks.
//!
//! What is left: a thread still inside after [`QUIESCE_TIMEOUT`] (a custom policy that
//! blocks for seconds) is not waited for further; the last resort is
//! [`catch_panic`](admitgate_core::unwind::catch_panic), which parks a thread that a forced
//! unwind reaches instead of letting `catch_unwind` abort.

use std::cell::{Cell, OnceCell};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use pyo3::prelude::*;

/// Raised by the `atexit` hook: threads other than the exiting one no longer enter.
static EXITING: AtomicBool = AtomicBool::new(false);
/// How long the hook waits for other threads to leave admitgate.
const QUIESCE_TIMEOUT: Duration = Duration::from_secs(1);

/// The depth of every thread that has entered admitgate, for the hook to read; a thread's
/// entry dies with the thread (it holds the only strong reference).
///
/// Only ever locked by a thread attached to the interpreter, and never across a call into
/// Python: `os.fork()` is called by an attached thread, so a forked child never inherits it
/// locked (the same argument as the gate cores' locks, see `fork`).
static THREADS: Mutex<Vec<Weak<AtomicUsize>>> = Mutex::new(Vec::new());

thread_local! {
    static DEPTH: OnceCell<Arc<AtomicUsize>> = const { OnceCell::new() };
    /// Set on the thread that runs the `atexit` hook: it finalizes, and never parks.
    static EXITING_THREAD: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with this thread's depth counter, registering it on first use.
fn with_depth<R>(f: impl FnOnce(&AtomicUsize) -> R) -> Option<R> {
    DEPTH
        .try_with(|slot| {
            let depth = slot.get_or_init(|| {
                let depth = Arc::new(AtomicUsize::new(0));
                let mut all = THREADS.lock();
                all.retain(|d| d.strong_count() > 0);
                all.push(Arc::downgrade(&depth));
                depth
            });
            f(depth)
        })
        .ok()
}

/// This thread's depth counter, if it has one.
fn own_depth() -> Option<Arc<AtomicUsize>> {
    DEPTH.try_with(|slot| slot.get().cloned()).ok().flatten()
}

/// Whether a thread other than this one is inside admitgate.
fn others_inside() -> bool {
    let own = own_depth();
    THREADS
        .lock()
        .iter()
        .filter_map(Weak::upgrade)
        .any(|depth| {
            let this = own.as_ref().is_some_and(|own| Arc::ptr_eq(own, &depth));
            !this && depth.load(Ordering::SeqCst) > 0
        })
}

/// Whether this thread must not run admitgate code any more (see the module documentation).
fn must_park() -> bool {
    EXITING.load(Ordering::SeqCst) && !EXITING_THREAD.with(Cell::get)
}

/// Parks this thread for good, with the GIL released.
///
/// The thread stops counting as inside even when it parks in a nested entry (a policy's
/// `decide` calling back into admitgate): the outer call holds no Rust lock while it calls
/// out, so nothing is left locked, and what it leaves half-done dies with the process.
fn park_forever() -> ! {
    let _ = with_depth(|depth| depth.store(0, Ordering::SeqCst));
    // Attaching is a no-op for a thread that is attached already (every caller is); detaching
    // releases the GIL, so the finalizing thread is never kept waiting for it.
    Python::attach(|py| {
        py.detach(|| loop {
            std::thread::park();
        })
    })
}

/// Held while this thread runs admitgate code; parks the thread instead if the interpreter
/// is exiting and this is not the exiting thread.
pub struct Inside(());

impl Inside {
    /// Enters (see [`Inside`]).
    pub fn enter() -> Self {
        // SeqCst: paired with the hook's store of EXITING and its loads of every depth.
        let _ = with_depth(|depth| depth.fetch_add(1, Ordering::SeqCst));
        if must_park() {
            park_forever();
        }
        Self(())
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        let _ = with_depth(|depth| depth.fetch_sub(1, Ordering::SeqCst));
    }
}

/// [`Python::detach`] for a wait that may last (a blocked turn's slice): the thread does not
/// count as inside while it sleeps, and parks when it wakes if the interpreter is exiting.
pub fn detach_counted<T: Send>(py: Python<'_>, f: impl Send + FnOnce() -> T) -> T {
    let depth = with_depth(|depth| depth.swap(0, Ordering::SeqCst)).unwrap_or(0);
    let value = py.detach(f);
    let _ = with_depth(|d| d.store(depth, Ordering::SeqCst));
    if depth > 0 && must_park() {
        park_forever();
    }
    value
}

/// The `atexit` hook: other threads stop entering admitgate, and the ones inside are waited
/// for (with the GIL released between looks, so they can finish), for at most
/// [`QUIESCE_TIMEOUT`].
#[pyfunction]
pub fn _quiesce_at_exit(py: Python<'_>) {
    EXITING_THREAD.with(|t| t.set(true));
    EXITING.store(true, Ordering::SeqCst);
    let started = Instant::now();
    // Looked at attached (see THREADS), slept detached.
    while others_inside() && started.elapsed() < QUIESCE_TIMEOUT {
        py.detach(|| std::thread::sleep(Duration::from_millis(1)));
    }
}

/// In a freshly forked child: the parent's other threads do not exist here, so their depths
/// must not hold up the child's exit.
pub fn reset_after_fork() {
    let own = own_depth();
    THREADS.lock().retain(|depth| {
        depth
            .upgrade()
            .is_some_and(|depth| own.as_ref().is_some_and(|own| Arc::ptr_eq(own, &depth)))
    });
}
