//! The one place this crate (and the broker, through it) names the admission core.
//!
//! The core is the `admitgate-core` crate (`crates/core`), pure Rust like this one.

pub use admitgate_core::gate::TurnEnd;
pub use admitgate_core::histogram::HistogramSnapshot;
pub use admitgate_core::overload::{Discipline, Outcome};
pub use admitgate_core::policy::MemoryPressure;
pub use admitgate_core::queue::Tally;
pub use admitgate_core::transport::{
    RequestLabel, TransportError, TransportId, TransportStats, Transports, PASSTHROUGH,
};
pub use admitgate_core::{
    Arrival, Cancelled, Claim, ClassId, ClassStats, ConcurrencyLimit, ConfigError, Decision, Gate,
    Order, Overflow, Priorities, PriorityClass, PriorityError, Registered, Rejection, Stats,
    TurnSlot, WaiterKey, Waker, Wakes,
};
