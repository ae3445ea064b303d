//! A seeded discrete-event simulator: the real core gate in front of a simulated LLM provider.
//!
//! Virtual time; a provider with a concurrency capacity (which may change over time), a
//! log-normal service time and an immediate 429 beyond its capacity; Poisson clients with a
//! patience, who leave while queued (their turn is withdrawn) or while it runs (the call is
//! abandoned: a slot spent for nothing). Each [`Candidate`] is a gate configuration driven
//! through the real [`crate::Gate`] (the same calls the binding makes), with its
//! ceiling moved by its [`LimitController`](crate::overload::LimitController), so the
//! algorithms are compared side by side on the same arrivals. Goodput is turns answered to
//! a client still waiting, over the most the provider could serve.

mod rng;
mod run;
mod scenario;
mod table;

pub use rng::Rng;
pub use run::{run, Point, Report, TIMELINE_STEP};
pub use scenario::{standard, Algorithm, Candidate, Ceiling, Clients, Provider, Scenario};
pub use table::table;

#[cfg(test)]
mod tests;
