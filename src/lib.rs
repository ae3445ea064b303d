//! admitgate: an admission gate for AI-agent gateways. This crate is the Python extension
//! module `admitgate._admitgate` and nothing else.
//!
//! The pure-Rust gate (policy decisions, the state machine, the waiter queue and the RSS
//! sampler) is [`admitgate_core`] (`crates/core`); it knows nothing of Python. The PyO3
//! binding lives in `python` and is compiled only with the `python` feature, which maturin
//! turns on; without it this crate is empty.
//!
//! Neither panics: the lints below are denied for the binding, as `crates/core` denies them
//! for the core (see "No panics" in [`admitgate_core`]). Only the test hooks that panic on
//! purpose are exempt.

// Denied outside tests only: tests unwrap and index to state what they expect, and a test
// that panics is a test that fails.
#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::unreachable,
        clippy::todo,
        clippy::unimplemented,
        clippy::indexing_slicing,
        clippy::arithmetic_side_effects
    )
)]

#[cfg(feature = "python")]
mod python;
