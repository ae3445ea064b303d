//! The admission gate core: decides admit / queue / reject for every inbound turn.
//!
//! * [`policy`]: the pure decision functions (concurrency ceiling, memory-pressure ladder) and
//!   the configuration they validate.
//! * [`gate`]: the state machine that makes the decisions real, behind one lock.
//! * [`queue`]: the wait queue and the order it is served in (FIFO, priority classes with
//!   shares, fair queuing across tenants), consulted by the gate: [`waiters`] the slab of
//!   waiter records on intrusive lists, [`rank`] how many waiters are ahead of one, in
//!   O(log n), [`queue::classes`] the classes' configuration and shares.
//! * [`rejection`]: why a turn was refused.
//! * [`passthrough`]: turns let through while the gate enforces nothing, counted lock-free.
//! * [`rss`]: the cached resident-set-size sampler used for memory-aware admission.
//! * [`retry`]: the retry hint of a refused turn, from the recent release rate.
//! * [`transport`]: per-front-door counters (JSON-RPC, REST, gRPC, direct calls).
//! * [`histogram`]: lock-free duration histograms for request and queue-wait metrics.
//! * [`unwind`]: catching panics without catching a thread's forced exit.
//! * [`overload`]: overload control the gate consults (the adaptive ceiling, queue disciplines,
//!   the service-time estimate) and the simulator that drives the real gate with them.
//!
//! Nothing here imports pyo3: the binding layer wraps these types.
//!
//! # No panics
//!
//! The core never panics: no `unwrap`, `expect`, `panic!`, unchecked indexing or overflowing
//! arithmetic, which this crate's root (below) denies and CI's `cargo clippy` enforces.
//! A case that could only arise from a bug is checked by `debug_assert!` (so tests catch it)
//! and handled harmlessly in release builds (the `count` module says how for the counters).
//! Every change to a gate's state happens under its one lock with no call out: wakers run,
//! and are dropped, after the lock is released, and the caller's clock, the one foreign code
//! called under the lock, is read only between complete changes, never in the middle of one.
//! So no panic can interrupt a change halfway and leave the gate inconsistent. A waker is
//! foreign code and may panic; the others still run ([`Wakes::run`]). Allocation failure is
//! out of scope: it aborts the process rather than unwinding. (A collection's capacity
//! overflow does panic, but only past `isize::MAX` bytes, which allocation failure reaches
//! first.)

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

pub(crate) mod count;
pub mod gate;
pub mod histogram;
pub mod overload;
pub mod passthrough;
pub mod policy;
pub mod queue;
pub mod rejection;
pub mod retry;
pub mod rss;
pub(crate) mod sync;
pub mod transport;
pub mod unwind;

pub use queue::{rank, waiters};

pub use gate::{
    Arrival, Cancelled, Claim, Entrant, Gate, GateState, Registered, Rejection, Stats, TurnSlot,
    Waker, Wakes,
};
pub use policy::{ConcurrencyLimit, ConfigError, Decision, Facts, MemoryPressure, Overflow};
pub use queue::waiters::WaiterKey;
pub use queue::{ClassId, ClassStats, Order, Priorities, PriorityClass, PriorityError};
