//! The exception a refused turn raises: `admitgate.AdmissionRejected`, or the subclass
//! `admitgate.praisonai.install()` registers so praisonai-bot's handlers catch it too.

use std::time::Duration;

use parking_lot::Mutex;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

use admitgate_core::Rejection;

static REJECTION_CLASS: Mutex<Option<Py<PyType>>> = Mutex::new(None);
static DEFAULT_REJECTION: PyOnceLock<Py<PyType>> = PyOnceLock::new();

fn default_rejection_class(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    DEFAULT_REJECTION.import(py, "admitgate._errors", "AdmissionRejected")
}

/// The exception class the gate raises for a rejected or shed turn.
#[pyfunction]
pub fn _rejection_class(py: Python<'_>) -> PyResult<Py<PyType>> {
    // Cloned under the lock, used after it: the lock is never held while Python runs.
    let registered = REJECTION_CLASS.lock().as_ref().map(|cls| cls.clone_ref(py));
    match registered {
        Some(cls) => Ok(cls),
        None => Ok(default_rejection_class(py)?.clone().unbind()),
    }
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
    let previous = std::mem::replace(&mut *REJECTION_CLASS.lock(), cls.map(Bound::unbind));
    drop(previous); // after the lock: dropping a class may run Python
    Ok(())
}

/// The exception for a turn refused for `reason`, carrying the retry hint in seconds.
pub fn rejection(py: Python<'_>, reason: Rejection, retry_after: Option<Duration>) -> PyErr {
    rejection_in(py, reason, retry_after, None)
}

/// [`rejection`] for a turn of the priority class `priority` (`AdmissionRejected.priority`).
pub fn rejection_in(
    py: Python<'_>,
    reason: Rejection,
    retry_after: Option<Duration>,
    priority: Option<&str>,
) -> PyErr {
    let build = || -> PyResult<PyErr> {
        let cls = _rejection_class(py)?;
        let exc = cls.bind(py).call0()?;
        exc.setattr("reason", reason.as_str())?;
        exc.setattr("retry_after", retry_after.map(|d| d.as_secs_f64()))?;
        exc.setattr("priority", priority)?;
        Ok(PyErr::from_value(exc))
    };
    build().unwrap_or_else(|err| err)
}
