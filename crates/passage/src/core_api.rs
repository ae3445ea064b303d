//! The one place this crate (and the broker, through it) names the admission core.
//!
//! The core is the root crate's `core` module, built without the `python` feature, until the
//! re-layering moves it to `crates/core`; that move changes the `use` below and nothing else.

pub use _admitgate::core::histogram::HistogramSnapshot;
pub use _admitgate::core::policy::MemoryPressure;
pub use _admitgate::core::transport::{
    RequestLabel, TransportError, TransportId, TransportStats, Transports, PASSTHROUGH,
};
pub use _admitgate::core::{
    Arrival, Cancelled, Claim, ConcurrencyLimit, ConfigError, Decision, Gate, Overflow, Registered,
    Rejection, Stats, TurnSlot, WaiterKey, Waker, Wakes,
};
