//! The PyO3 binding: converts arguments, maps errors and wraps the core's types. No
//! admission logic lives here.
//!
//! # Panics
//!
//! The binding's own code does not panic either: the crate root (`src/lib.rs`) denies the
//! same lints for it as for the core, except in the two test hooks that panic on purpose
//! (`_panic_inside_gate`, `_panic_in_next_wakes`). What can still panic is PyO3's and the
//! standard library's own code. Every entry point catches that ([`errors::guard`]) and raises
//! `admitgate.InternalError`; a waker that panics withdraws its turn, so the slot it was
//! granted goes to the next waiter ([`wake`]), and the core's wake-ups carry on past it
//! ([`admitgate_core::Wakes::run`]).

mod adaptive;
mod admission;
mod args;
mod awaitable;
mod awaitables;
mod blocking;
mod broker;
mod budget_step;
mod classify;
mod enter;
mod errors;
mod estimator;
mod exit;
mod fleet;
mod fork;
mod gate;
mod gate_methods;
mod human_wait;
mod lease_wait;
mod policy;
mod pressure_check;
mod pressure_watch;
mod priorities;
mod rate_limit;
mod rejection;
mod resources;
mod runtime;
mod wake;
mod window_lockout;

use pyo3::prelude::*;

/// admitgate's native core.
#[pymodule(gil_used = true)]
mod _admitgate {
    #[pymodule_export]
    use super::adaptive::{_simulate, _standard_scenarios, Entered, PyAdaptiveLimit};
    #[pymodule_export]
    use super::admission::Admission;
    #[pymodule_export]
    use super::awaitable::Ready;
    #[pymodule_export]
    use super::awaitables::{QueueTimer, Wait};
    #[pymodule_export]
    use super::broker::{_broker_main, _panic_in_next_broker, serve_broker};
    #[pymodule_export]
    use super::budget_step::BudgetAnswer;
    #[pymodule_export]
    use super::classify::{_jsonrpc_request, A2ARules};
    #[pymodule_export]
    use super::errors::InternalError;
    #[pymodule_export]
    use super::estimator::PyRecentUsage;
    #[pymodule_export]
    use super::exit::_quiesce_at_exit;
    #[pymodule_export]
    use super::fleet::LoopInbox;
    #[pymodule_export]
    use super::fleet::{
        _fleet_runtime_running, _reset_fleet_after_fork, PyFleetLease, PyFleetLimit,
    };
    #[pymodule_export]
    use super::fork::{_invalidate_samplers, _reset_after_fork};
    #[pymodule_export]
    use super::gate::PyAdmissionGate;
    #[pymodule_export]
    use super::gate_methods::_panic_inside_gate;
    #[pymodule_export]
    use super::human_wait::{HumanWait, HumanWaitFactory};
    #[pymodule_export]
    use super::lease_wait::LeaseWait;
    #[pymodule_export]
    use super::policy::{PyConcurrencyLimitPolicy, PyMemoryPressurePolicy};
    #[pymodule_export]
    use super::rate_limit::PyRateLimit;
    #[pymodule_export]
    use super::rejection::{_rejection_class, _set_rejection_class};
    #[pymodule_export]
    use super::resources::PyRssSampler;
    #[pymodule_export]
    use super::wake::{_panic_in_next_wakes, _resolve_waiter, LoopMailbox};
    #[pymodule_export]
    use super::window_lockout::PyWindowLockout;

    use super::*;

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        m.add(
            "DURATION_BUCKETS",
            admitgate_core::histogram::DURATION_BUCKETS.to_vec(),
        )?;
        m.add("MAX_TRANSPORTS", admitgate_core::transport::MAX_TRANSPORTS)
    }
}
