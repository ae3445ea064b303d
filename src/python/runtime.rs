//! What the binding takes from the interpreter and the process: the monotonic clock, the
//! `admitgate` logger and the running event loop.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

/// The monotonic clock given to the gate's core (which never reads one itself) and to the
/// RSS sampler.
pub fn now() -> Duration {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed()
}

/// The deadline `timeout` from now on [`now`]'s clock; `None` (no deadline) for a timeout
/// so long that the deadline would not fit a `Duration`, which no wait could reach anyway.
pub fn deadline_after(timeout: Duration) -> Option<Duration> {
    now().checked_add(timeout)
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

/// Logs `message` at `level` on the `admitgate` logger. Logging never breaks admission: a
/// broken handler is Python's to report.
pub fn log(py: Python<'_>, level: &str, message: String) {
    if let Ok(logger) = logger(py) {
        let _ = logger.call_method1(level, (message,));
    }
}

static GET_RUNNING_LOOP: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// The event loop running on this thread, if any.
pub fn running_loop(py: Python<'_>) -> PyResult<Option<Bound<'_, PyAny>>> {
    let get = GET_RUNNING_LOOP.import(py, "asyncio.events", "_get_running_loop")?;
    let current = get.call0()?;
    Ok((!current.is_none()).then_some(current))
}
