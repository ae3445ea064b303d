//! The PyO3 binding: converts arguments, maps errors and wraps the core's types. No
//! admission logic lives here.

mod args;
mod errors;
mod gate;
mod policy;

use pyo3::prelude::*;

/// admitgate's native core.
#[pymodule(gil_used = true)]
mod _admitgate {
    #[pymodule_export]
    use super::errors::InternalError;
    #[pymodule_export]
    use super::gate::{
        _invalidate_samplers, _panic_inside_gate, _rejection_class, _reset_after_fork,
        _resolve_waiter, _set_rejection_class, Admission, HumanWait, HumanWaitFactory,
        PyAdmissionGate, PyRssSampler, Ready, Wait,
    };
    #[pymodule_export]
    use super::policy::{PyConcurrencyLimitPolicy, PyMemoryPressurePolicy};

    use super::*;

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add("__version__", env!("CARGO_PKG_VERSION"))
    }
}
