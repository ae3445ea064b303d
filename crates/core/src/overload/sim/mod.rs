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
//!
//! A scenario's arrivals may be of several kinds of [`Traffic`] (a priority class each, with
//! its part of the arrivals and its own patience) spread over tenants; a candidate with an
//! [`Order`](crate::queue::Order) serves them by class and fair share, and the report has
//! each kind's goodput and queue wait, in total and over time ([`ClassReport`]).

mod rng;
mod run;
mod scenario;
mod table;

pub use rng::Rng;
pub use run::{run, ClassPoint, ClassReport, Point, Report, TIMELINE_STEP};
pub use scenario::{standard, Algorithm, Candidate, Ceiling, Clients, Provider, Scenario, Traffic};
pub use table::table;

#[cfg(test)]
mod tests;
