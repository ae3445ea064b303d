//! The admission gate core: decides admit / queue / reject for every inbound turn.
//!
//! * [`policy`]: the pure decision functions (concurrency ceiling, memory-pressure ladder) and
//!   the configuration they validate.
//! * [`waiters`]: the FIFO wait queue, with per-scope sub-queues and O(1) removal.
//! * [`gate`]: the state machine that makes the decisions real, behind one lock.
//! * [`rss`]: the cached resident-set-size sampler used for memory-aware admission.
//! * [`retry`]: the retry hint of a refused turn, from the recent release rate.
//! * [`transport`]: per-front-door counters (JSON-RPC, REST, gRPC, direct calls).
//! * [`histogram`]: lock-free duration histograms for request and queue-wait metrics.
//!
//! Nothing here imports pyo3: the binding layer wraps these types.

pub mod gate;
pub mod histogram;
pub mod policy;
pub mod retry;
pub mod rss;
pub(crate) mod sync;
pub mod transport;
pub mod waiters;

pub use gate::{
    Arrival, Cancelled, Claim, Gate, GateState, Registered, Rejection, Stats, TurnSlot, Waker,
    Wakes,
};
pub use policy::{ConcurrencyLimit, ConfigError, Decision, Facts, MemoryPressure, Overflow};
pub use waiters::WaiterKey;
