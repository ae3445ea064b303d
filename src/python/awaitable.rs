//! The generator protocol's shared pieces: the already-finished awaitable every fast path
//! returns, and `throw()`'s normalisation of its arguments.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyTuple, PyType};

/// An awaitable that is already finished: what `__aenter__`/`__aexit__` return on the fast
/// path. Stateless, so one instance serves every caller.
#[pyclass(frozen, module = "admitgate._admitgate")]
pub struct Ready;

static READY: PyOnceLock<Py<Ready>> = PyOnceLock::new();

/// The shared [`Ready`] instance.
pub fn ready(py: Python<'_>) -> PyResult<Py<PyAny>> {
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

    #[pyo3(signature = (typ, val=None, tb=None))]
    fn throw(
        &self,
        typ: &Bound<'_, PyAny>,
        val: Option<&Bound<'_, PyAny>>,
        tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        Err(thrown(typ, val, tb))
    }

    fn close(&self) {}
}

/// The exception `throw(typ, val, tb)` raises, normalised as a generator's `throw` does: a
/// class is instantiated (with no argument, `val`, or `*val` for a tuple) unless `val` is
/// already an instance of it; an instance is raised as is; `tb` becomes its traceback.
pub fn thrown(
    typ: &Bound<'_, PyAny>,
    val: Option<&Bound<'_, PyAny>>,
    tb: Option<&Bound<'_, PyAny>>,
) -> PyErr {
    let build = || -> PyResult<Bound<'_, PyAny>> {
        let val = val.filter(|v| !v.is_none());
        let exc = if let Ok(cls) = typ.cast::<PyType>() {
            match val {
                None => cls.call0()?,
                Some(v) if v.is_instance(cls)? => v.clone(),
                Some(v) => match v.cast::<PyTuple>() {
                    Ok(args) => cls.call1(args)?,
                    Err(_) => cls.call1((v,))?,
                },
            }
        } else if val.is_some() {
            return Err(PyTypeError::new_err(
                "instance exception may not have a separate value",
            ));
        } else {
            typ.clone()
        };
        match tb.filter(|t| !t.is_none()) {
            Some(tb) => exc.call_method1(pyo3::intern!(typ.py(), "with_traceback"), (tb,)),
            None => Ok(exc),
        }
    };
    match build() {
        // Not an exception: PyO3 raises the TypeError Python would.
        Ok(exc) => PyErr::from_value(exc),
        Err(err) => err,
    }
}
