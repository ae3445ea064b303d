//! Handing the fleet runtime's results to an event loop without the GIL: [`run_for_loop`].
//!
//! # Why not pyo3-async-runtimes' conversion
//!
//! [`super::runtime::future_into_py`] completes each asyncio future from tokio's blocking
//! pool: a pool thread takes the GIL and calls `call_soon_threadsafe`, once per future. A
//! budget decision is one short Redis round trip, and at thousands of them per second those
//! threads queue for the GIL behind the event loop (which then waits for it in turn, up to the
//! interpreter's switch interval): measured at 32 concurrent turns, the pool threads burned
//! about 90 µs of CPU per decision and the loop was idle between hand-offs.
//!
//! Here a runtime thread never enters the interpreter. Each event loop has one
//! [`LoopInbox`]: a list of finished results behind a lock, and a socket pair whose read end
//! the loop watches (`loop.add_reader`). A runtime thread appends its result and writes one
//! byte only when the list was empty, so a burst of completions costs the loop one wake-up,
//! and the loop's own thread turns every result into Python and resolves its future.
//!
//! # Invariants
//!
//! * **No lost wake-up.** While the list is not empty, a byte is in the socket, or the
//!   runtime thread that made it non-empty is about to write one, or a delivery has read the
//!   socket and has yet to take the list (it reads before it takes).
//! * **Nothing Python on a runtime thread.** The runtime's task holds the result and the
//!   future's number, not the future; the futures wait in the inbox, on the loop's side.
//! * **Nothing held is lost.** A result whose future was cancelled meanwhile, or whose loop is
//!   gone, is dropped unconverted: a budget's admission in it is given back by its own drop.
//! * **Every future ends.** A task that ends without its result (a panic, a runtime that drops
//!   it unrun) posts an error in its place.
//!
//! A loop that takes no attributes, or cannot watch a file descriptor (or a process out of
//! descriptors), gets pyo3-async-runtimes' conversion instead (slower, same results).

use std::collections::HashMap;
use std::future::Future;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::{PyTraverseError, PyVisit};

use super::runtime;
use crate::python::errors::guard;

/// A finished result, turned into Python on the loop's thread (dropped unrun if its future
/// is gone).
pub type Deliver = Box<dyn FnOnce(Python<'_>) -> PyResult<Py<PyAny>> + Send>;

/// `work`, run on the fleet runtime, as an asyncio future of the running loop whose result is
/// what `work`'s output turns into on that loop. Cancelling the future does not stop `work`
/// (a budget's round trip is bounded): its output is then dropped unconverted.
pub fn run_for_loop<F>(py: Python<'_>, work: F) -> PyResult<Bound<'_, PyAny>>
where
    F: Future<Output = Deliver> + Send + 'static,
{
    static GET_RUNNING_LOOP: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let event_loop = GET_RUNNING_LOOP
        .import(py, "asyncio", "get_running_loop")?
        .call0()?;
    let Some(inbox) = inbox_for(&event_loop)? else {
        return runtime::future_into_py(py, async move { Ok(Converted(work.await)) });
    };
    let handle = runtime::start()?;
    let fut = event_loop.call_method0(pyo3::intern!(py, "create_future"))?;
    let inbox = inbox.get();
    let id = inbox.next_id.fetch_add(1, Ordering::Relaxed);
    inbox.pending.lock().insert(id, fut.clone().unbind());
    let mut owed = Owed {
        shared: Some(inbox.shared.clone()),
        id,
    };
    drop(handle.spawn(async move {
        let deliver = work.await;
        owed.pay(deliver);
    }));
    Ok(fut)
}

/// A future's result, owed to its inbox by the task that computes it. A task that ends
/// without it (its work panicked, or the runtime dropped it unrun) posts an error instead, so
/// the turn awaiting the future fails rather than waiting for ever.
struct Owed {
    shared: Option<Arc<Shared>>,
    id: u64,
}

impl Owed {
    fn pay(&mut self, deliver: Deliver) {
        if let Some(shared) = self.shared.take() {
            shared.post(self.id, deliver);
        }
    }
}

impl Drop for Owed {
    fn drop(&mut self) {
        self.pay(Box::new(|_py: Python<'_>| {
            Err(PyRuntimeError::new_err(
                "admitgate's fleet runtime dropped a decision before it was made",
            ))
        }));
    }
}

/// The runtime's side of an inbox: what it posts, and how it wakes the loop.
struct Shared {
    state: Mutex<Posted>,
    /// The write end of the socket pair (non-blocking).
    wake: UnixStream,
}

#[derive(Default)]
struct Posted {
    ready: Vec<(u64, Deliver)>,
    /// Set when the inbox is dropped (its loop is gone): results are dropped as they come.
    closed: bool,
}

impl Shared {
    fn post(&self, id: u64, deliver: Deliver) {
        let mut state = self.state.lock();
        if state.closed {
            drop(state);
            drop(deliver);
            return;
        }
        let was_empty = state.ready.is_empty();
        state.ready.push((id, deliver));
        drop(state);
        if was_empty {
            // A full socket already holds a wake-up; any other error means the loop's end is
            // closed, and the loop with it.
            let _ = (&self.wake).write(&[1]);
        }
    }
}

/// One event loop's finished results (see the module documentation), kept on the loop as
/// `loop._admitgate_inbox` and called by it when its socket is readable.
#[pyclass(frozen, module = "admitgate._admitgate")]
pub struct LoopInbox {
    shared: Arc<Shared>,
    /// The read end of the socket pair (non-blocking), watched by the loop.
    woken: UnixStream,
    /// The futures waiting for a result, by number.
    pending: Mutex<HashMap<u64, Py<PyAny>, foldhash::fast::RandomState>>,
    next_id: AtomicU64,
    /// The runtime's fork epoch when the inbox was made: a forked child makes its own.
    epoch: u64,
}

#[pymethods]
impl LoopInbox {
    /// Resolves the futures of every result posted since the last call (on the loop).
    fn __call__(&self, py: Python<'_>) -> PyResult<()> {
        guard(|| {
            // Read before taking the list: a result posted after the take writes a new byte.
            let mut bytes = [0u8; 64];
            while let Ok(read) = (&self.woken).read(&mut bytes) {
                if read < bytes.len() {
                    break;
                }
            }
            let ready = std::mem::take(&mut self.shared.state.lock().ready);
            for (id, deliver) in ready {
                let fut = self.pending.lock().remove(&id);
                if let Some(fut) = fut {
                    resolve(py, fut.bind(py), deliver);
                }
            }
            Ok(())
        })
    }

    /// The futures still waiting for a result (for tests: none once every round trip is
    /// over).
    fn __len__(&self) -> usize {
        self.pending.lock().len()
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        // Never block inside the collector: a table being changed is skipped this time.
        if let Some(pending) = self.pending.try_lock() {
            for fut in pending.values() {
                visit.call(fut)?;
            }
        }
        Ok(())
    }

    fn __clear__(&self) {
        let pending = std::mem::take(&mut *self.pending.lock());
        drop(pending);
    }
}

impl Drop for LoopInbox {
    fn drop(&mut self) {
        // The loop is gone: what is posted from now on is dropped on arrival, and what waits
        // here is dropped now (with the GIL: the inbox is freed by the interpreter).
        let ready = {
            let mut state = self.shared.state.lock();
            state.closed = true;
            std::mem::take(&mut state.ready)
        };
        drop(ready);
    }
}

/// Sets `fut`'s result to what `deliver` turns into, unless the future is done (cancelled).
fn resolve(py: Python<'_>, fut: &Bound<'_, PyAny>, deliver: Deliver) {
    let done = fut
        .call_method0(pyo3::intern!(py, "done"))
        .and_then(|d| d.is_truthy())
        .unwrap_or(true);
    if done {
        return;
    }
    // A future that refuses (cancelled in between) keeps its state; the result is dropped.
    let _ = match deliver(py) {
        Ok(value) => fut.call_method1(pyo3::intern!(py, "set_result"), (value,)),
        Err(err) => fut.call_method1(pyo3::intern!(py, "set_exception"), (err.value(py),)),
    };
}

/// The inbox of `event_loop`, made and watched on first use (or after a fork); `None` for a
/// loop that takes no attributes or cannot watch a file descriptor, or when no socket pair
/// can be made. Called on the loop's own thread, so two inboxes are never made for one loop
/// at once.
fn inbox_for<'py>(event_loop: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, LoopInbox>>> {
    let py = event_loop.py();
    let name = pyo3::intern!(py, "_admitgate_inbox");
    let epoch = runtime::epoch();
    if let Ok(existing) = event_loop.getattr(name) {
        if let Ok(inbox) = existing.cast_into::<LoopInbox>() {
            if inbox.get().epoch == epoch {
                return Ok(Some(inbox));
            }
        }
    }
    // No socket pair (the process is out of descriptors): the slower route needs none.
    let Ok((woken, wake)) = UnixStream::pair() else {
        return Ok(None);
    };
    if woken.set_nonblocking(true).is_err() || wake.set_nonblocking(true).is_err() {
        return Ok(None);
    }
    let fd = woken.as_raw_fd();
    let inbox = Bound::new(
        py,
        LoopInbox {
            shared: Arc::new(Shared {
                state: Mutex::new(Posted::default()),
                wake,
            }),
            woken,
            pending: Mutex::new(HashMap::default()),
            next_id: AtomicU64::new(0),
            epoch,
        },
    )?;
    if event_loop.setattr(name, &inbox).is_err() {
        return Ok(None);
    }
    if event_loop
        .call_method1(pyo3::intern!(py, "add_reader"), (fd, &inbox))
        .is_err()
    {
        let _ = event_loop.delattr(name);
        return Ok(None);
    }
    Ok(Some(inbox))
}

/// A result handed over by pyo3-async-runtimes' conversion (the fallback), turned into
/// Python there.
struct Converted(Deliver);

impl<'py> IntoPyObject<'py> for Converted {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok((self.0)(py)?.into_bound(py))
    }
}
