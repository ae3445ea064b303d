//! The tokio runtime admitgate owns for its fleet limits, and the bridge that awaits its
//! futures from asyncio.
//!
//! # Design
//!
//! * **Lazy.** Nothing exists until a `FleetLimit` is built, and building one creates a
//!   current-thread runtime *without* threads (the lease protocol needs a [`Handle`] to exist,
//!   not to run). The one driver thread (`admitgate-fleet`) starts with the first future handed
//!   to the runtime: the first `acquire`, `connect`, ... A gate without `fleet=` never gets here.
//! * **One thread.** The work is a few Redis round trips per turn; a current-thread runtime
//!   driven by one thread does it without taking a core per CPU. Completions that need the
//!   interpreter run on tokio's blocking pool (capped at [`MAX_BLOCKING_THREADS`]), so the
//!   driver never waits for the GIL.
//! * **Fork.** A child of `os.fork()` inherits the runtime's memory but not its threads, and a
//!   lock a runtime thread held at the fork stays locked in the child forever. So the child never
//!   touches the parent's runtime, nor anything built on it (the fleet limits, their leases):
//!   [`reset_after_fork`] forgets the runtime (leaked, never dropped: dropping would join
//!   threads that do not exist) and bumps the [`epoch`]; every object built on the runtime
//!   carries the epoch it was built in and is rebuilt (a limit) or forgotten (a lease, whose
//!   release belongs to the parent) when it sees a newer one.
//!
//! * **Exit.** A thread that waits for the GIL while the interpreter finalizes is ended by
//!   CPython (`pthread_exit`) in the middle of Rust code, which crashes the process. So every
//!   runtime thread enters the interpreter through [`attach_guard`] only, and an `atexit`
//!   hook ([`_quiesce_fleet_runtime`], registered on first use) turns new entries away and
//!   waits (detached) for the ones under way before finalization starts. A turned-away
//!   completion is dropped unrun: its lease, if any, is given back.
//!
//! Only threads attached to the interpreter take [`RUNTIME`]'s lock (runtime threads use
//! [`Handle::try_current`]), and `os.fork()` is called by an attached thread, so the child never
//! inherits it locked.
//!
//! # Why not `pyo3_async_runtimes::tokio`
//!
//! Its runtime is a process-wide `OnceLock` that cannot be replaced, so a forked child could
//! never get a working one. admitgate implements pyo3-async-runtimes' generic [`Runtime`] and
//! [`ContextExt`] traits on its own runtime instead ([`FleetRuntime`]) and keeps the library's
//! conversion, [`future_into_py`]: an asyncio future whose cancellation drops the Rust future
//! (the lease protocol then withdraws the ticket, or gives back a lease granted at that moment),
//! and whose result is set with `call_soon_threadsafe` after checking it was not cancelled (a
//! result that is never delivered is dropped, which gives its lease back).

use std::cell::{Cell, OnceCell};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3_async_runtimes::generic::{ContextExt, Runtime as GenericRuntime};
use pyo3_async_runtimes::TaskLocals;
use tokio::runtime::{Builder, Handle, Runtime};

/// Threads of tokio's blocking pool: each hands one finished future back to asyncio (they
/// queue for the GIL anyway, so a few are enough).
const MAX_BLOCKING_THREADS: usize = 4;

struct Owned {
    runtime: Arc<Runtime>,
    /// Whether the driver thread was started.
    driven: bool,
}

static RUNTIME: Mutex<Option<Owned>> = Mutex::new(None);
static EPOCH: AtomicU64 = AtomicU64::new(0);
/// Runtime threads inside the interpreter (or about to enter it), see [`attach_guard`].
static ENTERED: AtomicUsize = AtomicUsize::new(0);
/// Set by the `atexit` hook: runtime threads no longer enter the interpreter.
static CLOSING: AtomicBool = AtomicBool::new(false);
/// How long the `atexit` hook waits for runtime threads to leave the interpreter.
const QUIESCE_TIMEOUT: Duration = Duration::from_secs(2);

thread_local! {
    /// Set on the runtime's own threads (the driver and the blocking pool).
    static OURS: Cell<bool> = const { Cell::new(false) };
}

/// Bumped by every fork: objects built on the runtime remember the epoch they were built in.
pub fn epoch() -> u64 {
    EPOCH.load(Ordering::Acquire)
}

fn build() -> std::io::Result<Runtime> {
    Builder::new_current_thread()
        .enable_all()
        .thread_name("admitgate-fleet-blocking")
        .max_blocking_threads(MAX_BLOCKING_THREADS)
        .on_thread_start(|| OURS.with(|ours| ours.set(true)))
        .build()
}

/// `RuntimeError`, naming why the runtime could not be started (or found).
fn runtime_error(err: impl std::fmt::Display) -> PyErr {
    PyRuntimeError::new_err(format!(
        "admitgate could not start its fleet runtime: {err}"
    ))
}

/// The runtime's handle, creating the runtime (without threads) on first use.
pub fn handle() -> PyResult<Handle> {
    with_runtime(false)
}

/// The runtime's handle, with its driver thread running: call before handing it work.
pub fn start() -> PyResult<Handle> {
    with_runtime(true)
}

fn with_runtime(drive: bool) -> PyResult<Handle> {
    if OURS.with(Cell::get) {
        // A runtime thread runs inside the runtime's context, so this never fails.
        return Handle::try_current().map_err(runtime_error);
    }
    let mut slot = RUNTIME.lock();
    let owned = match slot.take() {
        Some(owned) => owned,
        None => Owned {
            runtime: Arc::new(build().map_err(runtime_error)?),
            driven: false,
        },
    };
    let owned = slot.insert(owned);
    if drive && !owned.driven {
        let runtime = owned.runtime.clone();
        std::thread::Builder::new()
            .name("admitgate-fleet".into())
            .spawn(move || {
                OURS.with(|ours| ours.set(true));
                // Runs every task spawned on the runtime, for the life of the process.
                runtime.block_on(std::future::pending::<()>());
            })
            .map_err(runtime_error)?;
        owned.driven = true;
    }
    Ok(owned.runtime.handle().clone())
}

/// In a freshly forked child: forget the parent's runtime (see the module documentation).
pub fn reset_after_fork() {
    let inherited = RUNTIME.lock().take();
    // Never dropped: its threads are the parent's, and its locks may be held by them.
    std::mem::forget(inherited);
    // The parent's threads that were inside the interpreter do not exist here.
    ENTERED.store(0, Ordering::SeqCst);
    EPOCH.fetch_add(1, Ordering::AcqRel);
}

/// Leave to enter the interpreter from a runtime thread, held until the thread is out again;
/// `None` once the interpreter is about to finalize.
pub struct AttachGuard(());

/// See [`AttachGuard`].
pub fn attach_guard() -> Option<AttachGuard> {
    ENTERED.fetch_add(1, Ordering::SeqCst);
    if CLOSING.load(Ordering::SeqCst) {
        ENTERED.fetch_sub(1, Ordering::SeqCst);
        return None;
    }
    Some(AttachGuard(()))
}

impl Drop for AttachGuard {
    fn drop(&mut self) {
        ENTERED.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The `atexit` hook: runtime threads stop entering the interpreter, and the ones inside are
/// waited for (detached, so they can finish), for at most [`QUIESCE_TIMEOUT`].
#[pyfunction]
pub fn _quiesce_fleet_runtime(py: Python<'_>) {
    CLOSING.store(true, Ordering::SeqCst);
    py.detach(|| {
        let started = Instant::now();
        while ENTERED.load(Ordering::SeqCst) > 0 && started.elapsed() < QUIESCE_TIMEOUT {
            std::thread::sleep(Duration::from_millis(1));
        }
    });
}

/// Registers [`_quiesce_fleet_runtime`] with `atexit`, once per process (when the first fleet
/// limit is built: registering starts nothing).
pub fn register_atexit(py: Python<'_>) -> PyResult<()> {
    static REGISTERED: AtomicBool = AtomicBool::new(false);
    if REGISTERED.swap(true, Ordering::AcqRel) {
        return Ok(());
    }
    let hook = pyo3::wrap_pyfunction!(_quiesce_fleet_runtime, py)?;
    py.import("atexit")?.call_method1("register", (hook,))?;
    Ok(())
}

/// pyo3-async-runtimes' view of admitgate's runtime.
pub struct FleetRuntime;

tokio::task_local! {
    static TASK_LOCALS: OnceCell<TaskLocals>;
}

thread_local! {
    /// Why [`FleetRuntime::spawn`] could not start the runtime for the conversion under way on
    /// this (interpreter) thread; [`future_into_py`] raises it.
    static SPAWN_FAILED: Cell<Option<PyErr>> = const { Cell::new(None) };
}

/// Work for the blocking pool that waits until the task tree it was submitted from is over.
///
/// pyo3-async-runtimes runs each conversion as an outer task (spawned from the interpreter's
/// thread) around an inner one, and hands the result to asyncio from the blocking pool. The
/// outer task holds a reference to the asyncio future, dropped when it ends, on a runtime
/// thread, where PyO3 can only defer the decref until the next time some thread enters the
/// interpreter. If the hand-off ran first, that deferred reference would keep the future, and
/// the lease that is its result, alive after the caller dropped it. So the hand-off of a
/// conversion waits until its outer task is over, and the decref is then carried out when the
/// hand-off enters the interpreter.
#[derive(Default)]
struct Deferred(std::sync::Mutex<Vec<Box<dyn FnOnce() + Send>>>);

tokio::task_local! {
    static DEFERRED: Arc<Deferred>;
}

impl Deferred {
    fn push(&self, job: Box<dyn FnOnce() + Send>) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(job);
    }

    fn take(&self) -> Vec<Box<dyn FnOnce() + Send>> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// Runs `f` on the blocking pool with leave to enter the interpreter (see [`attach_guard`]).
fn spawn_attached(
    handle: &Handle,
    f: impl FnOnce() + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    handle.spawn_blocking(move || {
        if let Some(_entered) = attach_guard() {
            f();
        }
    })
}

/// A spawned task, or blocking work deferred until its task tree is over (see [`Deferred`]).
pub enum Joined {
    /// A task on the runtime.
    Task(tokio::task::JoinHandle<()>),
    /// Deferred work: nothing to wait for.
    Deferred,
    /// The runtime could not be started: the work was dropped unrun.
    NotSpawned,
}

impl Future for Joined {
    type Output = Result<(), tokio::task::JoinError>;

    fn poll(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        match self.get_mut() {
            Joined::Task(handle) => Pin::new(handle).poll(cx),
            Joined::Deferred | Joined::NotSpawned => std::task::Poll::Ready(Ok(())),
        }
    }
}

impl GenericRuntime for FleetRuntime {
    type JoinError = tokio::task::JoinError;
    type JoinHandle = Joined;

    fn spawn<F>(fut: F) -> Self::JoinHandle
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let ours = OURS.with(Cell::get);
        // `future_into_py` started the runtime just before, and a runtime thread runs inside it,
        // so this fails only if the runtime was lost meanwhile (a fork) and cannot be rebuilt.
        let handle = match start() {
            Ok(handle) => handle,
            Err(err) => {
                // `fut` is dropped unrun. On the interpreter's thread `future_into_py` raises
                // the error instead of returning an asyncio future that would never complete.
                if !ours {
                    SPAWN_FAILED.with(|failed| failed.set(Some(err)));
                }
                return Joined::NotSpawned;
            }
        };
        if ours {
            // Spawned by a conversion's task: part of its tree.
            return Joined::Task(match DEFERRED.try_with(Arc::clone) {
                Ok(deferred) => handle.spawn(DEFERRED.scope(deferred, fut)),
                Err(_) => handle.spawn(fut),
            });
        }
        // A conversion's outer task, spawned from the interpreter's thread.
        let deferred = Arc::new(Deferred::default());
        let runs_on = handle.clone();
        Joined::Task(handle.spawn(async move {
            DEFERRED.scope(deferred.clone(), fut).await;
            // Everything the tree held is dropped by now.
            for job in deferred.take() {
                drop(spawn_attached(&runs_on, job));
            }
        }))
    }

    fn spawn_blocking<F>(f: F) -> Self::JoinHandle
    where
        F: FnOnce() + Send + 'static,
    {
        // pyo3-async-runtimes hands each result to asyncio here, attached to the interpreter.
        match DEFERRED.try_with(Arc::clone) {
            Ok(deferred) => {
                deferred.push(Box::new(f));
                Joined::Deferred
            }
            // Outside a conversion's tree: a runtime that cannot be started turns the
            // completion away, dropped unrun like one turned away at exit.
            Err(_) => match start() {
                Ok(handle) => Joined::Task(spawn_attached(&handle, f)),
                Err(_) => Joined::NotSpawned,
            },
        }
    }
}

impl ContextExt for FleetRuntime {
    fn scope<F, R>(locals: TaskLocals, fut: F) -> Pin<Box<dyn Future<Output = R> + Send>>
    where
        F: Future<Output = R> + Send + 'static,
    {
        let cell = OnceCell::new();
        let _ = cell.set(locals);
        Box::pin(TASK_LOCALS.scope(cell, fut))
    }

    fn get_task_locals() -> Option<TaskLocals> {
        TASK_LOCALS
            .try_with(|cell| cell.get().cloned())
            .unwrap_or_default()
    }
}

/// `fut` as an asyncio future on the running loop. Cancelling the asyncio future drops `fut`
/// on the runtime; a result that cannot be delivered (cancelled meanwhile, loop closed) is
/// dropped there too.
pub fn future_into_py<F, T>(py: Python<'_>, fut: F) -> PyResult<Bound<'_, PyAny>>
where
    F: Future<Output = PyResult<T>> + Send + 'static,
    T: for<'py> IntoPyObject<'py> + Send + 'static,
{
    // The event loop alone: the futures never call back into Python code, so the context
    // variables need not be copied.
    let locals = TaskLocals::with_running_loop(py)?;
    register_atexit(py)?;
    start()?;
    SPAWN_FAILED.with(|failed| failed.set(None));
    let converted = pyo3_async_runtimes::generic::future_into_py_with_locals::<FleetRuntime, F, T>(
        py, locals, fut,
    );
    // The asyncio future, if any, is dropped: nothing would ever complete it.
    match SPAWN_FAILED.with(Cell::take) {
        Some(err) => Err(err),
        None => converted,
    }
}

/// Runs `f` on the runtime's blocking pool (it may attach to the interpreter there).
pub fn spawn_blocking(f: impl FnOnce() + Send + 'static) {
    if let Ok(handle) = start() {
        drop(handle.spawn_blocking(f));
    }
}

/// Whether the runtime's driver thread is running in this process.
pub fn is_running() -> bool {
    RUNTIME.lock().as_ref().is_some_and(|owned| owned.driven)
}
