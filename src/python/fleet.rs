//! The fleet-wide limit for Python: `admitgate.FleetLimit` and `admitgate.FleetLease`, over the
//! pure-Rust lease protocol ([`admitgate_fleet`]) on a tokio runtime admitgate owns.
//!
//! * [`runtime`]: the runtime (lazy, one thread, rebuilt after `os.fork()`) and the asyncio
//!   bridge (pyo3-async-runtimes' conversion on that runtime).
//! * [`limit`]: `FleetLimit`, its validated settings and its awaitables.
//! * [`lease`]: `FleetLease`, given back when released or dropped.
//! * [`events`]: the protocol's events, logged on the `admitgate` logger.
//! * [`handoff`]: the runtime's results handed to an event loop without the GIL (a budget's
//!   round trips).
//! * [`turn`]: what a gate turn's wait for its lease (`AdmissionGate(..., fleet=...)`) needs
//!   from the runtime: the lease as an asyncio future or a blocking wait, what ends the wait
//!   from outside, and the runtime a running turn's lease lends itself on.
//!
//! # No panics
//!
//! As in the core and the lease protocol, none of this code panics: no `unwrap`, `expect`,
//! `panic!`, unchecked indexing or overflowing arithmetic (denied for the whole crate in
//! `src/lib.rs`). Starting the fleet
//! runtime can fail (the system refuses a thread, say): the Python call that needed it raises
//! `RuntimeError` naming the cause.

mod events;
mod handoff;
mod lease;
mod limit;
mod runtime;
mod turn;

use pyo3::prelude::*;

pub use handoff::{run_for_loop, Deliver, LoopInbox};
pub use lease::PyFleetLease;
pub use limit::{set_gate_fleet_keys, PyFleetLimit};
pub use runtime::{epoch as runtime_epoch, handle as runtime_handle, start as runtime_start};
pub use turn::{
    acquire_blocking, lease_future, lease_scope, Blocked, FleetRuntime, Interrupt, LeaseTimer,
    LeaseWaits,
};

/// In a freshly forked child: the parent's fleet runtime, limits and leases are forgotten (the
/// child never gives back the parent's leases); each limit is rebuilt on first use. Called by
/// the package's `os.register_at_fork(after_in_child=...)` hook.
#[pyfunction]
pub fn _reset_fleet_after_fork() {
    runtime::reset_after_fork();
}

/// Whether admitgate's fleet runtime has started its thread in this process (for tests: a
/// gate without `fleet=` never starts it).
#[pyfunction]
pub fn _fleet_runtime_running() -> bool {
    runtime::is_running()
}
