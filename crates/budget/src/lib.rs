//! Budgets: how much an identity may do per window (requests, and tokens reserved at admission
//! and settled to what was used), decided locally in pure Rust with time as an input.
//!
//! ```
//! use std::time::Duration;
//! use admitgate_budget::{Budget, Decision, Limit, Meter, Rate, DEFAULT_MAX_KEYS};
//!
//! let budget = Budget::new(
//!     vec![
//!         Limit::sliding(Meter::Requests, Rate::parse("requests", "60/min")?),
//!         Limit::sliding(Meter::Requests, Rate::parse("requests", "1000/day")?),
//!         Limit::sliding(Meter::Tokens, Rate::parse("tokens", "100000/min")?),
//!     ],
//!     DEFAULT_MAX_KEYS,
//! )?;
//! let key = budget.key(b"api-key-of-tenant-42");
//! let now = Duration::from_secs(10);
//! if let Decision::Allowed(reservation) = budget.reserve(key, 2_000, now) {
//!     // ... the turn runs and reports 1,500 tokens: 500 are refunded.
//!     budget.settle(reservation, 1_500, now + Duration::from_secs(3));
//! }
//! # Ok::<(), admitgate_budget::BudgetError>(())
//! ```
//!
//! # Design
//!
//! **What `"N/T"` means.** By default, at most `N` in any half-open interval of length `T`,
//! per identity: what an operator reads, with no fixed-window edge that lets `2N` through
//! around a boundary. It is decided by an exact sliding log (module `log`): a key keeps
//! the times (and amounts) admitted within the last `T`, so a refusal carries the exact time
//! at which the same admission fits. An explicit `burst` selects GCRA instead (one 16-byte
//! cell per key; at most `N + burst - 1` in any window of length `T`, `burst` at once, proof
//! in module `gcra`).
//!
//! **Several limits at once.** A [`Budget`] holds any number of limits (requests or tokens,
//! each with its own window and algorithm); an admission is allowed only if all allow it and
//! then counts in all. Each limit's "allowed from" only moves later as time passes with nothing
//! admitted, so the latest of them is the exact retry time of the whole.
//!
//! **Tokens.** An admission reserves its estimate in every token limit. [`Budget::settle`]
//! refunds the difference where the estimate was recorded, or records a debt at the settling
//! time, which delays the identity's next turns until it leaves the window (a debt larger than
//! a whole window holds the identity for one window from the settling time, no longer: it
//! does not carry over). An unsettled reservation keeps its estimate. [`Budget::cancel`] gives
//! a reservation back whole, request and tokens, for a turn refused or cancelled before it
//! ran. A cost above a token limit's whole window is refused with no retry time
//! ([`Limited::retry_at`] is `None`).
//!
//! So the tokens admitted per identity in any window are at most the limit plus, for that
//! identity's turns settled with debt, their estimate errors; requests per identity per window
//! are at most the limit, exactly.
//!
//! **Estimates.** A caller that knows no cost can ask a [`RecentUsage`] (module `estimate`):
//! per identity, the larger of its last reported usage and a decayed average of its reports,
//! learned from what turns report, in bounded memory.
//!
//! **Time** is the caller's (a `Duration` since any fixed origin, as the core takes it); per
//! key it is made monotonic (a time earlier than the key's newest record is read as that
//! record's), so two threads that read the clock in one order and lock in the other cannot
//! record out of order.
//!
//! **Identities** are hashed with a per-budget random key ([`KeyHash`]) before anything is
//! stored: the raw identity is never held or shown.
//!
//! **Memory.** Keys are spread over 16 locked shards (module `table`), stored densely
//! with no per-key allocation except a sliding log's buffer while it holds entries. Per key: 8
//! bytes of hash, 40 bytes of state per limit inline, about 9 bytes of index (a 4-byte slot
//! and a control byte at hashbrown's load factor): **about 57 bytes for a one-limit key**
//! (69 measured at 100,000 keys, with the vectors' growth slack), 40 more per extra limit.
//! A sliding log adds its buffer while it holds entries: 16 bytes per distinct admission time
//! in the window (at most `N` for a request limit; a buffer of 4 entries at first). That is
//! inherent to exactness: the next-allowed time depends on each of the last `N` admission
//! times. Idle keys (all limits as if new) are reclaimed as new keys arrive, so a shard holds
//! at most twice its live keys; and at most `max_keys` are held at all. At the cap, a new key
//! evicts the sampled key that would be idle soonest; if that key's window still held
//! admissions, its limit is forgotten early (counted in [`BudgetStats::evicted`]): the one way
//! a local budget can let more through, and it takes more distinct identities within one
//! window than `max_keys`. Random keys at any rate therefore hold memory at most `max_keys`
//! keys' worth.
//!
//! **No panics.** As in admitgate's core, the crate's root denies `unwrap`, `expect`,
//! `panic!`, unchecked indexing and overflowing arithmetic outside tests: arithmetic saturates
//! (times and amounts are far from `u64::MAX`), and a case that could only come from a bug is
//! handled harmlessly.
//!
//! **Cost.** A decision is one shard lock, one hash lookup and O(1) amortised work per limit
//! (pruning is amortised over the admissions that added the entries; a refusal walks the log
//! only as far as the entries that must leave, one for a request limit).

// Denied outside tests, as in admitgate's core: the binding and the fleet call this crate on
// every admission, so it never panics (no unwrap, indexing or overflowing arithmetic).
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

pub mod budget;
pub mod error;
pub mod estimate;
mod gcra;
pub mod limit;
mod log;
pub mod rate;
pub mod stats;
mod table;
mod verdict;
pub mod window_lockout;

#[cfg(test)]
mod model_tests;

pub use budget::{Budget, Decision, KeyHash, Limited, Reservation, Settlement, DEFAULT_MAX_KEYS};
pub use error::BudgetError;
pub use estimate::{RecentUsage, UsageKey, UsageStats};
pub use limit::{Algorithm, Limit, Meter};
pub use rate::Rate;
pub use stats::BudgetStats;
pub use window_lockout::{
    KeyState, Verdict as WindowVerdict, WindowLockout, WindowLockoutRule, WindowLockoutStats,
};
