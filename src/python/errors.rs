//! Error mapping and panic containment: the one place Rust failures become Python ones.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

pub use admitgate_core::unwind::catch_panic;
use admitgate_core::ConfigError;

pyo3::create_exception!(
    admitgate,
    InternalError,
    pyo3::exceptions::PyRuntimeError,
    "A bug inside admitgate's Rust core (a Rust panic), raised as an ordinary exception.\n\n\
     The gate stays usable: its state is only changed by operations that keep it consistent.\n\
     Set RUST_BACKTRACE=1 to print where the panic happened."
);

/// A configuration error becomes a `ValueError` naming the argument and the value.
pub fn config_error(err: ConfigError) -> PyErr {
    PyValueError::new_err(err.to_string())
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic payload".to_owned()
    }
}

/// Runs `f`, turning a Rust panic into [`InternalError`] (an `Exception` subclass) instead
/// of PyO3's `PanicException`, which derives from `BaseException` and so escapes the
/// `except Exception` guards gateways wrap their turns in. Counts as being inside admitgate
/// for the exit hook ([`super::exit`]); a daemon thread that a finalizing interpreter ends
/// inside `f` anyway is parked, not caught ([`catch_panic`]).
pub fn guard<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    let _inside = super::exit::Inside::enter();
    match catch_panic(f) {
        Ok(result) => result,
        Err(payload) => Err(InternalError::new_err(format!(
            "admitgate internal error (Rust panic): {}",
            panic_message(payload.as_ref())
        ))),
    }
}
