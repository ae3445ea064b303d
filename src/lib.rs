//! admitgate: an admission gate for AI-agent gateways.
//!
//! [`core`] is the pure-Rust gate (policy decisions, the state machine, the waiter queue and
//! the RSS sampler); it knows nothing of Python. The PyO3 binding lives in `python` and is
//! compiled only with the `python` feature, which maturin turns on.

pub mod core;

#[cfg(feature = "python")]
mod python;
